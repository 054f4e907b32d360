"""Exchanges of two dependent rounds (PowerSGD's P then Q, CLT-k's indices then
values), gloo-safe, across DDP's buckets.

Round 2's buffer is computed from round 1's result, so round 1 must be
waited for before round 2 can start. torch 2.13's ``powerSGD_hook`` waits
inside a future callback, which deadlocks gloo once DDP has several
buckets. Here every wait and every collective happens in the caller's
thread, in the same order on every rank (1a 2a 1b 2b ...), but a launch that
is not the step's last returns at once: its round 1 is waited for at the
start of the next launch, so the backward pass computes the next bucket's
gradients while round 1 is on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.comm._metered import Segments, record_segments
from thinwire.comm.collectives import Group, all_reduce_mean, device_future, done, world
from thinwire.comm.meter import Meter

Future = torch.futures.Future[Any]


@dataclass
class _Launch:
    """One launch whose round 2 has not started yet."""

    first: Future  # round 1's result
    second: Callable[[Any], torch.Tensor]
    segments: Segments  # of round 2's buffer, metered as W_grad
    group: Group
    meter: Meter | None
    result: Future  # round 2's mean, handed to the caller at launch


class TwoRounds:
    """Runs launches of two dependent rounds (the second an all-reduce of the mean);
    at most one launch is left pending.

    Not thread-safe: one caller thread, as DDP's hooks run. A backward pass that
    fails between two buckets leaves one launch pending; the next launch finishes it
    first, on every rank alike.
    """

    def __init__(self) -> None:
        self._pending: _Launch | None = None

    def launch(self, first: Callable[[], Future], second: Callable[[Any], torch.Tensor], *,
               device: torch.device, last: bool = True, group: Group = None,
               meter: Meter | None = None, segments: Segments = ()) -> Future:
        """Start round 1 with ``first()``; then all-reduce the mean of ``second(its result)``.

        The previous launch's round 2 starts first. With ``last`` (the step's last
        DDP bucket, or a call outside DDP) this launch's round 1 is waited for and its
        round 2 started before returning; otherwise that happens at the next launch.

        Args:
            first: starts round 1 (metering it) and returns its future.
            second: maps round 1's result to the flat round-2 buffer (in the caller's
                thread); empty: no round 2.
            device: where the result lives (a CUDA future must know its device).
            segments: ``(layer, bytes)`` parts of round 2's buffer, metered as W_grad.

        Returns:
            A future of the mean of round 2's buffer over ranks.
        """
        self.flush()
        result = device_future([device])
        self._pending = _Launch(first(), second, segments, group, meter, result)
        if last:
            self.flush()
        return result

    def flush(self) -> None:
        """Wait for the pending launch's round 1 and start its round 2 (if any is pending)."""
        launch, self._pending = self._pending, None
        if launch is None:
            return
        try:
            buffer = launch.second(launch.first.wait())
            record_segments(launch.meter, "W_grad", "all_reduce", launch.segments,
                            world(launch.group)[1])
            round_two = (all_reduce_mean(buffer, launch.group) if buffer.numel() > 0
                         else done(buffer))
        except Exception as error:
            launch.result.set_exception(error)
            raise

        def forward(fut: Future) -> None:
            try:
                launch.result.set_result(fut.value())
            except Exception as error:  # noqa: BLE001  (handed to whoever waits on it)
                launch.result.set_exception(error)

        round_two.add_done_callback(forward)


def all_reduce_round(buffer: torch.Tensor, group: Group = None, meter: Meter | None = None,
                     segments: Segments = ()) -> Future:
    """A first round that all-reduces ``buffer``'s mean in place (metered as W_grad);
    an empty buffer sends nothing."""
    if buffer.numel() == 0:
        return done(buffer)
    record_segments(meter, "W_grad", "all_reduce", segments, world(group)[1])
    return all_reduce_mean(buffer, group)
