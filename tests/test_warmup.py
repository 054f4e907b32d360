"""The compression warm-up (every scheme's ``warmup_steps``): dense bit for bit while it lasts,
the scheme after, resumed exactly across the switch, a coupled memory carried through, and
the same in a rebuilt scheme."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.comm import Meter
from thinwire.launch import spawn

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
            scheme = schemes.build(name, ratio=0.1, warmup_steps=warm)
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


@pytest.mark.parametrize("name", schemes.names())
@pytest.mark.parametrize("steps", [-1, 1.5, True, "3", None])
def test_a_warm_up_length_must_be_a_count_of_steps(name: str, steps: Any) -> None:
    with pytest.raises(ValueError, match=rf"warmup_steps={steps!r} must be an integer >= 0"):
        schemes.build(name, warmup_steps=steps)


def test_register_and_warmup_spell_it_warm_up_a_scheme_spells_it_warmup_steps() -> None:
    with pytest.raises(ValueError, match="option is warmup_steps"):
        schemes.build("topk:warmup=30")


def _launches(scheme: schemes.Scheme, grads: list[dict[str, torch.Tensor]]
              ) -> tuple[list[dict[str, torch.Tensor]], list[list[tuple[str, str, int]]]]:
    """Each launch's result and what it handed the collectives: (collective, layer,
    bytes) of each record."""
    meter = scheme.meter = Meter(0, 1)
    results, handed = [], []
    for grad in grads:
        results.append(scheme.reduce({key: value.clone() for key, value in grad.items()}))
        handed.append([(r.collective, r.layer, r.nbytes) for r in meter.records
                       if r.step == meter.step])
        meter.next_step()
    return results, handed


@pytest.mark.parametrize("name", schemes.names())
def test_every_scheme_warms_up_as_dense_and_a_rebuild_keeps_it(name: str) -> None:
    """``NAME:warmup_steps=N``, and its rebuild (a rollback's, register's under Adam): the
    first N launches hand the collectives what ``dense`` hands them and average the same
    bits; then the scheme compresses (all but dense itself)."""
    warm = 2
    torch.manual_seed(0)
    grads = [{"w": torch.randn(64, 48), "b": torch.randn(48)} for _ in range(warm + 1)]
    dense = _launches(schemes.build("dense"), grads)
    scheme = schemes.build(f"{name}:warmup_steps={warm}")
    fresh = schemes.rebuild(scheme)
    assert fresh.origin == scheme.origin == schemes.build(name, warmup_steps=warm).origin
    assert schemes.fingerprint(fresh) == schemes.fingerprint(scheme)
    assert fresh.warmup_steps == scheme.warmup_steps == warm
    for built in (scheme, fresh):
        results, handed = _launches(built, grads)
        assert handed[:warm] == dense[1][:warm]
        for got, want in zip(results[:warm], dense[0][:warm]):
            assert all(torch.equal(got[key], want[key]) for key in want)
        compressed = handed[warm] != dense[1][warm] or not all(
            torch.equal(results[warm][key], dense[0][warm][key]) for key in grads[warm])
        assert compressed == (name != "dense")


@pytest.mark.parametrize("name", schemes.names())
def test_a_warm_up_round_trips_through_the_spelling(name: str) -> None:
    """Spelled from a scheme's options, the name builds the same scheme."""
    scheme = schemes.build(name, warmup_steps=5, nonfinite="skip")
    config = scheme.origin[1]
    spelled = ":".join([name, *(f"{key}={getattr(config, key)!r}" for key in sorted(scheme.given))])
    assert schemes.parse_spelling(spelled) == (name, {"nonfinite": "skip", "warmup_steps": 5})
    again = schemes.build(spelled)
    assert again.origin == scheme.origin and again.given == scheme.given
    assert schemes.fingerprint(again) == schemes.fingerprint(scheme)


def test_ranks_with_different_warm_ups_have_different_fingerprints() -> None:
    """The fingerprint every front door compares across ranks carries the warm-up."""
    assert (schemes.fingerprint(schemes.build("topk", warmup_steps=3))
            != schemes.fingerprint(schemes.build("topk")))


def test_old_warm_up_is_the_option_set_in_place() -> None:
    """Code written before the option: ``warm_up`` still warms up, in place, and the
    scheme's config, fingerprint and rebuild say so."""
    scheme = schemes.build("powersgd", warmup_steps=2)
    with pytest.warns(DeprecationWarning, match="warmup_steps=30"):
        assert schemes.warm_up(scheme, 30) is scheme
    assert scheme.warmup_steps == 30 and scheme.origin[1].warmup_steps == 30
    assert schemes.fingerprint(scheme) == schemes.fingerprint(
        schemes.build("powersgd", warmup_steps=30))
    assert schemes.rebuild(scheme).warmup_steps == 30


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_old_warm_up_refuses_what_it_refused() -> None:
    scheme = schemes.build("topk")
    scheme.launch({"w": torch.ones(4)})
    with pytest.raises(ValueError, match="launched already"):
        schemes.warm_up(scheme, 2)
    with pytest.raises(TypeError, match="expected a scheme"):
        schemes.warm_up(object(), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        schemes.warm_up(schemes.build("topk"), -1)


def test_a_checkpoint_of_a_scheme_warmed_up_the_old_way_resumes_exactly() -> None:
    """A scheme's state holds each tensor's launch count, not the warm-up's length, in the
    same layout whichever way the warm-up was given: an old checkpoint loads as it was."""
    torch.manual_seed(0)
    grads = [{"w": torch.randn(64, 48)} for _ in range(4)]
    with pytest.warns(DeprecationWarning):
        old = schemes.warm_up(schemes.build("topk", ratio=0.1), 2)
    new = schemes.build("topk", ratio=0.1, warmup_steps=2)
    old.reduce(grads[0])
    new.reduce(grads[0])
    saved = old.state_dict()
    assert saved.keys() == new.state_dict().keys() and saved["steps"] == {"w": 1}
    resumed = schemes.build("topk", ratio=0.1, warmup_steps=2)
    resumed.load_state_dict(saved)
    for grad in grads[1:]:
        assert torch.equal(resumed.reduce(grad)["w"], new.reduce(grad)["w"])


def test_a_registered_config_must_carry_a_warm_up() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bare:
        nonfinite: str = "raise"

    with pytest.raises(TypeError, match="needs a field 'warmup_steps: int = 0'"):
        schemes.register("test-bare", Bare)
    assert "test-bare" not in schemes.names()


def test_each_tensor_counts_its_own_launches() -> None:
    """FSDP launches each module's shards on its own: a tensor warms up over its own
    launches, whatever else is launched between them."""
    scheme = schemes.build("topk", ratio=0.25, warmup_steps=1)
    grad = torch.arange(1.0, 65.0)
    sent = []
    for _ in range(2):  # two steps, two launches each
        for key in ("a", "b"):
            sent.append(scheme.launch({key: grad}).wait()[key].count_nonzero().item())
    assert sent == [64, 64, 16, 16]
