"""Scaling efficiency of dense data parallelism: steps(1) / steps(n) to each workload's target.

n workers are simulated in one process, as :mod:`benchmarks.coupling` does: each
draws its batch from its own shard with its own stream, and the optimiser steps
on the mean of their gradients -- what dense DDP computes. With a mean loss and
equal batches that mean is the gradient of the concatenated batch, so one
forward and backward over the n batches stands for the n workers. The recipe
(optimiser, lr, per-worker batch) is the workload's own and the same for every
n: a recipe tuned per n would hide how well the workload scales.

Each run records the test metric every ``--eval-every`` steps, so the steps to
any target can be read back; steps to the workload's own target and the
efficiency steps(1) / steps(n) are the median over seeds.

Usage: ``python -m benchmarks.efficiency --workload text-lm [--workers 1,2,4,8]
[--seeds 2] [--out docs/data/efficiency-text-lm.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from thinwire.data.digits import batches
from thinwire.jobs import workloads
from thinwire.jobs.dataparallel import step_seconds


def curve(workload: str, workers: int, seed: int, steps: int, eval_every: int,
          stop_at_target: bool = True) -> list[tuple[int, float]]:
    """(step, test metric) every ``eval_every`` steps of dense training on ``workers``
    simulated workers under the workload's recipe; stops once the target is reached
    (``stop_at_target``) or the metric is no longer finite."""
    work = workloads.load(workload, seed=seed)
    recipe = workloads.RECIPES[workload]
    shards = [work.train.shard(r, workers) for r in range(workers)]
    streams = [batches(s, recipe["batch_size"], seed * 1000 + r) for r, s in enumerate(shards)]
    model = work.model(seed)
    optimizer = workloads.optimizer(recipe["optimizer"], model.parameters(), recipe["lr"],
                                    recipe["momentum"])
    points: list[tuple[int, float]] = []
    for step in range(1, steps + 1):
        parts = [shards[r].rows(next(streams[r])) for r in range(workers)]
        side = {key: torch.cat([p.side[key] for p in parts]) for key in parts[0].side}
        loss = work.loss(model(torch.cat([p.inputs for p in parts]), **side),
                         torch.cat([p.targets for p in parts]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % eval_every == 0:
            model.eval()
            points.append((step, work.score(model)))
            model.train()
            if not torch.isfinite(torch.tensor(points[-1][1])) or (
                    stop_at_target and work.reached(points[-1][1])):
                break
    return points


def steps_to(points: list[tuple[int, float]], target: float, lower_is_better: bool) -> int | None:
    """The first step of ``points`` whose metric meets ``target`` (None: none does)."""
    for step, value in points:
        if (value <= target) if lower_is_better else (value >= target):
            return step
    return None


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """Median steps to the target per worker count, and steps(1) / steps(n)."""
    target, lower = record["target"], record["lower_is_better"]
    medians: dict[str, float | None] = {}
    for n, runs in record["curves"].items():
        got = [steps_to([tuple(p) for p in points], target, lower) for points in runs]
        medians[n] = (None if any(s is None for s in got)
                      else statistics.median([float(s) for s in got if s is not None]))
    lone = medians.get("1")
    return {"steps_to_target": medians,
            "efficiency": {n: (lone / s if lone and s else None) for n, s in medians.items()},
            "step_fraction": {n: (s / lone if lone and s else None)
                              for n, s in medians.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="text-lm", choices=sorted(workloads.WORKLOADS))
    parser.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None,
                        help="step budget of the lone worker (default: the recipe's); n "
                             "workers get it too")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None,
                        help="default docs/data/efficiency-WORKLOAD.json")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    steps = args.steps or workloads.RECIPES[args.workload]["steps"]
    work = workloads.load(args.workload)
    torch.set_num_threads(1)
    load_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout
    compute_s = step_seconds(work.model(0), work, work.train,
                             workloads.RECIPES[args.workload]["batch_size"], repeats=30)
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    for n in counts:
        curves[str(n)] = []
        for seed in range(args.seeds):
            start = time.perf_counter()
            curves[str(n)].append(curve(args.workload, n, seed, steps, args.eval_every))
            print(f"n={n} seed={seed}: {curves[str(n)][-1][-1]} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    record: dict[str, Any] = {
        "workload": args.workload, "recipe": workloads.RECIPES[args.workload],
        "metric": work.metric, "target": work.target, "lower_is_better": work.lower_is_better,
        "seeds": args.seeds, "eval_every": args.eval_every, "step_budget": steps,
        "compute_ms_per_step": 1000.0 * compute_s, "threads": 1,
        "curves": curves,
        "command": " ".join(["python -m benchmarks.efficiency",
                             *(sys.argv[1:] if argv is None else argv)]),
        "when": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load": load_before.split("load average:")[-1].strip()}
    record.update(summarise(record))
    out = args.out or Path(f"docs/data/efficiency-{args.workload}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record[k] for k in ("steps_to_target", "efficiency")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# The sizing: where data parallelism pays, n workers need at most this share of a
# lone worker's steps to the target, and a step's compute is long enough for the link to matter.
CRITERIA = {"4": 0.4, "8": 0.25}
MIN_COMPUTE_MS = 20.0


def verdict(record: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``record``'s workload meets :data:`CRITERIA` and :data:`MIN_COMPUTE_MS`, and
    the reasons it does not."""
    fractions = record["step_fraction"]
    reasons = [f"{n} workers need {fractions[n]:.2f}x the lone steps (at most {most}x)"
               if fractions.get(n) is not None else f"{n} workers: target not reached"
               for n, most in CRITERIA.items()
               if fractions.get(n) is None or fractions[n] > most]
    if record["compute_ms_per_step"] < MIN_COMPUTE_MS:
        reasons.append(f"a compute step takes {record['compute_ms_per_step']:.1f} ms "
                       f"(at least {MIN_COMPUTE_MS:g})")
    return not reasons, "; ".join(reasons)


