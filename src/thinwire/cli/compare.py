"""Train the same model under several schemes side by side and compare them.

Spawns N local ranks (gloo), trains the MLP with the same seed and data
shards under each scheme on scikit-learn's digits, prints a table and writes
``runs/<timestamp>/`` with results.json, results.md and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from thinwire.jobs.compare import compare, markdown_table, parse_bandwidth, plot
from thinwire.jobs.dataparallel import RunOptions
from thinwire.jobs.workloads import OPTIMIZERS, RECIPES, WORKLOADS
from thinwire.launch import add_timeout

# What `thinwire compare` runs when --schemes is not given (every name in --schemes works).
DEFAULT_SCHEMES = ("dense", "fp16", "topk", "dct-dp", "powersgd", "clt-k")
# Fields the summary table and --json carry, in order.
TABLE = ("scheme", "test_accuracy", "final_loss", "bytes_sent_per_step", "compression_ratio",
         "overhead_ms_per_step", "wall_s", "modelled_s", "steps_to_target")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                        help="comma-separated scheme names, from `thinwire schemes` "
                             f"(default: {','.join(DEFAULT_SCHEMES)})")
    parser.add_argument("--workers", type=int, default=4, help="local ranks (default 4)")
    parser.add_argument("--workload", default=RunOptions.workload, choices=sorted(WORKLOADS),
                        help=f"model and data set (default {RunOptions.workload})")
    parser.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                        help="the user's optimiser (default: the workload's recipe)")
    parser.add_argument("--momentum", type=float, default=None,
                        help="SGD momentum, or AdamW's beta1 (default: the workload's recipe)")
    parser.add_argument("--no-couple", dest="couple", action="store_false",
                        help="leave the momentum in the optimiser (see thinwire.optim.couple)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimiser steps per scheme (default: the workload's recipe)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per worker per step (default: the workload's recipe)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: the workload's recipe)")
    parser.add_argument("--hidden", type=int, default=RunOptions.hidden)
    parser.add_argument("--seed", type=int, default=RunOptions.seed)
    parser.add_argument("--sparsity", type=float, default=0.99,
                        help="fraction dropped by sparsifiers (ratio = 1 - sparsity)")
    parser.add_argument("--life-span", type=int, default=100,
                        help="DCT threshold life-span L in steps")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="set KEY on every scheme that has it, e.g. --option rank=2")
    parser.add_argument("--bandwidth", default="100mbit",
                        help="link rate for the modelled time (compute + bytes / rate)")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default runs/<time>)")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    add_timeout(parser)


def run_options(args: argparse.Namespace) -> RunOptions:
    """RunOptions from the command line; unset recipe options come from the workload."""
    recipe = RECIPES[args.workload]
    chosen = {key: getattr(args, key) for key in ("optimizer", "momentum", "lr", "steps",
                                                  "batch_size")}
    resolved = {key: recipe[key] if value is None else value for key, value in chosen.items()}
    return RunOptions(hidden=args.hidden, seed=args.seed, workload=args.workload,
                      couple=args.couple, **resolved)


def run(args: argparse.Namespace) -> int:
    names = [name.strip() for name in args.schemes.split(",") if name.strip()]
    options = run_options(args)
    bandwidth_bps = parse_bandwidth(args.bandwidth)
    results = compare(names, args.workers, options, bandwidth_bps, args.sparsity,
                      args.life_span, args.option, args.timeout)
    out = args.out or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results, args.bandwidth)
    print(table)
    summary = {"runs": [{key: r[key] for key in TABLE} for r in results]}
    (out / "results.json").write_text(json.dumps({"runs": results, "options": vars(args)},
                                                 indent=2, default=str))
    (out / "results.md").write_text(
        f"# thinwire compare\n\n{options.workload}, {options.optimizer} (lr {options.lr}, "
        f"momentum {options.momentum}, coupled {options.couple}), target test accuracy "
        f"{results[0]['target']}; {args.workers} workers, {options.steps} steps, "
        f"sparsity {args.sparsity}, life-span {args.life_span}.\n\n{table}\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    figures = plot(results, out)
    print(f"wrote {out}/results.json, results.md, " + ", ".join(f.name for f in figures))
    diverged = [r["scheme"] for r in results if not r["replicas_identical"]]
    broken = [r["scheme"] for r in results if not math.isfinite(r["test_accuracy"])]
    if diverged:  # the ranks no longer train one model: the run's numbers mean nothing
        print(f"thinwire compare: error: replicas diverged under {', '.join(diverged)}: the "
              "ranks' final weights differ", file=sys.stderr)
    if broken:
        print(f"thinwire compare: error: non-finite test accuracy under {', '.join(broken)}",
              file=sys.stderr)
    return 1 if diverged or broken else 0
