"""One rank's tensors and objects to every rank: workers that start from the same state.

DDP broadcasts rank 0's parameters when it wraps a model; front doors without
DDP (local updates) do the same here, and compare a digest instead where the
caller keeps each rank's own values (:func:`digest_tensors`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.collectives import Group, split_flat, world


def broadcast_tensors(tensors: Sequence[torch.Tensor], group: Group = None, src: int = 0) -> None:
    """Overwrite ``tensors`` (in place) on every rank of ``group`` with rank ``src``'s.

    One broadcast per dtype and device, in the order of ``tensors``: every rank must
    pass tensors of the same shapes in the same order. A no-op when not distributed.
    """
    _, n = world(group)
    if n == 1:
        return
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same in kinds.values():
        flat = torch.cat([tensor.reshape(-1) for tensor in same])
        dist.broadcast(flat, group=group, group_src=src)
        with torch.no_grad():
            torch._foreach_copy_(same, [part.view_as(tensor) for part, tensor in
                                        zip(split_flat(flat, [t.numel() for t in same]), same)])


def broadcast_object(value: Any, group: Group = None, src: int = 0,
                     device: torch.device | None = None) -> Any:
    """Rank ``src``'s ``value`` (picklable), returned on every rank of ``group``."""
    _, n = world(group)
    if n == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=src, device=device)
    return box[0]


def digest_tensors(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, dtypes and shapes, in order (a hex string)."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(f"{tensor.dtype} {tuple(tensor.shape)};".encode())
        hasher.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()
