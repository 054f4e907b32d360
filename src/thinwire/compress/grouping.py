"""Which tensors one selection spans (``scope="bucket"``), and splitting its result.

A bucket-scope selection picks k entries over several tensors at once (the
sparsified tensors of one DDP bucket). DDP builds its buckets anew once after
its first step, so a resumed run's first step can arrive in other buckets
than the uninterrupted run's did; :func:`regroup` remembers, per tensor, the
keys it was last selected with and selects in those groups again when they
are all present, which keeps a resume bit-exact.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def regroup(memory: dict[str, tuple[str, ...]], keys: Sequence[str]) -> list[list[int]]:
    """Positions in ``keys`` of each group to select together; records new groups.

    Args:
        memory: key -> the keys it was last selected with; updated in place
            when ``keys`` cannot be split into remembered groups.
        keys: the tensors of one call, in order.

    Returns:
        The remembered groups when every key's last group is wholly present,
        else one group of all ``keys`` (then remembered).
    """
    position = {key: i for i, key in enumerate(keys)}
    groups = dict.fromkeys(memory.get(key, ()) for key in keys)  # each distinct group once
    if () in groups or not all(key in position for group in groups for key in group):
        whole = tuple(keys)
        memory.update(dict.fromkeys(whole, whole))
        return [list(range(len(keys)))]
    return [[position[key] for key in group] for group in groups]


def split_ascending(indices: torch.Tensor, numels: Sequence[int]) -> list[torch.Tensor]:
    """Ascending indices into tensors laid back to back, as indices into each one."""
    if len(numels) == 1:
        return [indices]
    ends = list(itertools.accumulate(numels))
    cuts = torch.searchsorted(indices, torch.tensor(ends, device=indices.device)).tolist()
    return [indices[low:high] - start
            for start, low, high in zip([0, *ends], [0, *cuts], cuts)]
