"""What one rank sends of a selected tensor, between selection and memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from thinwire.compress import TensorInfo


@dataclass(frozen=True)
class Chosen:
    """A selected tensor's ``p`` (flat) and the indices into it to send."""

    info: TensorInfo
    p: torch.Tensor
    indices: torch.Tensor

    def sent(self, values: torch.Tensor) -> Kept:
        """What the memory is told: ``values`` as every receiver decodes them."""
        return Kept(self.info.key, self.p, self.indices, values)


@dataclass(frozen=True)
class Region:
    """The selected tensors as one: their ``p`` back to back (flat), the ascending
    indices into it to send and each tensor's count of them."""

    infos: Sequence[TensorInfo]
    p: torch.Tensor
    indices: torch.Tensor
    counts: list[int]


@dataclass(frozen=True)
class Kept:
    """What the memory is told of one tensor: its ``p``, the indices sent, their values."""

    key: str
    p: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor


def merged(kept: list[Kept]) -> list[Kept]:
    """One :class:`Kept` per tensor, its parts' indices and values joined in order."""
    by_key: dict[str, list[Kept]] = {}
    for item in kept:
        by_key.setdefault(item.key, []).append(item)
    return [items[0] if len(items) == 1 else
            Kept(key, items[0].p, torch.cat([i.indices for i in items]),
                 torch.cat([i.values for i in items])) for key, items in by_key.items()]
