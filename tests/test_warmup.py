"""The compression warm-up (thinwire.schemes.warm_up): dense bit for bit while it lasts, the
scheme after, resumed exactly across the switch, a coupled memory carried through."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.comm import Meter
from thinwire.launch import spawn
from thinwire.schemes import warm_up

STEPS, WARM = 6, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 3)).double()


def _train(net: nn.Module, rank: int, optimizer: torch.optim.Optimizer, steps: range,
           meter: Meter | None = None) -> list[list[torch.Tensor]]:
    """Train; the weights after each step."""
    after = []
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 10, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        if meter is not None:
            meter.next_step()
        after.append([p.detach().clone() for p in net.parameters()])
    return after


def _run(rank: int, world_size: int, name: str, warm: int, couple: bool,
         split: int | None = None) -> dict[str, Any]:
    """``name`` warmed up for ``warm`` steps (dense: no hook at all), SGD momentum coupled
    through ``register`` when ``couple``; with ``split``, checkpointed and rebuilt there.

    Several DDP buckets a step; one when resumed (a fresh DDP's first buckets are not
    those it rebuilds after its first step, which a selection over a bucket would see).
    """

    def build(model: nn.Module) -> tuple[nn.Module, Any, torch.optim.Optimizer, Meter]:
        net = DistributedDataParallel(model, bucket_cap_mb=0.0005 if split is None else 25)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        meter = Meter(rank, world_size)
        state = None
        if name != "dense":
            scheme = warm_up(schemes.build(name, ratio=0.1), warm)
            state = ddp.register(net, scheme, meter=meter,
                                 optimizer=optimizer if couple else None)
        return net, state, optimizer, meter

    model = _model()
    net, state, optimizer, meter = build(model)
    stop = STEPS if split is None else split
    weights = _train(net, rank, optimizer, range(stop), meter)
    if split is not None:
        saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                               "scheme": state.state_dict()})
        model = _model()
        model.load_state_dict(saved["model"])
        net, state, optimizer, meter = build(model)
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["scheme"])
        weights += _train(net, rank, optimizer, range(split, STEPS), meter)
    collectives = [sorted({r.collective for r in meter.records if r.step == step})
                   for step in range(meter.step)]
    return {"weights": weights, "collectives": collectives}


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "dense": _run(rank, world_size, "dense", 0, False),
        "topk": _run(rank, world_size, "topk", WARM, False),
        "topk-cold": _run(rank, world_size, "topk", 0, False),
        "coupled": _run(rank, world_size, "topk", WARM, True),
        "clt-k": _run(rank, world_size, "clt-k", WARM, True),
        **{f"resumed-{split}": _run(rank, world_size, "topk", WARM, True, split)
           for split in (2, 3, 5, STEPS)},
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_scenarios, 2)


def test_warm_up_steps_are_bit_identical_to_dense_and_then_compressed(
        runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        dense, warmed = rank["dense"]["weights"], rank["topk"]["weights"]
        for step in range(WARM):
            assert all(torch.equal(a, b) for a, b in zip(dense[step], warmed[step]))
        assert not torch.equal(dense[WARM][0], warmed[WARM][0])
        collectives = rank["topk"]["collectives"]
        assert collectives[:WARM] == [["all_reduce"]] * WARM
        assert all("all_gather" in step for step in collectives[WARM:])


def test_after_the_warm_up_the_scheme_sends_what_it_sends_alone(
        runs: list[dict[str, Any]]) -> None:
    # the same bytes a step as the scheme alone from its own first step on
    for rank in runs:
        assert rank["topk"]["collectives"][WARM:] == rank["topk-cold"]["collectives"][:STEPS - WARM]


@pytest.mark.parametrize("name", ["coupled", "clt-k"])
def test_a_coupled_memory_steps_as_sgd_momentum_through_the_warm_up(
        runs: list[dict[str, Any]], name: str) -> None:
    # the momentum lives in the workers: during the warm-up the mean of their velocities
    # is SGD's own velocity, up to the order of a sum
    for rank in runs:
        for step in range(WARM):
            for a, b in zip(rank["dense"]["weights"][step], rank[name]["weights"][step]):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("split", [2, 3, 5])
def test_resume_on_either_side_of_the_switch_is_bit_identical(
        runs: list[dict[str, Any]], split: int) -> None:
    for rank in runs:
        straight = rank[f"resumed-{STEPS}"]["weights"]  # one bucket, never interrupted
        resumed = rank[f"resumed-{split}"]["weights"]
        for a, b in zip(straight[-1], resumed[-1]):
            assert torch.equal(a, b)


def test_replicas_stay_identical(runs: list[dict[str, Any]]) -> None:
    for name in ("topk", "coupled", "clt-k"):
        for a, b in zip(runs[0][name]["weights"][-1], runs[1][name]["weights"][-1]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("steps", [-1, 1.5, True])
def test_a_warm_up_length_must_be_a_count_of_steps(steps: Any) -> None:
    with pytest.raises(ValueError, match="steps="):
        warm_up(schemes.build("topk"), steps)


def test_a_warm_up_is_given_before_the_first_launch() -> None:
    scheme = schemes.build("topk")
    scheme.launch({"w": torch.ones(4)})
    with pytest.raises(ValueError, match="launched already"):
        warm_up(scheme, 2)


def test_only_a_built_scheme_warms_up() -> None:
    with pytest.raises(TypeError, match="expected a scheme"):
        warm_up(object(), 2)  # type: ignore[arg-type]


def test_a_warm_up_is_the_schemes_own_option() -> None:
    scheme = schemes.build("topk")
    assert warm_up(scheme, 5) is scheme and scheme.warmup_steps == 5
    assert schemes.build("powersgd", warmup_steps=5).warmup_steps == 5


def test_each_tensor_counts_its_own_launches() -> None:
    """FSDP launches each module's shards on its own: a tensor warms up over its own
    launches, whatever else is launched between them."""
    scheme = warm_up(schemes.build("topk", ratio=0.25), 1)
    grad = torch.arange(1.0, 65.0)
    sent = []
    for _ in range(2):  # two steps, two launches each
        for key in ("a", "b"):
            sent.append(scheme.launch({key: grad}).wait()[key].count_nonzero().item())
    assert sent == [64, 64, 16, 16]
