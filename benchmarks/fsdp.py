"""Time to target with FSDP2 inside sites and each scheme across them, modelled.

2 sites x 2 shards on one workload (``text-lm`` where the workloads define it, else
``transformer-digits``): every scheme sends the gradient shards across sites
through ``thinwire.fsdp``; ``native-hsdp`` (torch's own HSDP, uncompressed) is the
anchor. Each run stops at its first evaluation that reaches the workload's target.
Beside them: the **lone worker** (one worker, the same recipe, no communication)
and the **compute-only bound** (native HSDP's steps at free communication).

Time to target at a cross-site rate B = steps x (compute + codec overhead + the
larger ring direction across sites / B), with one compute probe for every row;
the intra-site reduce-scatter and all-gather are taken as free (a fast link).
Results go to ``docs/data/fsdp-time-to-target.json``.

    python -m benchmarks.fsdp                 # the workload's recipe
    python -m benchmarks.fsdp --steps 100     # a shorter budget
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from thinwire import schemes
from thinwire.jobs.compare import compare
from thinwire.jobs.dataparallel import RunOptions
from thinwire.jobs.sharded import NATIVE
from thinwire.jobs.workloads import RECIPES, WORKLOADS

SCHEMES = (NATIVE, "dense", "fp16", "powersgd", "topk", "dct-dp", "clt-k")
SITES, WORKERS = 2, 4
RATES = {"10mbit": 10e6, "100mbit": 100e6}
# Every sparsifier at 99 % of every tensor (small tensors keep at least one entry).
SPARSE = ["min_numel=0", "capacity=1.0"]
DATA = Path("docs/data/fsdp-time-to-target.json")


def modelled(steps: int | None, per_step_s: float, wire_bytes: float, rate: float) -> float | None:
    """Seconds to the target: ``steps`` x (compute + overhead + wire / rate)."""
    return None if steps is None else steps * (per_step_s + 8.0 * wire_bytes / rate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="text-lm" if "text-lm" in WORKLOADS
                        else "transformer-digits", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=None, help="budget (default: recipe)")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args(argv)
    recipe = RECIPES[args.workload]
    options = RunOptions(**{**{k: recipe[k] for k in ("optimizer", "momentum", "lr",
                                                      "batch_size", "steps")},
                            **({"steps": args.steps} if args.steps else {})},
                         workload=args.workload, until_target=True)
    names = [name for name in args.schemes.split(",") if name]
    keys = {field.name for name in names if name != NATIVE
            for field in dataclasses.fields(schemes.config_class(name))}
    sparse = [option for option in SPARSE if option.split("=")[0] in keys]  # compare refuses
    # an option no scheme of the run has
    load = os.getloadavg()
    start = time.time()
    lone = compare(["dense"], 1, options, 100e6)[0]
    sharded = compare(names, WORKERS, options, 100e6, ratio=0.01, life_span=1000,
                      extra=sparse, sites=SITES)
    compute_s = sharded[0]["compute_ms_per_step"] / 1000.0
    rows = []
    for result in sharded:
        wire = max(result["wire_sent_per_step"], result["bytes_received_per_step"])
        per_step = compute_s + result["overhead_ms_per_step"] / 1000.0
        rows.append({"row": result["scheme"], "steps_to_target": result["steps_to_target"],
                     "test_score": result["test_score"],
                     "handed_bytes_per_step": result["bytes_sent_per_step"],
                     "cross_site_wire_bytes_per_step": wire,
                     "shard_bytes_per_step": result["dense_bytes_per_step"],
                     "overhead_ms_per_step": result["overhead_ms_per_step"],
                     "coupled": result["coupled"],
                     "replicas_identical": result["replicas_identical"],
                     "time_to_target_s": {label: modelled(result["steps_to_target"], per_step,
                                                          wire, rate)
                                          for label, rate in RATES.items()}})
    native = next((r for r in rows if r["row"] == NATIVE), None)
    bound = None if native is None else native["steps_to_target"]
    rows.append({"row": "compute-only bound", "steps_to_target": bound,
                 "time_to_target_s": {label: modelled(bound, compute_s, 0.0, 1.0)
                                      for label in RATES}})
    rows.append({"row": "lone worker", "steps_to_target": lone["steps_to_target"],
                 "test_score": lone["test_score"],
                 "time_to_target_s": {label: modelled(lone["steps_to_target"], compute_s, 0.0,
                                                      1.0) for label in RATES}})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    record = {"meta": {"workload": args.workload, "target": sharded[0]["target"],
                       "metric": sharded[0]["metric"],
                       "sites": SITES, "shards_per_site": WORKERS // SITES,
                       "options": {k: getattr(options, k) for k in (
                           "optimizer", "lr", "momentum", "batch_size", "steps", "eval_every")},
                       "sparse_options": ["ratio=0.01", *sparse],
                       "compute_ms_per_step": 1000.0 * compute_s,
                       "lone_compute_ms_per_step": lone["compute_ms_per_step"],
                       "load_before": load, "load_after": os.getloadavg(),
                       "wall_s": time.time() - start, "commit": commit,
                       "torch": torch.__version__, "machine": platform.processor() or
                       platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                 time.gmtime())},
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    for row in rows:
        times = ", ".join(f"{label} {t:.1f} s" if t is not None else f"{label} -"
                          for label, t in row["time_to_target_s"].items())
        print(f"{row['row']:>20}: steps {row['steps_to_target']}, {times}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
