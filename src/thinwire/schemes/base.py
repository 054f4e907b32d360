"""A scheme = compressor + error-feedback memory + transport, applied layer-wise."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from thinwire.comm import Meter, all_reduce_mean, world
from thinwire.comm._metered import record_segments
from thinwire.comm.collectives import Future, Group, all_gather_fixed, collect, split_flat
from thinwire.compress import Compressor, DensePayload, Payload, Sparsifier, TensorInfo
from thinwire.compress import decode as decode_payload
from thinwire.compress.payload import SparseLayout, layout_segments
from thinwire.compress.pieces import Streams
from thinwire.feedback import Memory, all_finite
from thinwire.schemes.streaming import Streaming, joined, offsets_of
from thinwire.schemes.traits import ALL_GATHER, ALL_REDUCE, Traits

T = TypeVar("T")


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
        # Set to {} to record, where traits.energy: key -> per launch, the share of this
        # rank's own top-k energy that the shared indices captured.
        self.energy: dict[str, list[float]] | None = None
        self._lock = threading.Lock()
        self._scratch: torch.Tensor | None = None  # |p|, reused across launches

    def _magnitudes(self, buffer: torch.Tensor) -> torch.Tensor:
        """Room for ``|p|`` of ``buffer`` (1-D): a scratch tensor kept between launches (a
        fresh one of a large bucket costs its page faults on every launch on CPU)."""
        scratch = self._scratch
        if (scratch is None or scratch.numel() < buffer.numel() or scratch.dtype != buffer.dtype
                or scratch.device != buffer.device):
            scratch = self._scratch = torch.empty_like(buffer)
        return scratch[: buffer.numel()]

    @abstractmethod
    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Start averaging ``grads`` (not modified); the future holds a dict of results."""

    def reduce(self, grads: Mapping[str, torch.Tensor],
               group: Group = None) -> dict[str, torch.Tensor]:
        """Average ``grads`` across ``group`` and wait for the result."""
        result: dict[str, torch.Tensor] = self.launch(grads, group).wait()
        return result

    def launch_flat(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                    group: Group = None, *, last: bool = True) -> Future[Any]:
        """Average the tensors laid out back to back in the 1-D ``buffer`` (a DDP bucket).

        This default splits ``buffer`` into views, runs :meth:`launch` on them
        and copies the results back; schemes with a flat engine override it.

        Args:
            last: whether this is the step's last launch (DDP's last bucket). A
                scheme with dependent rounds may leave a launch that is not the
                last waiting for its first round until the next launch; its future
                then completes once a launch with ``last`` has run.

        Returns:
            A future holding ``buffer``, overwritten with the mean over ranks.
        """
        views = split_flat(buffer, [info.numel for info in infos])
        grads = {info.key: view.view(info.shape) for info, view in zip(infos, views)}

        def write(fut: Future[Any]) -> torch.Tensor:
            reduced = fut.value()
            for info, view in zip(infos, views):
                view.copy_(reduced[info.key].reshape(-1))
            return buffer

        return self.launch(grads, group).then(write)

    @property
    def traits(self) -> Traits:
        """What this scheme is (:class:`~thinwire.schemes.traits.Traits`): the layers
        above read this, never the scheme's class. Here: a dense all-reduce."""
        return Traits()

    @property
    def trace(self) -> Mapping[str, Sequence[tuple[int, float, float]]]:
        """Per tensor, its threshold's recent (call, threshold, achieved density); empty
        where nothing is thresholded."""
        return {}

    @property
    def error_memory(self) -> Memory | None:
        """The error feedback of a sparsifier, into which :func:`thinwire.optim.couple`
        moves the optimiser's momentum; None: nothing to couple."""
        return None

    def couple_memory(self, memory: Memory) -> None:
        """Put ``memory`` (a coupling that wraps :attr:`error_memory`) in its place.

        Raises:
            TypeError: the scheme has no error memory to couple.
        """
        raise TypeError(f"{type(self).__name__} has no error memory to couple")

    def _via_flat(self, grads: Mapping[str, torch.Tensor], group: Group) -> Future[Any]:
        """:meth:`launch` through :meth:`launch_flat`: ``grads`` (not modified) copied into
        one flat buffer per dtype and device, so a dict and a DDP bucket take one path."""
        groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
        for key, grad in grads.items():
            groups.setdefault((grad.dtype, grad.device), []).append(key)
        futures = []
        for keys in groups.values():
            buffer = torch.cat([grads[key].reshape(-1) for key in keys])
            futures.append(self.launch_flat(buffer, [TensorInfo.of(key, grads[key])
                                                     for key in keys], group))

        def split(fut: Future[Any]) -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for keys, done_future in zip(groups.values(), fut.value()):
                views = split_flat(done_future.value(), [grads[key].numel() for key in keys])
                out.update({key: view.view(grads[key].shape) for key, view in zip(keys, views)})
            return {key: out[key] for key in grads}

        both = collect(futures, [device for _, device in groups])
        return both.then(split)

    def _charge(self, seconds: float) -> None:
        with self._lock:
            self.overhead_s += seconds

    def _charged(self, callback: Callable[[Any], T]) -> Callable[[Any], T]:
        """``callback`` (of a future, or of a round's result), its seconds charged to
        :attr:`overhead_s`: the codec's time after the exchange, not the wait for it."""
        def timed(arrived: Any) -> T:
            begin = time.perf_counter()
            try:
                return callback(arrived)
            finally:
                self._charge(time.perf_counter() - begin)

        return timed

    def _finite(self, grads: Mapping[str, torch.Tensor], policy: str,
                flat: torch.Tensor | None = None) -> bool:
        """Whether this round's gradients are finite on every rank (one reduction); a
        skipped round is counted (see :func:`thinwire.feedback.all_finite`)."""
        finite = all_finite(grads, policy, flat=flat)
        if not finite:
            self.skipped += 1
        return finite

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = state["skipped"]


