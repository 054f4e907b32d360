"""Soak: resident memory of a long data-parallel run stays flat.

Trains a small MLP with DDP and each scheme's hook for many steps on local
ranks (gloo) and samples every rank's resident set size (``/proc/self/statm``)
as it goes, with the sizes of what grows per step if anything does: the
Meter's record window and a sparsifier's threshold trace. Reports, per
scheme, the growth of resident memory from step ``--from-step`` to the end
(the ticket's bound: within 2 % from step 1,000 to 10,000).

Usage: ``python -m benchmarks.soak [--schemes dense,dct-dp] [--steps 10000] [--out DIR]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, schemes
from thinwire.comm import Meter
from thinwire.launch import spawn
from thinwire.models.mlp import mlp


def resident_bytes() -> int:
    """This process's resident set size (Linux)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trace_entries(scheme: schemes.Scheme) -> int:
    """Points in the scheme's threshold trace, if its codec keeps one."""
    return sum(len(points) for points in scheme.trace.values())


def soak(rank: int, world_size: int, name: str, config: dict[str, Any], steps: int,
         every: int) -> list[dict[str, int]]:
    """Train ``steps`` steps under scheme ``name``; a sample every ``every`` steps."""
    torch.manual_seed(0)
    model = mlp(64, 64, classes=10)
    net = DistributedDataParallel(model)
    meter = Meter(rank, world_size)
    scheme = schemes.build(name, **config)
    ddp.register(net, scheme, meter=meter)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,),
                                                                   generator=generator)
    samples = []
    for step in range(1, steps + 1):
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        meter.next_step()
        if step % every == 0:
            gc.collect()
            samples.append({"step": step, "rss": resident_bytes(),
                            "meter_records": len(meter.records),
                            "trace_entries": trace_entries(scheme)})
    dist.barrier()
    return samples


def growth(samples: list[dict[str, int]], from_step: int) -> float:
    """Relative growth of resident memory from the first sample at or after ``from_step``."""
    start = next(s["rss"] for s in samples if s["step"] >= from_step)
    return (samples[-1]["rss"] - start) / start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="dense,dct-dp,topk,clt-k,powersgd")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=500, help="steps between samples")
    parser.add_argument("--from-step", type=int, default=1000,
                        help="growth is measured from this step to the end")
    parser.add_argument("--out", default="results/soak")
    args = parser.parse_args()
    if not 0 < args.every <= args.from_step <= args.steps:
        raise SystemExit("need 0 < --every <= --from-step <= --steps")
    results = {}
    for name in (n.strip() for n in args.schemes.split(",") if n.strip()):
        config = {"life_span": 100} if name == "dct-dp" else {}
        start = time.perf_counter()
        per_rank = spawn(soak, args.workers, name, config, args.steps, args.every)
        results[name] = {"config": config, "seconds": time.perf_counter() - start,
                         "growth": [growth(samples, args.from_step) for samples in per_rank],
                         "samples": per_rank}
        last = per_rank[0][-1]
        print(f"{name:10s} rss growth step {args.from_step}->{args.steps}: "
              + ", ".join(f"{100 * g:+.2f}%" for g in results[name]["growth"])
              + f"  (rank 0: {last['rss'] / 2**20:.0f} MiB, meter records "
              f"{last['meter_records']}, trace entries {last['trace_entries']})")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, time.strftime("soak-%Y%m%d-%H%M%S.json"))
    with open(path, "w") as handle:
        json.dump({"options": vars(args), "load": os.getloadavg(), "torch": torch.__version__,
                   "results": results}, handle, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
