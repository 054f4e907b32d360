"""The engine's two transports, metered: gather row blocks, all-reduce sums.

Row blocks (activations, deltas, factors) have as many rows as a site has
samples (or components), which differ between sites, so they travel by one
variable-size all-gather per step (:func:`thinwire.comm.all_gather_bytes`).
Each site's buffer starts with an int64 header: its local batch size and the
row count of every block; the column counts are known everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from thinwire.comm import Meter, all_gather_bytes, world
from thinwire.comm.collectives import Group

_INDEX = torch.int64


@dataclass(frozen=True)
class Block:
    """Rows one site sends for one layer."""

    entity: str  # Meter entity: activation, delta or factor
    layer: str
    rows: torch.Tensor  # (rows, width)


@dataclass(frozen=True)
class Site:
    """What one site sent: its batch size and its blocks, in the order given."""

    batch: int
    blocks: list[torch.Tensor]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)


def gather(batch: int, blocks: Sequence[Block], widths: Sequence[int],
           dtypes: Sequence[torch.dtype], group: Group = None,
           meter: Meter | None = None) -> list[Site]:
    """All-gather every site's blocks in one round (after a round of lengths).

    Args:
        batch: this site's local batch size (0 when it contributes nothing).
        blocks: this site's blocks; every site passes the same layers in the same order.
        widths, dtypes: each block's column count and dtype (the same on every site).

    Returns:
        Each site's batch and blocks, in rank order.
    """
    _, n = world(group)
    header = torch.tensor([batch, *(b.rows.shape[0] for b in blocks)], dtype=_INDEX,
                          device=blocks[0].rows.device if blocks else None)
    payload = torch.cat([_bytes(header), *(_bytes(b.rows) for b in blocks)])
    buffers = all_gather_bytes(payload, group).wait()
    if meter is not None:
        meter.record("size", "(header)", "all_gather", header.numel() * 8, world_size=n)
        if n > 1:  # the round of lengths inside all_gather_bytes
            meter.record("size", "(lengths)", "all_gather", 8, world_size=n)
        for block in blocks:
            meter.record(block.entity, block.layer, "all_gather",
                         block.rows.numel() * block.rows.element_size(), world_size=n)
        padding = max(int(b.numel()) for b in buffers) - payload.numel()
        meter.record(blocks[0].entity if blocks else "size", "(padding)", "all_gather",
                     padding, world_size=n)
    return [_decode(buffer, len(blocks), widths, dtypes) for buffer in buffers]


def _decode(buffer: torch.Tensor, count: int, widths: Sequence[int],
            dtypes: Sequence[torch.dtype]) -> Site:
    offset = (count + 1) * 8
    header = buffer[:offset].clone().view(_INDEX).tolist()
    blocks = []
    for rows, width, dtype in zip(header[1:], widths, dtypes, strict=True):
        size = rows * width * dtype.itemsize
        # clone: a view into the shared buffer may be misaligned for ``dtype``
        blocks.append(buffer[offset: offset + size].clone().view(dtype).reshape(rows, width))
        offset += size
    return Site(int(header[0]), blocks)


def all_reduce_sum(parts: Sequence[tuple[str, str, torch.Tensor]], group: Group = None,
                   meter: Meter | None = None) -> list[torch.Tensor]:
    """Sum each ``(entity, layer, tensor)`` over sites in one all-reduce.

    Returns:
        The sums, shaped like the inputs (which are not modified).
    """
    if not parts:
        return []
    _, n = world(group)
    dtype = parts[0][2].dtype
    flat = torch.cat([tensor.reshape(-1).to(dtype) for _, _, tensor in parts])
    if meter is not None:
        for entity, layer, tensor in parts:
            meter.record(entity, layer, "all_reduce", tensor.numel() * flat.element_size(),
                         world_size=n)
    if n > 1:
        dist.all_reduce(flat, group=group)
    sums = torch.split(flat, [tensor.numel() for _, _, tensor in parts])
    return [s.reshape(t.shape).to(t.dtype) for s, (_, _, t) in zip(sums, parts, strict=True)]
