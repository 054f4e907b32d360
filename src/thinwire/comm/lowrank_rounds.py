"""Two dependent all-reduce rounds (PowerSGD's P then Q), gloo-safe, across DDP's buckets.

Round 2's buffer is computed from round 1's mean (orthonormalise P,
``Q = M^T P_hat``), so round 1 must be waited for before round 2 can start.
torch 2.13's ``powerSGD_hook`` waits inside a future callback, which
deadlocks gloo once DDP has several buckets. Here every wait and every
collective happens in the caller's thread, in the same order on every rank
(1a 2a 1b 2b ...), but a launch that is not the step's last returns at once:
its round 1 is waited for at the start of the next launch, so the backward
pass computes the next bucket's gradients while round 1 is on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.comm._metered import Segments, record_segments
from thinwire.comm.collectives import Group, all_reduce_mean, done, world
from thinwire.comm.meter import Meter

Future = torch.futures.Future[Any]


@dataclass
class _Launch:
    """One launch whose round 2 has not started yet."""

    first: Future  # round 1's mean
    second: Callable[[torch.Tensor], torch.Tensor]
    segments: Segments  # of round 2's buffer
    group: Group
    meter: Meter | None
    entity: str
    result: Future  # round 2's mean, handed to the caller at launch


class TwoRounds:
    """Runs launches of two dependent all-reduce rounds; at most one is left pending.

    Not thread-safe: one caller thread, as DDP's hooks run.
    """

    def __init__(self) -> None:
        self._pending: _Launch | None = None

    def launch(self, first: torch.Tensor, second: Callable[[torch.Tensor], torch.Tensor], *,
               last: bool = True, group: Group = None, meter: Meter | None = None,
               first_segments: Segments = (), second_segments: Segments = (),
               entity: str = "W_grad") -> Future:
        """Average ``first``, then ``second(mean of first)``; a future of round 2's mean.

        The previous launch's round 2 starts first. With ``last`` (the step's last
        DDP bucket, or a call outside DDP) this launch's round 1 is waited for and its
        round 2 started before returning; otherwise that happens at the next launch.

        Args:
            first: flat round-1 buffer (modified in place). Empty: no round 1, and
                ``second`` receives it unchanged.
            second: maps the round-1 mean to the flat round-2 buffer (in the caller's
                thread).
            first_segments / second_segments: ``(layer, bytes)`` parts of each
                buffer, metered as ``entity`` (all-reduce).
        """
        self.flush()
        _, n = world(group)
        if first.numel() > 0:
            record_segments(meter, entity, "all_reduce", first_segments, n)
            round_one = all_reduce_mean(first, group)
        else:
            round_one = done(first)
        device = first.device
        result: Future = (torch.futures.Future(devices=[device]) if device.type == "cuda"
                          else torch.futures.Future())
        self._pending = _Launch(round_one, second, second_segments, group, meter, entity,
                                result)
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
            record_segments(launch.meter, launch.entity, "all_reduce", launch.segments,
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