def section(records: list[tuple[dict[str, Any], Path]]) -> str:
    """Markdown: steps to target and scaling efficiency per workload, with its verdict."""
    counts = sorted({n for record, _ in records for n in record["curves"]}, key=int)
    lines = ["### Scaling efficiency of dense training", "",
             "Steps to each workload's target with dense data parallelism at n workers "
             "(simulated in one process: the mean of n workers' gradients, each from its own "
             "shard; `benchmarks.efficiency`), under the workload's recipe at the same "
             "learning rate for every n; the median over seeds. *x lone*: steps(n) / "
             "steps(1); distributing pays where 4 workers need at most "
             f"{CRITERIA['4']}x and 8 workers at most {CRITERIA['8']}x the lone worker's "
             f"steps and a step's compute (one thread) takes at least {MIN_COMPUTE_MS:g} ms, "
             "so a link of 100 Mbit/s to 1 Gbit/s matters.", "",
             "| workload | target | recipe | " + " | ".join(f"steps, {n} (x lone)"
                                                          for n in counts)
             + " | compute ms | distributing pays? |",
             "|---|---|---|" + "---|" * len(counts) + "---|---|"]
    for record, _ in records:
        recipe = record["recipe"]
        cells = []
        for n in counts:
            steps = record["steps_to_target"].get(n)
            fraction = record["step_fraction"].get(n)
            cells.append("-" if n not in record["steps_to_target"] else
                         "not reached" if steps is None else
                         f"{steps:.0f} ({fraction:.2f}x)" if fraction else f"{steps:.0f}")
        good, why = verdict(record)
        lines.append(f"| {record['workload']} | {record['target']:g} {record['metric']} | "
                     f"{recipe['optimizer']} lr {recipe['lr']:g}, batch {recipe['batch_size']}"
                     f" per worker | " + " | ".join(cells)
                     + f" | {record['compute_ms_per_step']:.1f} | "
                     + ("yes" if good else f"**no**: {why}") + " |")
    measured = {record["workload"] for record, _ in records}
    missing = [name for name in sorted(workloads.WORKLOADS) if name not in measured]
    if missing:
        lines += ["", "Not measured yet: " + ", ".join(missing)
                  + " (`python -m benchmarks.efficiency --workload NAME`)."]
    lines += ["", "Sources: " + "; ".join(
        f"`{path.as_posix()}` (`{record['command']}`, {record['seeds']} seeds, evaluated "
        f"every {record['eval_every']} steps, load average {record['load']})"
        for record, path in records) + ".", ""]
    return "\n".join(lines)
