"""The exchange kernel: every scheme is a selection, a value codec and a memory run through it.

One launch of a flat bucket (:meth:`CompressedScheme.launch_flat`):

1. route: tensors the selection keeps whole (small, excluded) and the rest; in a
   tensor's warm-up (its first ``warmup_steps`` launches, an option of every scheme:
   :func:`~thinwire.schemes.build`) every tensor travels whole at its own width, bit for
   bit what ``dense`` sends;
2. compensate: the error memory adds what it held back, ``p = g + e`` (DCT Alg. 1 line 3);
3. select: each rank's own indices (a :class:`~thinwire.compress.Sparsifier`: top-k,
   a reused threshold, a Laplace fit, chunks), or coordinates agreed in a first round
   (:mod:`thinwire.schemes.agreed`: a leader's indices, CLT-k; a low-rank basis, PowerSGD);
4. encode: values by the value codec (:mod:`thinwire.compress.values`), own indices by
   the index codec (:class:`~thinwire.compress.SparseLayout`; a chunk code where the
   selection fixes each chunk's count, SparseLoCo's);
5. move: an all-reduce where every rank's coordinates are the same (whole tensors, or
   agreed ones) and the values summable; otherwise one all-gather of fixed-size payloads,
   in pieces where a threshold known before the gradient lets them stream
   (:mod:`thinwire.schemes.streaming`);
6. remember: the memory keeps ``p - sent`` (Alg. 1 line 11), or ``p`` less the mean's
   approximation (PowerSGD, as torch's hook);
7. decode the mean into the bucket, every rank's payload summed in rank order, and
   settle it (an EF21 estimate steps with the whole).

A rank whose gradient is not finite (``nonfinite="skip"``) contributes zeros and
leaves its memory and selection state as they were; the collectives stay in step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.comm import all_reduce_mean, done, world
from thinwire.comm._metered import record_segments
from thinwire.comm.collectives import Future, Group, all_gather_fixed, collect, split_flat
from thinwire.comm.rounds import TwoRounds, all_reduce_round
from thinwire.comm.shared_index import broadcast_indices
from thinwire.compress import FULL_WIDTH, SparseLayout, Sparsifier, TensorInfo, ValueCodec
from thinwire.compress.payload import CHUNK_FORMATS
from thinwire.compress.pieces import Part, Streams
from thinwire.feedback import Memory
from thinwire.schemes.agreed import Agreed, Proposal
from thinwire.schemes.base import Scheme, count_step
from thinwire.schemes.selected import Chosen, Kept, Region
from thinwire.schemes.streaming import Streaming, joined, offsets_of
from thinwire.schemes.traits import ALL_GATHER, ALL_REDUCE, BROADCAST, Traits

AnySelection = Sparsifier | Agreed
STEP_BYTES = 4  # a row's header: the launch's step, int32
ROW = "row"  # the collective of bytes only a row carries (its step, its padding)
MEANS = ("ranks", "senders")  # what a gathered entry's sum is divided by
Segment = tuple[str, str, int]  # (collective, layer, bytes) of a row


def _step_header(step: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([step], dtype=torch.int32, device=device).view(torch.uint8)


def _row_step(rows: Sequence[torch.Tensor]) -> int:
    """The one step of ``rows``' headers.

    Raises:
        ValueError: a row that is not flat uint8 bytes with a header, or rows of
            several steps or a negative one.
    """
    for row in rows:
        if row.dtype != torch.uint8 or row.dim() != 1 or row.numel() < STEP_BYTES:
            raise ValueError(f"a row is flat uint8 bytes of at least {STEP_BYTES}, got "
                             f"{row.dtype} {tuple(row.shape)}")
    steps = {int(row[:STEP_BYTES].clone().view(torch.int32)[0]) for row in rows}
    step = steps.pop()
    if steps or step < 0:
        raise ValueError(f"rows of steps {sorted(steps | {step})}: one step >= 0 expected")
    return step


@dataclass
class _Launch:
    """One launch's bucket: its views, what travels whole and what is selected.

    Own indices address the selected tensors laid back to back (their region), so
    tensors sent whole cost no index room; :meth:`in_bucket` maps them back.
    """

    buffer: torch.Tensor
    infos: Sequence[TensorInfo]
    views: dict[str, torch.Tensor]
    whole: list[TensorInfo]
    selected: list[TensorInfo]
    finite: bool
    n: int
    values: ValueCodec  # of the tensors sent whole: the scheme's, or full width in warm-up

    @functools.cached_property
    def offsets(self) -> dict[str, int]:
        """Where each tensor starts in the bucket."""
        return offsets_of(self.infos)

    @functools.cached_property
    def region(self) -> dict[str, int]:
        """Where each selected tensor starts in the region."""
        return offsets_of(self.selected)

    @functools.cached_property
    def _shifts(self) -> tuple[torch.Tensor, torch.Tensor] | int:
        """Bucket offset less region offset of each selected tensor: one number when all
        agree (no tensor sent whole lies between two selected ones), else per tensor."""
        shifts = [self.offsets[info.key] - self.region[info.key] for info in self.selected]
        if len(set(shifts)) == 1:
            return shifts[0]
        device = self.buffer.device
        return (torch.tensor([self.region[info.key] for info in self.selected], device=device),
                torch.tensor(shifts, device=device))

    @property
    def span(self) -> slice | None:
        """Where the selected tensors lie in the bucket, if back to back there."""
        shift = self._shifts
        if not isinstance(shift, int):
            return None
        return slice(shift, shift + sum(info.numel for info in self.selected))

    def in_bucket(self, indices: torch.Tensor) -> torch.Tensor:
        """Region indices as bucket positions."""
        shifts = self._shifts
        if isinstance(shifts, int):
            return indices + shifts if shifts else indices
        starts, per_tensor = shifts
        return indices + per_tensor[torch.searchsorted(starts, indices, right=True) - 1]


class CompressedScheme(Scheme):
    """The exchange kernel (module docstring): ``selection`` + ``values`` + ``memory``.

    Per-tensor state (memory, thresholds, factors, step counts) is keyed by tensor
    name, never by position, so it survives DDP's re-bucketing.

    Args:
        values: how values travel (:class:`~thinwire.compress.Cast`,
            :class:`~thinwire.compress.Quantised`); also the tensors sent whole.
        selection: which entries go: None (every entry), a
            :class:`~thinwire.compress.Sparsifier` (each rank's own), or an
            :class:`~thinwire.schemes.agreed.Agreed` selection (a first round).
        memory: error feedback, or None for none.
        nonfinite: ``"raise"`` or ``"skip"`` (see :func:`thinwire.feedback.all_finite`).
        indices: the index list of own selections' payloads, ``"delta16"``, ``"delta8"``
            or ``"int32"`` (a bitmap where smaller), or a chunk code (``"elias-fano"``, ``"fixed"``)
            of a selection that sends a fixed count of each chunk
            (:meth:`~thinwire.compress.Sparsifier.plan`).
        warmup_steps: launches of a tensor sent whole, at its own width (dense), before
            the scheme compresses it (a scheme built by name takes its config's).
        mean: what the sum of the entries gathered from every rank's payload is divided
            by: ``"ranks"``, or ``"senders"`` (at each entry, the ranks that sent it).

    Raises:
        ValueError: an agreed selection with values that do not sum (codes), a chunk
            code or per-tensor values without a selection of fixed counts, a negative
            ``warmup_steps``, or an unknown ``mean``.
    """

    def __init__(self, values: ValueCodec, selection: AnySelection | None = None,
                 memory: Memory | None = None, nonfinite: str = "raise", *,
                 indices: str = "delta16", warmup_steps: int = 0,
                 mean: str = "ranks") -> None:
        super().__init__()
        if isinstance(selection, Agreed) and not values.summable:
            raise ValueError(f"values={values.name!r} do not sum, so they cannot be "
                             "all-reduced at agreed coordinates")
        # a selection with a plan (even of no tensors) sends a fixed count of each chunk
        fixed = isinstance(selection, Sparsifier) and selection.plan(()) is not None
        if indices in CHUNK_FORMATS and not fixed:
            raise ValueError(f"indices={indices!r} codes chunks of a fixed count; the "
                             "selection does not fix its counts")
        if values.per_tensor and selection is not None and not fixed:
            raise ValueError(f"values={values.name!r} are coded per tensor, which needs a "
                             "selection that fixes each tensor's count (or none)")
        if mean not in MEANS:
            raise ValueError(f"mean={mean!r} must be one of {MEANS}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) \
                or warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 0")
        self.values = values
        self.selection = selection
        self.memory = memory
        self.nonfinite = nonfinite
        self.indices = indices
        self.warmup_steps = warmup_steps
        self.mean = mean
        self.steps: dict[str, int] = {}  # key -> launches so far
        self.rounds = TwoRounds()  # at most one launch whose round 2 waits for round 1
        # A selection whose threshold is known before the gradient streams large buckets.
        self.pieces = (Streaming(selection, self._record) if isinstance(selection, Streams)
                       and values.summable else None)

    # ------------------------------------------------------------ what it is
    @property
    def traits(self) -> Traits:
        selection, summable = self.selection, self.values.summable
        if isinstance(selection, Agreed):
            collectives: tuple[str, ...] = (
                BROADCAST if selection.shares_indices else ALL_REDUCE, ALL_REDUCE)
        elif selection is None:
            collectives = (ALL_REDUCE,) if summable else (ALL_GATHER,)
        else:
            collectives = (ALL_GATHER, ALL_REDUCE) if summable else (ALL_GATHER,)
        shares = isinstance(selection, Agreed) and selection.shares_indices
        return Traits(None if selection is None else selection.density,
                      None if self.memory is None else self.memory.rule,
                      streams=self.pieces is not None, shared_indices=shares, energy=shares,
                      collectives=collectives, rounds=2 if isinstance(selection, Agreed) else 1)

    @property
    def started(self) -> bool:
        return bool(self.steps) or super().started

    @property
    def trace(self) -> Mapping[str, Sequence[tuple[int, float, float]]]:
        return {} if self.selection is None else self.selection.trace

    def diagnostics(self) -> dict[str, Any]:
        out = dict(self.selection.diagnostics()) if self.selection is not None else {}
        if self.pieces is not None and self.pieces.streaming:
            out["streaming"] = {keys[0]: choice for keys, choice in self.pieces.streaming.items()}
        return out

    @property
    def error_memory(self) -> Memory | None:
        return self.memory if self.traits.density is not None else None

    def couple_memory(self, memory: Memory) -> None:
        if self.error_memory is None:
            super().couple_memory(memory)
        self.memory = self.coupled = memory

    def selects(self, info: TensorInfo, step: int) -> bool:
        """Whether ``info``'s tensor is selected at ``step`` (the same on every rank)."""
        return (self.selection is not None and step >= self.warmup_steps
                and not self.selection.is_dense(info))

    # ------------------------------------------------------------ the exchange
    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Average ``grads`` (not modified): one flat buffer per dtype and device."""
        return self._via_flat(grads, group) if grads else done({})

    def launch_flat(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                    group: Group = None, *, last: bool = True) -> Future[Any]:
        """Average ``infos``' tensors, laid out back to back in the 1-D ``buffer``, in place.

        Args:
            last: whether this is the step's last launch (DDP's last bucket). An
                agreed selection's round 1 of a launch that is not the last is waited
                for at the next launch (:class:`~thinwire.comm.rounds.TwoRounds`), so
                the backward pass runs meanwhile; its future completes after a later
                launch with ``last``.

        Returns:
            A future holding ``buffer``, overwritten with the mean over ranks.

        Raises:
            FloatingPointError: a non-finite gradient under ``nonfinite="raise"``.
        """
        if not infos:
            return done(buffer)
        start = time.perf_counter()
        views = self._views(buffer, infos)
        finite = self._finite(views, self.nonfinite, buffer)
        step = count_step(self.steps, views)
        launch = self._bucket(buffer, infos, step, finite, world(group)[1], views)
        if isinstance(self.selection, Agreed):
            return self._launch_agreed(launch, self.selection, step, group, last, start)
        return self._launch_own(launch, group, start)

    def payload_bytes(self, infos: Sequence[TensorInfo],
                      step: int | None = None) -> dict[str, int]:
        """The bytes one launch of ``infos`` hands each collective, by collective, fixed by
        shapes and options alone (the payload layouts' own count; what the Meter records).

        Args:
            step: the launch's step; default the first past warm-up.
        """
        step = self.warmup_steps if step is None else step
        selected = [info for info in infos if self.selects(info, step)]
        whole = [info for info in infos if info not in selected]
        values, selection = self._whole_values(step), self.selection
        out: dict[str, int] = {}
        if whole and values.summable:
            out[ALL_REDUCE] = sum(values.entry_bytes(info.numel, info.dtype) for info in whole)
        if isinstance(selection, Agreed):
            collective, first, counts = selection.sizes(selected)
            if selected:
                out[collective] = out.get(collective, 0) + first
                out[ALL_REDUCE] = out.get(ALL_REDUCE, 0) + values.entry_bytes(
                    sum(counts), selected[0].dtype)
            return out
        gathered = sum(values.nbytes(info.numel, info.dtype) for info in whole
                       if not values.summable)
        if selected:
            assert isinstance(selection, Sparsifier)
            gathered += self._sparse_layout(selected, selection.room(selected, record=False),
                                            selected[0].dtype).nbytes
        if gathered:
            out[ALL_GATHER] = gathered
        return out

    # ---- one rank's payload as a row, for a transport that is not a collective
    def encode_row(self, buffer: torch.Tensor,
                   infos: Sequence[TensorInfo]) -> tuple[torch.Tensor, list[Segment]]:
        """This rank's payload of ``buffer``'s finite gradients as one row that another
        process decodes alone (:meth:`decode_row`): the parameter server's push.

        The row is the launch's step (int32, which routes warm-up alike on both
        sides), every tensor sent whole (cast values padded to 4 bytes, or codes),
        then the selected values and their indices: the bytes :meth:`launch_flat`
        hands its collectives for the same tensors, plus the step and that padding.
        Compensates, selects and remembers as :meth:`launch_flat` does; never streams.
        ``buffer`` is modified.

        Returns:
            The row (uint8) and its metered parts, each with the collective that
            :meth:`launch_flat` hands it to (:data:`ROW` for the step and padding, which
            only a row carries).

        Raises:
            TypeError: the selection agrees on its coordinates in a first round.
        """
        if isinstance(self.selection, Agreed):
            raise TypeError("this scheme agrees on its coordinates in a first round across "
                            "ranks; one rank's payload cannot be decoded alone")
        step = count_step(self.steps, [info.key for info in infos])
        launch = self._bucket(buffer, infos, step, True, 1)
        self._open(launch)
        parts = [_step_header(step, buffer.device)]
        segments: list[Segment] = [(ROW, "(step)", STEP_BYTES)]
        for info in launch.whole:
            area, _ = self._encode_whole(launch, info)
            parts.append(area)
            segments += self._row_segments(launch.values, info, area.numel())
        layout = self._layout(launch, None)
        if layout is not None:
            block, block_segments = self._pack(launch, layout, self._select(launch), None)
            parts.append(block)
            segments += [(ALL_GATHER, layer, nbytes) for layer, nbytes in block_segments]
        return torch.cat(parts), [segment for segment in segments if segment[2]]

    @staticmethod
    def _row_segments(values: ValueCodec, info: TensorInfo, nbytes: int) -> list[Segment]:
        """A row's metered parts of a tensor sent whole in ``nbytes``: summable values are
        all-reduced as they are (a row pads them to 4 bytes), codes all-gathered."""
        if not values.summable:
            return [(ALL_GATHER, info.key, nbytes)]
        size = values.entry_bytes(info.numel, info.dtype)
        return [(ALL_REDUCE, info.key, size), (ROW, "(padding)", nbytes - size)]

    def decode_rows(self, rows: Sequence[torch.Tensor],
                    infos: Sequence[TensorInfo]) -> torch.Tensor:
        """The mean of several ranks' rows (of one step), as :meth:`launch_flat` averages
        their tensors: those sent whole and summable each divided by the rank count, then
        summed in rank order (the all-reduce's mean), the rest summed in rank order and
        divided (the all-gather's decode). For replicas simulated in one process.

        Raises:
            ValueError: rows of another length, step or entry count than the layout's,
                or indices outside it.
        """
        step = _row_step(rows)
        dtype, device = infos[0].dtype, rows[0].device
        buffer = torch.zeros(sum(info.numel for info in infos), dtype=dtype, device=device)
        launch = self._bucket(buffer, infos, step, True, len(rows))
        layout = self._layout(launch, None)
        whole = sum(launch.values.nbytes(info.numel, info.dtype) for info in launch.whole)
        expected = STEP_BYTES + whole + (0 if layout is None else layout.nbytes)
        bodies = [row[STEP_BYTES:] for row in rows]
        for row in rows:
            if row.numel() != expected:
                raise ValueError(f"a row has {row.numel()} bytes; step {step}'s layout has "
                                 f"{expected}")
        if layout is not None:
            for count in layout.counts([body[whole:] for body in bodies]):
                if not 0 <= count <= layout.capacity:
                    raise ValueError(f"a row holds {count} entries, outside [0, "
                                     f"{layout.capacity}]")
        summed = launch.whole if not launch.values.summable else []
        try:
            self._add_rows(launch, layout, launch.whole, summed, None, bodies)
        except (IndexError, RuntimeError) as error:
            raise ValueError(f"the rows' indices do not decode: {error}") from error
        return buffer

    @staticmethod
    def _views(buffer: torch.Tensor, infos: Sequence[TensorInfo]) -> dict[str, torch.Tensor]:
        """Each tensor's flat view of the bucket, by key."""
        return dict(zip([info.key for info in infos],
                        split_flat(buffer, [info.numel for info in infos])))

    def _bucket(self, buffer: torch.Tensor, infos: Sequence[TensorInfo], step: int,
                finite: bool, n: int, views: dict[str, torch.Tensor] | None = None) -> _Launch:
        """A launch of ``buffer`` at ``step``: its views, and the tensors selected."""
        views = self._views(buffer, infos) if views is None else views
        selected = [info for info in infos if self.selects(info, step)]
        chosen = {info.key for info in selected}
        return _Launch(buffer, infos, views, [info for info in infos if info.key not in chosen],
                       selected, finite, n, self._whole_values(step))

    def _open(self, launch: _Launch, advance: Mapping[str, torch.Tensor] | None = None) -> None:
        """A finite round's opening: the memory advances (every tensor, or ``advance``)
        and compensates the tensors sent whole in the bucket."""
        memory = self.memory
        if memory is not None and launch.finite:
            memory.advance_(launch.views if advance is None else advance)
            memory.compensate_all_({info.key: launch.views[info.key] for info in launch.whole})

    def _whole_values(self, step: int) -> ValueCodec:
        """How tensors sent whole travel at ``step``: at their own width in warm-up."""
        return FULL_WIDTH if step < self.warmup_steps else self.values

    def _compensated(self, launch: _Launch, infos: Sequence[TensorInfo]) -> dict[str, torch.Tensor]:
        """``p = g + e`` of each of ``infos`` (flat): in the memory's own buffer where it
        forgets what is sent (the sent entries are then zeroed in place), else in the bucket."""
        memory, views = self.memory, launch.views
        if memory is None:
            return {info.key: views[info.key] for info in infos}
        absorb = memory.absorb_ if memory.forgets_what_is_sent else memory.compensate_
        return {info.key: absorb(info.key, views[info.key]) for info in infos}

    # ---- own selections: each rank's coordinates travel with its values
    def _launch_own(self, launch: _Launch, group: Group, start: float) -> Future[Any]:
        buffer, views = launch.buffer, launch.views
        selected, finite = launch.selected, launch.finite
        stream = self.pieces
        choice = stream.choose(buffer, selected, group) if stream is not None else False
        streamable = stream is not None and choice is not False and finite and stream.streams(
            selected, views, self.memory)
        pieces = stream.cut(selected) if stream is not None and choice else None
        streamed = streamable and pieces is not None
        # a streamed tensor is absorbed part by part
        self._open(launch, {info.key: views[info.key] for info in launch.whole}
                   if streamed else None)
        futures = []
        if launch.whole and launch.values.summable:
            futures.append(self._launch_whole(launch, group))
        rows: list[tuple[torch.Tensor, list[tuple[str, int]]]] = []
        if launch.whole and not launch.values.summable:  # codes do not sum: they go with the rest
            rows = [self._encode_whole(launch, info) for info in launch.whole]
        if selected or rows:
            if stream is not None and pieces is not None:
                futures.extend(stream.launch(
                    launch, pieces, streamed, memory=self.memory,
                    scratch=self._magnitudes(buffer), remember=self._remember,
                    send=lambda launch, chosen, piece, kept: self._send(
                        launch, chosen, piece, [], group, kept)))
            else:
                futures.append(self._send(launch, self._select(launch) if selected else [],
                                          None, rows, group))
        handed = time.perf_counter()
        self._charge(handed - start)
        if stream is not None and choice is None and streamable:  # a trial round, timed
            futures[-1] = stream.timed(selected, handed - start, handed, futures[-1])
        return collect(futures, [buffer.device]).then(self._charged(  # a failed one: its error
            lambda arrived: self._finish_whole(launch, arrived.value())))

    def _select(self, launch: _Launch) -> list[Chosen] | Region:
        """Each selected tensor's ``p`` and indices (absorbed whole first), or all of them
        as one :class:`Region` where they can be; none sent where the round is not finite."""
        selection = self.selection
        assert isinstance(selection, Sparsifier)
        if not launch.finite:
            nothing = launch.buffer.new_zeros(0, dtype=torch.int64)
            return [Chosen(info, launch.views[info.key], nothing) for info in launch.selected]
        region = self._region(launch, selection)
        if region is not None:
            return region
        ps = self._compensated(launch, launch.selected)
        scratch = self._magnitudes(launch.buffer)
        offset = 0
        for info in launch.selected:  # |p| back to back, so one selection can span them
            torch.abs(ps[info.key], out=scratch[offset: offset + info.numel])
            offset += info.numel
        indices = selection.select_all(scratch[:offset], launch.selected)
        return [Chosen(info, ps[info.key], local) for info, local in
                zip(launch.selected, indices)]

    def _region(self, launch: _Launch, selection: Sparsifier) -> Region | None:
        """The selected tensors compensated and selected as one, in a few ops whatever
        their count, where the memory (if any) absorbs them so
        (:attr:`~thinwire.feedback.Memory.absorbs_regions`); else None."""
        memory, selected = self.memory, launch.selected
        if memory is not None and not (memory.forgets_what_is_sent and memory.absorbs_regions):
            return None
        span = launch.span  # else gathered: tensors sent whole lie between them
        grads = launch.buffer[span] if span is not None else torch.cat(
            [launch.views[info.key] for info in selected])
        p = grads if memory is None else memory.absorb_region_(
            [info.key for info in selected], [info.numel for info in selected], grads)
        magnitudes = torch.abs(p, out=self._magnitudes(launch.buffer)[: p.numel()])
        return Region(selected, p, *selection.select_joined(magnitudes, selected))

    def _layout(self, launch: _Launch, piece: Sequence[Part] | None) -> SparseLayout | None:
        """The payload layout of the selected tensors: room for the selection's entries, or
        for ``piece``'s parts; indices address the selected tensors back to back."""
        if not launch.selected:
            return None
        selection = self.selection
        assert isinstance(selection, Sparsifier)
        room = (selection.room(launch.selected) if piece is None
                else sum(part.room for part in piece))
        return self._sparse_layout(launch.selected, room, launch.buffer.dtype)

    def _sparse_layout(self, selected: Sequence[TensorInfo], room: int,
                       dtype: torch.dtype) -> SparseLayout:
        """The layout of ``selected`` with ``room`` entries: a chunk code's plan and a
        per-tensor codec's groups where the scheme has them."""
        selection = self.selection
        assert isinstance(selection, Sparsifier)
        plan = selection.plan(selected) if self.indices in CHUNK_FORMATS else None
        groups = (tuple(selection.capacity(info.numel) for info in selected)
                  if self.values.per_tensor else ())
        return SparseLayout(sum(info.numel for info in selected), room, dtype, self.indices,
                            self.values, plan or (), groups)

    def _pack(self, launch: _Launch, layout: SparseLayout, chosen: Sequence[Chosen] | Region,
              kept: list[Kept] | None) -> tuple[torch.Tensor, list[tuple[str, int]]]:
        """The values at ``chosen`` and their indices, as ``layout`` lays them out, with
        the payload's metered parts. What was sent is remembered now (when the round is
        finite), or appended to ``kept`` (a piece's: remembered once every piece has gone)."""
        if isinstance(chosen, Region):
            block, sent = layout.pack(chosen.indices, chosen.p.index_select(0, chosen.indices),
                                      ascending=True)
            keys = [info.key for info in chosen.infos]
            if self.memory is not None:  # a region is only ever chosen in a finite round
                exact = self.memory.forgets_what_is_sent and self.values.exact(chosen.p.dtype)
                self.memory.update_region_(keys, chosen.p, chosen.indices,
                                           None if exact else sent)
            return block, layout.segments(list(zip(keys, chosen.counts)))
        region, empty = launch.region, launch.buffer.new_zeros(0)
        indices = joined([c.indices + region[c.info.key] if region[c.info.key]
                          else c.indices for c in chosen]) if chosen else empty.long()
        taken = joined([c.p.index_select(0, c.indices) for c in chosen]) if chosen else empty
        block, sent = layout.pack(indices, taken, ascending=True)  # select_all's order
        items = [c.sent(part) for c, part in zip(
            chosen, sent.split([c.indices.numel() for c in chosen]))]
        if kept is not None:
            kept.extend(items)
        elif launch.finite:
            self._remember(items)
        return block, layout.segments([(c.info.key, c.indices.numel()) for c in chosen])

    def _send(self, launch: _Launch, chosen: Sequence[Chosen] | Region,
              piece: Sequence[Part] | None,
              rows: Sequence[tuple[torch.Tensor, list[tuple[str, int]]]], group: Group,
              kept: list[Kept] | None = None) -> Future[Any]:
        """All-gather this rank's payload, ``rows`` (tensors sent whole as codes) then
        the selected block (:meth:`_pack`), and decode every rank's into the bucket."""
        layout = self._layout(launch, piece)
        segments = [segment for _, row_segments in rows for segment in row_segments]
        payload = [row for row, _ in rows]
        if layout is not None:
            block, block_segments = self._pack(launch, layout, chosen, kept)
            payload.append(block)
            segments += block_segments
        offsets = launch.offsets
        ranges = None if piece is None else [
            (offsets[part.info.key] + part.start, offsets[part.info.key] + part.stop)
            for part in piece]
        future = all_gather_fixed(payload[0] if len(payload) == 1 else torch.cat(payload),
                                  group, self.meter, segments)
        whole = launch.whole if rows else []  # codes: summed, then divided
        return future.then(self._charged(lambda arrived: self._add_rows(
            launch, layout, whole, whole, ranges, arrived.value())))

    def _remember(self, kept: Sequence[Kept]) -> None:
        """The memory keeps ``p`` less what was sent at each tensor's indices."""
        memory = self.memory
        if memory is None:
            return
        for item in kept:
            if memory.forgets_what_is_sent and self.values.exact(item.p.dtype):
                memory.update_selected_(item.key, item.p, item.indices)  # sent exactly: 0
            else:
                memory.update_sparse(item.key, item.p, item.indices, item.values)

    def _add_rows(self, launch: _Launch, layout: SparseLayout | None,
                  whole: Sequence[TensorInfo], summed: Sequence[TensorInfo],
                  ranges: Sequence[tuple[int, int]] | None,
                  rows: Sequence[torch.Tensor]) -> None:
        """Write the mean of ``rows`` (every rank's payload) into ``ranges`` of the bucket
        (all of it when None): first the ``whole`` tensors' areas, then the selected
        block; ranks summed in rank order.

        The ``summed`` of the whole tensors (codes), and the selected entries, are summed
        and then divided by the rank count; the other whole tensors (summable values) are
        divided first, as the all-reduce's mean divides. Only the entries some rank sent
        are divided (a duplicate index writes the same quotient twice): the same bits as
        dividing the whole buffer, without a pass over it; under ``mean="senders"`` a
        selected entry by the ranks that sent it.
        """
        buffer, views, n = launch.buffer, launch.views, launch.n
        if ranges is None:
            buffer.zero_()
        for begin, end in ranges or ():
            buffer[begin:end].zero_()
        skip = sum(launch.values.nbytes(info.numel, info.dtype) for info in whole)
        self._add_whole(launch, whole, {info.key for info in summed},
                        [row[:skip] for row in rows])
        touched = []
        if layout is not None:
            bodies = [row[skip:] for row in rows]
            for body, count in zip(bodies, layout.counts(bodies)):
                indices, decoded = layout.decode(body, count)
                indices = launch.in_bucket(indices)
                buffer.index_add_(0, indices, decoded.to(buffer.dtype))
                touched.append(indices)
        if n > 1:  # x / 1 == x
            for info in summed:
                views[info.key].div_(n)
            if touched:
                sent = torch.cat(touched)
                divisor: torch.Tensor | int = n
                if self.mean == "senders":
                    divisor = torch.zeros_like(buffer).index_add_(
                        0, sent, torch.ones_like(sent, dtype=buffer.dtype)).index_select(0, sent)
                buffer.index_copy_(0, sent, buffer.index_select(0, sent).div_(divisor))

    @staticmethod
    def _add_whole(launch: _Launch, whole: Sequence[TensorInfo], later: set[str],
                   rows: Sequence[torch.Tensor]) -> None:
        """Every rank's areas of the tensors sent whole into their views, in rank order:
        those in ``later`` summed (divided by the caller), the rest as the all-reduce's
        mean (each divided by the rank count, summed in the wire's dtype)."""
        views, n, values = launch.views, launch.n, launch.values
        means: dict[str, torch.Tensor] = {}
        for index, row in enumerate(rows):
            offset = 0
            for info in whole:
                size = values.nbytes(info.numel, info.dtype)
                part = values.read(row[offset: offset + size], info.numel, info.numel,
                                   info.dtype)
                offset += size
                if info.key in later or n == 1:
                    views[info.key].add_(part)
                else:
                    share = part / n
                    means[info.key] = share if index == 0 else means[info.key].add_(share)
        for key, mean in means.items():
            views[key].copy_(mean)

    # ---- tensors sent whole
    def _launch_whole(self, launch: _Launch, group: Group) -> Future[Any]:
        """All-reduce the tensors sent whole (summable values), in one concatenation; their
        memory keeps what the cast left out (nothing, where exact)."""
        memory, values = self.memory, launch.values
        whole = launch.whole
        exact = all(values.exact(info.dtype) for info in whole)
        n = launch.n
        if len(whole) == len(launch.infos) and memory is None and exact:
            if not launch.finite:
                launch.buffer.zero_()
            self._record([(info.key, info.numel * launch.buffer.element_size())
                          for info in whole], "all_reduce", n)
            return all_reduce_mean(launch.buffer, group)
        flat = self._wire_whole(launch)
        self._record([(info.key, info.numel * flat.element_size()) for info in whole],
                     "all_reduce", n)
        return all_reduce_mean(flat, group)

    def _wire_whole(self, launch: _Launch) -> torch.Tensor:
        """The tensors sent whole, cast for the wire, back to back (a new tensor): zeros
        where the round is not finite; the memory remembers what the cast left out."""
        views, memory, values = launch.views, self.memory, launch.values
        whole = launch.whole
        wire = values.wire_dtype(whole[0].dtype)
        if not launch.finite:
            return views[whole[0].key].new_zeros(sum(info.numel for info in whole), dtype=wire)
        every = len(whole) == len(launch.infos)
        if every:  # the whole bucket: one cast (a new tensor), viewed per tensor
            flat = values.cast(launch.buffer)
            flat = flat.clone() if flat.data_ptr() == launch.buffer.data_ptr() else flat
            cast = split_flat(flat, [info.numel for info in whole]) if memory is not None else []
        else:
            cast = [values.cast(views[info.key]) for info in whole]
        for info, sent in zip(whole, cast):
            if memory is None:
                continue
            if memory.forgets_what_is_sent and values.exact(info.dtype):
                memory.buffers.pop(info.key, None)  # sent whole and exactly: no error left
            else:
                memory.update(info.key, views[info.key], sent.to(info.dtype))
        if every:
            return flat
        return torch.cat(cast) if len(cast) > 1 or cast[0].data_ptr() == views[
            whole[0].key].data_ptr() else cast[0]

    def _encode_whole(self, launch: _Launch,
                      info: TensorInfo) -> tuple[torch.Tensor, list[tuple[str, int]]]:
        """A tensor sent whole in a payload's row (codes, or cast values padded to 4): its
        area, zeros where the round is not finite, and its metered part. The memory keeps
        what the codec left out."""
        values, view, memory = launch.values, launch.views[info.key], self.memory
        area = torch.zeros(values.nbytes(info.numel, info.dtype), dtype=torch.uint8,
                           device=view.device)
        if launch.finite:
            sent = values.write(view, area, info.numel)
            if memory is not None and memory.forgets_what_is_sent and values.exact(info.dtype):
                memory.buffers.pop(info.key, None)  # sent whole and exactly: no error left
            elif memory is not None:
                memory.update(info.key, view, sent.to(info.dtype))
        return area, [(info.key, area.numel())]

    def _finish_whole(self, launch: _Launch, futures: Sequence[Future[Any]]) -> torch.Tensor:
        """Copy the all-reduced mean of the tensors sent whole into their views."""
        if launch.whole and launch.values.summable:
            mean = futures[0].value()
            if len(launch.whole) == len(launch.infos):
                if mean.data_ptr() != launch.buffer.data_ptr():
                    launch.buffer.copy_(mean)
            elif mean.data_ptr() != launch.buffer.data_ptr():
                torch._foreach_copy_([launch.views[info.key] for info in launch.whole],
                                     split_flat(mean, [info.numel for info in launch.whole]))
        return launch.buffer

    # ---- agreed selections: a first round makes every rank's coordinates the same
    def _launch_agreed(self, launch: _Launch, selection: Agreed, step: int, group: Group,
                       last: bool, start: float) -> Future[Any]:
        memory = self.memory
        proposal = self._propose(launch, selection, step, group)
        self._charge(time.perf_counter() - start)

        # agreed coordinates travel at the scheme's width; in warm-up there are none
        values, dtype = launch.values, launch.buffer.dtype
        exact = values.exact(dtype)

        def second(received: Any) -> torch.Tensor:
            parts: list[torch.Tensor] = []
            if proposal is not None:
                selection.agree(proposal, received)
                selection.energy = self.energy
                parts = [values.cast(part) for part in selection.project(proposal)]
                if launch.finite and memory is not None and not selection.errors_from_mean:
                    selection.remember(proposal, memory, None if exact else parts)
            if launch.whole:
                parts.append(self._wire_whole(launch))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        size = values.width(dtype)
        segments = ([(name, count * size) for name, count in proposal.values]
                    if proposal is not None else [])
        segments += [(info.key, info.numel * size) for info in launch.whole]
        future = self.rounds.launch(
            lambda: self._first_round(proposal, group), self._charged(second),
            device=launch.buffer.device, last=last, group=group, meter=self.meter,
            segments=segments)
        return future.then(self._charged(
            lambda arrived: self._place(launch, selection, proposal, arrived.value())))

    def _place(self, launch: _Launch, selection: Agreed, proposal: Proposal | None,
               mean: torch.Tensor) -> torch.Tensor:
        """The second round's ``mean`` (agreed coordinates, then the tensors sent whole)
        into the bucket, settled as the optimiser steps with it (EF21: an estimate)."""
        views, memory = launch.views, self.memory
        mean = mean.to(launch.buffer.dtype)  # from the wire's dtype (a no-op if the same)
        if proposal is not None:
            selection.place(proposal, mean, views, memory, launch.finite)
        offset = mean.numel() - sum(info.numel for info in launch.whole)
        for info in launch.whole:
            views[info.key].copy_(mean[offset: offset + info.numel])
            offset += info.numel
        if memory is not None:
            for info in launch.infos:
                memory.settle_(info.key, views[info.key])
        return launch.buffer

    def _propose(self, launch: _Launch, selection: Agreed, step: int,
                 group: Group) -> Proposal | None:
        """Compensate the bucket and propose coordinates for the selected tensors (None:
        none selected). A round that is not finite counts as zero; a leader still selects
        on its memory."""
        views, memory, selected = launch.views, self.memory, launch.selected
        self._open(launch)
        if launch.finite:
            ps = self._compensated(launch, selected)
        else:
            for info in selected:
                views[info.key].zero_()
                if memory is not None:
                    memory.compensate_(info.key, views[info.key])
            ps = {info.key: views[info.key] for info in selected}
        rank, n = world(group)
        return selection.propose(ps, selected, step, rank, n, launch.finite) \
            if selected else None

    def _first_round(self, proposal: Proposal | None, group: Group) -> Future[Any]:
        if proposal is None:
            return done(None)  # nothing selected: no round 1
        if proposal.collective == ALL_REDUCE:
            return all_reduce_round(proposal.buffer, group, self.meter, proposal.segments)
        return broadcast_indices(proposal.buffer, proposal.root, group, self.meter,
                                 proposal.segments)

    def _record(self, segments: Sequence[tuple[str, int]], collective: str, n: int) -> None:
        record_segments(self.meter, "W_grad", collective, segments, n)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        selection = self.selection
        return {**super().state_dict(), "steps": dict(self.steps),
                "selection": None if selection is None else selection.state_dict(),
                "memory": None if self.memory is None else self.memory.state_dict(),
                "streaming": [] if self.pieces is None else self.pieces.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps = dict(state["steps"])
        if self.selection is not None:
            self.selection.load_state_dict(state["selection"])
        if self.pieces is not None:
            self.pieces.load_state_dict(state.get("streaming", []))
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])
