"""Steps to target and bytes per step of every data-parallel scheme on every workload.

For each workload (``thinwire.jobs.workloads``), world size and seed, one
spawned process group trains every scheme through the DDP hook with the
workload's own recipe (SGD momentum 0.9, AdamW for the transformer) and
records the first evaluation step whose test accuracy reaches the
workload's target, the bytes handed to torch.distributed per worker and
step, and the achieved density per layer of the sparsifiers. Sparse
schemes run twice: with the optimiser's momentum coupled into the scheme
(``thinwire.optim.couple``, the default) and without (``--no-couple`` in
``thinwire compare``), so the effect of the coupling is measured, not
assumed.

Results accumulate in ``docs/data/convergence.json`` (one record per
workload x workers x seed x scheme x coupling; a rerun replaces its own
records), and ``python -m benchmarks.report`` renders them into
``docs/results.md``.

Usage::

    python -m benchmarks.convergence --quick          # one seed, 4 workers, two workloads
    python -m benchmarks.convergence                  # the full matrix: 3 seeds x 2/4 workers
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.machine import CpuWatch, cpu_model
from thinwire import schemes
from thinwire.compress import keep_count
from thinwire.data.imagesets import FASHION_MNIST_DIR
from thinwire.jobs.compare import compare
from thinwire.jobs.dataparallel import RunOptions
from thinwire.jobs.workloads import RECIPES, WORKLOADS, load

SCHEMES = ("dense", "fp16", "powersgd", "topk", "dct-dp", "clt-k")
SPARSE = ("topk", "dct-dp", "clt-k")
DATA = Path("docs/data/convergence.json")
# Every tensor 99 % sparse (small ones keep at least one entry, instead of travelling
# dense), and dct-dp's payload room exactly k (its default 1.25 k costs 25 % more bytes).
SPARSE_OPTIONS = ("min_numel=0", "capacity=1.0")
QUICK = {"workloads": ["digits-mlp", "transformer-digits"], "workers": [4], "seeds": [0]}


def measure(workload: str, workers: int, seed: int, schemes: list[str],
            uncoupled: bool) -> list[dict[str, Any]]:
    """Every scheme on one workload, world size and seed; one record per run.

    Each run stops at its first evaluation that reaches the target (bytes per
    step are then those of the steps run), or at the recipe's step budget.
    The sparse schemes run with :data:`SPARSE_OPTIONS`, so that their bytes
    are those of the sparsity asked for.
    """
    recipe = RECIPES[workload]
    rows = []
    variants = [(True, schemes)] + ([(False, [s for s in schemes if s in SPARSE])]
                                    if uncoupled else [])
    for couple, names in variants:
        if not names:
            continue
        options = RunOptions(steps=recipe["steps"], batch_size=recipe["batch_size"],
                             lr=recipe["lr"], momentum=recipe["momentum"], seed=seed,
                             workload=workload, optimizer=recipe["optimizer"],
                             coupling="auto" if couple else "none",
                             until_target=True)
        extra = sparse_options(names)
        for result in compare(names, workers, options, 100e6, ratio=0.01, life_span=1000,
                              extra=extra):
            densities = list(density_ratios(workload, result["density_per_layer"]).values())
            energy = result.get("captured_energy_per_layer", {})
            rows.append({
                "workload": workload, "workers": workers, "seed": seed,
                "scheme": result["scheme"], "coupled": result["coupled"],
                "optimizer": recipe["optimizer"], "lr": recipe["lr"],
                "target": result["target"], "steps": recipe["steps"],
                "steps_to_target": result["steps_to_target"],
                "test_accuracy": result["test_accuracy"],
                "bytes_sent_per_step": result["bytes_sent_per_step"],
                "dense_bytes_per_step": result["dense_bytes_per_step"],
                "density_per_layer": result["density_per_layer"],
                "density_vs_target": densities,
                "mean_density": statistics.fmean(densities) if densities else None,
                "captured_energy_per_layer": energy,
                "mean_captured_energy": statistics.fmean(energy.values()) if energy else None,
                "curve": [(step, acc) for step, _, acc in result["curve"]],
            })
    return rows


def sparse_options(names: list[str]) -> list[str]:
    """The :data:`SPARSE_OPTIONS` that one of ``names`` takes: ``compare`` refuses an
    option none of its schemes has (clt-k alone has no ``capacity``)."""
    keys = {field.name for name in names if name in SPARSE
            for field in dataclasses.fields(schemes.config_class(name))}
    return [option for option in SPARSE_OPTIONS if option.split("=")[0] in keys]


def density_ratios(workload: str, density_per_layer: dict[str, float],
                   density: float = 0.01) -> dict[str, float]:
    """Each layer's achieved density over its target ``keep_count(N, density) / N``.

    Small layers keep at least one entry, so their target is above ``density``; a plain
    mean of densities over layers would be dominated by them.
    """
    if not density_per_layer:
        return {}
    numel = {name: p.numel() for name, p in load(workload).model(0).named_parameters()}
    return {name: achieved / (keep_count(numel[name], density) / numel[name])
            for name, achieved in density_per_layer.items()}


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["workload"], row["workers"], row["seed"], row["scheme"], row["coupled"])


def save(rows: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Merge ``rows`` into the data file (replacing records with the same key)."""
    record = json.loads(path.read_text()) if path.exists() else {"runs": [], "meta": []}
    merged = {_key(r): r for r in record["runs"] + rows}  # a key measured twice: the last
    record["runs"] = list(merged.values())
    record["meta"].append(meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return record


def summary(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per workload x workers x scheme x coupling: median steps to target over seeds,
    its ratio to dense's (same seeds), bytes per step and its ratio to dense."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in record["runs"]:
        groups.setdefault((row["workload"], row["workers"], row["scheme"], row["coupled"]),
                          []).append(row)
    out = []
    for (workload, workers, scheme, coupled), rows in sorted(
            groups.items(), key=lambda item: (item[0][0], item[0][1], _order(item[0][2]),
                                              not item[0][3])):
        dense = {r["seed"]: r for r in record["runs"] if r["scheme"] == "dense"
                 and (r["workload"], r["workers"]) == (workload, workers)}
        ratios = []
        for row in rows:
            base = dense.get(row["seed"])
            if base is None or base["steps_to_target"] is None:
                continue
            mine = row["steps_to_target"]
            ratios.append(float("inf") if mine is None else mine / base["steps_to_target"])
        reached = [r["steps_to_target"] for r in rows if r["steps_to_target"] is not None]
        densities = [r["mean_density"] for r in rows if r["mean_density"] is not None]
        energies = [r["mean_captured_energy"] for r in rows
                    if r.get("mean_captured_energy") is not None]
        out.append({
            "workload": workload, "workers": workers, "scheme": scheme, "coupled": coupled,
            "seeds": len(rows), "reached": len(reached),
            "median_steps": statistics.median(reached) if len(reached) == len(rows) else None,
            "steps_ratio": statistics.median(ratios) if ratios else None,
            "bytes_per_step": statistics.fmean(r["bytes_sent_per_step"] for r in rows),
            "bytes_ratio": statistics.fmean(r["dense_bytes_per_step"] / r["bytes_sent_per_step"]
                                            for r in rows),
            "mean_density": statistics.fmean(densities) if densities else None,
            "mean_captured_energy": statistics.fmean(energies) if energies else None,
            "target": rows[0]["target"], "optimizer": rows[0]["optimizer"],
        })
    return out


def measured(record: dict[str, Any]) -> dict[tuple[Any, ...], str]:
    """When each record's run was made: the latest run of its cell that ran its scheme.

    A rerun of some schemes only (``--schemes clt-k``) leaves the other schemes' records of
    the cell as they were. Runs saved before ``schemes`` was recorded name it in ``argv``.
    """
    latest: dict[tuple[Any, ...], str] = {}
    for meta in record["meta"]:
        if "cell" not in meta:
            continue
        argv = meta.get("argv", [])
        ran = meta.get("schemes") or (argv[argv.index("--schemes") + 1].split(",")
                                      if "--schemes" in argv[:-1] else SCHEMES)
        for scheme in ran:
            latest[(*meta["cell"], scheme)] = meta["when"]
    return {_key(row): latest.get((row["workload"], row["workers"], row["seed"],
                                   row["scheme"]), "?") for row in record["runs"]}


def _order(scheme: str) -> int:
    return SCHEMES.index(scheme) if scheme in SCHEMES else len(SCHEMES)


def section(record: dict[str, Any], figures: Path, docs: Path) -> str:
    """The convergence section of docs/results.md (and its figure)."""
    rows = summary(record)
    meta = record["meta"][-1] if record["meta"] else {}
    first = min(measured(record).values(), default="?")  # the oldest record shown
    lines = ["## Convergence: steps to target and bytes per step", "",
             f"Source: `{DATA}` ({len(record['runs'])} runs; written by "
             "`python -m benchmarks.convergence`). Every scheme trains each workload with "
             "the workload's recipe through the DDP hook; steps to target is the first "
             "evaluation step (every 25) whose test accuracy reaches the target. Sparse "
             "schemes keep 1 % of the entries (99 % sparsity): dct-dp of each layer, topk "
             "and clt-k of each DDP bucket (their default scope), so a layer of theirs may "
             "get more or less than 1 %; *coupled* means the "
             "optimiser's momentum moved into the scheme (`thinwire.optim.couple`, the "
             "default), *plain* the momentum left in the optimiser. x dense: median over "
             "seeds of the per-seed ratio to dense's steps (inf: target not reached in the "
             "budget). Density: achieved fraction of entries sent over its target "
             "(ceil(0.01 N) / N), averaged over steps, then over layers (1.00 = on target). "
             "Energy (clt-k): share of rank 0's own top-k energy that the leader's indices "
             "captured, averaged over steps (rank 0's own leader steps count 1.0) and layers. "
             "Sparse schemes ran with "
             f"{', '.join(SPARSE_OPTIONS)}; runs stop at the target, so bytes/step are those "
             "of the steps run. "
             f"Runs: {first} to {meta.get('when', '?')} (a rerun of a cell's schemes replaces "
             f"their records); the last at load average {meta.get('load', '?')} on "
             f"{meta.get('cpu', '?')}.", "",
             "| workload (target, optimiser) | workers | scheme | momentum | seeds reached | "
             "median steps | x dense | bytes/step | x less than dense | density / target | "
             "energy |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        coupling = "coupled" if r["coupled"] and r["scheme"] in SPARSE else (
            "plain" if r["scheme"] in SPARSE else "-")
        ratio = "-" if r["steps_ratio"] is None else f"{r['steps_ratio']:.2f}"
        steps = "-" if r["median_steps"] is None else f"{r['median_steps']:.0f}"
        density = "-" if r["mean_density"] is None else f"{r['mean_density']:.2f}"
        energy = "-" if r["mean_captured_energy"] is None else f"{r['mean_captured_energy']:.2f}"
        lines.append(f"| {r['workload']} ({r['target']}, {r['optimizer']}) | {r['workers']} | "
                     f"{r['scheme']} | {coupling} | {r['reached']}/{r['seeds']} | {steps} | "
                     f"{ratio} | {r['bytes_per_step']:,.0f} | {r['bytes_ratio']:.0f}x | "
                     f"{density} | {energy} |")
    figure = figures / "convergence.png"
    plot(record, figure)
    lines += ["", f"![convergence]({figure.relative_to(docs)})", "",
              "*Figure: test accuracy against steps, seed 0, the largest world size run; "
              "dashed: momentum left in the optimiser.*", ""]
    return "\n".join(lines)


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in record["runs"]})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.0),
                             squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        runs = [r for r in record["runs"] if r["workload"] == workload and r["seed"] == 0]
        workers = max(r["workers"] for r in runs)
        for r in sorted(runs, key=lambda r: _order(r["scheme"])):
            if r["workers"] != workers or not r["curve"]:
                continue
            steps, acc = zip(*r["curve"])
            ax.plot(steps, acc, linestyle="-" if r["coupled"] or r["scheme"] not in SPARSE
                    else "--", label=r["scheme"] + ("" if r["coupled"] or r["scheme"]
                                                    not in SPARSE else " (plain)"))
        ax.axhline(runs[0]["target"], color="grey", linewidth=0.8)
        ax.set(title=f"{workload}, {workers} workers", xlabel="step", ylabel="test accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"only {QUICK} (fits a busy 2-core machine)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--uncoupled-seeds", default="0",
                        help="seeds on which the sparse schemes also run with the momentum "
                             "left in the optimiser (default 0; empty: none)")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    workers = [int(w) for w in args.workers.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        workloads, workers, seeds = QUICK["workloads"], QUICK["workers"], QUICK["seeds"]
    if "fashion-convnet" in workloads and not Path(FASHION_MNIST_DIR).exists():
        print(f"Fashion-MNIST is missing ({FASHION_MNIST_DIR}): install the Debian package "
              "dataset-fashion-mnist (apt-get install dataset-fashion-mnist); skipping "
              "fashion-convnet")
        workloads = [w for w in workloads if w != "fashion-convnet"]
    watch = CpuWatch()
    record: dict[str, Any] = {}
    for workload in workloads:
        for n in workers:
            for seed in seeds:  # saved as it goes: a long run interrupted keeps what it did
                begin = time.perf_counter()
                got = measure(workload, n, seed, args.schemes.split(","),
                              str(seed) in args.uncoupled_seeds.split(","))
                print(f"{workload} x{n} seed {seed} ({time.perf_counter() - begin:.0f} s): " +
                      ", ".join(f"{r['scheme']}{'' if r['coupled'] else '(plain)'}="
                                f"{r['steps_to_target']}" for r in got), flush=True)
                load = subprocess.run(["uptime"], capture_output=True, text=True).stdout
                meta = {"when": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": cpu_model(),
                        "load": load.split("load average:")[-1].strip(),
                        "others_share": watch.others_share(),
                        "argv": sys.argv[1:] if argv is None else argv,
                        "cell": [workload, n, seed], "schemes": args.schemes.split(",")}
                record = save(got, args.data, meta)
    for row in summary(record) if record else []:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
