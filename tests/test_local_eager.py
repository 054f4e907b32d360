"""Eager local updates: blocking DiLoCo alone, a reference of Kale et al.'s rule written
here (3 workers, float64, fragments, a tensor not a whole number of chunks), every share
stepped with once, resume with an exchange in flight."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

from thinwire import schemes
from thinwire.launch import spawn
from thinwire.local import LocalConfig, LocalUpdates, nesterov, outer_defaults, split

WORLD = 3
STEPS = 14  # every 4, 2 fragments: fragment 0 syncs at 2, 6, 10, 14, fragment 1 at 4, 8, 12
OPTIONS: dict[str, Any] = {"every": 4, "fragments": 2}
CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {}, "int4": {"chunk": 4},
    "sparseloco": {"chunk": 4, "k": 1, "aggregate": "ranks"}}  # a mean over ranks, as below


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(torch.float64)


def _inner_step(model: nn.Module, inner: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One SGD step on a batch of the worker's own."""
    generator = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    x = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (5,), generator=generator)
    inner.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    inner.step()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _build(name: str, **options: Any) -> tuple[nn.Module, LocalUpdates]:
    model = _model()
    return model, LocalUpdates(model, _sgd(model), schemes.build(name, **CONFIGS[name]),
                               **OPTIONS, **options)


def _run(rank: int, name: str = "dense", stop: int | None = None,
         **options: Any) -> dict[str, Any]:
    """Local weights after every step, and the global weights once the last exchange landed;
    ``stop``: saved there, rebuilt and resumed."""
    model, updates = _build(name, **options)
    trajectory = []
    for step in range(STEPS):
        if step == stop:
            buffer = io.BytesIO()
            torch.save(updates.state_dict(), buffer)
            model, updates = _build(name, **options)
            buffer.seek(0)
            updates.load_state_dict(torch.load(buffer, weights_only=False))
        _inner_step(model, updates.inner, rank, step)
        updates.step()
        trajectory.append(_weights(model))
    agreed = [g.clone() for g in updates.global_state().values()]
    updates.finish()
    return {"trajectory": trajectory, "agreed": agreed,
            "globals": [g.clone() for g in updates.global_state().values()],
            "final": _weights(model)}


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {name: _run(rank, name, eager=True) for name in CONFIGS}
    for stop in (1, 3, 5, 7):  # before any sync, mid-flight, just after a launch
        out[f"resumed {stop}"] = _run(rank, "int4", stop=stop, eager=True)
    out["sgd"] = _run(rank, eager=True, outer=nesterov(1.0, 0.0))
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_scenarios, WORLD, timeout_s=300, deadline_s=600)


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _matches(got: dict[str, Any], want: dict[str, Any]) -> None:
    """A worker's run against a reference's, to rounding: every step's weights, the final
    and the global ones."""
    for at_step, wanted in zip(got["trajectory"], want["trajectory"], strict=True):
        _close(at_step, wanted)
    _close(got["final"], want["final"])
    _close(got["globals"], want["globals"])


