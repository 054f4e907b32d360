"""CLT-k's exchange: the leader's indices by broadcast, then the values by all-reduce.

Round 1 (blocking, in the caller's thread) broadcasts the leader's encoded
index sets; the caller's ``gather`` then picks its own values at those
indices (pure maths, still in the caller's thread); round 2 all-reduces the
values and is the only asynchronous one. Every rank hands the same number of
bytes to each round whatever the world size: nothing builds up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm._metered import Segments, record_segments
from thinwire.comm.collectives import Group, all_reduce_mean, done, world
from thinwire.comm.meter import Meter

Future = torch.futures.Future[Any]


def shared_index_all_reduce(index_wire: torch.Tensor, leader: int,
                            gather: Callable[[torch.Tensor], torch.Tensor], *,
                            group: Group = None, meter: Meter | None = None,
                            index_segments: Segments = (),
                            value_segments: Segments = ()) -> Future:
    """Broadcast ``index_wire`` from ``leader``, gather values at it, all-reduce their mean.

    Args:
        index_wire: uint8 encoded indices, the leader's on the leader and a
            buffer of the same length elsewhere (overwritten). Empty: no
            broadcast round (nothing is sparse this step).
        leader: the broadcasting rank, within ``group``.
        gather: maps the received ``index_wire`` to this rank's flat values
            to average (called once, in this thread, before round 2).
        index_segments: ``(layer, bytes)`` of ``index_wire``, metered as entity
            ``"index"`` (broadcast, rooted at ``leader``).
        value_segments: ``(layer, bytes)`` of the gathered values, metered as
            ``"W_grad"`` (all-reduce).

    Returns:
        A future holding the flat mean of every rank's gathered values.
    """
    _, n = world(group)
    if index_wire.numel() > 0:
        record_segments(meter, "index", "broadcast", index_segments, n, root=leader)
        if n > 1:
            dist.broadcast(index_wire, group=group, group_src=leader)
    values = gather(index_wire)
    record_segments(meter, "W_grad", "all_reduce", value_segments, n)
    return all_reduce_mean(values, group) if values.numel() > 0 else done(values)
