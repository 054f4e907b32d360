"""Local updates (DiLoCo family) against per-step compression: steps, bytes and modelled time.

For each workload, 4 workers, one seed: per-step ``dense`` and ``dct-dp``
through the DDP hook; ``diloco`` (dense pseudo-gradients) at several H; then
at the H where dense DiLoCo reaches the target soonest at 10 Mbit/s,
``diloco+int8``, ``diloco+int4``, ``diloco+topk+int2`` (SparseLoCo's top-k
+ 2-bit), ``diloco+topk`` and ``diloco+dct-dp``, and at half that H
``diloco+int4`` and ``diloco+topk+int2``. Every table carries the lone
worker (dense, one process) and the compute-only bound (dense's steps at 4
workers x a step's compute). Separately, DCT's reused threshold on
pseudo-gradients: ``diloco+dct-dp`` at H = 10 with one threshold for the
whole run (``gain=None``, as DCT's Algorithm 1) and room for 4 k entries, so
its sent count against exact top-k's k shows over- and under-sending.

Modelled time to target at a link rate B: steps x (compute + overhead) +
8 x (bytes on the wire until the target) / B, the wire bytes being the larger
ring direction (all-reduce 2(n-1)/n of a payload, all-gather (n-1) payloads),
one compute probe for every row of a workload. Exchanges block (delay 0), as
in DiLoCo. Results go to ``docs/data/local-updates-<workload>.json``.

Usage::

    python -m benchmarks.local_updates --workloads digits-mlp
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from thinwire.compress import keep_count
from thinwire.jobs import local_run
from thinwire.jobs.compare import compare
from thinwire.jobs.dataparallel import RunOptions
from thinwire.jobs.workloads import RECIPES, load

WORKERS = 4
H_VALUES = (10, 25, 50, 100)
RATES = {"10mbit": 10e6, "100mbit": 100e6}
COMPRESSED = ("diloco+int8", "diloco+int4", "diloco+topk+int2", "diloco+topk",
              "diloco+dct-dp")
RATIO = 0.01  # sparsifiers keep 1 % of every tensor (min_numel 0), in a room of exactly k
SPARSE = ("min_numel=0", "capacity=1.0")


def options_for(workload: str, steps: int, eval_every: int) -> RunOptions:
    recipe = RECIPES[workload]
    return RunOptions(workload=workload, optimizer=recipe["optimizer"],
                      momentum=recipe["momentum"], lr=recipe["lr"],
                      batch_size=recipe["batch_size"], steps=steps, eval_every=eval_every,
                      until_target=True)


def summarise(result: dict[str, Any], label: str, compute_ms: float) -> dict[str, Any]:
    """The row of one run: steps and wire bytes to target, modelled times (a step's
    compute is ``compute_ms``, one probe for the workload's every row)."""
    steps = result["steps_to_target"]
    handed = result["bytes_sent_per_step"]
    wire = max(result["wire_sent_per_step"], result["bytes_received_per_step"])
    at_target = next((b for s, b, _ in result["curve"] if s == steps), None)
    per_step = (compute_ms + result["overhead_ms_per_step"]) / 1000.0
    row: dict[str, Any] = {
        "label": label, "scheme": result["scheme"], "config": result["config"],
        "steps_to_target": steps, "steps_run": result["steps"],
        "test_accuracy": result["test_accuracy"], "target": result["target"],
        "handed_bytes_per_step": handed, "wire_bytes_per_step": wire,
        "compute_ms_per_step": compute_ms,
        "wall_s": result["wall_s"],
        "overhead_ms_per_step": result["overhead_ms_per_step"],
        "syncs": result.get("local", {}).get("syncs"),
        "replicas_identical": result.get("replicas_identical"),
        "curve": result["curve"],
    }
    for name, rate in RATES.items():
        if steps is None or at_target is None:
            row[f"modelled_s_to_target_{name}"] = None
            continue
        wire_bytes = at_target * (wire / handed if handed else 0.0)
        row[f"modelled_s_to_target_{name}"] = steps * per_step + 8.0 * wire_bytes / rate
    return row


def run(names: list[str], options: RunOptions, extra: list[str],
        workers: int = WORKERS) -> list[dict[str, Any]]:
    """``compare`` on ``names``, with the options of ``extra`` that one of them takes."""
    known = set().union(*(local_run.fields(name) for name in names))
    extra = [text for text in extra if text.split("=", 1)[0] in known]
    return compare(names, workers, options, RATES["10mbit"], ratio=RATIO, extra=extra,
                   timeout_s=600)


def density_over_syncs(result: dict[str, Any], numels: dict[str, int]) -> dict[str, Any]:
    """Entries a reused threshold sent per sync against exact top-k's k, over every layer.

    Read from the threshold trace (each layer's density per call, a call per
    sync); exact top-k sends ``keep_count(numel, RATIO)`` of each layer.
    """
    sent: dict[int, float] = {}
    for key, points in result["threshold_trace"].items():
        for call, _, density in points:
            sent[call] = sent.get(call, 0.0) + density * numels[key]
    exact = sum(keep_count(n, RATIO) for n in numels.values())
    calls = sorted(sent)
    return {"syncs": calls, "sent_over_topk": [sent[c] / exact for c in calls]}


def threshold_reuse(workload: str, options: RunOptions) -> dict[str, Any]:
    """DCT's reused threshold on pseudo-gradients: ``diloco+dct-dp`` at H = 10 for 40 syncs
    (no early stop), one selection for the run (life span 1000), with a payload room of
    4 k so over-sending shows; without the density control (``gain=None``, Algorithm 1)
    and with its default (0.05 a call, here a sync)."""
    reuse_options = dataclasses.replace(options, until_target=False,
                                        steps=min(options.steps, 40 * 10))
    numels = {name: p.numel() for name, p in load(workload, seed=0).model(0).named_parameters()}
    out: dict[str, Any] = {"setting": "diloco+dct-dp, H=10, ratio 0.01, life_span 1000 "
                                      "(one threshold for the run), capacity 4 k"}
    for gain in ("None", "0.05"):
        reuse = run(["diloco+dct-dp"], reuse_options, ["every=10", "min_numel=0",
                                                       "capacity=4.0", f"gain={gain}"])[0]
        out[f"gain {gain}"] = density_over_syncs(reuse, numels)
    return out


def measure(workload: str, steps: int, eval_every: int, h_values: tuple[int, ...] = H_VALUES,
            compressed_names: tuple[str, ...] = COMPRESSED, lone_worker: bool = True,
            extras: bool = True) -> dict[str, Any]:
    """Every row of one workload (see the module docstring).

    Args:
        h_values: the H of the dense ``diloco`` runs.
        compressed_names: the schemes run at the best H.
        lone_worker: run the lone worker's row.
        extras: run the half-H rows and the threshold-reuse measurement.
    """
    started = time.time()
    options = options_for(workload, steps, eval_every)
    rows: list[dict[str, Any]] = []
    per_step = run(["dense", "dct-dp"], options, list(SPARSE))
    dense = per_step[0]
    compute_ms = dense["compute_ms_per_step"]  # one probe for every row of the workload
    if lone_worker:
        lone = run(["dense"], options, [], workers=1)[0]
        rows.append(summarise(lone, "lone worker (dense, 1 process)", compute_ms))
    rows += [summarise(r, f"{r['scheme']} per step", compute_ms) for r in per_step]
    diloco = {h: run(["diloco"], options, [f"every={h}"])[0] for h in h_values}
    rows += [summarise(r, f"diloco H={h}", compute_ms) for h, r in diloco.items()]
    reached = {h: summarise(r, "", compute_ms)["modelled_s_to_target_10mbit"]
               for h, r in diloco.items()}
    best = min((h for h in reached if reached[h] is not None), key=lambda h: reached[h],
               default=max(h_values))
    compressed = run(list(compressed_names), options, [f"every={best}", *SPARSE])
    rows += [summarise(r, f"{r['scheme']} H={best}", compute_ms) for r in compressed]
    shorter = max(h for h in (best // 2, 10) if h > 0)
    record: dict[str, Any] = {}
    if extras and shorter < best:  # a compressed sync costs less: more of them may pay
        rows += [summarise(r, f"{r['scheme']} H={shorter}", compute_ms) for r in
                 run(["diloco+int4", "diloco+topk+int2"], options, [f"every={shorter}",
                                                                    *SPARSE])]
    if extras:
        record["dct_threshold_reuse"] = threshold_reuse(workload, options)
    bound_steps = dense["steps_to_target"]
    return {
        "workload": workload, "workers": WORKERS, "seed": 0, "best_dense_h": best,
        "steps_budget": steps, "eval_every": eval_every, "compute_ms_per_step": compute_ms,
        "metric": dense["metric"], "target": dense["target"],
        "compute_only_bound_s": (None if bound_steps is None
                                 else bound_steps * compute_ms / 1000.0),
        "rows": rows, **record,
        "seconds": time.time() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="digits-mlp",
                        help="comma-separated workload names")
    parser.add_argument("--steps", type=int, default=None,
                        help="step budget (default: 1.5 x the workload's recipe)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--h-values", default=",".join(map(str, H_VALUES)),
                        help="comma-separated H of the dense diloco runs")
    parser.add_argument("--compressed", default=",".join(COMPRESSED),
                        help="comma-separated schemes run at the best H")
    parser.add_argument("--no-lone", dest="lone", action="store_false",
                        help="skip the lone worker's row")
    parser.add_argument("--reuse-only", action="store_true",
                        help="only the threshold-reuse measurement")
    parser.add_argument("--no-extras", dest="extras", action="store_false",
                        help="skip the half-H rows and the threshold-reuse measurement")
    parser.add_argument("--out", type=Path, default=Path("docs/data"))
    args = parser.parse_args()
    for workload in args.workloads.split(","):
        steps = args.steps or 3 * RECIPES[workload]["steps"] // 2
        if args.reuse_only:
            reuse = threshold_reuse(workload, options_for(workload, steps, args.eval_every))
            path = args.out / f"local-updates-reuse-{workload}.json"
            path.write_text(json.dumps({"workload": workload, **reuse}, indent=1))
            print(f"wrote {path}")
            continue
        record = measure(workload, steps, args.eval_every,
                         tuple(int(h) for h in args.h_values.split(",")),
                         tuple(args.compressed.split(",")), args.lone, args.extras)
        record["machine"] = {"load_average": os.getloadavg(), "cpus": os.cpu_count(),
                             "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                      capture_output=True,
                                                      text=True).stdout.strip()}
        path = args.out / f"local-updates-{workload}.json"
        path.write_text(json.dumps(record, indent=1, default=str))
        print(f"wrote {path}")
        for row in record["rows"]:
            print(f"{row['label']:40s} steps {row['steps_to_target']!s:>6} "
                  f"10mbit {row['modelled_s_to_target_10mbit']!s:>22} "
                  f"100mbit {row['modelled_s_to_target_100mbit']!s:>22}")


if __name__ == "__main__":
    main()
