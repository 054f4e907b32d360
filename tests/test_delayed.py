"""The one-step-delayed DDP update: step t applies step t-1's mean, against a reference."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.comm.fingerprint import PeerMismatchError
from thinwire.launch import spawn

WORLD = 2
STEPS = 7
LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(5, 6, generator=generator, dtype=torch.float64),
            torch.randint(0, 3, (5,), generator=generator))


def _net(name: str, delayed: bool, **config: Any) -> tuple[nn.Module, Any, ddp.HookState]:
    model = _model()
    # small buckets: several per step, rebuilt by DDP after the first
    net = DistributedDataParallel(model, bucket_cap_mb=0.001)
    state = ddp.register(net, schemes.build(name, **config), delay=delayed)
    return net, torch.optim.SGD(net.parameters(), lr=LR), state


def _step(net: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    optimizer.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()


def _train(rank: int, name: str, delayed: bool, stop: int | None = None,
           **config: Any) -> list[torch.Tensor]:
    net, optimizer, state = _net(name, delayed, **config)
    for step in range(STEPS):
        if step == stop:  # checkpoint, rebuild everything, resume
            buffer = io.BytesIO()
            torch.save({"model": net.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheme": state.state_dict()}, buffer)
            net, optimizer, state = _net(name, delayed, **config)
            buffer.seek(0)
            saved = torch.load(buffer, weights_only=False)
            net.module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            state.load_state_dict(saved["scheme"])
        _step(net, optimizer, rank, step)
    return [p.detach().clone() for p in net.module.parameters()]


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "dense delayed": _train(rank, "dense", True),
        "dense": _train(rank, "dense", False),
        "topk delayed": _train(rank, "topk", True, ratio=0.3),
    }
    for stop in (1, 4):
        out[f"resumed {stop}"] = _train(rank, "topk", True, stop, ratio=0.3)
    try:
        _net("dense", delayed=rank == 0)
        out["refused"] = None
    except PeerMismatchError as error:
        out["refused"] = str(error)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_scenarios, WORLD, timeout_s=300, deadline_s=600)


def _reference(delayed: bool) -> list[torch.Tensor]:
    """SGD on the mean gradient of WORLD workers, applied at its step or the next."""
    model = _model()
    params = list(model.parameters())
    waiting = [torch.zeros_like(p) for p in params]  # the first step applies nothing
    for step in range(STEPS):
        grads = []
        for rank in range(WORLD):
            model.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in params])
        mean = [sum(g[i] for g in grads) / WORLD for i in range(len(params))]
        applied, waiting = (waiting, mean) if delayed else (mean, waiting)
        with torch.no_grad():
            for p, g in zip(params, applied):
                p.sub_(LR * g)
    return [p.detach() for p in params]


@pytest.mark.parametrize("delayed", [True, False])
def test_each_mean_is_applied_one_step_late_to_float64_precision(
        delayed: bool, runs: list[dict[str, Any]]) -> None:
    expected = _reference(delayed)
    for rank in range(WORLD):
        got = runs[rank]["dense delayed" if delayed else "dense"]
        for mine, theirs in zip(got, expected):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(runs[0]["dense delayed"][0], runs[0]["dense"][0])


def test_a_sparse_scheme_delayed_keeps_the_replicas_identical(
        runs: list[dict[str, Any]]) -> None:
    for mine, theirs in zip(runs[0]["topk delayed"], runs[1]["topk delayed"]):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("stop", [1, 4])
def test_resume_with_a_mean_in_flight_is_bit_identical(stop: int,
                                                       runs: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        for mine, theirs in zip(runs[rank][f"resumed {stop}"], runs[rank]["topk delayed"]):
            assert torch.equal(mine, theirs)


def test_a_rank_that_does_not_delay_is_refused_on_every_rank(
        runs: list[dict[str, Any]]) -> None:
    messages = [runs[rank]["refused"] for rank in range(WORLD)]
    assert messages[0] is not None and messages[0] == messages[1] and "delay" in messages[0]
