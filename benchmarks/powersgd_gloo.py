"""PowerSGD through DDP on gloo with several buckets: torch 2.13's hooks versus thinwire's.

torch's ``powerSGD_hook`` waits on its second all-reduce inside a future
callback; with more than one DDP bucket on gloo that blocks the thread the
next bucket needs, and training hangs. ``batched_powerSGD_hook`` fails an
assertion in its orthogonalisation on the same set-up. thinwire's
``powersgd`` performs round 1 in the calling thread and returns a future for
round 2 only. Each variant runs in fresh gloo processes under a deadline, so
a hang is reported as such and killed.

Usage: ``python -m benchmarks.powersgd_gloo [--deadline 30] [--steps 5] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.launch import spawn


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 10))


def run(rank: int, world_size: int, variant: str, steps: int) -> dict[str, Any]:
    model = _model()
    # Several buckets every step (torch 2.13 merges a small model back into one bucket
    # after the first step unless it searches for unused parameters).
    wrapped = DistributedDataParallel(model, bucket_cap_mb=0.001, find_unused_parameters=True)
    if variant == "thinwire":
        ddp.register(wrapped, schemes.build("powersgd", rank=1, warmup_steps=2))
    else:
        state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                             start_powerSGD_iter=2)
        hook = (torch_powersgd.batched_powerSGD_hook if variant == "torch-batched"
                else torch_powersgd.powerSGD_hook)
        wrapped.register_comm_hook(state, hook)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        inputs = torch.randn(16, 64, generator=generator)
        wrapped(inputs).square().mean().backward()
    return {"steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="results/powersgd_gloo")
    args = parser.parse_args()
    results = {}
    for variant in ("thinwire", "torch", "torch-batched"):
        start = time.perf_counter()
        try:
            spawn(run, 2, variant, args.steps, timeout_s=args.deadline, deadline_s=args.deadline)
            outcome = "completed"
        except TimeoutError:
            outcome = f"hung (killed after {args.deadline:.0f} s)"
        except Exception as error:  # a rank raised: report its last line
            lines = [line for line in str(error).strip().splitlines() if line.strip()]
            outcome = f"failed: {lines[-1] if lines else type(error).__name__}"
        seconds = time.perf_counter() - start
        results[variant] = {"outcome": outcome, "seconds": seconds}
        print(f"{variant:14s} {outcome}  ({seconds:.1f} s)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "powersgd_gloo.json"), "w") as handle:
        json.dump({"steps": args.steps, "deadline_s": args.deadline, "world_size": 2,
                   "backend": "gloo", "torch": torch.__version__, "results": results},
                  handle, indent=2)


if __name__ == "__main__":
    main()
