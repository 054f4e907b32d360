"""The DDP hook over gloo: identity is bit-exact, keying survives buckets, state resumes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp
from thinwire.comm import Meter
from thinwire.schemes import build
from thinwire.train.launch import spawn

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _train(net: nn.Module, rank: int, steps: range, optimizer: torch.optim.Optimizer,
           poison: tuple[int, int] | None = None) -> None:
    for step in steps:
        x, y = _batch(rank, step)
        if poison == (rank, step):
            x = x.clone()
            x[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _ddp_run(rank: int, world_size: int, scheme: str | None, config: dict[str, Any],
             bucket_cap_mb: float, poison: tuple[int, int] | None = None) -> dict[str, Any]:
    model = _model()
    net = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    state = None
    if scheme is not None:
        state = ddp.register(net, build(scheme, **config), meter=Meter(rank, world_size))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _train(net, rank, range(STEPS), optimizer, poison)
    out: dict[str, Any] = {"params": [p.detach().clone() for p in model.parameters()]}
    if state is not None:
        out["scheme"] = state.scheme.state_dict()
        out["skipped"] = state.scheme.skipped
    return out


def test_dense_hook_is_bit_identical_to_ddp_without_hook() -> None:
    plain = spawn(_ddp_run, 2, None, {}, 25.0, timeout_s=60)
    hooked = spawn(_ddp_run, 2, "dense", {}, 0.001, timeout_s=60)  # one bucket per tensor
    for a, b in zip(plain[0]["params"], hooked[0]["params"]):
        assert torch.equal(a, b)
    assert not torch.equal(plain[0]["params"][0], _model()[0].weight)  # it trained


def _manual_run(rank: int, world_size: int, config: dict[str, Any]) -> list[torch.Tensor]:
    """The same training without DDP: local gradients through ``scheme.reduce``."""
    model = _model()
    for p in model.parameters():  # DDP broadcasts rank 0's weights; all equal here anyway
        dist.broadcast(p.data, 0)
    scheme = build("dct-dp", **config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        named = {name: p.grad for name, p in model.named_parameters()}
        reduced = scheme.reduce(named)  # type: ignore[arg-type]
        for name, p in model.named_parameters():
            p.grad = reduced[name]
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("bucket_cap_mb", [0.001, 25.0])
def test_dct_hook_equals_reduce_without_ddp_for_any_bucketing(bucket_cap_mb: float) -> None:
    config = {"sparsity": 0.9, "life_span": 3}
    hooked = spawn(_ddp_run, 2, "dct-dp", config, bucket_cap_mb, timeout_s=60)
    manual = spawn(_manual_run, 2, config, timeout_s=60)
    for rank in range(2):
        for a, b in zip(hooked[rank]["params"], manual[rank]):
            assert torch.equal(a, b)


def _resume_run(rank: int, world_size: int, split: int) -> list[torch.Tensor]:
    """Train STEPS steps, checkpointing and rebuilding everything after ``split``."""
    config = {"sparsity": 0.8, "life_span": 4}
    model = _model()
    net = DistributedDataParallel(model, bucket_cap_mb=0.001)
    state = ddp.register(net, build("dct-dp", **config))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _train(net, rank, range(split), optimizer)
    if split < STEPS:
        checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": optimizer.state_dict(),
                                    "scheme": state.scheme.state_dict()})
        model = _model()
        model.load_state_dict(checkpoint["model"])
        net = DistributedDataParallel(model, bucket_cap_mb=0.001)
        scheme = build("dct-dp", **config)
        scheme.load_state_dict(checkpoint["scheme"])
        ddp.register(net, scheme)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        optimizer.load_state_dict(checkpoint["opt"])
        _train(net, rank, range(split, STEPS), optimizer)
    return [p.detach().clone() for p in model.parameters()]


def test_checkpoint_resume_is_bit_identical_to_an_uninterrupted_run() -> None:
    straight = spawn(_resume_run, 2, STEPS, timeout_s=60)
    resumed = spawn(_resume_run, 2, 3, timeout_s=60)
    for a, b in zip(straight[0], resumed[0]):
        assert torch.equal(a, b)


def test_nan_on_one_rank_is_skipped_and_replicas_stay_identical() -> None:
    config = {"sparsity": 0.9, "life_span": 2, "nonfinite": "skip"}
    results = spawn(_ddp_run, 2, "dct-dp", config, 0.001, (1, 2), timeout_s=60)
    # skipped counts reduce calls (one per DDP bucket) whose gradients were dropped
    assert results[0]["skipped"] == 0 and results[1]["skipped"] >= 1
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b) and torch.isfinite(a).all()
    for buffer in results[1]["scheme"]["memory"]["buffers"].values():
        assert torch.isfinite(buffer).all()


def test_register_rejects_a_plain_module() -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ddp.register(_model(), build("dense"))  # type: ignore[arg-type]