class CompressedScheme(Scheme):
    """Each tensor is compressed on its own, the work done on one flat buffer.

    The engine (:meth:`launch_flat`) takes a DDP bucket's flat buffer, or the
    concatenated gradients of :meth:`launch`, and works on it in place:

    1. one reduction decides whether the round is finite
       (:func:`thinwire.feedback.all_finite`);
    2. each tensor's error memory absorbs its gradient in place (DCT Alg. 1
       line 3: ``p = g + e``);
    3. on one ``|p|`` scratch buffer, the compressor picks the indices to
       send (:meth:`~thinwire.compress.Sparsifier.select_all`: its own
       threshold per layer, Alg. 1 lines 4-9, or one over the bucket);
       tensors the compressor keeps dense go by all-reduce instead;
    4. the sparse entries of the whole buffer travel as one fixed-capacity
       payload (:class:`~thinwire.compress.SparseLayout`) by one all-gather;
    5. the residual is ``p`` with the sent entries zeroed, in the memory's
       own buffer (Alg. 1 line 11, :meth:`~thinwire.feedback.Memory.update_sparse`);
    6. the mean over ranks is decoded straight into the buffer, ranks summed
       in rank order so every rank gets the same bits.

    Error memory and compressor state stay keyed by tensor name, so they
    survive DDP's re-bucketing.

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
        # A compressor that streams sends large buckets in pieces (schemes.streaming).
        self.pieces = Streaming(compressor, self) if isinstance(compressor, Streams) else None

    @property
    def traits(self) -> Traits:
        density = self.compressor.density
        return Traits(density, None if self.memory is None else self.memory.rule,
                      streams=self.pieces is not None,
                      collectives=(ALL_REDUCE,) if density is None else (ALL_GATHER, ALL_REDUCE))

    @property
    def trace(self) -> Mapping[str, Sequence[tuple[int, float, float]]]:
        return self.compressor.trace if isinstance(self.compressor, Sparsifier) else {}

    @property
    def error_memory(self) -> Memory | None:
        return self.memory if self.compressor.density is not None else None

    def couple_memory(self, memory: Memory) -> None:
        if self.error_memory is None:
            super().couple_memory(memory)
        self.memory = memory

    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Average ``grads`` (not modified): one flat buffer per dtype and device."""
        return self._via_flat(grads, group)

    def launch_flat(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                    group: Group = None, *, last: bool = True) -> Future[Any]:
        """Average ``infos``' tensors, laid out back to back in the 1-D ``buffer``.

        Args:
            buffer: the gradients, flat; modified in place and returned holding
                the mean over ranks.
            infos: the tensors of ``buffer`` in order (key, shape, dtype, device).
            last: unused (one round, nothing deferred).

        Returns:
            A future holding ``buffer``.

        Raises:
            FloatingPointError: a non-finite gradient under ``nonfinite="raise"``.
        """
        start = time.perf_counter()
        _, n = world(group)
        views = dict(zip([info.key for info in infos],
                         split_flat(buffer, [info.numel for info in infos])))
        finite = self._finite(views, self.nonfinite, buffer)
        compressor = self.compressor
        sparse = [info for info in infos
                  if isinstance(compressor, Sparsifier) and not compressor.is_dense(info)]
        sparse_keys = {info.key for info in sparse}
        dense = [info for info in infos if info.key not in sparse_keys]
        stream = self.pieces
        choice = stream.choose(buffer, sparse, group) if stream is not None else False
        streamable = stream is not None and choice is not False and finite and stream.streams(
            sparse, views)
        timed = choice is None and streamable  # a trial round of one payload
        pieces = stream.cut(sparse) if stream is not None and choice else None
        streamed = streamable and pieces is not None
        if finite and self.memory is not None:  # sparse tensors: in the memory, below
            # the round's per-tensor state, batched; a streamed tensor's, part by part
            self.memory.advance_({info.key: views[info.key] for info in dense} if streamed
                                 else views)
            self.memory.compensate_all_({info.key: views[info.key] for info in dense})
        futures = []
        if dense and len(dense) == len(infos) and self.memory is None and compressor.identity:
            if not finite:
                buffer.zero_()
            self._record([(info.key, info.numel * buffer.element_size()) for info in dense],
                         "all_reduce", n)
            futures.append(all_reduce_mean(buffer, group))
            dense = []
        elif dense:
            futures.append(self._launch_dense(dense, views, finite, group))
        if stream is not None and pieces is not None:
            futures.append(stream.launch(buffer, infos, pieces, views, finite, streamed, group))
        elif sparse:
            futures.append(self._launch_sparse(buffer, infos, sparse, views, finite, group))
        handed = time.perf_counter()
        self._charge(handed - start)
        if stream is not None and timed:  # the codec to hand-over, the exchange to arrival
            futures[-1] = stream.timed(sparse, handed - start, handed, futures[-1])

        def decode(fut: Future[Any]) -> torch.Tensor:
            results = [f.value() for f in fut.value()]
            if sparse and pieces is None:  # pieces are decoded as they arrive
                self._sum_sparse(buffer, results.pop(), n)
            elif sparse:
                results.pop()
            if dense:
                torch._foreach_copy_([views[info.key] for info in dense],
                                     split_flat(results.pop(), [i.numel for i in dense]))
            return buffer

        return collect(futures, [buffer.device]).then(self._charged(decode))

    def _launch_dense(self, dense: Sequence[TensorInfo], views: Mapping[str, torch.Tensor],
                      finite: bool, group: Group) -> Future[Any]:
        """All-reduce the tensors the compressor keeps dense, as one concatenation."""
        compressor, memory = self.compressor, self.memory
        if (isinstance(compressor, Sparsifier)
                and all(compressor.wire_dtype(views[info.key].dtype) == views[info.key].dtype
                        for info in dense)
                and (memory is None or memory.forgets_what_is_sent)):
            # Sent whole and exactly: the payload is the tensor and no error is left,
            # so there is nothing to encode or remember per tensor.
            if finite:
                flat = torch.cat([views[info.key] for info in dense])
                if memory is not None:
                    for info in dense:
                        memory.buffers.pop(info.key, None)
            else:
                flat = views[dense[0].key].new_zeros(sum(info.numel for info in dense))
            self._record([(info.key, info.numel * flat.element_size()) for info in dense],
                         "all_reduce", world(group)[1])
            return all_reduce_mean(flat, group)
        payloads: list[Payload] = []
        for info in dense:
            view = views[info.key]
            if not finite:  # contribute nothing, keep memory and thresholds as they were
                payloads.append(self.compressor.empty(info))
                continue
            payload = self.compressor.compress(view, info)
            exact = isinstance(payload, DensePayload) and payload.values.dtype == view.dtype
            if self.memory is not None and exact and self.memory.forgets_what_is_sent:
                self.memory.buffers.pop(info.key, None)  # sent whole: no error is left
            elif self.memory is not None:
                self.memory.update(info.key, view, decode_payload(payload, info).reshape(-1))
            payloads.append(payload)
        flat = torch.cat([p.values for p in payloads])  # type: ignore[union-attr]
        self._record([(info.key, p.nbytes) for info, p in zip(dense, payloads)], "all_reduce",
                     world(group)[1])
        return all_reduce_mean(flat, group)

    def _launch_sparse(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                       sparse: Sequence[TensorInfo], views: Mapping[str, torch.Tensor],
                       finite: bool, group: Group) -> Future[Any]:
        """Select, send and remember the sparse tensors of ``buffer`` in one all-gather."""
        compressor = self.compressor
        assert isinstance(compressor, Sparsifier)
        offsets = offsets_of(infos)
        layout = SparseLayout(buffer.numel(), compressor.room(sparse),
                              compressor.wire_dtype(buffer.dtype), compressor.index_format)
        chosen: list[torch.Tensor] = []  # per sparse tensor, indices into its own view
        sent: list[torch.Tensor] = []
        if finite:
            scratch = self._magnitudes(buffer)
            compensated = []
            start = 0
            for info in sparse:  # their |p| back to back, so one selection can span them
                view = views[info.key]
                # p = g + e, held by the memory when there is one (Residual: in its
                # buffer, so the residual is p with the sent entries zeroed, in place).
                p = view if self.memory is None else self.memory.absorb_(info.key, view)
                torch.abs(p, out=scratch[start: start + info.numel])
                start += info.numel
                compensated.append(p)
            chosen = compressor.select_all(scratch[:start], sparse)
            for info, p, local in zip(sparse, compensated, chosen):
                values = p.index_select(0, local).to(layout.value_dtype)
                if (self.memory is not None and self.memory.forgets_what_is_sent
                        and values.dtype == p.dtype):  # sent exactly: those entries become 0
                    self.memory.update_selected_(info.key, p, local)
                elif self.memory is not None:
                    self.memory.update_sparse(info.key, p, local, values)
                sent.append(values)
        else:
            chosen = [torch.zeros(0, dtype=torch.int64, device=buffer.device) for _ in sparse]
            sent = [torch.zeros(0, dtype=layout.value_dtype, device=buffer.device)]
        indices = joined([local + offsets[info.key] if offsets[info.key] else local
                           for info, local in zip(sparse, chosen)])
        segments = layout_segments(layout, [(info.key, local.numel())
                                            for info, local in zip(sparse, chosen)])
        payload = layout.encode(indices, joined(sent), ascending=True)  # select_all's order
        future = all_gather_fixed(payload, group, self.meter, segments)
        return future.then(lambda f: (layout, f.value()))

    @staticmethod
    def _sum_sparse(buffer: torch.Tensor, gathered: tuple[SparseLayout, list[torch.Tensor]],
                    n: int, ranges: Sequence[tuple[int, int]] | None = None) -> None:
        """Write the mean of every rank's sparse payload into ``buffer`` (rank order).

        Sums in rank order, then divides only the entries some rank sent (a
        duplicate index writes the same quotient twice): the same bits as
        dividing the whole buffer, without a pass over it.

        Args:
            ranges: ``[start, stop)`` of ``buffer`` the payloads cover (zeroed
                first); None: all of it.
        """
        layout, rows = gathered
        if ranges is None:
            buffer.zero_()
        for start, stop in ranges or ():
            buffer[start:stop].zero_()
        touched = []
        for row, count in zip(rows, layout.counts(rows)):
            indices, values = layout.decode(row, count)
            buffer.index_add_(0, indices, values.to(buffer.dtype))
            touched.append(indices)
        if n > 1:  # x / 1 == x
            sent = torch.cat(touched)
            buffer.index_copy_(0, sent, buffer.index_select(0, sent).div_(n))

    def _record(self, segments: Sequence[tuple[str, int]], collective: str, n: int) -> None:
        record_segments(self.meter, "W_grad", collective, segments, n)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "compressor": self.compressor.state_dict(),
                "memory": None if self.memory is None else self.memory.state_dict(),
                "streaming": [] if self.pieces is None else self.pieces.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.compressor.load_state_dict(state["compressor"])
        if self.pieces is not None:
            self.pieces.load_state_dict(state.get("streaming", []))
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])


def count_step(steps: dict[str, int], keys: Iterable[str]) -> int:
    """A launch's step, that of its first key, so the tensors launched together (a DDP
    bucket) share it; advances every key's count in ``steps``."""
    keys = list(keys)
    step = steps.get(keys[0], 0) if keys else 0
    for key in keys:
        steps[key] = steps.get(key, 0) + 1
    return step
