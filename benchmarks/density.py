"""dct-dp's threshold refreshes and achieved density per layer on the shaped-link MLP.

One process trains the MLP 64-2048-2048-10 on digits (batch 32, SGD lr 0.05,
momentum 0.9 coupled into the scheme as the quick start does) through
``scheme.reduce`` and reports, per dct-dp configuration, the share of
tensor-steps that re-selected tau and each layer's achieved density over its
target. Pass dct-dp options as ``KEY=VALUE``; each ``--config`` is one run.

Usage::

    python -m benchmarks.density --steps 300 --config gain=0.05 \\
        --config gain=None,refresh_above=2.0,capacity=1.25
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
from typing import Any

import torch

from benchmarks._digits import digits
from thinwire import optim, schemes
from thinwire.compress import keep_count

SIZES = (64, 2048, 2048, 10)


def run(steps: int, config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Train ``steps`` steps under dct-dp with ``config``; refreshes and densities."""
    x, y, x_test, y_test = digits()
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(),
                              torch.nn.Linear(SIZES[1], SIZES[2]), torch.nn.ReLU(),
                              torch.nn.Linear(SIZES[2], SIZES[3]))
    scheme = schemes.build("dct-dp", **{"ratio": 0.01, **config})
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    optim.couple(optimizer, scheme)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = torch.randint(len(y), (32,), generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[pick]), y[pick])
        loss.backward()  # type: ignore[no-untyped-call]
        reduced = scheme.reduce({name: p.grad for name, p in net.named_parameters()
                                 if p.grad is not None})
        for name, p in net.named_parameters():
            assert p.grad is not None
            p.grad.copy_(reduced[name])
        optimizer.step()
    refreshes = scheme.diagnostics()["threshold_refreshes"]
    density = scheme.traits.density
    assert density is not None
    numel = {name: p.numel() for name, p in net.named_parameters()}
    with torch.no_grad():
        accuracy = float((net(x_test).argmax(dim=1) == y_test).float().mean())
    return {"config": config, "steps": steps,
            "refresh_share": sum(refreshes.values()) / (steps * len(refreshes)),
            "density_vs_target": {
                key: statistics.fmean(d for _, _, d in trace)
                / (keep_count(numel[key], density) / numel[key])
                for key, trace in scheme.trace.items()},
            "test_accuracy": accuracy}


def parse(text: str) -> dict[str, Any]:
    """``"gain=0.05,capacity=1.0,values=fp16"`` -> ``{"gain": 0.05, "capacity": 1.0, ...}``."""
    out: dict[str, Any] = {}
    for key, _, value in (item.partition("=") for item in text.split(",") if item):
        try:
            out[key.strip()] = ast.literal_eval(value)  # numbers, None, True/False
        except (ValueError, SyntaxError):
            out[key.strip()] = value  # a bare word: a string option
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--config", action="append", default=None,
                        help="dct-dp options KEY=VALUE,...; repeat for several runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for text in args.config or [""]:
        print(json.dumps(run(args.steps, parse(text))), flush=True)


if __name__ == "__main__":
    main()
