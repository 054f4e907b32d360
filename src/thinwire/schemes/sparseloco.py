"""SparseLoCo's exchange: decayed error feedback, chunk-wise top-k, 2-bit values, one all-gather.

Per rank and tensor (Sarfi et al. 2025, Alg. 1): ``e <- beta e + delta``
(:class:`~thinwire.feedback.Decayed`), the ``k`` largest ``|e|`` of every
chunk (:class:`~thinwire.compress.chunked.ChunkTopK`), their values as 2-bit
codes (:mod:`~thinwire.compress.codebook`), ``e <- e - sent``. A rank's payload
is, tensor after tensor, the chunks' positions (:mod:`~thinwire.compress.chunk_index`)
then the codebook; a tensor of one dimension sends every entry and no positions.
Its size is fixed by the shapes, so one all-gather carries it; every rank decodes
every row and sums them in rank order, then divides by the ranks (Alg. 1's
``1/R``; ``aggregate="senders"``: at each entry by the ranks that sent it, as
the reference code's scatter-mean does): the same bits everywhere. The outer
step belongs to the caller: under
:class:`~thinwire.local.LocalUpdates` it is SGD with lr alpha and no momentum
(the decayed memory is the momentum), chosen there from this scheme's traits.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.comm.collectives import Future, Group, all_gather_fixed, world
from thinwire.compress import TensorInfo, chunk_index, codebook
from thinwire.compress.base import check_fraction
from thinwire.compress.chunked import CHUNK, ChunkTopK, K, chunk_counts, chunk_topk
from thinwire.feedback import Decayed, all_finite, check_policy
from thinwire.schemes.base import Scheme
from thinwire.schemes.registry import register
from thinwire.schemes.traits import ALL_GATHER, Traits

AGGREGATES = ("ranks", "senders")


@dataclass(frozen=True)
class SparseLoCoConfig:
    chunk: int = CHUNK  # entries per chunk, in [2, 65536] (the paper's 64 x 64 = 4096)
    k: int = K  # entries sent per chunk, in [1, chunk] (the paper's 64: 1.56 %)
    beta: float = 0.95  # the error memory's decay, in [0, 1] (the paper's 0.95)
    indices: str = "elias-fano"  # positions on the wire: "elias-fano" or "fixed" (the paper's)
    aggregate: str = "ranks"  # an entry's sum over: "ranks" (Alg. 1) or "senders" (its code)
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite pseudo-gradient

    def __post_init__(self) -> None:
        ChunkTopK(self.chunk, self.k)
        check_fraction("beta", self.beta, 0.0, 1.0, closed_low=True, closed_high=True)
        chunk_index.check(self.indices)
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate={self.aggregate!r} must be one of {AGGREGATES}")
        check_policy(self.nonfinite)


class SparseLoCo(Scheme):
    """The exchange of the module docstring.

    Args:
        selection: the chunk-wise top-k (which tensors bypass it: ``is_dense``).
        memory: the decayed error feedback.
        indices: the position code, one of :data:`~thinwire.compress.chunk_index.FORMATS`.
        aggregate: what an entry's sum is divided by, one of :data:`AGGREGATES`.
        nonfinite: ``"raise"`` or ``"skip"`` (see :func:`thinwire.feedback.all_finite`).
    """

    def __init__(self, selection: ChunkTopK, memory: Decayed, indices: str = "elias-fano",
                 aggregate: str = "ranks", nonfinite: str = "raise") -> None:
        super().__init__()
        self.selection = selection
        self.compressor = selection  # what schemes.fingerprint names
        self.memory = memory
        self.indices = chunk_index.check(indices)
        self.aggregate = aggregate
        self.nonfinite = nonfinite

    @property
    def traits(self) -> Traits:
        return Traits(self.selection.density, self.memory.rule, collectives=(ALL_GATHER,))

    def _plan(self, info: TensorInfo) -> list[tuple[int, int]] | None:
        """The chunk plan of a selected tensor; None: every entry is sent."""
        if self.selection.is_dense(info):
            return None
        return chunk_counts(info.numel, self.selection.chunk, self.selection.k)

    def block_bytes(self, info: TensorInfo) -> int:
        """Bytes of one tensor's part of a rank's payload (fixed by its shape)."""
        plan = self._plan(info)
        if plan is None:
            return codebook.nbytes(info.numel)
        return (chunk_index.nbytes(plan, self.indices)
                + codebook.nbytes(sum(count for _, count in plan)))

    def payload_bytes(self, infos: Sequence[TensorInfo]) -> int:
        """Bytes of one rank's payload for ``infos``: what each rank hands the all-gather."""
        return sum(self.block_bytes(info) for info in infos)

    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Average what each rank sends of ``grads`` (not modified); a future of a dict.

        Raises:
            FloatingPointError: a non-finite entry under ``nonfinite="raise"``.
        """
        start = time.perf_counter()
        _, n = world(group)
        infos = [TensorInfo.of(key, grad) for key, grad in grads.items()]
        finite = all_finite(grads, self.nonfinite)
        if not finite:
            self.skipped += 1
        blocks = [self._encode(info, grads[info.key], finite) for info in infos]
        payload = (torch.cat(blocks) if blocks
                   else torch.zeros(0, dtype=torch.uint8))
        segments = [(info.key, block.numel()) for info, block in zip(infos, blocks)]
        future = all_gather_fixed(payload, group, self.meter, segments)
        self._charge(time.perf_counter() - start)

        def mean(fut: Future[Any]) -> dict[str, torch.Tensor]:
            out = {info.key: torch.zeros(info.numel, dtype=info.dtype, device=info.device)
                   for info in infos}
            senders = ({info.key: torch.zeros_like(out[info.key]) for info in infos}
                       if self.aggregate == "senders" and n > 1 else None)
            for row in fut.value():  # rank order: the same sum on every rank
                offset = 0
                for info in infos:
                    offset = self._add(row, offset, info, out[info.key],
                                       None if senders is None else senders[info.key])
            for info in infos:
                if senders is not None:
                    out[info.key].div_(senders[info.key].clamp_(min=1))
                elif n > 1:
                    out[info.key].div_(n)
            return {info.key: out[info.key].view(info.shape) for info in infos}

        return future.then(self._charged(mean))

    def _encode(self, info: TensorInfo, delta: torch.Tensor, finite: bool) -> torch.Tensor:
        """This rank's block for one tensor; updates its memory (not when ``finite`` is
        False: then a block that decodes to zeros)."""
        flat = delta.reshape(-1)
        p = self.memory.compensate(info.key, flat) if finite else torch.zeros_like(flat)
        plan = self._plan(info)
        if plan is None:
            book = codebook.encode(p)
            if finite:
                self.memory.update(info.key, p, codebook.decode(book, p.dtype))
            return book.to_bytes()
        magnitudes = p.abs()
        chosen = (self.selection.indices(magnitudes, info) if finite
                  else chunk_topk(magnitudes, self.selection.chunk, self.selection.k))
        book = codebook.encode(p.index_select(0, chosen))
        if finite:
            self.memory.update_sparse(info.key, p, chosen, codebook.decode(book, p.dtype))
        return torch.cat([chunk_index.encode(chosen, plan, self.indices), book.to_bytes()])

    def _add(self, row: torch.Tensor, offset: int, info: TensorInfo, out: torch.Tensor,
             senders: torch.Tensor | None) -> int:
        """Add what ``row``'s block at ``offset`` stands for into ``out`` (flat), and 1 into
        ``senders`` where it sent; returns the next block's offset."""
        plan = self._plan(info)
        if plan is None:
            book = codebook.Codebook.from_bytes(row[offset:], info.numel)
            out.add_(codebook.decode(book, out.dtype))
            if senders is not None:
                senders.add_(1.0)
            return offset + codebook.nbytes(info.numel)
        size = chunk_index.nbytes(plan, self.indices)
        positions = chunk_index.decode(row[offset: offset + size], plan, self.indices)
        count = positions.numel()
        book = codebook.Codebook.from_bytes(row[offset + size:], count)
        out.index_add_(0, positions, codebook.decode(book, out.dtype))
        if senders is not None:
            senders.index_add_(0, positions, torch.ones_like(positions, dtype=senders.dtype))
        return offset + size + codebook.nbytes(count)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "selection": self.selection.state_dict(),
                "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.selection.load_state_dict(state["selection"])
        self.memory.load_state_dict(state["memory"])


@register("sparseloco", SparseLoCoConfig)
def _build(config: SparseLoCoConfig) -> Scheme:
    return SparseLoCo(ChunkTopK(config.chunk, config.k), Decayed(config.beta), config.indices,
                      config.aggregate, config.nonfinite)
