"""Quantised schemes with error feedback: int8, int4, int2, sign, and top-k chained before them.

The quantised values of every rank travel by one all-gather of fixed-size
packed payloads; each rank then decodes every row and takes the mean, ranks
summed in rank order so every rank gets the same bits. An all-reduce cannot
carry them: a sum of codes at different scales is not a code, and summing
dequantised values in fp32 sends 32 bits an entry again. All-gather moves
(n-1) payloads into each rank, which beats a dense ring all-reduce's
2(n-1)/n x 32 bits while n * bits < 64.

``topk+KIND`` (SparseLoCo's top-k + 2-bit is ``topk+int2``) selects by
:class:`~thinwire.compress.TopK` as the topk scheme does (its ``ratio``,
``scope``, index format), then quantises the selected values in chunks; the
indices travel as today's :class:`~thinwire.compress.payload.SparseLayout`
header and index list (or bitmap). Error feedback: ``p = g + e``, then
``e <- p - sent`` with ``sent`` what every receiver decodes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.comm.collectives import Future, Group, all_gather_fixed, world
from thinwire.compress import TensorInfo, TopK
from thinwire.compress.payload import SparseLayout
from thinwire.compress.quantise import (
    CHUNK,
    KINDS,
    SCALE_DTYPE,
    QuantisedPayload,
    Quantiser,
    chunks,
    code_bytes,
)
from thinwire.compress.sparse import MIN_NUMEL
from thinwire.feedback import Memory, Residual, all_finite
from thinwire.schemes.base import Scheme
from thinwire.schemes.registry import register, validate_common, validate_ratio
from thinwire.schemes.traits import ALL_GATHER, Traits


@dataclass(frozen=True)
class QuantConfig:
    chunk: int = CHUNK  # entries sharing one fp32 scale, >= 1
    error_feedback: bool = True  # keep what quantisation left out for the next round
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk={self.chunk!r} must be an integer >= 1")
        validate_common(self)


@dataclass(frozen=True)
class TopKQuantConfig:
    ratio: float = 0.01  # fraction of each tensor's entries sent, in (0, 1]
    chunk: int = CHUNK  # selected values sharing one fp32 scale, >= 1
    min_numel: int = MIN_NUMEL  # tensors smaller than this are quantised whole (0: none)
    indices: str = "delta16"  # index list on the wire: "delta16" (16 bits an index) or "int32"
    scope: str = "bucket"  # "bucket": ratio of all tensors, one selection; "layer": of each
    error_feedback: bool = True  # keep what was not sent, or sent coarsely, for the next round
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient

    def __post_init__(self) -> None:
        validate_ratio(self.ratio)
        QuantConfig(self.chunk, self.error_feedback, self.nonfinite)
        validate_common(self)


class QuantisedScheme(Scheme):
    """Error feedback, optional top-k, per-chunk quantisation, all-gather, decode and mean.

    Args:
        quantiser: the codec of the values.
        memory: error feedback, or None for none.
        sparsifier: selects the entries to send first (their values quantised),
            or None to quantise every entry.
        nonfinite: ``"raise"`` or ``"skip"`` (see :func:`thinwire.feedback.all_finite`).
    """

    def __init__(self, quantiser: Quantiser, memory: Memory | None = None,
                 sparsifier: TopK | None = None, nonfinite: str = "raise") -> None:
        super().__init__()
        self.quantiser = quantiser
        self.compressor = quantiser  # what schemes.fingerprint names
        self.memory = memory
        self.sparsifier = sparsifier
        self.nonfinite = nonfinite

    @property
    def traits(self) -> Traits:
        return Traits(None if self.sparsifier is None else self.sparsifier.density,
                      None if self.memory is None else self.memory.rule,
                      collectives=(ALL_GATHER,))

    @property
    def error_memory(self) -> Memory | None:
        """The memory of ``topk+KIND``, which couples as the other sparsifiers'."""
        return self.memory if self.sparsifier is not None else None

    def couple_memory(self, memory: Memory) -> None:
        if self.error_memory is None:
            super().couple_memory(memory)
        self.memory = memory

    def _sparse(self, info: TensorInfo) -> bool:
        return self.sparsifier is not None and not self.sparsifier.is_dense(info)

    def _layout(self, sparse: Sequence[TensorInfo]) -> SparseLayout:
        """The header and index part of the sparse tensors' block (its values area unused):
        indices into their concatenation, room for the sparsifier's entries."""
        assert self.sparsifier is not None
        return SparseLayout(sum(info.numel for info in sparse), self.sparsifier.room(sparse),
                            torch.uint8, self.sparsifier.index_format)

    def _sparse_bytes(self, layout: SparseLayout) -> int:
        """The sparse block: header and indices, the codes of a full room, its scales."""
        return layout.value_start + self.quantiser.nbytes(layout.capacity)

    def payload_bytes(self, infos: Sequence[TensorInfo]) -> int:
        """Bytes of one rank's payload for ``infos`` (fixed by shapes and config)."""
        sparse = [info for info in infos if self._sparse(info)]
        whole = sum(self.quantiser.nbytes(info.numel) for info in infos
                    if not self._sparse(info))
        return whole + (self._sparse_bytes(self._layout(sparse)) if sparse else 0)

    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Average ``grads`` (not modified) across ``group``; the future holds a dict.

        A rank's payload is each tensor quantised whole, in order, then one
        block for the tensors the sparsifier selects from.
        """
        start = time.perf_counter()
        _, n = world(group)
        infos = [TensorInfo.of(key, grad) for key, grad in grads.items()]
        whole = [info for info in infos if not self._sparse(info)]
        sparse = [info for info in infos if self._sparse(info)]
        layout = self._layout(sparse) if sparse else None
        finite = all_finite(grads, self.nonfinite)
        if not finite:
            self.skipped += 1
        segments: list[tuple[str, int]] = []
        if finite:
            blocks = self._encode(grads, whole, sparse, layout, segments)
        else:  # a zero contribution: all-zero codes and scales decode to zeros
            blocks = [torch.zeros(self.payload_bytes(infos), dtype=torch.uint8,
                                  device=infos[0].device)] if infos else []
            segments = [("(skipped)", blocks[0].numel())] if blocks else []
        payload = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.uint8)
        future = all_gather_fixed(payload, group, self.meter, segments)
        self._charge(time.perf_counter() - start)

        def decode(fut: Future[Any]) -> dict[str, torch.Tensor]:
            begin = time.perf_counter()
            out = {info.key: torch.zeros(info.numel, dtype=info.dtype, device=info.device)
                   for info in infos}
            for row in fut.value():  # rank order: the same sum on every rank
                self._decode_row(row, whole, sparse, layout, out)
            result = {info.key: (out[info.key].div_(n) if n > 1 else out[info.key]).view(
                info.shape) for info in infos}
            self._charge(time.perf_counter() - begin)
            return result

        return future.then(decode)

    def _encode(self, grads: Mapping[str, torch.Tensor], whole: Sequence[TensorInfo],
                sparse: Sequence[TensorInfo], layout: SparseLayout | None,
                segments: list[tuple[str, int]]) -> list[torch.Tensor]:
        """This rank's payload blocks; updates the error memory; appends the metered parts."""
        memory, quantiser = self.memory, self.quantiser
        blocks = []
        for info in [*whole, *sparse]:
            grad = grads[info.key].reshape(-1)
            p = grad.clone() if memory is None else memory.compensate(info.key, grad)
            if info in sparse:  # selected below, with the other sparse tensors
                blocks.append(p)
                continue
            payload = quantiser.compress(p, info)
            if memory is not None:
                memory.update(info.key, p, quantiser.decode_flat(payload, p.dtype))
            blocks.append(payload.to_bytes())
            segments.append((info.key, payload.nbytes))
        if not sparse:
            return blocks
        assert self.sparsifier is not None and layout is not None
        compensated = blocks[len(whole):]
        del blocks[len(whole):]
        device = compensated[0].device
        chosen = self.sparsifier.select_all(torch.cat([p.abs() for p in compensated]), sparse)
        values = torch.cat([p.index_select(0, local) for p, local in zip(compensated, chosen)])
        payload = quantiser.compress(values, TensorInfo.of("(selected)", values))
        sent = quantiser.decode_flat(payload, values.dtype).split(
            [local.numel() for local in chosen])
        offset = 0
        indices = []
        for info, p, local, part in zip(sparse, compensated, chosen, sent):
            if memory is not None:
                memory.update_sparse(info.key, p, local, part)
            indices.append(local + offset)
            offset += info.numel
        block = torch.zeros(self._sparse_bytes(layout), dtype=torch.uint8, device=device)
        joined = torch.cat(indices)
        head = layout.encode(joined, torch.zeros(joined.numel(), dtype=torch.uint8,
                                                 device=device), ascending=True)
        block[: layout.value_start] = head[: layout.value_start]
        codes = block[layout.value_start:]
        codes[: payload.codes.numel()] = payload.codes
        room = code_bytes(layout.capacity, quantiser.bits)
        scales = payload.scales.view(torch.uint8)
        codes[room: room + scales.numel()] = scales
        blocks.append(block)
        # Each layer is charged its entries' index and code bits (whole bytes); the
        # header, bitmap, scales and unused room are charged apart, so the parts add up.
        per_index = layout.index_entry_bytes
        parts = [(info.key, local.numel() * per_index + local.numel() * quantiser.bits // 8)
                 for info, local in zip(sparse, chosen)]
        parts.append(("(header)", 4))
        if layout.uses_bitmap:
            parts.append(("(bitmap)", layout.index_bytes))
        parts.append(("(scales)", 4 * chunks(layout.capacity, quantiser.chunk)))
        parts.append(("(padding)", block.numel() - sum(nbytes for _, nbytes in parts)))
        segments.extend(parts)
        return blocks

    def _decode_row(self, row: torch.Tensor, whole: Sequence[TensorInfo],
                    sparse: Sequence[TensorInfo], layout: SparseLayout | None,
                    out: dict[str, torch.Tensor]) -> None:
        """Add what one rank's payload ``row`` stands for into ``out`` (flat, by key)."""
        quantiser = self.quantiser
        offset = 0
        for info in whole:
            size = quantiser.nbytes(info.numel)
            payload = QuantisedPayload.from_bytes(row[offset: offset + size], info.numel,
                                                  quantiser.bits, quantiser.chunk)
            out[info.key].add_(quantiser.decode_flat(payload, info.dtype))
            offset += size
        if not sparse:
            return
        assert layout is not None
        block = row[offset:]
        count = layout.counts([block])[0]
        indices, _ = layout.decode(block[: layout.value_start], count)
        body = block[layout.value_start:]
        room = code_bytes(layout.capacity, quantiser.bits)
        scales = body[room: room + 4 * chunks(count, quantiser.chunk)].clone().view(
            SCALE_DTYPE)
        codes = body[: (count * quantiser.bits + 7) // 8]
        values = quantiser.decode_flat(QuantisedPayload(codes, scales, count, quantiser.bits),
                                       sparse[0].dtype)
        flat = torch.zeros(layout.numel, dtype=values.dtype, device=values.device)
        flat.index_copy_(0, indices, values)
        for info, part in zip(sparse, flat.split([info.numel for info in sparse])):
            out[info.key].add_(part.to(info.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "sparsifier": None if self.sparsifier is None else self.sparsifier.state_dict(),
                "memory": None if self.memory is None else self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.sparsifier is not None:
            self.sparsifier.load_state_dict(state["sparsifier"])
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])


def _plain(kind: str) -> Any:
    def build(config: QuantConfig) -> Scheme:
        return QuantisedScheme(Quantiser(kind, config.chunk),
                               Residual() if config.error_feedback else None,
                               nonfinite=config.nonfinite)
    return build


def _after_topk(kind: str) -> Any:
    def build(config: TopKQuantConfig) -> Scheme:
        sparsifier = TopK(config.ratio, min_numel=config.min_numel, indices=config.indices,
                          scope=config.scope)
        return QuantisedScheme(Quantiser(kind, config.chunk),
                               Residual() if config.error_feedback else None, sparsifier,
                               config.nonfinite)
    return build


for _kind in KINDS:
    register(_kind, QuantConfig)(_plain(_kind))
for _kind in KINDS:
    register(f"topk+{_kind}", TopKQuantConfig)(_after_topk(_kind))
