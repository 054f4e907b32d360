"""The burst-aware Adam step against its floors: milliseconds per step, in one process.

    python -m benchmarks.aged_adam [--entries 3400000] [--density 0.01] [--repeats 15]

:class:`thinwire.optim.adam.AgedAdam` is the Adam(W) step that
:func:`thinwire.optim.couple` installs for a sparsifier's parameters. Each round
(:func:`benchmarks.overhead.interleaved`, medians over rounds) steps, on the same
gradient with ``density`` of its entries arrived:

* ``aged-adam``: the library's step, which touches the moments only where an
  entry arrived;
* ``every-entry``: the same rule written in plain torch ops over every entry,
  arrived or not (what the step did before; :func:`every_entry_step`);
* ``adamw``: torch's own AdamW step with ``betas[0] = 0``, the least an Adam step
  over every entry costs.

The default size is dlrm-large's 3.4 M parameters. The record goes to
``docs/data/aged-adam.json`` with the machine's load before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.overhead import interleaved
from thinwire.feedback import MomentumCorrection, Residual
from thinwire.optim.adam import AgedAdam

LR, BETA2, EPS, DECAY, HORIZON = 1e-3, 0.999, 1e-8, 0.01, 100


def every_entry_step(param: torch.Tensor, grad: torch.Tensor,
                     state: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """One step of the burst-aware rule over every entry (``state``: age, square, weight)."""
    age, square, weight = state
    waited = grad.eq(0).to(param.dtype)
    age.add_(1)
    credited = age.clamp(max=HORIZON)
    mean = grad / credited
    decay = credited.mul_(1 - waited).mul_(math.log(BETA2)).exp_()
    weight.mul_(decay).add_(1 - decay)
    square.mul_(decay).addcmul_(mean.mul_(mean), 1 - decay)
    age.mul_(waited)
    param.mul_(1 - LR * DECAY)
    denominator = (square / weight.clamp_min(torch.finfo(weight.dtype).tiny)).sqrt_()
    param.add_(grad / denominator.add_(EPS).add_(waited), alpha=-LR)


def rows(entries: int, density: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The three steps and, per step, the untimed hand-over of the same fresh gradient."""
    grad = torch.randn(entries) * (torch.rand(entries) < density)
    def adam_w(parameter: torch.nn.Parameter) -> torch.optim.AdamW:
        return torch.optim.AdamW([parameter], lr=LR, betas=(0.0, BETA2), eps=EPS,
                                 weight_decay=DECAY)

    aged = torch.nn.Parameter(torch.randn(entries))
    aged_optimizer = adam_w(aged)
    AgedAdam(aged_optimizer, {id(aged): "w"}, MomentumCorrection(Residual(), 0.0, LR),
             horizon=HORIZON)
    plain = torch.nn.Parameter(torch.randn(entries))
    plain_optimizer = adam_w(plain)
    reference = torch.randn(entries)
    state = (torch.zeros(entries), torch.zeros(entries), torch.zeros(entries))

    def give(parameter: torch.nn.Parameter) -> None:
        parameter.grad = grad.clone()

    steps = {"aged-adam": aged_optimizer.step, "adamw": plain_optimizer.step,
             "every-entry": lambda: every_entry_step(reference, grad, state)}
    prepare = {"aged-adam": lambda: give(aged), "adamw": lambda: give(plain)}
    return steps, prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=3_400_000)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path("docs/data/aged-adam.json"))
    args = parser.parse_args(argv)
    if args.entries < 1 or not 0 < args.density <= 1 or args.repeats < 1:
        parser.error("--entries and --repeats must be >= 1 and --density in (0, 1]")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    before = os.getloadavg()
    steps, prepare = rows(args.entries, args.density)
    seconds = interleaved(steps, args.repeats, prepare)
    spelled = sys.argv[1:] if argv is None else argv
    record = {"command": " ".join(["python -m benchmarks.aged_adam", *spelled]),
              "when": time.strftime("%Y-%m-%d %H:%M %Z"), "entries": args.entries,
              "density": args.density, "repeats": args.repeats, "threads": 1,
              "ms": {name: 1000 * s for name, s in seconds.items()},
              "ratio_vs_adamw": {name: s / seconds["adamw"] for name, s in seconds.items()},
              "load_before": before, "load_after": os.getloadavg(),
              "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    for name, ms in record["ms"].items():
        print(f"{name:12s} {ms:8.2f} ms  {record['ratio_vs_adamw'][name]:.2f}x adamw")
    print(f"wrote {args.out} (load {before[0]:.2f} before)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
