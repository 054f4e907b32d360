"""CLT-k's first round: the leader's encoded indices, by broadcast.

Every rank then gathers its own values at those indices and the values are
all-reduced (the second round, :class:`thinwire.comm.rounds.TwoRounds`).
Every rank hands the same number of bytes to each round whatever the world
size: nothing builds up.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm._metered import Segments, record_segments
from thinwire.comm.collectives import Group, done, then_hold, world
from thinwire.comm.meter import Meter

Future = torch.futures.Future[Any]


def broadcast_indices(index_wire: torch.Tensor, leader: int, group: Group = None,
                      meter: Meter | None = None, segments: Segments = ()) -> Future:
    """Broadcast ``index_wire`` from ``leader``; a future holding it, received.

    Args:
        index_wire: uint8 encoded indices, the leader's on the leader and a
            buffer of the same length elsewhere (overwritten). Empty: no
            broadcast (nothing is sparse this step).
        leader: the broadcasting rank, within ``group``.
        segments: ``(layer, bytes)`` of ``index_wire``, metered as entity
            ``"index"`` (broadcast, rooted at ``leader``).
    """
    _, n = world(group)
    if index_wire.numel() == 0:
        return done(index_wire)
    record_segments(meter, "index", "broadcast", segments, n, root=leader)
    if n == 1:
        return done(index_wire)
    work = dist.broadcast(index_wire, group=group, group_src=leader, async_op=True)
    assert work is not None
    return then_hold(work.get_future(), lambda: index_wire)
