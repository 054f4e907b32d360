"""SimulatedReplicas (one process) against the real scheme on a gloo group, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from thinwire import schemes
from thinwire.comm import Meter
from thinwire.jobs.dct_mp import SimulatedReplicas
from thinwire.launch import spawn

WORLD = 2
STEPS = 4
SHAPES = {"emb": (60, 8), "fc.weight": (24, 30), "fc.bias": (24,), "out.weight": (3, 24)}
# Every scheme one process can simulate, at its default scope and the other one.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("dense", {}),
    "fp16": ("fp16", {}),
    "topk": ("topk", {"ratio": 0.05}),  # default scope: the bucket
    "topk-layer": ("topk", {"ratio": 0.05, "scope": "layer"}),
    "topk-fp16": ("topk", {"ratio": 0.05, "values": "fp16", "min_numel": 100}),
    "dct-dp": ("dct-dp", {"ratio": 0.05, "life_span": 2}),  # default scope: the layer
    "dct-dp-bucket": ("dct-dp", {"ratio": 0.05, "life_span": 2, "scope": "bucket"}),
    "laplace": ("laplace", {"ratio": 0.1, "min_numel": 200}),
    "local-topk": ("local-topk", {"ratio": 0.05, "warmup_steps": 1, "beta": 0.5}),
    "local-topk-layer": ("local-topk", {"ratio": 0.05, "scope": "layer", "selection": "chunk"}),
    "sparseloco": ("sparseloco", {"chunk": 64, "k": 4, "aggregate": "ranks"}),
    "sparseloco-senders": ("sparseloco", {"chunk": 100, "k": 7, "aggregate": "senders",
                                          "indices": "fixed"}),
}


def _grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return {key: torch.randn(shape, generator=generator) for key, shape in SHAPES.items()}


def _bytes(meter: Meter) -> int:
    return sum(record.nbytes for record in meter.records)


def _compare(rank: int, world_size: int) -> dict[str, Any]:
    """Per case: whether the simulation equalled the real mean at every step, and the
    bytes the real rank and the simulated replicas handed over."""
    out = {}
    for label, (name, options) in CASES.items():
        real = schemes.build(name, **options)
        real.meter = Meter(rank, world_size)
        simulated = SimulatedReplicas(name, options, world_size, Meter())
        equal = []
        for step in range(STEPS):
            mean = real.reduce(_grads(rank, step))
            parts = [simulated.encode(r, _grads(r, step)) for r in range(world_size)]
            expected = simulated.mean(parts)
            equal.append(all(torch.equal(mean[key], expected[key]) for key in SHAPES))
        out[label] = {"equal": equal, "real_bytes": _bytes(real.meter),
                      "simulated_bytes": _bytes(simulated.meter)}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_compare, WORLD)


@pytest.mark.parametrize("label", list(CASES))
def test_simulated_replicas_equal_the_real_scheme(runs: list[dict[str, Any]],
                                                  label: str) -> None:
    for rank in runs:
        assert rank[label]["equal"] == [True] * STEPS
    assert runs[0][label]["simulated_bytes"] == sum(r[label]["real_bytes"] for r in runs)


def test_simulated_topk_selects_over_the_bucket_as_the_scheme_does() -> None:
    """The default scope is the bucket: one layer may get more than its ratio."""
    grads = _grads(0, 0)
    grads["fc.weight"] *= 100  # the loud layer takes the bucket's k
    simulated = SimulatedReplicas("topk", {"ratio": 0.05}, 2, Meter())
    sent = simulated.mean([simulated.encode(0, grads)])  # one replica: what it sent
    assert int((sent["fc.weight"] != 0).sum()) > round(0.05 * 24 * 30)
    assert int((sent["emb"] != 0).sum()) < round(0.05 * 60 * 8)


def test_schemes_that_need_processes_are_refused() -> None:
    for name in ("clt-k", "powersgd"):
        with pytest.raises(ValueError, match="cannot be simulated"):
            SimulatedReplicas(name, {}, 2, Meter())
