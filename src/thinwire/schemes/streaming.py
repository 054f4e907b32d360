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
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from thinwire.comm import world
from thinwire.comm.collectives import Future, Group
from thinwire.compress import TensorInfo
from thinwire.compress.pieces import TRIALS, Part, Streams, cut, pay
from thinwire.feedback import Memory
from thinwire.schemes.selected import Chosen, Kept, merged


class Engine(Protocol):
    """What streaming uses of the kernel it serves (a ``CompressedScheme``)."""

    memory: Memory | None

    def _magnitudes(self, buffer: torch.Tensor) -> torch.Tensor: ...

    def _record(self, segments: Sequence[tuple[str, int]], collective: str, n: int) -> None: ...

    def _send(self, launch: Any, chosen: Sequence[Chosen], piece: Sequence[Part] | None,
              rows: Sequence[Any], group: Group, kept: list[Kept] | None = None) -> Future[Any]:
        ...

    def _remember(self, kept: Sequence[Kept]) -> None: ...


class Streaming:
    """One scheme's buckets in pieces: when to cut, the timed trials, the agreed choice.

    Args:
        compressor: the scheme's codec.
        scheme: the engine it serves (its memory, meter, scratch and sums).

    Attributes:
        streaming: per bucket (its sparse keys), the agreed choice (True: pieces);
            kept in the scheme's ``state_dict``.
    """

    def __init__(self, compressor: Streams, scheme: Engine) -> None:
        self.compressor = compressor
        self.scheme = scheme
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

    def streams(self, sparse: Sequence[TensorInfo], views: Mapping[str, torch.Tensor]) -> bool:
        """Whether every sparse tensor's threshold and memory let it be absorbed part by part
        (a reused tau, state from an earlier round); else each is absorbed whole first."""
        memory = self.scheme.memory
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
            self.scheme._record([("stream", both.numel() * both.element_size())],
                                "all_reduce", n)
            exchange, codec = both[0].item(), -both[1].item()
        return pay(exchange, codec)

    def launch(self, launch: Any, pieces: Sequence[Sequence[Part]], streamed: bool,
               group: Group) -> list[Future[Any]]:
        """The kernel's selected tensors in pieces, each sent once selected (by the kernel's
        own send, :meth:`~thinwire.schemes.kernel.CompressedScheme._send`), decoded on arrival.

        ``streamed``: each part is absorbed into the memory, selected and sent
        before the next part is touched. Otherwise (a threshold refresh, a first
        round) every tensor is absorbed whole first; the parts are then selected
        alike, so both give the same bits. The memory remembers once every piece
        has gone (a later part may read what an earlier one left in it).

        Returns:
            One future per piece, completed once it is decoded into the bucket.
        """
        scheme, compressor, memory = self.scheme, self.compressor, self.scheme.memory
        views, finite = launch.views, launch.finite
        offsets = offsets_of(launch.infos)
        tensors = list(dict.fromkeys(part.info for piece in pieces for part in piece))
        scratch = scheme._magnitudes(launch.buffer)

        def magnitudes(info: TensorInfo, start: int = 0, stop: int | None = None) -> torch.Tensor:
            offset = offsets[info.key]
            return scratch[offset + start: offset + (info.numel if stop is None else stop)]

        held: dict[str, torch.Tensor] = {}  # key -> p, flat (the memory's buffer)
        tau: dict[str, float] = {}
        if finite:
            for info in tensors:
                whole = views[info.key]
                if not streamed:
                    whole = whole if memory is None else memory.absorb_(info.key, whole)
                    torch.abs(whole, out=magnitudes(info))
                    held[info.key] = whole
                tau[info.key] = compressor.open_call(None if streamed else magnitudes(info), info)
        passed = dict.fromkeys(tau, 0)
        kept: list[Kept] = []
        futures = []
        for piece in pieces:
            chosen = []
            for part in piece if finite else ():
                key, start, stop = part.info.key, part.start, part.stop
                if streamed:
                    grad = views[key]
                    held[key] = grad if memory is None else memory.absorb_part_(
                        key, grad[start:stop], start)
                part_abs = magnitudes(part.info, start, stop)
                if streamed:
                    torch.abs(held[key][start:stop], out=part_abs)
                local, count = compressor.pick(part_abs, tau[key], part.room)
                passed[key] += count
                chosen.append(Chosen(part.info, held[key], local + start))
            futures.append(scheme._send(launch, chosen, piece, [], group, kept))
        whole = {item.key: item for item in merged(kept)}
        if finite:
            scheme._remember(list(whole.values()))
        for info in tensors if finite else ():
            compressor.close_call(magnitudes(info), info, passed[info.key],
                                  whole[info.key].indices.numel())
        return futures

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
