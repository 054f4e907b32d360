"""Shared by the ScaleCom / PowerSGD benchmarks: digits shards, a small MLP, a DDP worker.

scikit-learn's ``load_digits`` (1797 8x8 images, ships with the wheel) is the
offline stand-in for the image sets of the papers; it is split 80/20 once
with a fixed seed, and each rank trains on its own contiguous shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.comm import Meter

HIDDEN = (256, 128)


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, test x, test y), pixels scaled to [0, 1]."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x.astype(np.float32) / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    return (torch.from_numpy(x_train), torch.from_numpy(y_train),
            torch.from_numpy(x_test), torch.from_numpy(y_test))


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    sizes = (64, *HIDDEN)
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(sizes[-1], 10))


def result_bytes(meter: Meter, world_size: int) -> float:
    """Mean bytes per step each rank must receive to hold a collective's result, in any
    topology (App. F's parameter server included): an all-reduce's reduced payload, the
    n - 1 other payloads of an all-gather, a broadcast's payload except at its root."""
    total = 0.0
    for record in meter.records:
        if record.collective == "all_reduce":
            total += record.nbytes
        elif record.collective == "all_gather":
            total += (world_size - 1) * record.nbytes
        elif record.collective == "broadcast" and record.received > 0:  # not the root
            total += record.nbytes
    return total / max(1, meter.step)


def train(rank: int, world_size: int, runs: list[tuple[str, dict[str, Any]]], steps: int,
          batch: int, lr: float, momentum: float) -> list[dict[str, Any]]:
    """Train one fresh MLP per ``(scheme, options)`` with DDP + the scheme's hook.

    Returns:
        Per run: the rank's Meter summary, result bytes per step, final test accuracy.
    """
    x_train, y_train, x_test, y_test = digits()
    shard = np.array_split(np.arange(len(y_train)), world_size)[rank]
    x_mine, y_mine = x_train[shard], y_train[shard]
    out = []
    for name, options in runs:
        model = mlp()
        wrapped = DistributedDataParallel(model)
        meter = Meter(rank, world_size, window=None)  # result_bytes reads every record
        scheme = schemes.build(name, **options)
        ddp.register(wrapped, scheme, meter=meter)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=momentum)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            pick = torch.randint(len(y_mine), (batch,), generator=generator)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(wrapped(x_mine[pick]), y_mine[pick])
            loss.backward()
            optimizer.step()
            meter.next_step()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(dim=1) == y_test).float().mean())
        out.append({"scheme": name, "options": options, **meter.summary(),
                    "result_bytes_per_step": result_bytes(meter, world_size),
                    "test_accuracy": accuracy, "overhead_s": scheme.overhead_s})
    return out
