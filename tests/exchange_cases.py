"""Every scheme's exchange on fixed gradients, recorded: means, error memory, metered bytes.

``tests/fixtures/exchange.json`` holds what the schemes gave before their
exchanges were rewritten as one kernel; ``tests/test_exchange_fixtures.py``
holds the schemes to them, to the bit. ``python tests/exchange_cases.py``
writes the files anew (only when a change of results is intended and said).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from thinwire import schemes
from thinwire.comm import Meter
from thinwire.comm.collectives import ALONE
from thinwire.compress import TensorInfo

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "exchange.json"
WORLDS = (2, 3)
DICT_STEPS = 4  # rounds through launch (a dict of gradients)
FLAT_STEPS = 3  # rounds through launch_flat (two DDP-like buckets, the first not last)
SHAPES = {"emb": (60, 8), "fc.weight": (24, 30), "fc.bias": (24,), "out.weight": (3, 24),
          "big.weight": (40, 50)}
BUCKETS = (("emb", "fc.weight", "fc.bias"), ("out.weight", "big.weight"))
NAN_STEP, NAN_RANK = 2, 1  # under nonfinite="skip": this rank's gradient is NaN this round

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "dense": ("dense", {}),
    "dense-skip": ("dense", {"nonfinite": "skip"}),
    "fp16": ("fp16", {}),
    "topk": ("topk", {"ratio": 0.05}),
    "topk-layer": ("topk", {"ratio": 0.05, "scope": "layer"}),
    "topk-fp16": ("topk", {"ratio": 0.05, "values": "fp16", "min_numel": 100}),
    "topk-int32": ("topk", {"ratio": 0.05, "indices": "int32", "exclude": ("*.bias",)}),
    "topk-no-ef": ("topk", {"ratio": 0.05, "error_feedback": False}),
    "topk-skip": ("topk", {"ratio": 0.05, "nonfinite": "skip"}),
    "topk-dense": ("topk", {"ratio": 1.0}),
    "dct-dp": ("dct-dp", {"ratio": 0.05, "life_span": 2}),
    "dct-dp-bucket": ("dct-dp", {"ratio": 0.05, "life_span": 2, "scope": "bucket"}),
    "dct-dp-pieces": ("dct-dp", {"ratio": 0.05, "life_span": 3, "piece": 300,
                                 "stream": "always"}),
    "dct-dp-room": ("dct-dp", {"ratio": 0.05, "capacity": 2.0, "gain": None,
                               "values": "fp16", "drain_every": 2}),
    "laplace": ("laplace", {"ratio": 0.1, "min_numel": 200}),
    "powersgd": ("powersgd", {"rank": 2}),
    "powersgd-warm": ("powersgd", {"rank": 1, "warmup_steps": 1, "warm_start": False}),
    "powersgd-no-ef": ("powersgd", {"rank": 2, "error_feedback": False}),
    "int8": ("int8", {}),
    "int4": ("int4", {"chunk": 16}),
    "int2": ("int2", {}),
    "sign": ("sign", {"nonfinite": "skip"}),
    "topk+int2": ("topk+int2", {"ratio": 0.05}),
    "topk+int8-layer": ("topk+int8", {"ratio": 0.05, "scope": "layer", "chunk": 8}),
    "topk+sign": ("topk+sign", {"ratio": 0.1, "indices": "int32", "min_numel": 100}),
    "clt-k": ("clt-k", {"ratio": 0.05}),
    "clt-k-layer": ("clt-k", {"ratio": 0.05, "scope": "layer", "selection": "chunk",
                              "beta": 0.5, "warmup_steps": 1}),
    "clt-k-k": ("clt-k", {"k": 3, "scope": "layer", "min_numel": 30, "nonfinite": "skip"}),
    "local-topk": ("local-topk", {"ratio": 0.05, "warmup_steps": 1, "beta": 0.5}),
    "local-topk-layer": ("local-topk", {"ratio": 0.05, "scope": "layer",
                                        "selection": "chunk"}),
    "sparseloco": ("sparseloco", {"chunk": 64, "k": 4, "aggregate": "ranks"}),
    "sparseloco-senders": ("sparseloco", {"chunk": 100, "k": 7, "beta": 0.5,
                                          "aggregate": "senders", "indices": "fixed"}),
    "sparseloco-skip": ("sparseloco", {"chunk": 64, "k": 4, "aggregate": "ranks",
                                       "nonfinite": "skip"}),
}


def gradients(rank: int, step: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    grads = {key: torch.randn(shape, generator=generator, dtype=dtype)
             for key, shape in SHAPES.items()}
    grads["big.weight"][:4] *= 30.0  # a few loud rows, as a layer's gradient often has
    return grads


def _poisoned(grads: dict[str, torch.Tensor], options: Mapping[str, Any], rank: int,
              step: int) -> dict[str, torch.Tensor]:
    if options.get("nonfinite") == "skip" and (rank, step) == (NAN_RANK, NAN_STEP):
        grads["fc.weight"][3, 4] = float("nan")
    return grads


def handed_alone(scheme: schemes.Scheme, grad: torch.Tensor,
                 infos: list[TensorInfo]) -> int:
    """Bytes ``scheme`` hands torch.distributed for one bucket, ``grad`` (not modified) laid
    out as ``infos``, launched over a group of one (its collectives are no-ops)."""
    scheme.meter = Meter()
    scheme.launch_flat(grad.clone(), infos, ALONE).wait()
    return sum(record.nbytes for record in scheme.meter.records)


def _records(meter: Meter) -> dict[str, Any]:
    """The meter's records: bytes per (entity, collective) in all, and a digest of every
    (step, entity, layer, collective, bytes) record in order."""
    rows = [(r.step, r.entity, r.layer, r.collective, r.nbytes) for r in meter.records]
    totals: dict[str, int] = {}
    for _, entity, _, collective, nbytes in rows:
        totals[f"{entity} {collective}"] = totals.get(f"{entity} {collective}", 0) + nbytes
    digest = hashlib.blake2b(repr(rows).encode(), digest_size=12).hexdigest()
    return {"bytes": totals, "records": digest}


def _memory(scheme: schemes.Scheme) -> dict[str, torch.Tensor]:
    """The error memory's buffers, flat (their shapes are the memory's own business)."""
    memory = scheme.state_dict().get("memory")
    return {key: value.reshape(-1) for key, value in (memory or {}).get("buffers", {}).items()}


def run_case(rank: int, world_size: int, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank: through ``launch`` and through ``launch_flat``."""
    out: dict[str, Any] = {}
    scheme = schemes.build(name, **options)
    scheme.meter = Meter(rank, world_size)
    means = []
    for step in range(DICT_STEPS):
        grads = _poisoned(gradients(rank, step), options, rank, step)
        mean = scheme.launch(grads).wait()
        means.append({key: value.clone() for key, value in mean.items()})
        scheme.meter.next_step()
    out["dict"] = {"means": means, "memory": _memory(scheme),
                   "records": _records(scheme.meter), "skipped": scheme.skipped}
    scheme = schemes.build(name, **options)
    scheme.meter = Meter(rank, world_size)
    means = []
    for step in range(FLAT_STEPS):
        grads = _poisoned(gradients(rank, 100 + step), options, rank, step)
        buffers = [torch.cat([grads[key].reshape(-1) for key in keys]) for keys in BUCKETS]
        futures = [scheme.launch_flat(buffer, [TensorInfo.of(key, grads[key]) for key in keys],
                                      last=index == len(BUCKETS) - 1)
                   for index, (buffer, keys) in enumerate(zip(buffers, BUCKETS))]
        means.append([future.wait().clone() for future in futures])
        scheme.meter.next_step()
    out["flat"] = {"means": means, "memory": _memory(scheme),
                   "records": _records(scheme.meter), "skipped": scheme.skipped}
    return out


