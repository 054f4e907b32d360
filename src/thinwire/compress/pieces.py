"""Cutting a bucket's sparse tensors into pieces that travel one after another.

DCT-DP reuses a layer's threshold for ``life_span`` steps (DCT KDD'21
Algorithm 1 line 8), so on a reuse step each entry is kept or not on its own
(line 9) and a large bucket need not be compressed whole before any of it is
sent. A payload's room is fixed before its entries are known (one collective
round, no lengths first), so each piece carries its parts' share of their
tensors' room: a part ``[start, stop)`` of a tensor with room ``R`` of ``N``
entries gets ``R*stop//N - R*start//N``, which add up to ``R``; what a part
passes beyond its share waits in the error memory. Pieces pay only where the
link is slow next to the codec, so by default (``stream="auto"``) a bucket is
timed as one payload for :data:`TRIALS` rounds before the ranks agree
(:func:`pay`). The engine's side is :mod:`thinwire.schemes.streaming`;
measured: docs/notes/engine.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from thinwire.compress.base import TensorInfo

# Entries per piece: enough bytes to keep the link busy while the next piece is
# compressed, with few collectives (measured: docs/notes/engine.md).
PIECE_ENTRIES = 1 << 20
# Rounds of one payload a bucket is timed over before "auto" decides (its first round,
# which refreshes every threshold, not among them).
TRIALS = 5
STREAM_RULES = ("auto", "always")


@runtime_checkable
class Streams(Protocol):
    """A selection that selects each entry on its own once a tensor's threshold is known,
    so a bucket can be selected and sent part by part (DCT's reused threshold)."""

    stream: str  # when pieces are sent: one of STREAM_RULES

    @property
    def piece(self) -> int:
        """Entries per piece; 0: this compressor's buckets travel whole."""

    def capacity(self, numel: int) -> int:
        """Most entries one payload of a ``numel``-entry tensor carries."""

    def reused(self, info: TensorInfo) -> bool:
        """Whether this call's threshold is known before ``info``'s magnitudes."""

    def open_call(self, magnitudes: torch.Tensor | None, info: TensorInfo) -> float:
        """Begin a call on ``info``'s tensor; its threshold (None: a reused one)."""

    def pick(self, magnitudes: torch.Tensor, tau: float,
             room: int) -> tuple[torch.Tensor, int]:
        """A part's indices at or above ``tau``, at most ``room``; and how many passed."""

    def close_call(self, magnitudes: torch.Tensor, info: TensorInfo, passed: int,
                   sent: int) -> None:
        """End the call :meth:`open_call` began."""


def pay(exchange_s: float, codec_s: float) -> bool:
    """Whether pieces pay on this link: the exchange takes at least half as long as the codec.

    The overlap pieces win is about the shorter of the two, less the first
    piece's compression; each piece costs a collective and its decoding beside
    the codec (docs/notes/engine.md).

    Args:
        exchange_s: the exchange's median time from hand-over to arrival, on the
            rank that waited least (the others also wait for the later ranks).
        codec_s: the median codec time to hand-over, on the slowest rank.
    """
    return math.isfinite(exchange_s) and exchange_s >= codec_s / 2


@dataclass(frozen=True)
class Part:
    """Entries ``[start, stop)`` of one tensor's flat view, and their share of its room."""

    info: TensorInfo
    start: int
    stop: int
    room: int


def cut(infos: Sequence[TensorInfo], rooms: Sequence[int],
        entries: int = PIECE_ENTRIES) -> list[list[Part]]:
    """The pieces of ``infos``' tensors, in order: lists of parts of about ``entries`` entries.

    A tensor of ``N`` entries is cut into ``max(1, round(N / entries))``
    near-equal parts; parts are packed into a piece until it holds at least
    ``entries``. Empty tensors get no part. The result depends on the shapes
    and rooms alone, so every rank cuts alike.

    Args:
        rooms: per tensor, the most entries its payload carries.

    Raises:
        ValueError: ``entries`` < 1, or ``rooms`` and ``infos`` of other lengths.
    """
    if entries < 1:
        raise ValueError(f"entries={entries!r} must be >= 1")
    if len(rooms) != len(infos):
        raise ValueError(f"{len(rooms)} rooms for {len(infos)} tensors")
    pieces: list[list[Part]] = []
    piece: list[Part] = []
    size = 0
    for info, room in zip(infos, rooms):
        numel = info.numel
        if not numel:
            continue
        count = max(1, round(numel / entries))
        bounds = [numel * j // count for j in range(count + 1)]
        for start, stop in zip(bounds, bounds[1:]):
            piece.append(Part(info, start, stop, room * stop // numel - room * start // numel))
            size += stop - start
            if size >= entries:
                pieces.append(piece)
                piece, size = [], 0
    if piece:
        pieces.append(piece)
    return pieces
