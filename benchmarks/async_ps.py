"""DC-ASGD against ASGD, SSGD and sequential SGD on a real image set (DC-ASGD §5, Fig. 2-3).

Every method trains the same small convolutional network from the same
initialisation for the same number of passes over the training set; the
parameter-server methods run a server and 4 or 8 worker processes on
loopback RPC. Reported, as medians over seeds measured side by side (the
methods of one seed run back to back):

* test error of the global model, and each method's gap to sequential SGD;
* the staleness histogram (tau = updates between a worker's pull and push);
* server updates per second of DC-ASGD relative to ASGD, in the runs (worker
  bound) and at saturation (the server alone, fed precomputed gradients);
* a worker killed mid-run (SIGKILL with a push in flight): the error and
  updates of DC-ASGD with and without it;
* figures: test error against passes (Fig. 2) and against wall time (Fig. 3).

Run from the repository root (``async`` is a Python keyword, so this file is
``async_ps.py``)::

    PYTHONPATH=src python -m benchmarks.async_ps --out results/async
    PYTHONPATH=src python benchmarks/async_ps.py --workers 8 --seeds 5

``--simulate`` adds the same comparison under a fixed cyclic delay schedule
(tau = M - 1 for every push, no processes, no timing noise).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from typing import Any

import torch
from tqdm import tqdm

from thinwire.ps import AsyncConfig, ClassifierTask, ParameterServerCore, TaskSpec, build_rule, run
from thinwire.ps.config import run_fingerprint
from thinwire.ps.server import build_server
from thinwire.ps.simulate import cyclic_schedule, run_schedule


def _methods(args: argparse.Namespace) -> dict[str, tuple[str, dict[str, Any]]]:
    """label -> (method, rule options)."""
    plain = {"lr": args.lr}
    return {
        "ssgd": ("ssgd", plain),
        "asgd": ("asgd", plain),
        "dc-asgd-square": ("dc-asgd", {**plain, "variant": "square", "lam": args.lambda_square,
                                       "adaptive": args.square_mode == "adaptive"}),
        "dc-asgd-abs": ("dc-asgd", {**plain, "variant": "abs", "lam": args.lambda_abs}),
    }


def _config(args: argparse.Namespace, method: str, rule: dict[str, Any],
            workers: int) -> AsyncConfig:
    return AsyncConfig(method=method, workers=workers, passes=args.passes, rule=rule,
                       milestones=tuple(args.milestones), snapshot_every=args.snapshot_every,
                       timeout_s=args.timeout)


def _record(label: str, workers: int, seed: int, result: Any) -> dict[str, Any]:
    summary = result.summary()
    return {"label": label, "workers": workers, "seed": seed, **{
        k: summary[k] for k in ("final", "curve", "staleness", "updates", "updates_per_second",
                                "apply_seconds", "wall_seconds", "bytes")},
        "worker_errors": {m: r["error"] for m, r in summary["workers"].items() if "error" in r}}


def run_real(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every method, worker count and seed on RPC; the methods of a seed back to back."""
    records = []
    plan = [("sequential", 1, "sequential", {"lr": args.lr}, None)]
    for workers in args.workers:
        for label, (method, rule) in _methods(args).items():
            plan.append((label, workers, method, rule, None))
        if args.kill and workers == max(args.workers):
            _, rule = _methods(args)["dc-asgd-abs"]
            plan.append(("dc-asgd-abs+kill", workers, "dc-asgd", rule, 0))
    with tqdm(total=len(plan) * len(args.seeds), desc="runs") as bar:
        for seed in args.seeds:
            spec = TaskSpec(dataset=args.dataset, model=args.model, batch_size=args.batch_size,
                            seed=seed, train_limit=args.train_limit)
            for label, workers, method, rule, victim in plan:
                config = _config(args, method, rule, workers)
                kill = None
                if victim is not None:  # dies a quarter of the way through its own pushes
                    task = ClassifierTask(spec)
                    kill = {victim: task.steps(victim, workers, args.passes) // 4}
                result = run(config, spec, kill_after=kill)
                records.append(_record(label, workers, seed, result))
                bar.set_postfix_str(f"{label} w{workers}: {result.final['test_error']:.4f}")
                bar.update(1)
    return records


def run_simulated(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same methods under a cyclic schedule: every push has tau = M - 1 exactly."""
    records = []
    for seed in tqdm(args.seeds, desc="simulated"):
        spec = TaskSpec(dataset=args.dataset, model=args.model, batch_size=args.batch_size,
                        seed=seed, train_limit=args.train_limit)
        for workers in [1, *args.workers]:
            labels = {"sequential": ("asgd", {"lr": args.lr})} if workers == 1 else {
                k: v for k, v in _methods(args).items() if k != "ssgd"}
            for label, (method, rule) in labels.items():
                task = ClassifierTask(spec)
                batches = [task.batches(s, workers, args.passes) for s in range(workers)]
                steps = min(task.steps(s, workers, args.passes) for s in range(workers))
                core = ParameterServerCore(task.initial_weights(),
                                           build_rule(method, **rule), workers)
                begin = time.perf_counter()
                run_schedule(core, cyclic_schedule(workers, steps),
                             lambda s, w, t=task, b=batches: t.gradient(w, next(b[s])))
                records.append({"label": label, "workers": workers, "seed": seed,
                                "final": task.evaluate(core.weights),
                                "staleness": core.staleness.summary(),
                                "wall_seconds": time.perf_counter() - begin})
    return records


def server_capacity(args: argparse.Namespace, pushes: int = 400,
                    repeats: int = 7) -> dict[str, Any]:
    """Updates per second the server itself can apply (decode, lock, rule), workers excluded.

    Streams pull and push precomputed gradients round-robin in this process
    (tau = M - 1), ASGD and DC-ASGD alternating, ``repeats`` times; medians.
    """
    spec = TaskSpec(dataset=args.dataset, model=args.model, batch_size=args.batch_size)
    task = ClassifierTask(spec)
    batches = task.batches(0, 1, 1)
    grads = [task.gradient(task.initial_weights(), next(batches)) for _ in range(8)]
    workers = max(args.workers)
    labels = {k: v for k, v in _methods(args).items() if k != "ssgd"}
    rates: dict[str, list[float]] = {label: [] for label in labels}
    for _ in range(repeats):
        for label, (method, rule) in labels.items():
            config = AsyncConfig(method=method, workers=workers, passes=1, rule=rule)
            server = build_server(config, task)
            for m in range(workers):
                server.join(m, run_fingerprint(config, task))
            for m in range(workers):
                server.pull(m)
            begin = time.perf_counter()
            for n in range(pushes):
                stream = n % workers
                server.push(stream, n, grads[n % len(grads)], True).wait()
                server.pull(stream)
            rates[label].append(pushes / (time.perf_counter() - begin))
    medians = {label: statistics.median(values) for label, values in rates.items()}
    return {"workers": workers, "pushes": pushes, "repeats": repeats,
            "updates_per_second": medians,
            "over_asgd": {label: rate / medians["asgd"] for label, rate in medians.items()}}


def _median(records: list[dict[str, Any]], label: str, workers: int, key: str) -> float:
    values = [r[key] if key != "error" else r["final"]["test_error"] for r in records
              if r["label"] == label and r["workers"] == workers]
    return statistics.median(values) if values else float("nan")


def summarise(records: list[dict[str, Any]], args: argparse.Namespace,
              simulated: bool = False) -> dict[str, Any]:
    """Medians per method and worker count, gaps to sequential, throughput ratios."""
    sequential = _median(records, "sequential", 1, "error")
    table: dict[str, Any] = {"sequential": {"test_error": sequential}}
    labels = sorted({r["label"] for r in records} - {"sequential"})
    for workers in args.workers:
        rows: dict[str, Any] = {}
        for label in labels:
            error = _median(records, label, workers, "error")
            if error != error:  # nan: not run for this worker count
                continue
            histogram: Counter[int] = Counter()
            for r in records:
                if r["label"] == label and r["workers"] == workers:
                    histogram.update({int(k): v for k, v in r["staleness"]["histogram"].items()})
            rows[label] = {"test_error": error, "gap": error - sequential,
                           "staleness_histogram": dict(sorted(histogram.items()))}
            if not simulated:
                rows[label]["updates_per_second"] = _median(records, label, workers,
                                                            "updates_per_second")
                rows[label]["updates"] = _median(records, label, workers, "updates")
                rows[label]["rule_us_per_update"] = statistics.median(
                    1e6 * r["apply_seconds"] / max(1, r["updates"]) for r in records
                    if r["label"] == label and r["workers"] == workers)
        asgd_gap = rows.get("asgd", {}).get("gap", float("nan"))
        for label in ("dc-asgd-square", "dc-asgd-abs"):
            if label in rows:
                rows[label]["gap_over_asgd_gap"] = (rows[label]["gap"] / asgd_gap
                                                    if asgd_gap > 0 else float("nan"))
                if not simulated:
                    rows[label]["updates_per_second_over_asgd"] = _paired_ratio(
                        records, label, "asgd", workers)
        table[f"workers={workers}"] = rows
    return table


def _paired_ratio(records: list[dict[str, Any]], label: str, reference: str,
                  workers: int) -> float:
    """Median over seeds of the per-seed ratio of updates per second (runs side by side)."""
    ratios = []
    for seed in {r["seed"] for r in records}:
        ours = [r for r in records
                if (r["label"], r["workers"], r["seed"]) == (label, workers, seed)]
        theirs = [r for r in records
                  if (r["label"], r["workers"], r["seed"]) == (reference, workers, seed)]
        if ours and theirs and theirs[0]["updates_per_second"] > 0:
            ratios.append(ours[0]["updates_per_second"] / theirs[0]["updates_per_second"])
    return statistics.median(ratios) if ratios else float("nan")


def plot(records: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Error against passes (Fig. 2) and against wall time (Fig. 3), one pair per worker count,
    for the first seed; and the staleness histograms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = args.seeds[0]
    written = []
    sequential = [r for r in records if r["label"] == "sequential" and r["seed"] == seed]
    for workers in args.workers:
        runs = sequential + [r for r in records
                             if r["workers"] == workers and r["seed"] == seed]
        for axis_key, axis_label, name in (("passes", "passes over the training set", "passes"),
                                           ("seconds", "wall time (s)", "time")):
            figure, axes = plt.subplots(figsize=(6, 4))
            for r in runs:
                axes.plot([p[axis_key] for p in r["curve"]],
                          [100 * p["test_error"] for p in r["curve"]], label=r["label"])
            axes.set_xlabel(axis_label)
            axes.set_ylabel("test error (%)")
            axes.set_ylim(0, min(100, 3 * 100 * max(r["final"]["test_error"] for r in runs) + 5))
            axes.set_title(f"{args.dataset}, {workers} workers (seed {seed})")
            axes.legend()
            path = os.path.join(args.out, f"error_vs_{name}_w{workers}.png")
            figure.tight_layout()
            figure.savefig(path, dpi=120)
            plt.close(figure)
            written.append(path)
        figure, axes = plt.subplots(figsize=(6, 4))
        for r in runs:
            if r["label"] in ("asgd", "dc-asgd-abs", "dc-asgd-square"):
                histogram = {int(k): v for k, v in r["staleness"]["histogram"].items()}
                taus = sorted(histogram)
                axes.plot(taus, [histogram[t] for t in taus], marker=".", label=r["label"])
        axes.set_xlabel("staleness tau (updates between pull and push)")
        axes.set_ylabel("pushes")
        axes.set_title(f"staleness, {workers} workers")
        axes.legend()
        path = os.path.join(args.out, f"staleness_w{workers}.png")
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


def _print_table(title: str, table: dict[str, Any]) -> None:
    print(f"\n{title}")
    print(f"  sequential SGD: test error {100 * table['sequential']['test_error']:.2f}%")
    for key, rows in table.items():
        if key == "sequential":
            continue
        print(f"  {key}")
        for label, row in rows.items():
            line = (f"    {label:18s} error {100 * row['test_error']:6.2f}%  "
                    f"gap {100 * row['gap']:+6.2f}")
            if "gap_over_asgd_gap" in row:
                line += f"  gap/asgd-gap {row['gap_over_asgd_gap']:.2f}"
            if "updates_per_second" in row:
                line += f"  updates/s {row['updates_per_second']:7.1f}"
            if "updates_per_second_over_asgd" in row:
                line += f" ({row['updates_per_second_over_asgd']:.2f}x asgd)"
            if "rule_us_per_update" in row:
                line += f"  rule {row['rule_us_per_update']:.0f} us/update"
            histogram = row["staleness_histogram"]
            total = sum(histogram.values())
            mean_tau = sum(t * n for t, n in histogram.items()) / total if total else 0.0
            line += f"  mean tau {mean_tau:.2f}"
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/async", help="folder for JSON and PNG files")
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.15,
                        help="learning rate of every method (sequential SGD does best near it)")
    parser.add_argument("--lambda-square", type=float, default=2.0,
                        help="lambda_2 of Option II (with --square-mode plain the paper's "
                        "CIFAR value is 0.04)")
    parser.add_argument("--square-mode", choices=["adaptive", "plain"], default="adaptive",
                        help="Option II with lambda / sqrt(MeanSquare(g)) (DC-ASGD-a) or as is")
    parser.add_argument("--lambda-abs", type=float, default=8.0,
                        help="lambda_1 of Option I (the paper's CIFAR value is 2)")
    parser.add_argument("--milestones", type=float, nargs="*", default=[],
                        help="passes at which lr drops 10x and lambda grows 10x")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="convnet")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-limit", type=int, default=None)
    parser.add_argument("--snapshot-every", type=float, default=0.5, help="passes per point")
    parser.add_argument("--timeout", type=float, default=1800.0, help="deadline per run (s)")
    parser.add_argument("--no-kill", dest="kill", action="store_false",
                        help="skip the killed-worker run")
    parser.add_argument("--simulate", action="store_true",
                        help="also run the cyclic-delay simulation (no processes)")
    args = parser.parse_args()
    try:
        ClassifierTask(TaskSpec(dataset=args.dataset, model=args.model))
    except FileNotFoundError as error:
        print(f"skipping: {error}")
        return
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    begin = time.time()
    capacity = server_capacity(args)
    print("server capacity (updates/s, in-process, no workers): " + ", ".join(
        f"{label} {rate:.0f} ({capacity['over_asgd'][label]:.2f}x asgd)"
        for label, rate in capacity["updates_per_second"].items()))
    records = run_real(args)
    results: dict[str, Any] = {"arguments": vars(args), "runs": records,
                               "summary": summarise(records, args),
                               "server_capacity": capacity}
    _print_table(f"{args.dataset}, {args.passes} passes, medians over seeds {args.seeds}",
                 results["summary"])
    kill = [r for r in records if r["label"] == "dc-asgd-abs+kill"]
    if kill:
        whole = [r for r in records
                 if r["label"] == "dc-asgd-abs" and r["workers"] == kill[0]["workers"]]
        results["kill"] = {
            "workers": kill[0]["workers"],
            "test_error_killed": statistics.median(r["final"]["test_error"] for r in kill),
            "test_error_whole": statistics.median(r["final"]["test_error"] for r in whole),
            "updates_killed": statistics.median(r["updates"] for r in kill),
            "updates_whole": statistics.median(r["updates"] for r in whole),
            "errors": [r["worker_errors"] for r in kill]}
        k = results["kill"]
        print(f"\n  worker 0 of {k['workers']} killed a quarter into its pushes: error "
              f"{100 * k['test_error_killed']:.2f}% "
              f"(whole run {100 * k['test_error_whole']:.2f}%), "
              f"updates {k['updates_killed']:.0f} of {k['updates_whole']:.0f}")
    if args.simulate:
        simulated = run_simulated(args)
        results["simulated"] = {"runs": simulated, "summary": summarise(simulated, args, True)}
        _print_table("cyclic delay schedule (tau = M - 1), medians over seeds",
                     results["simulated"]["summary"])
    results["figures"] = plot(records, args)
    results["seconds"] = time.time() - begin
    with open(os.path.join(args.out, "async.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"\nwrote {args.out}/async.json and {len(results['figures'])} figures "
          f"in {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
