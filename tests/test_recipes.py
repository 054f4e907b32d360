"""The user guide's recipes do what the guide says (docs/guide/recipes.md)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.launch import spawn

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3)).double()


def _rows(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(8, 12, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (8,), generator=generator))


def _accumulate(rank: int, world_size: int, micro: int) -> dict[str, Any]:
    """The recipe: ``micro`` backward passes per step, all but the last under ``no_sync``."""
    model = _model()
    net = DistributedDataParallel(model)
    meter = thinwire.Meter(dist.get_rank(), dist.get_world_size())
    scheme = thinwire.schemes.build("topk", ratio=0.05)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = thinwire.ddp.register(net, scheme, meter=meter)
    thinwire.optim.couple(optimizer, state)
    for step in range(STEPS):
        x, y = _rows(rank, step)
        optimizer.zero_grad()
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = i == micro - 1
            # DDP decides in the forward whether the backward exchanges: both go inside
            with contextlib.nullcontext() if last else net.no_sync():
                loss = nn.functional.cross_entropy(net(xs), ys) / micro
                loss.backward()  # the hook runs on the last one only, on the summed gradient
        optimizer.step()
        meter.next_step()
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "steps": meter.step, "bytes": meter.bytes_per_step().get("total", 0.0)}


def _both(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return _accumulate(rank, world_size, 1), _accumulate(rank, world_size, 4)


def test_gradient_accumulation_with_no_sync_equals_one_large_batch() -> None:
    for one, other in spawn(_both, 2):
        assert other["steps"] == one["steps"] == STEPS  # one exchange per optimiser step
        assert other["bytes"] == one["bytes"] > 0
        for a, b in zip(one["weights"], other["weights"]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
