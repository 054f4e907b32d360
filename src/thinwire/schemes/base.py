"""A scheme = compressor + error-feedback memory + transport, applied layer-wise."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from thinwire.comm import Meter, all_gather_bytes, all_reduce_mean, world
from thinwire.comm.collectives import Future, Group, done
from thinwire.compress import Compressor, DensePayload, Payload, SparsePayload, TensorInfo
from thinwire.feedback import Memory, all_finite


class Scheme(ABC):
    """Averages named gradients across a group, compressed.

    ``launch`` returns a future of the averaged gradients; ``reduce`` waits
    for it (for loops without DDP). Per-tensor state is keyed by name, never
    by position, so it survives DDP re-bucketing.

    Attributes:
        meter: records the bytes handed to torch.distributed (set by the caller).
        overhead_s: seconds spent compressing, decompressing and in memory.
        skipped: rounds whose gradients were non-finite and dropped (``skip``).
        origin: (registered name, config) when built by ``schemes.build``.
    """

    origin: tuple[str, Any] | None = None

    def __init__(self) -> None:
        self.meter: Meter | None = None
        self.overhead_s = 0.0
        self.skipped = 0
        self._lock = threading.Lock()

    @abstractmethod
    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Start averaging ``grads`` (not modified); the future holds a dict of results."""

    def reduce(self, grads: Mapping[str, torch.Tensor],
               group: Group = None) -> dict[str, torch.Tensor]:
        """Average ``grads`` across ``group`` and wait for the result."""
        result: dict[str, torch.Tensor] = self.launch(grads, group).wait()
        return result

    def _charge(self, seconds: float) -> None:
        with self._lock:
            self.overhead_s += seconds

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = state["skipped"]


class CompressedScheme(Scheme):
    """Each tensor is compressed on its own; dense payloads are all-reduced together,
    sparse ones all-gathered together (their sizes differ per rank) and summed.

    Args:
        compressor: the codec applied to each tensor.
        memory: error feedback, or None for none.
        nonfinite: ``"raise"`` or ``"skip"`` (see :func:`thinwire.feedback.all_finite`).
    """

    def __init__(self, compressor: Compressor, memory: Memory | None = None,
                 nonfinite: str = "raise") -> None:
        super().__init__()
        self.compressor = compressor
        self.memory = memory
        self.nonfinite = nonfinite

    def _encode(self, key: str, grad: torch.Tensor, info: TensorInfo, finite: bool) -> Payload:
        if not finite:  # contribute nothing, keep memory and thresholds as they were
            return self.compressor.empty(info)
        if self.memory is None:
            return self.compressor.compress(grad, info)
        compensated = self.memory.compensate(key, grad)
        payload = self.compressor.compress(compensated, info)
        self.memory.update(key, compensated, self.compressor.decompress(payload, info))
        return payload

    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        start = time.perf_counter()
        _, n = world(group)
        finite = all_finite(grads, self.nonfinite)
        if not finite:
            self.skipped += 1
        infos = {key: TensorInfo.of(key, grad) for key, grad in grads.items()}
        payloads = {key: self._encode(key, grad, infos[key], finite)
                    for key, grad in grads.items()}
        dense = [key for key, p in payloads.items() if isinstance(p, DensePayload)]
        sparse = [key for key, p in payloads.items() if isinstance(p, SparsePayload)]
        futures = []
        if dense:
            flat = torch.cat([payloads[key].values for key in dense])  # type: ignore[union-attr]
            self._record(dense, payloads, "all_reduce", n)
            futures.append(all_reduce_mean(flat, group))
        if sparse:
            wire = torch.cat([payloads[key].to_bytes() for key in sparse])
            segments = [(key, payloads[key].nbytes) for key in sparse]
            futures.append(all_gather_bytes(wire, group, self.meter, segments))
        self._charge(time.perf_counter() - start)
        both = torch.futures.collect_all(futures) if futures else done([])

        def decode(fut: Future[Any]) -> dict[str, torch.Tensor]:
            begin = time.perf_counter()
            results = [f.value() for f in fut.value()]
            out: dict[str, torch.Tensor] = {}
            if dense:
                out.update(unflatten(results.pop(0), [infos[key] for key in dense]))
            if sparse:
                out.update(sum_sparse(results.pop(0), [infos[key] for key in sparse],
                                      n, self.compressor.value_dtype))
            self._charge(time.perf_counter() - begin)
            return {key: out[key] for key in grads}

        return both.then(decode)

    def _record(self, keys: list[str], payloads: Mapping[str, Payload], collective: str,
                n: int) -> None:
        if self.meter is not None:
            for key in keys:
                self.meter.record("W_grad", key, collective, payloads[key].nbytes, world_size=n)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "compressor": self.compressor.state_dict(),
                "memory": None if self.memory is None else self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.compressor.load_state_dict(state["compressor"])
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])


def unflatten(flat: torch.Tensor, infos: Sequence[TensorInfo]) -> dict[str, torch.Tensor]:
    """Split a flat (averaged) buffer back into the tensors it was concatenated from."""
    if not infos:
        return {}
    parts = torch.split(flat, [info.numel for info in infos])
    return {info.key: part.to(info.dtype).reshape(info.shape) for info, part in zip(infos, parts)}


def sum_sparse(buffers: Sequence[torch.Tensor], infos: Sequence[TensorInfo], n: int,
               value_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Mean over ranks of all-gathered sparse payloads, one buffer per rank.

    Each buffer holds one :class:`SparsePayload` per tensor of ``infos``, in
    that order. Buffers are summed in rank order, so every rank gets the same
    result bit for bit.

    Args:
        value_dtype: dtype the values travel in; None: each tensor's own dtype.
    """
    sums = [torch.zeros(info.numel, dtype=info.dtype, device=info.device) for info in infos]
    for buffer in buffers:
        offset = 0
        for info, total in zip(infos, sums):
            payload, used = SparsePayload.from_bytes(buffer[offset:], info.numel,
                                                     value_dtype or info.dtype)
            total.index_add_(0, payload.indices, payload.values.to(info.dtype))
            offset += used
    return {info.key: (total / n).reshape(info.shape) for info, total in zip(infos, sums)}
