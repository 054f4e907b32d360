"""Per-worker bytes of clt-k, local-topk and dense as the number of workers grows.

ScaleCom App. F: local top-k's gain falls as workers are added because each
worker receives every other worker's indices and values (all-gather), while
CLT-k's shared indices keep the exchange an all-reduce. This runs a few DDP
steps of a small MLP on digits at each world size and reports, per worker
and step (mean over ranks):

* ``bytes_sent_per_step``: bytes handed to torch.distributed (measured);
* ``bytes_received_per_step``: ring-model inbound traffic of the collectives
  used (all-reduce 2(n-1)/n of the payload, all-gather (n-1) payloads,
  pipelined broadcast one payload into every rank but the root);
* ``result_bytes_per_step``: bytes a worker must receive to hold each
  collective's result in any topology (App. F's parameter-server model):
  the reduced payload of an all-reduce, n - 1 payloads of an all-gather.

Usage: ``python -m benchmarks.scaling [--workers 2 4 8] [--steps 8] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from tqdm import tqdm

from benchmarks._digits import train
from thinwire.launch import spawn

FIELDS = ("bytes_sent_per_step", "bytes_received_per_step", "result_bytes_per_step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=8,
                        help="a multiple of every world size, so each rank leads equally")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--out", default="results/scaling")
    args = parser.parse_args()
    runs = [("dense", {}), ("clt-k", {"ratio": args.ratio}), ("local-topk", {"ratio": args.ratio})]
    table: dict[str, dict[int, dict[str, float]]] = {name: {} for name, _ in runs}
    for n in tqdm(args.workers, desc="world sizes"):
        start = time.perf_counter()
        per_rank = spawn(train, n, runs, args.steps, 32, 0.1, 0.9, timeout_s=600)
        for index, (name, _) in enumerate(runs):
            table[name][n] = {field: float(np.mean([r[index][field] for r in per_rank]))
                              for field in FIELDS}
        tqdm.write(f"n={n}: {time.perf_counter() - start:.1f} s")
    low, high = min(args.workers), max(args.workers)
    growth = {name: {field: table[name][high][field] / table[name][low][field]
                     for field in FIELDS} for name in table}
    print(f"\nper-worker bytes per step ({args.steps} steps, ratio {args.ratio})")
    print(f"{'scheme':11s} {'n':>3s} " + " ".join(f"{f:>24s}" for f in FIELDS))
    for name, rows in table.items():
        for n, row in rows.items():
            print(f"{name:11s} {n:3d} " + " ".join(f"{row[f]:24.0f}" for f in FIELDS))
    print(f"\ngrowth from {low} to {high} workers")
    for name, ratios in growth.items():
        print(f"{name:11s}     " + " ".join(f"{ratios[f]:23.2f}x" for f in FIELDS))
    field = "result_bytes_per_step"
    print("\nclt-k / local-topk at each n (result bytes): " + ", ".join(
        f"n={n}: {table['clt-k'][n][field] / table['local-topk'][n][field]:.2f}"
        for n in args.workers))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scaling.json"), "w") as handle:
        json.dump({"steps": args.steps, "ratio": args.ratio, "workers": args.workers,
                   "per_worker": table, "growth": growth}, handle, indent=2)
    plot(table, args)


def plot(table: dict[str, dict[int, dict[str, float]]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"bytes_sent_per_step": "handed to torch.distributed",
              "bytes_received_per_step": "received (ring model)",
              "result_bytes_per_step": "received (result / server model)"}
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, field in zip(axes, FIELDS, strict=True):
        for name, rows in table.items():
            ns = sorted(rows)
            axis.plot(ns, [rows[n][field] / 1024 for n in ns], marker="o", label=name)
        axis.set_title(titles[field])
        axis.set_xlabel("workers")
        axis.set_xticks(args.workers)
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("KiB per worker per step")
    axes[0].legend()
    figure.suptitle(f"Per-worker bytes, MLP on digits, k/N = {args.ratio}")
    figure.tight_layout()
    figure.savefig(os.path.join(args.out, "scaling.png"), dpi=120)


if __name__ == "__main__":
    main()