def _identical(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Two runs' every step and global weights, to the bit."""
    for a, b in zip(got["trajectory"] + [got["globals"]], want["trajectory"] + [want["globals"]],
                    strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_one_worker_eager_is_blocking_diloco() -> None:
    """Alone the fresh share is the whole average: every step is blocking DiLoCo's, to the bit."""
    eager, blocking = _run(0, eager=True), _run(0)
    for got, want in zip(eager["trajectory"], blocking["trajectory"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(eager["agreed"], blocking["globals"]))


def _workers(name: str) -> tuple[list[nn.Module], list[torch.optim.Optimizer], list[Any],
                                 list[list[str]]]:
    """WORLD workers for a reference in one process: models, inner optimisers, codecs (each
    alone), and the names of each of the two fragments."""
    models = [_model() for _ in range(WORLD)]
    names = [n for n, _ in models[0].named_parameters()]
    fragments = [[names[i] for i in run]
                 for run in split([p.numel() for p in models[0].parameters()], 2)]
    return (models, [_sgd(m) for m in models],
            [schemes.build(name, **CONFIGS[name]) for _ in range(WORLD)], fragments)


def _reference(name: str) -> list[dict[str, Any]]:
    """Kale et al. 2025's eager rule for WORLD workers in one process, literally: each worker
    keeps its own global weights and outer optimisers (one a fragment); at a fragment's
    sync it sends ``delta`` through its own codec and steps with ``delta / M`` plus, from
    the previous sync's average, ``mean - last_delta / M``; the replica restarts from the
    result. At the end the last average's rest is stepped with."""
    models, inners, codecs, fragments = _workers(name)
    config = LocalConfig(**OPTIONS)
    lr, momentum = outer_defaults(codecs[0])
    globals_ = [{n: p.detach().clone() for n, p in models[0].named_parameters()}
                for _ in range(WORLD)]
    outers = [[torch.optim.SGD([g[k] for k in keys], lr=lr, momentum=momentum,
                               nesterov=momentum > 0) for keys in fragments] for g in globals_]
    last: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    in_flight: dict[int, dict[str, torch.Tensor]] = {}

    def outer_step(rank: int, f: int, fresh: dict[str, torch.Tensor] | None,
                   mean: dict[str, torch.Tensor] | None) -> None:
        before = last.pop((rank, f), None)
        for k in fragments[f]:
            share = (torch.zeros_like(globals_[rank][k]) if fresh is None
                     else fresh[k] / WORLD)
            if mean is not None and before is not None:
                share = share + (mean[k] - before[k] / WORLD)
            globals_[rank][k].grad = share
        outers[rank][f].step()
        params = dict(models[rank].named_parameters())
        with torch.no_grad():
            for k in fragments[f]:
                globals_[rank][k].grad = None
                params[k].copy_(globals_[rank][k])
        if fresh is not None:
            last[rank, f] = fresh

    trajectories: list[list[list[torch.Tensor]]] = [[] for _ in range(WORLD)]
    for step in range(1, STEPS + 1):
        for rank in range(WORLD):
            _inner_step(models[rank], inners[rank], rank, step - 1)
        for f, keys in enumerate(fragments):
            if (step - config.offset(f)) % config.every:
                continue
            landing = in_flight.pop(f, None)
            sum_ = {k: torch.zeros_like(globals_[0][k]) for k in keys}
            for rank in range(WORLD):
                params = dict(models[rank].named_parameters())
                deltas = {k: globals_[rank][k] - params[k].detach() for k in keys}
                for k, sent in codecs[rank].reduce(deltas).items():  # alone: what it sent
                    sum_[k].add_(sent)
                outer_step(rank, f, deltas, landing)
            in_flight[f] = {k: v / WORLD for k, v in sum_.items()}
        for rank in range(WORLD):
            trajectories[rank].append(_weights(models[rank]))
    for f in sorted(in_flight):
        for rank in range(WORLD):
            outer_step(rank, f, None, in_flight[f])
    return [{"trajectory": trajectories[rank], "final": _weights(models[rank]),
             "globals": list(globals_[rank].values())} for rank in range(WORLD)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_updates_of_three_workers_equal_a_reference_of_the_rule(
        name: str, runs: list[dict[str, Any]]) -> None:
    expected = _reference(name)
    for rank in range(WORLD):
        _matches(runs[rank][name], expected[rank])
    # each worker stepped with its own fresh share, so their weights differ
    assert not torch.allclose(runs[0][name]["agreed"][0], runs[1][name]["agreed"][0])


def test_every_share_is_stepped_with_once(runs: list[dict[str, Any]]) -> None:
    """Under plain SGD the outer steps add up: once the last average has landed, every
    worker has stepped with every share once, so all hold the same weights."""
    for rank in range(1, WORLD):
        assert not torch.allclose(runs[rank]["sgd"]["agreed"][0], runs[0]["sgd"]["agreed"][0])
        _close(runs[rank]["sgd"]["globals"], runs[0]["sgd"]["globals"])


@pytest.mark.parametrize("stop", [1, 3, 5, 7])
def test_resume_with_an_eager_exchange_in_flight_is_bit_identical(
        stop: int, runs: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        _identical(runs[rank][f"resumed {stop}"], runs[rank]["int4"])


@pytest.mark.parametrize("options", [{"overlap": True}, {"delay": 1}, {"mix": 0.5}])
def test_eager_refuses_overlap_delay_and_mix_by_name(options: dict[str, Any]) -> None:
    key, value = next(iter(options.items()))
    with pytest.raises(ValueError, match=f"eager=True .*{key}={value!r}"):
        LocalConfig(every=4, eager=True, **options)
    with pytest.raises(ValueError, match="eager=1"):
        LocalConfig(eager=1)  # type: ignore[arg-type]
