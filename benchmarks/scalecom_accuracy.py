"""Test accuracy and bytes of dense, clt-k, local-topk and powersgd on the same steps.

ScaleCom reports CLT-k at ~100x compression within a fraction of a point of
dense training (App. E). This trains the same MLP on digits with each scheme
through the DDP hook -- same seeds, same batches, same number of steps -- and
reports the final test accuracy, the accuracy gap to dense, and the bytes per
worker and step (handed, ring-model received) with their ratio to dense.

Usage: ``python -m benchmarks.scalecom_accuracy [--workers 4] [--steps 900] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks._digits import train
from thinwire.launch import spawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=900)
    parser.add_argument("--batch-size", dest="batch", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--ratio", type=float, default=0.01, help="k / N of clt-k, local-topk")
    parser.add_argument("--warmup", type=int, default=0, help="dense steps of clt-k first")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD rank")
    parser.add_argument("--out", default="results/scalecom_accuracy")
    args = parser.parse_args()
    runs = [
        ("dense", {}),
        ("clt-k", {"ratio": args.ratio, "warmup_steps": args.warmup}),
        ("clt-k", {"ratio": args.ratio, "warmup_steps": args.warmup, "beta": 0.1}),
        ("local-topk", {"ratio": args.ratio, "warmup_steps": args.warmup}),
        ("powersgd", {"rank": args.rank}),
    ]
    per_rank = spawn(train, args.workers, runs, args.steps, args.batch, args.lr, args.momentum,
                     timeout_s=1800)
    rows = []
    for index, (name, options) in enumerate(runs):
        mine = per_rank[0][index]
        rows.append({"scheme": name, "options": options,
                     "test_accuracy": mine["test_accuracy"],
                     "bytes_sent_per_step": mine["bytes_sent_per_step"],
                     "bytes_received_per_step": mine["bytes_received_per_step"]})
    dense = rows[0]
    print(f"{args.workers} workers, {args.steps} steps, batch {args.batch}/worker, "
          f"lr {args.lr}, momentum {args.momentum}")
    print(f"{'scheme':34s} {'test acc':>8s} {'vs dense':>9s} {'handed':>9s} {'x less':>7s} "
          f"{'received':>9s} {'x less':>7s}")
    for row in rows:
        label = row["scheme"] + " " + ",".join(f"{k}={v}" for k, v in row["options"].items())
        row["accuracy_gap_points"] = 100 * (row["test_accuracy"] - dense["test_accuracy"])
        row["handed_ratio"] = dense["bytes_sent_per_step"] / row["bytes_sent_per_step"]
        row["received_ratio"] = dense["bytes_received_per_step"] / row["bytes_received_per_step"]
        print(f"{label:34s} {100 * row['test_accuracy']:7.2f}% "
              f"{row['accuracy_gap_points']:+8.2f}p {row['bytes_sent_per_step']:9.0f} "
              f"{row['handed_ratio']:6.1f}x {row['bytes_received_per_step']:9.0f} "
              f"{row['received_ratio']:6.1f}x")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scalecom_accuracy.json"), "w") as handle:
        json.dump({"config": vars(args), "runs": rows}, handle, indent=2)
    plot(rows, args)


def plot(rows: list[dict[str, object]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["scheme"]) + ("\nbeta=0.1" if r["options"].get("beta") else "")  # type: ignore[union-attr]
              for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    left.bar(labels, [100 * float(r["test_accuracy"]) for r in rows])  # type: ignore[arg-type]
    left.set_ylabel("test accuracy (%)")
    left.set_ylim(80, 100)
    right.bar(labels, [float(r["bytes_sent_per_step"]) / 1024 for r in rows])  # type: ignore[arg-type]
    right.set_yscale("log")
    right.set_ylabel("KiB handed per worker per step")
    figure.suptitle(f"MLP on digits, {args.workers} workers, {args.steps} steps")
    figure.tight_layout()
    figure.savefig(os.path.join(args.out, "scalecom_accuracy.png"), dpi=120)


if __name__ == "__main__":
    main()
