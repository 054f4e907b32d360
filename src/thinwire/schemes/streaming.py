"""Streaming in pieces: a bucket selected and sent part by part, decoded as each arrives.

:class:`~thinwire.schemes.kernel.CompressedScheme` delegates here for a selection
that :class:`~thinwire.compress.pieces.Streams` (its threshold is known before
the gradient on a reuse step, DCT KDD'21 Algorithm 1 line 8), so compression
of one piece runs while the previous one is on the wire. Pieces, their rooms
and the rule that decides whether they pay are :mod:`thinwire.compress.pieces`.
The choice depends on shapes, configuration and an all-reduced timing only,
never on one rank's values, so every rank sends the same payloads.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from thinwire.comm import world
from thinwire.comm.collectives import Future, Group
from thinwire.compress import TensorInfo
from thinwire.compress.pieces import TRIALS, Part, Streams, cut, pay
from thinwire.feedback import Memory
from thinwire.schemes.selected import Chosen, Kept, merged

# the kernel's payload of a piece: (launch, chosen, piece, kept) -> decoded on arrival
Send = Callable[[Any, Sequence[Chosen], Sequence[Part], list[Kept]], Future[Any]]
# meters a collective: (segments, collective, ranks)
Record = Callable[[Sequence[tuple[str, int]], str, int], None]


class Streaming:
    """One scheme's buckets in pieces: when to cut, the timed trials, the agreed choice.

    It works on the kernel's launch with what the kernel hands it: the memory, a
    scratch for ``|p|``, how a piece is sent and decoded (``send``), how what was sent
    is remembered, and how the trials' one all-reduce is metered (``record``).

    Args:
        compressor: the scheme's codec.
        record: meters a collective's segments (the trials' choice, once per bucket).

    Attributes:
        streaming: per bucket (its sparse keys), the agreed choice (True: pieces);
            kept in the scheme's ``state_dict``.
    """

    def __init__(self, compressor: Streams, record: Record) -> None:
        self.compressor = compressor
        self.record = record
        self.rounds: dict[tuple[str, ...], int] = {}  # stream="auto": rounds launched
        self.trials: dict[tuple[str, ...], list[tuple[float, float]]] = {}  # (codec, exchange) s
        self.streaming: dict[tuple[str, ...], bool] = {}

    def cuts(self, buffer: torch.Tensor, sparse: Sequence[TensorInfo]) -> bool:
        """Whether ``sparse`` can travel in pieces: on the CPU only, where compression costs
        as much as a slow link's transfer (a GPU compresses in a fraction of it), and at
        least two pieces' worth of entries."""
        entries = self.compressor.piece
        return (buffer.device.type == "cpu" and bool(entries)
                and sum(info.numel for info in sparse) >= 2 * entries)

    def cut(self, sparse: Sequence[TensorInfo]) -> list[list[Part]]:
        """The pieces ``sparse`` travels in, each tensor's room shared among its parts."""
        compressor = self.compressor
        return cut(sparse, [compressor.capacity(info.numel) for info in sparse], compressor.piece)

    def choose(self, buffer: torch.Tensor, sparse: Sequence[TensorInfo],
               group: Group) -> bool | None:
        """Whether the bucket goes in pieces this round; None: a trial round, one payload timed.

        Under ``"auto"`` a bucket travels as one payload for its first
        ``TRIALS + 1`` rounds, the last :data:`~thinwire.compress.pieces.TRIALS`
        timed; then every rank contributes its medians to one all-reduce and all
        take the same choice (:func:`~thinwire.compress.pieces.pay`), kept for the
        rest of the run. Rounds are counted whatever this rank's values.
        """
        if not self.cuts(buffer, sparse):
            return False
        if self.compressor.stream == "always":
            return True
        bucket = tuple(info.key for info in sparse)
        if bucket not in self.streaming:
            rounds = self.rounds[bucket] = self.rounds.get(bucket, 0) + 1
            if rounds <= TRIALS + 1:
                return None
            self.streaming[bucket] = self._agree(self.trials.pop(bucket, []), group)
            del self.rounds[bucket]
        return self.streaming[bucket]

    def streams(self, sparse: Sequence[TensorInfo], views: Mapping[str, torch.Tensor],
                memory: Memory | None) -> bool:
        """Whether every sparse tensor's threshold and ``memory`` let it be absorbed part by
        part (a reused tau, state from an earlier round); else each is absorbed whole first."""
        return all(self.compressor.reused(info) and (
            memory is None or memory.holds(info.key, views[info.key])) for info in sparse)

    def timed(self, sparse: Sequence[TensorInfo], codec_s: float, handed: float,
              future: Future[Any]) -> Future[Any]:
        """``future``, recording this trial round's codec and exchange seconds on arrival."""
        trials = self.trials.setdefault(tuple(info.key for info in sparse), [])

        def record(done: Future[Any]) -> Any:
            trials.append((codec_s, time.perf_counter() - handed))
            return done.value()

        return future.then(record)

    def _agree(self, trials: Sequence[tuple[float, float]], group: Group) -> bool:
        """Every rank's choice from the trials: the least exchange time against the most codec.

        A rank whose trial rounds were all skipped (non-finite) or refreshed its
        thresholds contributes nothing to either.
        """
        _, n = world(group)
        codec = statistics.median(c for c, _ in trials) if trials else 0.0
        exchange = statistics.median(w for _, w in trials) if trials else math.inf
        if n > 1:
            both = torch.tensor([exchange, -codec], dtype=torch.float64)
            torch.distributed.all_reduce(both, torch.distributed.ReduceOp.MIN, group=group)
            self.record([("stream", both.numel() * both.element_size())], "all_reduce", n)
            exchange, codec = both[0].item(), -both[1].item()
        return pay(exchange, codec)

    def launch(self, launch: Any, pieces: Sequence[Sequence[Part]], streamed: bool, *,
               memory: Memory | None, scratch: torch.Tensor, send: Send,
               remember: Callable[[Sequence[Kept]], None]) -> list[Future[Any]]:
        """The kernel's selected tensors in pieces, each sent once selected (``send``: the
        kernel's own payload, decoded on arrival).

        ``streamed``: each part is absorbed into ``memory``, selected and sent
        before the next part is touched. Otherwise (a threshold refresh, a first
        round) every tensor is absorbed whole first; the parts are then selected
        alike, so both give the same bits. What was sent is remembered once every
        piece has gone (a later part may read what an earlier one left in the memory).

        Args:
            scratch: room for ``|p|`` of the whole bucket.

        Returns:
            One future per piece, completed once it is decoded into the bucket.
        """
        compressor = self.compressor
        views, finite = launch.views, launch.finite
        offsets = offsets_of(launch.infos)
        tensors = list(dict.fromkeys(part.info for piece in pieces for part in piece))

        def magnitudes(info: TensorInfo, start: int = 0, stop: int | None = None) -> torch.Tensor:
            offset = offsets[info.key]
            return scratch[offset + start: offset + (info.numel if stop is None else stop)]

        held: dict[str, torch.Tensor] = {}  # key -> p, flat (the memory's buffer)
        tau: dict[str, float] = {}
        for info in tensors if finite else ():
            if not streamed:  # absorbed whole first
                held[info.key] = views[info.key] if memory is None else memory.absorb_(
                    info.key, views[info.key])
                torch.abs(held[info.key], out=magnitudes(info))
            tau[info.key] = compressor.open_call(None if streamed else magnitudes(info), info)
        passed = dict.fromkeys(tau, 0)
        kept: list[Kept] = []
        futures = []
        for piece in pieces:
            chosen = []
            for part in piece if finite else ():
                key = part.info.key
                if streamed:  # absorbed part by part
                    held[key] = views[key] if memory is None else memory.absorb_part_(
                        key, views[key][part.start: part.stop], part.start)
                one, count = self._pick(part, held[key], streamed, tau[key],
                                        magnitudes(part.info, part.start, part.stop))
                passed[key] += count
                chosen.append(one)
            futures.append(send(launch, chosen, piece, kept))
        whole = {item.key: item for item in merged(kept)}
        if finite:
            remember(list(whole.values()))
        for info in tensors if finite else ():
            compressor.close_call(magnitudes(info), info, passed[info.key],
                                  whole[info.key].indices.numel())
        return futures

    def _pick(self, part: Part, p: torch.Tensor, streamed: bool, tau: float,
              magnitudes: torch.Tensor) -> tuple[Chosen, int]:
        """A part's indices to send (into its tensor's flat ``p``), and how many passed
        ``tau``; its ``|p|`` are written into ``magnitudes`` first where ``streamed``."""
        if streamed:
            torch.abs(p[part.start: part.stop], out=magnitudes)
        local, count = self.compressor.pick(magnitudes, tau, part.room)
        return Chosen(part.info, p, local + part.start), count

    def state_dict(self) -> list[list[Any]]:
        return [[list(bucket), choice] for bucket, choice in self.streaming.items()]

    def load_state_dict(self, state: Sequence[Sequence[Any]]) -> None:
        # Trials in progress are not kept: every rank loading the checkpoint starts them anew.
        self.streaming = {tuple(bucket): choice for bucket, choice in state}
        self.rounds, self.trials = {}, {}


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tensors flat and back to back (a view of a lone one: no copy)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def offsets_of(infos: Sequence[TensorInfo]) -> dict[str, int]:
    """Where each tensor of a flat buffer laid out as ``infos`` starts."""
    start, out = 0, {}
    for info in infos:
        out[info.key] = start
        start += info.numel
    return out