def run_all(rank: int, world_size: int) -> dict[str, Any]:
    return {label: run_case(rank, world_size, name, options)
            for label, (name, options) in CASES.items()}


def summary(value: Any) -> Any:
    """``value`` as JSON can hold it: each tensor as its dtype, shape and a digest of its
    bytes (equal to the bit, or not), tuples as lists, keys as strings."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1)
        digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes() if data.numel()
                                 else b"", digest_size=12).hexdigest()
        return f"{value.dtype} {tuple(value.shape)} {digest}"
    if isinstance(value, Mapping):
        return {str(key): summary(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [summary(item) for item in value]
    return value


def condensed(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' summaries with the means kept once, on rank 0.

    Raises:
        AssertionError: another rank's means differ from rank 0's (replicas must agree).
    """
    first = summary(ranks[0])
    out = [first]
    for rank in ranks[1:]:
        rest = summary(rank)
        for label, case in rest.items():
            for path, result in case.items():
                assert result.pop("means") == first[label][path]["means"], (label, path)
        out.append(rest)
    return out


def differences(expected: Any, actual: Any, where: str = "") -> list[str]:
    """Where the summary ``actual`` differs from ``expected``, entry by entry."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        if set(expected) != set(actual):
            return [f"{where}: keys {sorted(expected)} became {sorted(actual)}"]
        return [d for key in expected
                for d in differences(expected[key], actual[key], f"{where}/{key}")]
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [d for i, (e, a) in enumerate(zip(expected, actual))
                for d in differences(e, a, f"{where}[{i}]")]
    return [] if expected == actual else [f"{where}: {expected!r} became {actual!r}"]


if __name__ == "__main__":
    from thinwire.launch import spawn

    FIXTURES.mkdir(exist_ok=True)
    recorded = {str(world): condensed(spawn(run_all, world)) for world in WORLDS}
    FIXTURE.write_text(json.dumps(recorded, indent=None, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}", file=sys.stderr)
