"""Lookahead local updates: blocking DiLoCo alone, a reference of the rule written here
(3 workers, float64, fragments, a tensor not a whole number of chunks), resume with an
exchange in flight, refusals."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from test_local_eager import (
    CONFIGS,
    OPTIONS,
    STEPS,
    WORLD,
    _identical,
    _inner_step,
    _matches,
    _model,
    _run,
    _sgd,
    _weights,
    _workers,
)
from thinwire.launch import spawn
from thinwire.local import LocalConfig, LocalUpdates, outer_defaults


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {name: _run(rank, name, lookahead=True) for name in CONFIGS}
    for stop in (1, 3, 5, 7):  # before any sync, mid-flight, just after a launch
        out[f"resumed {stop}"] = _run(rank, "int4", stop=stop, lookahead=True)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_scenarios, WORLD, timeout_s=300, deadline_s=600)


@pytest.mark.parametrize("name", ["dense", "sparseloco"])
def test_one_worker_lookahead_is_blocking_diloco(name: str) -> None:
    """Alone a worker's fresh pseudo-gradient is the average the lookahead stands in for:
    every step is blocking DiLoCo's, to the bit (a lossless scheme; SparseLoCo sends less
    than its delta, so there only the schedule is checked)."""
    ahead, blocking = _run(0, name, lookahead=True), _run(0, name)
    if name == "dense":
        for got, want in zip(ahead["trajectory"], blocking["trajectory"], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(ahead["final"], blocking["final"]))
    else:
        assert len(ahead["trajectory"]) == len(blocking["trajectory"])


def _reference(name: str) -> list[dict[str, Any]]:
    """The rule for WORLD workers in one process, literally: one set of global weights and
    outer optimisers (one a fragment) that only whole averages step, a sync late; at a
    fragment's sync each worker sends ``delta`` (from where its replica started) through
    its own codec, the previous sync's average steps the global weights, and each replica
    starts from the step its own ``delta`` would take from them, on copies of the weights
    and the outer state. At the end the last averages land, and each replica moves by what
    they changed of where it started."""
    models, inners, codecs, fragments = _workers(name)
    config = LocalConfig(**OPTIONS)
    lr, momentum = outer_defaults(codecs[0])
    global_ = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    outers = [torch.optim.SGD([global_[k] for k in keys], lr=lr, momentum=momentum,
                              nesterov=momentum > 0) for keys in fragments]
    starts = [dict(copy.deepcopy(global_)) for _ in range(WORLD)]
    in_flight: dict[int, dict[str, torch.Tensor]] = {}

    def step_with(f: int, weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                  optimizer: torch.optim.Optimizer) -> None:
        for k in fragments[f]:
            weights[k].grad = grads[k]
        optimizer.step()
        for k in fragments[f]:
            weights[k].grad = None

    def land(f: int) -> None:
        mean = in_flight.pop(f, None)
        if mean is not None:
            step_with(f, global_, mean, outers[f])

    trajectories: list[list[list[torch.Tensor]]] = [[] for _ in range(WORLD)]
    for step in range(1, STEPS + 1):
        for rank in range(WORLD):
            _inner_step(models[rank], inners[rank], rank, step - 1)
        for f, keys in enumerate(fragments):
            if (step - config.offset(f)) % config.every:
                continue
            sum_ = {k: torch.zeros_like(global_[k]) for k in keys}
            deltas = []
            for rank in range(WORLD):
                params = dict(models[rank].named_parameters())
                deltas.append({k: starts[rank][k] - params[k].detach() for k in keys})
                for k, sent in codecs[rank].reduce(deltas[rank]).items():  # alone: its own
                    sum_[k].add_(sent)
            land(f)
            for rank in range(WORLD):
                ahead = {k: global_[k].detach().clone() for k in keys}
                optimizer = torch.optim.SGD(list(ahead.values()), lr=lr, momentum=momentum,
                                            nesterov=momentum > 0)
                for k in keys:
                    kept = outers[f].state.get(global_[k], {})
                    optimizer.state[ahead[k]] = {key: value.clone() for key, value
                                                 in kept.items()}
                step_with(f, ahead, deltas[rank], optimizer)
                params = dict(models[rank].named_parameters())
                with torch.no_grad():
                    for k in keys:
                        params[k].copy_(ahead[k])
                        starts[rank][k] = ahead[k].detach().clone()
            in_flight[f] = {k: v / WORLD for k, v in sum_.items()}
        for rank in range(WORLD):
            trajectories[rank].append(_weights(models[rank]))
    for f in sorted(in_flight):  # the last averages land; each replica keeps its progress
        land(f)
        for rank, model in enumerate(models):
            with torch.no_grad():
                for k, p in model.named_parameters():
                    if k in fragments[f]:
                        p.add_(global_[k] - starts[rank][k])
    return [{"trajectory": trajectories[rank], "final": _weights(models[rank]),
             "globals": list(global_.values())} for rank in range(WORLD)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lookahead_of_three_workers_equals_a_reference_of_the_rule(
        name: str, runs: list[dict[str, Any]]) -> None:
    expected = _reference(name)
    for rank in range(WORLD):
        _matches(runs[rank][name], expected[rank])
    # the replicas started from their own lookahead; the global weights are everyone's
    assert not torch.allclose(runs[0][name]["trajectory"][2][0],
                              runs[1][name]["trajectory"][2][0])
    for rank in range(1, WORLD):
        assert all(torch.equal(a, b) for a, b in zip(runs[rank][name]["agreed"],
                                                     runs[0][name]["agreed"]))


@pytest.mark.parametrize("stop", [1, 3, 5, 7])
def test_resume_with_a_lookahead_exchange_in_flight_is_bit_identical(
        stop: int, runs: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        _identical(runs[rank][f"resumed {stop}"], runs[rank]["int4"])


@pytest.mark.parametrize("options", [{"overlap": True}, {"eager": True}, {"delay": 1},
                                     {"mix": 0.5}, {"lookahead": 1}])
def test_lookahead_takes_the_late_schedule_alone(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="lookahead"):
        LocalConfig(every=4, **{"lookahead": True, **options})
    model = _model()
    with pytest.raises(ValueError, match="lookahead"):
        LocalUpdates(model, _sgd(model), every=4, **{"lookahead": True, **options})
