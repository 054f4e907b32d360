"""Two dependent all-reduce rounds (PowerSGD's P then Q), gloo-safe.

Round 1 is averaged and waited for in the caller's thread; the caller's
``second`` then computes round 2's buffer from it (orthonormalise P,
``Q = M^T P_hat``: pure maths, still in the caller's thread); round 2 is the
only asynchronous one. torch 2.13's ``powerSGD_hook`` instead waits on round
2 inside a future callback, which deadlocks gloo once DDP has several buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from thinwire.comm._metered import Segments, record_segments
from thinwire.comm.collectives import Group, all_reduce_mean, done, world
from thinwire.comm.meter import Meter

Future = torch.futures.Future[Any]


def two_round_all_reduce(first: torch.Tensor, second: Callable[[torch.Tensor], torch.Tensor],
                         *, group: Group = None, meter: Meter | None = None,
                         first_segments: Segments = (), second_segments: Segments = (),
                         entity: str = "W_grad") -> Future:
    """Average ``first`` (blocking), then average ``second(mean of first)`` (async).

    Args:
        first: flat round-1 buffer (modified in place). Empty: no round 1, and
            ``second`` receives it unchanged.
        second: maps the round-1 mean to the flat round-2 buffer.
        first_segments / second_segments: ``(layer, bytes)`` parts of each
            buffer, metered as ``entity`` (all-reduce).

    Returns:
        A future holding the flat round-2 mean.
    """
    _, n = world(group)
    if first.numel() > 0:
        record_segments(meter, entity, "all_reduce", first_segments, n)
        first = all_reduce_mean(first, group).wait()
    buffer = second(first)
    record_segments(meter, entity, "all_reduce", second_segments, n)
    return all_reduce_mean(buffer, group) if buffer.numel() > 0 else done(buffer)
