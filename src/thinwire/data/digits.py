"""The embedded default dataset: scikit-learn's handwritten digits (ships in the wheel)."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Split:
    """Features and labels of one split."""

    x: torch.Tensor  # (n, 64) float32 in [0, 1]
    y: torch.Tensor  # (n,) int64 class labels 0..9

    def __len__(self) -> int:
        return self.y.numel()


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """The 1797 8x8 digits, shuffled with ``seed`` and split into (train, test)."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Split(x[train], y[train]), Split(x[test], y[test])


def shard(split: Split, rank: int, world_size: int) -> Split:
    """Rank ``rank``'s disjoint, equally sized share (the remainder is dropped)."""
    per_rank = len(split) // world_size
    part = slice(rank * per_rank, (rank + 1) * per_rank)
    return Split(split.x[part], split.y[part])


def batches(split: Sized, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """An endless stream of batch index tensors, reshuffled each epoch, reproducible."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(split), generator=generator)
        for start in range(0, len(split) - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
