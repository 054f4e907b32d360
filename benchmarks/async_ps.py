"""DC-ASGD against ASGD, SSGD and sequential SGD on a real image set (DC-ASGD §5, Fig. 2-3).

Protocol (every choice is made without the test set):

1. **Validation split.** The last ``--validation`` training images (287 of
   digits' 1437, a fifth) are held out (``TaskSpec.holdout``); every run of
   the search trains on the rest and is scored on them.
2. **Search.** The learning rate of sequential SGD and of ASGD at M workers
   come from ``--lr-grid``. The *paper regime* is ASGD's best learning rate
   (the paper trains every method at one rate where ASGD is stable too); the
   *harsh regime* is ``--harsh-lr`` (0.15), where plain ASGD is unstable.
   In each regime λ₁ (Option I) and λ₂ (Option II) are chosen from grids
   that contain the paper's values (2 and 0.04). ``--search-runner
   simulated`` scores the search under the cyclic delay schedule in this
   process (tau = M - 1, quick); ``rpc`` with real worker processes.
3. **Report.** Each method is then trained on the whole training set and
   the test set is read once per run: sequential SGD, SSGD, ASGD, and
   DC-ASGD with the paper's λ and with the chosen λ, in both regimes, for M
   = 4 and 8, medians over seeds (the methods of one seed back to back).

Also reported: the staleness histogram, server updates per second of
DC-ASGD relative to ASGD (in the runs, and at saturation: the server alone
fed precomputed gradients), a worker killed mid-run, and test error against
passes (Fig. 2) and against wall time (Fig. 3).

Run from the repository root (``async`` is a Python keyword, so this file is
``async_ps.py``)::

    PYTHONPATH=src python -m benchmarks.async_ps --out results/async
    PYTHONPATH=src python -m benchmarks.async_ps --quick --out results/async-quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from thinwire.jobs.ps_task import ClassifierTask, TaskSpec
from thinwire.ps import AsyncConfig, ParameterServerCore, build_rule, run
from thinwire.ps.config import METHODS, run_fingerprint
from thinwire.ps.rules import PAPER_LAMBDA
from thinwire.ps.server import build_server
from thinwire.ps.simulate import cyclic_schedule, run_schedule

REGIMES = ("paper", "harsh")
Runner = Callable[[AsyncConfig, TaskSpec], dict[str, float]]  # -> the run's final evaluation


def _spec(args: argparse.Namespace, seed: int, holdout: int = 0) -> TaskSpec:
    return TaskSpec(dataset=args.dataset, model=args.model, batch_size=args.batch_size,
                    seed=seed, train_limit=args.train_limit, holdout=holdout)


def _config(args: argparse.Namespace, method: str, rule: dict[str, Any],
            workers: int) -> AsyncConfig:
    return AsyncConfig(method=method, workers=workers, passes=args.passes, rule=rule,
                       milestones=tuple(args.milestones), snapshot_every=args.snapshot_every,
                       timeout_s=args.timeout)


def rpc_runner(config: AsyncConfig, spec: TaskSpec) -> dict[str, float]:
    """A real run: server and worker processes on loopback RPC."""
    return run(config, spec).final


def simulated_runner(config: AsyncConfig, spec: TaskSpec) -> dict[str, float]:
    """The same rule under the cyclic schedule (tau = M - 1 for every push), in this process."""
    task = ClassifierTask(spec)
    streams = config.streams
    batches = [task.batches(s, streams, config.passes) for s in range(streams)]
    steps = min(task.steps(s, streams, config.passes) for s in range(streams))
    per_pass = steps / config.passes * streams
    core = ParameterServerCore(task.initial_weights(),
                               build_rule(config.rule_name, **config.rule_options(per_pass)),
                               streams)
    run_schedule(core, cyclic_schedule(streams, steps),
                 lambda s, w: task.gradient(w, next(batches[s])))
    return task.evaluate(core.weights)


RUNNERS: dict[str, Runner] = {"rpc": rpc_runner, "simulated": simulated_runner}


def search(args: argparse.Namespace, runner: Runner) -> dict[str, Any]:
    """Learning rates and lambdas chosen on the validation split only (never the test set).

    Returns:
        ``sequential_lr``; per worker count: ``lr`` of each regime and the
        chosen ``lambda`` per (regime, variant), with every score seen.
    """
    def score(method: str, rule: dict[str, Any], workers: int) -> float:
        errors = [runner(_config(args, method, rule, workers),
                         _spec(args, seed, args.validation))["validation_error"]
                  for seed in args.search_seeds]
        return statistics.median(errors)

    def best(scores: dict[float, float]) -> float:
        return min(scores, key=lambda value: (scores[value], value))  # ties: the smaller value

    sequential = {lr: score("sequential", {"lr": lr}, 1) for lr in args.lr_grid}
    out: dict[str, Any] = {"sequential_lr": best(sequential), "sequential": sequential}
    grids = {"abs": args.lambda_abs_grid, "square": args.lambda_square_grid}
    for workers in args.workers:
        asgd = {lr: score("asgd", {"lr": lr}, workers) for lr in args.lr_grid}
        lrs = {"paper": best(asgd), "harsh": args.harsh_lr}
        lambdas: dict[str, dict[str, Any]] = {}
        for regime, lr in lrs.items():
            for variant, grid in grids.items():
                scores = {lam: score("dc-asgd", {"lr": lr, "variant": variant, "lam": lam},
                                     workers) for lam in grid}
                lambdas[f"{regime}/{variant}"] = {"chosen": best(scores), "scores": scores}
        out[f"workers={workers}"] = {"asgd": asgd, "lr": lrs, "lambda": lambdas}
    return out


def _methods(lr: float, lambdas: dict[str, float]) -> dict[str, tuple[str, dict[str, Any]]]:
    """label -> (method, rule options) at one learning rate; DC-ASGD at each given lambda."""
    plain = {"lr": lr}
    methods: dict[str, tuple[str, dict[str, Any]]] = {"ssgd": ("ssgd", plain),
                                                      "asgd": ("asgd", plain)}
    for variant, lam in lambdas.items():
        for which, value in (("paper", PAPER_LAMBDA[variant]), ("chosen", lam)):
            label = f"dc-asgd-{variant} {which} λ={value:g}"
            if which == "chosen" and value == PAPER_LAMBDA[variant]:
                continue  # the search chose the paper's value: one run is enough
            methods[label] = ("dc-asgd", {**plain, "variant": variant, "lam": value})
    return methods


def plan(args: argparse.Namespace, chosen: dict[str, Any]
         ) -> list[tuple[str, str, int, str, dict[str, Any]]]:
    """(regime, label, workers, method, rule) of every reported run."""
    runs = [("-", "sequential", 1, "sequential", {"lr": chosen["sequential_lr"]})]
    for workers in args.workers:
        choice = chosen[f"workers={workers}"]
        for regime in REGIMES:
            lambdas = {v: choice["lambda"][f"{regime}/{v}"]["chosen"] for v in ("abs", "square")}
            for label, (method, rule) in _methods(choice["lr"][regime], lambdas).items():
                runs.append((regime, label, workers, method, rule))
    return runs


def _record(regime: str, label: str, workers: int, seed: int, rule: dict[str, Any],
            result: Any) -> dict[str, Any]:
    summary = result.summary()
    return {"regime": regime, "label": label, "workers": workers, "seed": seed, "rule": rule, **{
        k: summary[k] for k in ("final", "curve", "staleness", "updates", "updates_per_second",
                                "apply_seconds", "wall_seconds", "bytes")},
        "worker_errors": {m: r["error"] for m, r in summary["workers"].items() if "error" in r}}


def run_real(args: argparse.Namespace, chosen: dict[str, Any]) -> list[dict[str, Any]]:
    """Every reported run on RPC, trained on the whole training set, read on the test set."""
    records = []
    runs = plan(args, chosen)
    if args.kill:
        workers = max(args.workers)
        regime, label, _, method, rule = next(r for r in runs if r[0] == "paper" and r[2] ==
                                              workers and r[1].startswith("dc-asgd-abs paper"))
        runs.append((regime, label + "+kill", workers, method, rule))
    with tqdm(total=len(runs) * len(args.seeds), desc="runs") as bar:
        for seed in args.seeds:
            spec = _spec(args, seed)
            for regime, label, workers, method, rule in runs:
                config = _config(args, method, rule, workers)
                kill = None
                if label.endswith("+kill"):  # worker 0 dies a quarter into its own pushes
                    kill = {0: ClassifierTask(spec).steps(0, workers, args.passes) // 4}
                result = run(config, spec, kill_after=kill)
                records.append(_record(regime, label, workers, seed, rule, result))
                bar.set_postfix_str(f"{regime} {label} w{workers}: "
                                    f"{result.final['test_error']:.4f}")
                bar.update(1)
    return records


def server_capacity(args: argparse.Namespace, pushes: int = 400,
                    repeats: int = 7) -> dict[str, Any]:
    """Updates per second the server itself can apply (decode, lock, rule), workers excluded.

    Streams pull and push precomputed gradients round-robin in this process
    (tau = M - 1), ASGD and DC-ASGD (paper's lambdas) alternating, ``repeats``
    times; medians.
    """
    task = ClassifierTask(_spec(args, 0))
    batches = task.batches(0, 1, 1)
    grads = [task.gradient(task.initial_weights(), next(batches)) for _ in range(8)]
    workers = max(args.workers)
    labels = {"asgd": ("asgd", {"lr": 0.1}),
              **{f"dc-asgd-{v}": ("dc-asgd", {"lr": 0.1, "variant": v}) for v in PAPER_LAMBDA}}
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


def _select(records: list[dict[str, Any]], regime: str, label: str,
            workers: int) -> list[dict[str, Any]]:
    return [r for r in records if (r["regime"], r["label"], r["workers"]) ==
            (regime, label, workers)]


def summarise(records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Median test error per regime, worker count and method; gaps to sequential SGD and
    DC-ASGD's gap over ASGD's gap; staleness and throughput."""
    sequential = statistics.median(r["final"]["test_error"] for r in records
                                   if r["label"] == "sequential")
    table: dict[str, Any] = {"sequential": {"test_error": sequential}}
    for regime in REGIMES:
        for workers in args.workers:
            rows: dict[str, Any] = {}
            labels = sorted({r["label"] for r in records
                             if (r["regime"], r["workers"]) == (regime, workers)})
            for label in labels:
                runs = _select(records, regime, label, workers)
                error = statistics.median(r["final"]["test_error"] for r in runs)
                histogram: Counter[int] = Counter()
                for r in runs:
                    histogram.update({int(k): v for k, v in r["staleness"]["histogram"].items()})
                rows[label] = {"lr": runs[0]["rule"]["lr"], "lam": runs[0]["rule"].get("lam"),
                               "test_error": error, "gap": error - sequential,
                               "staleness_histogram": dict(sorted(histogram.items())),
                               "updates_per_second": statistics.median(
                                   r["updates_per_second"] for r in runs),
                               "updates": statistics.median(r["updates"] for r in runs)}
            asgd_gap = rows.get("asgd", {}).get("gap", float("nan"))
            for label, row in rows.items():
                if label.startswith("dc-asgd"):
                    row["gap_over_asgd_gap"] = (row["gap"] / asgd_gap if asgd_gap > 0
                                                else float("nan"))
                    row["updates_per_second_over_asgd"] = _paired_ratio(
                        records, regime, label, "asgd", workers)
            table[f"{regime}/workers={workers}"] = rows
    return table


def _paired_ratio(records: list[dict[str, Any]], regime: str, label: str, reference: str,
                  workers: int) -> float:
    """Median over seeds of the per-seed ratio of updates per second (runs side by side)."""
    ratios = []
    for seed in {r["seed"] for r in records}:
        ours = [r for r in _select(records, regime, label, workers) if r["seed"] == seed]
        theirs = [r for r in _select(records, regime, reference, workers) if r["seed"] == seed]
        if ours and theirs and theirs[0]["updates_per_second"] > 0:
            ratios.append(ours[0]["updates_per_second"] / theirs[0]["updates_per_second"])
    return statistics.median(ratios) if ratios else float("nan")


def plot(records: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Test error against passes (Fig. 2) and against wall time (Fig. 3), per regime and
    worker count, for the first seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = args.seeds[0]
    written = []
    sequential = [r for r in records if r["label"] == "sequential" and r["seed"] == seed]
    for regime in REGIMES:
        for workers in args.workers:
            runs = sequential + [r for r in records if (r["regime"], r["workers"], r["seed"])
                                 == (regime, workers, seed) and "+kill" not in r["label"]]
            for key, axis_label, name in (("passes", "passes over the training set", "passes"),
                                          ("seconds", "wall time (s)", "time")):
                figure, axes = plt.subplots(figsize=(6, 4))
                for r in runs:
                    axes.plot([p[key] for p in r["curve"]],
                              [100 * p["test_error"] for p in r["curve"]], label=r["label"])
                axes.set_xlabel(axis_label)
                axes.set_ylabel("test error (%)")
                axes.set_ylim(0, min(100, 3 * 100 * max(r["final"]["test_error"] for r in runs)
                                     + 5))
                lr = runs[-1]["rule"]["lr"]
                axes.set_title(f"{args.dataset}, {workers} workers, {regime} regime (lr {lr:g})")
                axes.legend(fontsize=7)
                path = os.path.join(args.out, f"error_vs_{name}_{regime}_w{workers}.png")
                figure.tight_layout()
                figure.savefig(path, dpi=120)
                plt.close(figure)
                written.append(path)
    return written


def _print_table(table: dict[str, Any]) -> None:
    print(f"  sequential SGD: test error {100 * table['sequential']['test_error']:.2f}%")
    for key, rows in table.items():
        if key == "sequential":
            continue
        print(f"  {key}")
        for label, row in rows.items():
            line = (f"    {label:28s} lr {row['lr']:<6g} error {100 * row['test_error']:6.2f}%  "
                    f"gap {100 * row['gap']:+6.2f}")
            if "gap_over_asgd_gap" in row:
                line += f"  gap/asgd-gap {row['gap_over_asgd_gap']:.2f}"
            histogram = row["staleness_histogram"]
            total = sum(histogram.values())
            mean_tau = sum(t * n for t, n in histogram.items()) / total if total else 0.0
            line += f"  mean tau {mean_tau:.2f}  updates/s {row['updates_per_second']:.0f}"
            print(line)


QUICK = {"workers": [4, 8], "seeds": [0, 1, 2], "search_seeds": [0], "passes": 10,
         "lr_grid": [0.05, 0.1, 0.15], "lambda_abs_grid": [0.5, 2.0, 8.0],
         "lambda_square_grid": [0.04, 0.4, 4.0], "search_runner": "simulated", "kill": False}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/async", help="folder for JSON and PNG files")
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--search-seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="seeds whose median validation error scores a setting")
    parser.add_argument("--epochs", dest="passes", type=int, default=10,
                        help="passes over the training set")
    parser.add_argument("--validation", type=int, default=287,
                        help="training images held out for the search (default 287 of 1437)")
    parser.add_argument("--lr-grid", type=float, nargs="+",
                        default=[0.025, 0.05, 0.1, 0.15, 0.2])
    parser.add_argument("--harsh-lr", type=float, default=0.15,
                        help="the harsh regime's learning rate, where plain ASGD is unstable")
    parser.add_argument("--lambda-abs-grid", type=float, nargs="+",
                        default=[0.5, 1.0, 2.0, 4.0, 8.0], help="lambda_1 candidates (Option I)")
    parser.add_argument("--lambda-square-grid", type=float, nargs="+",
                        default=[0.004, 0.04, 0.4, 4.0], help="lambda_2 candidates (Option II)")
    parser.add_argument("--search-runner", choices=sorted(RUNNERS), default="rpc",
                        help="score the search with real processes or the cyclic schedule")
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
    parser.add_argument("--quick", action="store_true",
                        help=f"a smaller run: {', '.join(f'{k}={v}' for k, v in QUICK.items())}")
    return parser


def main() -> None:
    args = parser().parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    try:
        ClassifierTask(_spec(args, 0))
    except FileNotFoundError as error:
        print(f"skipping: {error}")
        return
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)
    begin = time.time()
    chosen = search(args, RUNNERS[args.search_runner])
    picks = "; ".join(f"{key}: lr {value['lr']}, λ " + ", ".join(
        f"{k} {v['chosen']:g}" for k, v in value["lambda"].items())
        for key, value in chosen.items() if key.startswith("workers="))
    print(f"chosen on the validation split: sequential lr {chosen['sequential_lr']:g}; {picks}")
    capacity = server_capacity(args)
    records = run_real(args, chosen)
    results: dict[str, Any] = {"arguments": vars(args), "search": _jsonable(chosen),
                               "runs": records, "summary": summarise(records, args),
                               "server_capacity": capacity, "methods": sorted(METHODS)}
    print(f"\n{args.dataset}, {args.passes} passes, medians over seeds {args.seeds}")
    _print_table(results["summary"])
    kill = [r for r in records if r["label"].endswith("+kill")]
    if kill:
        whole = _select(records, kill[0]["regime"], kill[0]["label"][:-5], kill[0]["workers"])
        results["kill"] = {
            "workers": kill[0]["workers"],
            "test_error_killed": statistics.median(r["final"]["test_error"] for r in kill),
            "test_error_whole": statistics.median(r["final"]["test_error"] for r in whole),
            "updates_killed": statistics.median(r["updates"] for r in kill),
            "updates_whole": statistics.median(r["updates"] for r in whole),
            "errors": [r["worker_errors"] for r in kill]}
    results["figures"] = plot(records, args)
    results["seconds"] = time.time() - begin
    with open(os.path.join(args.out, "async.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"\nwrote {args.out}/async.json and {len(results['figures'])} figures "
          f"in {results['seconds']:.0f} s")


def _jsonable(value: Any) -> Any:
    """Dicts with float keys (grid values) as dicts with string keys."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    main()
