"""The DDP hook over gloo: identity is bit-exact, keying survives buckets, state resumes."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, optim
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
             bucket_cap_mb: float, poison: tuple[int, int] | None = None,
             couple: bool = False) -> dict[str, Any]:
    model = _model()
    net = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    state = None
    if scheme is not None:
        state = ddp.register(net, build(scheme, **config), meter=Meter(rank, world_size))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if couple:
        optim.couple(optimizer, state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(net, rank, range(STEPS), optimizer, poison)
    out: dict[str, Any] = {"params": [p.detach().clone() for p in model.parameters()],
                           "warnings": [str(w.message) for w in caught]}
    if state is not None:
        out["scheme"] = state.scheme.state_dict()
        out["skipped"] = state.scheme.skipped
    return out


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


DCT = {"sparsity": 0.9, "life_span": 3}


def _all_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    """Every DDP scenario in one process group: one spawn instead of ten."""
    return {
        "plain": _ddp_run(rank, world_size, None, {}, 25.0),
        "dense": _ddp_run(rank, world_size, "dense", {}, 0.001),
        "dense-coupled": _ddp_run(rank, world_size, "dense", {}, 0.001, couple=True),
        "topk-all-coupled": _ddp_run(rank, world_size, "topk", {"ratio": 1.0}, 0.001,
                                     couple=True),
        "topk-coupled": _ddp_run(rank, world_size, "topk", {"ratio": 0.1}, 0.001, couple=True),
        "dct-small-buckets": _ddp_run(rank, world_size, "dct-dp", DCT, 0.001),
        "dct-one-bucket": _ddp_run(rank, world_size, "dct-dp", DCT, 25.0),
        "manual": _manual_run(rank, world_size, DCT),
        "straight": _resume_run(rank, world_size, STEPS),
        "resumed": _resume_run(rank, world_size, 3),
        "nan": _ddp_run(rank, world_size, "dct-dp", {**DCT, "nonfinite": "skip"}, 0.001,
                        (1, 2)),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_all_scenarios, 2, timeout_s=120)


def test_dense_hook_is_bit_identical_to_ddp_without_hook(runs: list[dict[str, Any]]) -> None:
    for a, b in zip(runs[0]["plain"]["params"], runs[0]["dense"]["params"]):
        assert torch.equal(a, b)
    assert not torch.equal(runs[0]["plain"]["params"][0], _model()[0].weight)  # it trained


def test_coupling_leaves_dense_bit_identical_to_ddp_without_hook(
        runs: list[dict[str, Any]]) -> None:
    for a, b in zip(runs[0]["plain"]["params"], runs[0]["dense-coupled"]["params"]):
        assert torch.equal(a, b)


def test_coupled_topk_sending_everything_is_sgd_momentum_up_to_rounding(
        runs: list[dict[str, Any]]) -> None:
    """The mean of the workers' velocities is plain SGD's velocity (summed in another order)."""
    for a, b in zip(runs[0]["plain"]["params"], runs[0]["topk-all-coupled"]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_forgetting_to_couple_warns_once_and_coupling_silences_it(
        runs: list[dict[str, Any]]) -> None:
    for rank in range(2):
        assert len([w for w in runs[rank]["dct-one-bucket"]["warnings"] if "couple" in w]) == 1
        for label in ("topk-coupled", "dense", "plain"):
            assert not [w for w in runs[rank][label]["warnings"] if "couple" in w]
    for a, b in zip(runs[0]["topk-coupled"]["params"], runs[1]["topk-coupled"]["params"]):
        assert torch.equal(a, b)  # replicas agree


@pytest.mark.parametrize("bucketing", ["dct-small-buckets", "dct-one-bucket"])
def test_dct_hook_equals_reduce_without_ddp_for_any_bucketing(runs: list[dict[str, Any]],
                                                             bucketing: str) -> None:
    for rank in range(2):
        for a, b in zip(runs[rank][bucketing]["params"], runs[rank]["manual"]):
            assert torch.equal(a, b)


def test_checkpoint_resume_is_bit_identical_to_an_uninterrupted_run(
        runs: list[dict[str, Any]]) -> None:
    for a, b in zip(runs[0]["straight"], runs[0]["resumed"]):
        assert torch.equal(a, b)


def test_nan_on_one_rank_is_skipped_and_replicas_stay_identical(
        runs: list[dict[str, Any]]) -> None:
    results = [r["nan"] for r in runs]
    # skipped counts reduce calls (one per DDP bucket) whose gradients were dropped
    assert results[0]["skipped"] == 0 and results[1]["skipped"] >= 1
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b) and torch.isfinite(a).all()
    for buffer in results[1]["scheme"]["memory"]["buffers"].values():
        assert torch.isfinite(buffer).all()


def test_register_rejects_a_plain_module() -> None:
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ddp.register(_model(), build("dense"))  # type: ignore[arg-type]
