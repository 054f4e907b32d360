"""A scheme = compressor + error-feedback memory + transport, applied layer-wise."""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from thinwire.comm import Meter, all_reduce_mean, world
from thinwire.comm.collectives import Future, Group, all_gather_fixed, collect, split_flat
from thinwire.compress import (
    Compressor,
    DCTThreshold,
    Dense,
    DensePayload,
    Payload,
    Sparsifier,
    TensorInfo,
)
from thinwire.compress import decode as decode_payload
from thinwire.compress.payload import SparseLayout, layout_segments
from thinwire.compress.pieces import TRIALS, Part, cut, pay
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

    def _charge(self, seconds: float) -> None:
        with self._lock:
            self.overhead_s += seconds

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
        # stream="auto": per bucket (its sparse keys), rounds launched, timed trial rounds
        # (codec s, exchange s), and the agreed choice (True: pieces).
        self._rounds: dict[tuple[str, ...], int] = {}
        self._trials: dict[tuple[str, ...], list[tuple[float, float]]] = {}
        self.streaming: dict[tuple[str, ...], bool] = {}

    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Average ``grads`` (not modified): one flat buffer per dtype and device."""
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
        finite = all_finite(views, self.nonfinite, flat=buffer)
        if not finite:
            self.skipped += 1
        compressor = self.compressor
        sparse = [info for info in infos
                  if isinstance(compressor, Sparsifier) and not compressor.is_dense(info)]
        sparse_keys = {info.key for info in sparse}
        dense = [info for info in infos if info.key not in sparse_keys]
        choice = self._stream_now(sparse, group) if self._cuts(buffer, sparse) else False
        streamable = choice is not False and finite and self._streams(sparse, views)
        timed = choice is None and streamable  # a trial round of one payload
        pieces = self._cut(sparse) if choice else None
        streamed = streamable and pieces is not None
        if finite and self.memory is not None:  # sparse tensors: in the memory, below
            # the round's per-tensor state, batched; a streamed tensor's, part by part
            self.memory.advance_({info.key: views[info.key] for info in dense} if streamed
                                 else views)
            self.memory.compensate_all_({info.key: views[info.key] for info in dense})
        futures = []
        if dense and len(dense) == len(infos) and self.memory is None and isinstance(
                compressor, Dense):
            if not finite:
                buffer.zero_()
            self._record([(info.key, info.numel * buffer.element_size()) for info in dense],
                         "all_reduce", n)
            futures.append(all_reduce_mean(buffer, group))
            dense = []
        elif dense:
            futures.append(self._launch_dense(dense, views, finite, group))
        if pieces is not None:
            futures.append(self._launch_pieces(buffer, infos, pieces, views, finite, streamed,
                                               group))
        elif sparse:
            futures.append(self._launch_sparse(buffer, infos, sparse, views, finite, group))
        handed = time.perf_counter()
        self._charge(handed - start)
        if timed:  # the codec to hand-over, and the exchange until the payloads arrive
            trials = self._trials.setdefault(tuple(info.key for info in sparse), [])
            futures[-1] = futures[-1].then(functools.partial(
                self._timed, trials, handed - start, handed))

        def decode(fut: Future[Any]) -> torch.Tensor:
            begin = time.perf_counter()
            results = [f.value() for f in fut.value()]
            if sparse and pieces is None:  # pieces are decoded as they arrive
                self._sum_sparse(buffer, results.pop(), n)
            elif sparse:
                results.pop()
            if dense:
                torch._foreach_copy_([views[info.key] for info in dense],
                                     split_flat(results.pop(), [i.numel for i in dense]))
            self._charge(time.perf_counter() - begin)
            return buffer

        return collect(futures, [buffer.device]).then(decode)

    def _launch_dense(self, dense: Sequence[TensorInfo], views: Mapping[str, torch.Tensor],
                      finite: bool, group: Group) -> Future[Any]:
        """All-reduce the tensors the compressor keeps dense, as one concatenation."""
        compressor, memory = self.compressor, self.memory
        if (isinstance(compressor, Sparsifier)
                and all(views[info.key].dtype == compressor.value_dtype for info in dense)
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
        offsets = _offsets(infos)
        layout = SparseLayout(buffer.numel(), compressor.room(sparse), compressor.value_dtype,
                              compressor.index_format)
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

    def _cuts(self, buffer: torch.Tensor, sparse: Sequence[TensorInfo]) -> bool:
        """Whether ``sparse`` can travel in pieces (:mod:`thinwire.compress.pieces`).

        Only on the CPU, where compression costs as much as a slow link's
        transfer (a GPU compresses in a fraction of it), and only for a
        compressor that cuts (:attr:`~thinwire.compress.Sparsifier.piece`) and
        at least two pieces' worth of entries. The answer depends on shapes
        and configuration alone, never on this rank's values, so every rank
        sends the same payloads.
        """
        compressor = self.compressor
        if buffer.device.type != "cpu" or not isinstance(compressor, Sparsifier):
            return False
        entries = compressor.piece
        return bool(entries) and sum(info.numel for info in sparse) >= 2 * entries

    def _cut(self, sparse: Sequence[TensorInfo]) -> list[list[Part]]:
        """The pieces ``sparse`` travels in, each tensor's room shared among its parts."""
        compressor = self.compressor
        assert isinstance(compressor, Sparsifier)
        return cut(sparse, [compressor.capacity(info.numel) for info in sparse], compressor.piece)

    def _stream_now(self, sparse: Sequence[TensorInfo], group: Group) -> bool | None:
        """Whether a bucket that can go in pieces does, this round (``stream``); None: a
        trial round, one payload timed.

        Under ``"auto"`` a bucket travels as one payload for its first
        ``TRIALS + 1`` rounds, the last :data:`~thinwire.compress.pieces.TRIALS`
        of them timed; then every rank contributes its medians to one
        all-reduce and all take the same choice (:func:`~thinwire.compress.pieces.pay`),
        kept for the rest of the run and in :meth:`state_dict`. Rounds are
        counted whatever this rank's values, so every rank decides in the same
        round.
        """
        compressor = self.compressor
        assert isinstance(compressor, DCTThreshold)
        bucket = tuple(info.key for info in sparse)
        if compressor.stream == "always":
            return True
        if bucket not in self.streaming:
            rounds = self._rounds[bucket] = self._rounds.get(bucket, 0) + 1
            if rounds <= TRIALS + 1:
                return None
            self.streaming[bucket] = self._agree(self._trials.pop(bucket, []), group)
            del self._rounds[bucket]
        return self.streaming[bucket]

    @staticmethod
    def _timed(trials: list[tuple[float, float]], codec_s: float, handed: float,
               future: Future[Any]) -> Any:
        trials.append((codec_s, time.perf_counter() - handed))
        return future.value()

    def _agree(self, trials: Sequence[tuple[float, float]], group: Group) -> bool:
        """Every rank's choice from the trials: the least exchange time against the most codec.

        A rank whose trial rounds were all skipped (non-finite) or refreshed
        its thresholds contributes nothing to either.
        """
        _, n = world(group)
        codec = statistics.median(c for c, _ in trials) if trials else 0.0
        wire = statistics.median(w for _, w in trials) if trials else math.inf
        if n > 1:
            both = torch.tensor([wire, -codec], dtype=torch.float64)
            torch.distributed.all_reduce(both, torch.distributed.ReduceOp.MIN, group=group)
            self._record([("stream", both.numel() * both.element_size())], "all_reduce", n)
            wire, codec = both[0].item(), -both[1].item()
        return pay(wire, codec)

    def _streams(self, sparse: Sequence[TensorInfo], views: Mapping[str, torch.Tensor]) -> bool:
        """Whether every sparse tensor's threshold and memory let it be absorbed part by part
        (a reused tau, state from an earlier round); else each is absorbed whole first."""
        compressor, memory = self.compressor, self.memory
        assert isinstance(compressor, DCTThreshold)
        return all(compressor.reused(info) and (
            memory is None or memory.holds(info.key, views[info.key])) for info in sparse)

    def _launch_pieces(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                       pieces: Sequence[Sequence[Part]], views: Mapping[str, torch.Tensor],
                       finite: bool, streamed: bool, group: Group) -> Future[Any]:
        """:meth:`_launch_sparse` in pieces, each sent once selected and decoded on arrival.

        ``streamed``: each part is absorbed into the memory, selected and sent
        before the next part is touched, so compression runs while earlier
        pieces are on the wire. Otherwise (a threshold refresh, a first round)
        every tensor is absorbed whole first; the parts are then selected
        alike, so both give the same bits.

        Returns:
            A future (of None) completed once every piece is decoded into ``buffer``.
        """
        compressor, memory = self.compressor, self.memory
        assert isinstance(compressor, DCTThreshold)
        _, n = world(group)
        offsets = _offsets(infos)
        tensors = list(dict.fromkeys(part.info for piece in pieces for part in piece))
        scratch = self._magnitudes(buffer)

        def magnitudes(info: TensorInfo, start: int = 0, stop: int | None = None) -> torch.Tensor:
            offset = offsets[info.key]
            return scratch[offset + start: offset + (info.numel if stop is None else stop)]

        held: dict[str, torch.Tensor] = {}  # key -> p, flat (the memory's buffer)
        tau: dict[str, float] = {}
        if finite:
            for info in tensors:
                whole = views[info.key].reshape(-1)
                if not streamed:
                    whole = whole if memory is None else memory.absorb_(info.key, whole)
                    torch.abs(whole, out=magnitudes(info))
                    held[info.key] = whole
                tau[info.key] = compressor.open_call(None if streamed else magnitudes(info), info)
        passed = dict.fromkeys(tau, 0)
        chosen: dict[str, list[torch.Tensor]] = {key: [] for key in tau}
        sent: dict[str, list[torch.Tensor]] = {key: [] for key in tau}
        futures = []
        for piece in pieces:
            indices, values, counts = [], [], []
            for part in piece if finite else ():
                key, start, stop = part.info.key, part.start, part.stop
                if streamed:
                    grad = views[key].reshape(-1)
                    held[key] = grad if memory is None else memory.absorb_part_(
                        key, grad[start:stop], start)
                p = held[key][start:stop]
                part_abs = magnitudes(part.info, start, stop)
                if streamed:
                    torch.abs(p, out=part_abs)
                local, count = compressor.pick(part_abs, tau[key], part.room)
                passed[key] += count
                chosen[key].append(local + start)
                sent[key].append(p.index_select(0, local).to(compressor.value_dtype))
                indices.append(chosen[key][-1] + offsets[key])
                values.append(sent[key][-1])
                counts.append((key, local.numel()))
            layout = SparseLayout(buffer.numel(), sum(part.room for part in piece),
                                  compressor.value_dtype, compressor.index_format)
            empty = buffer.new_zeros(0)
            payload = layout.encode(joined(indices) if indices else empty.long(),
                                    joined(values) if values else empty, ascending=True)
            ranges = [(offsets[part.info.key] + part.start, offsets[part.info.key] + part.stop)
                      for part in piece]
            future = all_gather_fixed(payload, group, self.meter, layout_segments(layout, counts))
            futures.append(future.then(functools.partial(self._decode_piece, buffer, layout,
                                                         ranges, n)))
        exact = compressor.value_dtype == buffer.dtype
        for info in tensors if finite else ():
            key = info.key
            local = torch.cat(chosen[key])
            if memory is not None and memory.forgets_what_is_sent and exact:
                memory.update_selected_(key, held[key], local)  # sent exactly: zeroed
            elif memory is not None:
                memory.update_sparse(key, held[key], local, torch.cat(sent[key]))
            compressor.close_call(magnitudes(info), info, passed[key], local.numel())
        return collect(futures, [buffer.device]).then(lambda _: None)

    def _decode_piece(self, buffer: torch.Tensor, layout: SparseLayout,
                      ranges: Sequence[tuple[int, int]], n: int, future: Future[Any]) -> None:
        """Decode one piece's rows into its ``ranges`` of ``buffer`` (on arrival)."""
        begin = time.perf_counter()
        self._sum_sparse(buffer, (layout, future.value()), n, ranges)
        self._charge(time.perf_counter() - begin)

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
        if self.meter is not None:
            for key, nbytes in segments:
                self.meter.record("W_grad", key, collective, nbytes, world_size=n)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "compressor": self.compressor.state_dict(),
                "memory": None if self.memory is None else self.memory.state_dict(),
                "streaming": [[list(bucket), choice]
                              for bucket, choice in self.streaming.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.compressor.load_state_dict(state["compressor"])
        # Trials in progress are not kept: every rank loading the checkpoint starts them anew.
        self.streaming = {tuple(bucket): choice for bucket, choice in state.get("streaming", [])}
        self._rounds, self._trials = {}, {}
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors flat and back to back (a view of a lone one: no copy)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _offsets(infos: Sequence[TensorInfo]) -> dict[str, int]:
    """Where each tensor of a flat buffer laid out as ``infos`` starts."""
    return dict(zip([info.key for info in infos],
                    itertools.accumulate([0] + [info.numel for info in infos])))


def unflatten(flat: torch.Tensor, infos: Sequence[TensorInfo]) -> dict[str, torch.Tensor]:
    """Split a flat (averaged) buffer back into the tensors it was concatenated from."""
    if not infos:
        return {}
    parts = torch.split(flat, [info.numel for info in infos])
    return {info.key: part.to(info.dtype).reshape(info.shape) for info, part in zip(infos, parts)}
