"""One data-parallel training run: DDP + a scheme's hook on the embedded dataset.

Shared by ``thinwire compare`` (local ranks) and ``thinwire train`` (torchrun).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.comm import Meter
from thinwire.compress import Sparsifier
from thinwire.schemes import CompressedScheme
from thinwire.train.digits import Split, batches, load_digits, shard
from thinwire.train.launch import phase
from thinwire.train.mlp import mlp


@dataclass(frozen=True)
class RunOptions:
    steps: int = 500  # optimiser steps per scheme
    batch_size: int = 32  # samples per worker per step
    lr: float = 0.05  # SGD learning rate
    momentum: float = 0.9  # SGD momentum
    hidden: int = 256  # width of the MLP's two hidden layers
    seed: int = 0  # model initialisation, data order and split
    eval_every: int = 25  # steps between test-accuracy points of the curves

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "hidden", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum={self.momentum!r} must be in [0, 1)")


def accuracy(model: nn.Module, split: Split) -> float:
    with torch.no_grad():
        return float((model(split.x).argmax(dim=1) == split.y).float().mean())


def compute_seconds(model: nn.Module, data: Split, batch_size: int, repeats: int = 15) -> float:
    """Median time of one local forward + backward + update, without communication."""
    probe = copy.deepcopy(model)
    optimizer = torch.optim.SGD(probe.parameters(), lr=0.0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(probe(data.x[:batch_size]), data.y[:batch_size])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_scheme(name: str, config: dict[str, Any], options: RunOptions,
               progress: Callable[[int], None] | None = None,
               group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Train the MLP under scheme ``name`` in the current process group.

    Every rank calls this with the same arguments. Returns this rank's
    results: accuracy, loss, bytes, overhead, timings, curves, final weights.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    phase(f"{name} setup")
    train, test = load_digits(seed=options.seed)
    local = shard(train, rank, world_size)
    torch.manual_seed(options.seed)
    model = mlp(train.x.shape[1], options.hidden, classes=10)
    compute_s = compute_seconds(model, local, options.batch_size)
    net = DistributedDataParallel(model, process_group=group)
    meter = Meter(rank, world_size)
    scheme = schemes.build(name, **config)
    ddp.register(net, scheme, meter=meter)
    optimizer = torch.optim.SGD(net.parameters(), lr=options.lr, momentum=options.momentum)
    stream = batches(local, options.batch_size, seed=options.seed * 1000 + rank)
    curve: list[tuple[int, float, float]] = []  # (step, cumulative bytes, test accuracy)
    losses = []
    start = time.perf_counter()
    for step in range(1, options.steps + 1):
        phase(f"{name} step {step}")
        index = next(stream)
        loss = nn.functional.cross_entropy(net(local.x[index]), local.y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        meter.next_step()
        losses.append(float(loss.detach()))
        if step % options.eval_every == 0 or step == options.steps:
            handed = meter.bytes_per_step().get("total", 0.0) * meter.step
            curve.append((step, handed, accuracy(model, test)))
        if progress is not None:
            progress(1)
    wall_s = time.perf_counter() - start
    tail = losses[-options.eval_every:]
    summary = meter.summary()
    result: dict[str, Any] = {
        "scheme": name,
        "config": asdict(schemes.config_class(name)(**config)),
        "test_accuracy": accuracy(model, test),
        "final_loss": statistics.fmean(tail),
        **summary,
        "overhead_ms_per_step": 1000.0 * scheme.overhead_s / options.steps,
        "compute_ms_per_step": 1000.0 * compute_s,
        "wall_s": wall_s,
        "skipped_steps": scheme.skipped,
        "curve": curve,
        "weights": [p.detach().clone() for p in model.parameters()],
    }
    result["threshold_trace"] = threshold_trace(scheme)
    return result


def threshold_trace(scheme: schemes.Scheme) -> dict[str, list[tuple[int, float, float]]]:
    """The sparsifier's (step, threshold, density) per layer, if it has one."""
    if isinstance(scheme, CompressedScheme) and isinstance(scheme.compressor, Sparsifier):
        return {key: list(points) for key, points in scheme.compressor.trace.items()}
    return {}
