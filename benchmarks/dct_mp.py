"""DCT-MP reproduction: DCT KDD'21 Table 1, Table 3 and Fig. 5 in direction, plus wire sizes.

On the DLRM-style model (§3.1) and the synthetic Criteo-shaped set (a known
teacher; Criteo itself is not available offline):

* bytes  -- measured bytes per step crossing the split (X_act forward, X_grad
  backward) for each sparsity, value dtype and threshold, and the ratio to
  the dense split measured the same way; which settings reach 8x.
* table1 -- train/test loss and accuracy at sparsity 0 / 75 / 90 / 95 / 98 %
  with 2 stages and 0 / 75 / 90 / 95 % with 3 (DCT-MP on X_act and X_grad).
  Sparsity 0 through the boundary is bit-identical to the unsplit model
  (tests/test_pipeline_split.py), so it is the baseline row.
* fig5   -- the mean per-row top-k threshold at the first split over
  iterations, without DCT-MP (one baseline run, thresholds only measured) and
  with it at each sparsity.
* table3 -- hybrid: 3 stages x 2 data-parallel replicas, DCT-MP on the splits
  and DCT-DP on W_grad at the same sparsity (replicas simulated in one
  process; the engine check below runs the real thing).
* engine -- a short real run (2 stages x 2 replicas on torch.distributed.
  pipelining + DDP over gloo) whose X_act / X_grad bytes per step must equal
  the single-process measurement.
* --laplace (MLSys App. B) and --negative (KDD App. A: Gaussian sketch,
  top-K + error feedback on X_grad) add their tables.

Writes results.json, tables.md and PNG plots to --out (default results/dct_mp).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from thinwire.jobs.dct_mp import TASKS, RunConfig, Task, train_engine, train_local  # noqa: E402

TABLE1 = {2: (0.75, 0.9, 0.95, 0.98), 3: (0.75, 0.9, 0.95)}  # stages -> sparsities (Table 1)
TABLE3 = (0.75, 0.9, 0.95)  # Table 3 sparsities (both DCT-DP and DCT-MP)
PROBE = (0.75, 0.9, 0.95)  # Fig. 5 sparsities
EMBEDDING = ("interact.*",)  # dense: Table 3 compresses only DLRM's 8 FC layers (§3.2)


def _kept(sparsity: float) -> float:
    """The ``ratio`` option for one of the paper's sparsities (the fraction kept)."""
    return round(1.0 - sparsity, 9)


def _mp(sparsity: float, **extra: Any) -> dict[str, Any]:
    return {"ratio": _kept(sparsity), **extra}


def _row(label: str, result: dict[str, Any], baseline: dict[str, Any] | None,
         dense_bytes: dict[str, float] | None) -> dict[str, Any]:
    entities = result["bytes_per_entity"]
    row: dict[str, Any] = {
        "run": label,
        "train_loss": result["train"]["loss"], "train_acc": result["train"]["accuracy"],
        "test_loss": result["test"]["loss"], "test_acc": result["test"]["accuracy"],
        "X_act": entities.get("X_act", 0.0), "X_grad": entities.get("X_grad", 0.0),
        "W_grad": entities.get("W_grad", 0.0), "seconds": result["seconds"],
    }
    if baseline is not None:
        row["test_loss_change_%"] = 100 * (row["test_loss"] / baseline["test"]["loss"] - 1)
    if dense_bytes is not None:
        row.update(_ratios(entities, dense_bytes))
    return row


def _ratios(entities: dict[str, float], dense: dict[str, float]) -> dict[str, float]:
    fwd, bwd = entities.get("X_act", 0.0), entities.get("X_grad", 0.0)
    return {"ratio_fwd": dense["X_act"] / fwd if fwd else float("inf"),
            "ratio_bwd": dense["X_grad"] / bwd if bwd else float("inf"),
            "ratio_round_trip": (dense["X_act"] + dense["X_grad"]) / (fwd + bwd)}


def markdown(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4f}" if abs(value) < 10 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


class Bench:
    """Runs configurations on one task (data built once) and keeps every result."""

    def __init__(self, base: RunConfig) -> None:
        self.base = base
        self.task: Task = TASKS[base.task](base)
        self.results: dict[str, Any] = {}

    def run(self, label: str, evaluation: bool = True, **changes: Any) -> dict[str, Any]:
        config = dataclasses.replace(self.base, **changes)
        result = train_local(config, task=self.task, evaluation=evaluation)
        self.results[label] = result
        return result

    def dense_bytes(self, stages: int) -> dict[str, float]:
        """Bytes per step of the dense split (constant per step: two steps suffice)."""
        result = self.run(f"dense-bytes-{stages}", stages=stages,
                          boundary_options=_mp(0.0), max_steps=2, evaluation=False)
        return result["bytes_per_entity"]


def bytes_table(bench: Bench, bar: tqdm) -> list[dict[str, Any]]:
    dense = bench.dense_bytes(2)
    rows = []
    settings = [(s, v, "topk") for s in (0.75, 0.9, 0.95, 0.98) for v in ("native", "fp16")]
    settings += [(0.9, "native", "laplace")]
    for sparsity, values, threshold in settings:
        result = bench.run(f"bytes-{sparsity}-{values}-{threshold}", stages=2, max_steps=2,
                           boundary_options=_mp(sparsity, values=values, threshold=threshold),
                           evaluation=False)
        entities = result["bytes_per_entity"]
        ratios = _ratios(entities, dense)
        rows.append({"sparsity": sparsity, "values": values, "threshold": threshold,
                     "X_act": entities["X_act"], "X_grad": entities["X_grad"], **ratios,
                     "8x_fwd": ratios["ratio_fwd"] >= 8, "8x_round_trip":
                     ratios["ratio_round_trip"] >= 8})
        bar.update()
    return rows


def table1(bench: Bench, bar: tqdm) -> list[dict[str, Any]]:
    baseline = bench.run("baseline", stages=2, boundary_options=_mp(0.0),
                         probe=tuple(map(_kept, PROBE)))
    bar.update()
    rows = [_row("0% (baseline)", baseline, baseline, None)]
    for stages, sparsities in TABLE1.items():
        dense = bench.dense_bytes(stages)
        for sparsity in sparsities:
            label = f"{stages} stages {sparsity:.0%}"
            result = bench.run(label, stages=stages, boundary_options=_mp(sparsity),
                               probe=(_kept(sparsity),))
            row = _row(label, result, baseline, dense)
            row["stages"] = stages
            rows.append(row)
            bar.update()
    return rows


def table3(bench: Bench, bar: tqdm, life_span: int) -> list[dict[str, Any]]:
    baseline = bench.run("hybrid baseline", stages=3, replicas=2,
                         boundary_options=_mp(0.0), dp_scheme="dense")
    bar.update()
    rows = [_row("baseline (dense)", baseline, baseline, None)]
    dense = baseline["bytes_per_entity"]
    for sparsity in TABLE3:
        label = f"hybrid {sparsity:.0%}"
        result = bench.run(label, stages=3, replicas=2, boundary_options=_mp(sparsity),
                           dp_scheme="dct-dp",
                           dp_options={"ratio": _kept(sparsity), "life_span": life_span,
                                       "exclude": EMBEDDING})
        row = _row(label, result, baseline, dense)
        row["W_grad_ratio"] = dense["W_grad"] / result["bytes_per_entity"]["W_grad"]
        rows.append(row)
        bar.update()
    return rows


def laplace_table(bench: Bench, bar: tqdm) -> list[dict[str, Any]]:
    baseline = bench.results["baseline"]
    dense = bench.results["dense-bytes-2"]["bytes_per_entity"]
    rows = []
    for threshold in ("laplace", "laplace-row"):
        for sparsity in TABLE1[2]:
            label = f"{threshold} {sparsity:.0%}"
            result = bench.run(label, stages=2,
                               boundary_options=_mp(sparsity, threshold=threshold))
            trace = next(iter(result["trace"].values()))
            overflow = next(iter(result["overflow"].values()))
            row = _row(label, result, baseline, dense)
            row["target_density"] = 1 - sparsity
            row["final_density"] = statistics.fmean(d for _, d in trace[-20:])
            row["rows_falling_back_to_topk"] = statistics.fmean(overflow)
            rows.append(row)
            bar.update()
    return rows


def negative_table(bench: Bench, bar: tqdm) -> list[dict[str, Any]]:
    baseline = bench.results["baseline"]
    dense = bench.results["dense-bytes-2"]["bytes_per_entity"]
    rows = []
    for compression in (0.5, 0.75, 0.9):
        label = f"sketch {compression:.0%}"
        result = bench.run(label, stages=2, boundary="sketch",
                           boundary_options={"compression": compression})
        rows.append(_row(label, result, baseline, dense))
        bar.update()
    for sparsity in (0.5, 0.75, 0.9):
        label = f"xgrad-topk+EF {sparsity:.0%}"
        result = bench.run(label, stages=2, boundary="xgrad-topk",
                           boundary_options={"ratio": _kept(sparsity)})
        rows.append(_row(label, result, baseline, dense))
        bar.update()
    return rows


def engine_check(bench: Bench, steps: int) -> dict[str, Any]:
    """Real processes: bytes per step of X_act / X_grad equal the one-process count."""
    config = dataclasses.replace(bench.base, stages=2, replicas=2, schedule="1f1b",
                                 boundary_options=_mp(0.9), dp_scheme="dct-dp",
                                 dp_options={"ratio": 0.1, "life_span": 50},
                                 max_steps=steps, train_size=min(bench.base.train_size, 4096),
                                 test_size=min(bench.base.test_size, 1024))
    engine = train_engine(config, timeout_s=600)
    local = train_local(config)
    checks = {entity: {"engine": engine["bytes_per_entity"].get(entity, 0.0),
                       "local": local["bytes_per_entity"].get(entity, 0.0)}
              for entity in ("X_act", "X_grad", "W_grad")}
    replicas_identical = all(
        len({r["digest"] for r in engine["ranks"] if r["stage"] == s}) == 1 for s in range(2))
    return {"steps": engine["steps"], "bytes": checks, "replicas_identical": replicas_identical,
            "X_equal": all(checks[e]["engine"] == checks[e]["local"] for e in ("X_act", "X_grad"))}


def smooth(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_fig5(bench: Bench, out: Path) -> Path:
    figure, axis = plt.subplots(figsize=(6, 4))
    colours = dict(zip(PROBE, ("tab:blue", "tab:orange", "tab:green")))
    baseline = bench.results["baseline"]["thresholds"]
    window = 20
    for sparsity in PROBE:
        axis.plot(smooth(baseline[str(_kept(sparsity))], window), color=colours[sparsity],
                  label=f"{sparsity:.0%}, no DCT-MP")
        with_mp = bench.results.get(f"2 stages {sparsity:.0%}")
        if with_mp is not None:
            axis.plot(smooth(with_mp["thresholds"][str(_kept(sparsity))], window), "--",
                      color=colours[sparsity], label=f"{sparsity:.0%}, DCT-MP")
    axis.set_xlabel("iteration")
    axis.set_ylabel("mean top-k threshold at the split")
    axis.set_title("DCT KDD'21 Fig. 5: top-k threshold with and without DCT-MP")
    axis.legend(fontsize=8)
    path = out / "fig5_thresholds.png"
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_table1(rows: Sequence[dict[str, Any]], out: Path) -> Path:
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for stages in TABLE1:
        picked = [r for r in rows if r.get("stages") == stages]
        sparsities = [100 * s for s in TABLE1[stages]]
        left.plot(sparsities, [r["test_loss_change_%"] for r in picked], "o-",
                  label=f"{stages} stages")
        right.plot(sparsities, [r["ratio_round_trip"] for r in picked], "o-",
                   label=f"{stages} stages")
    left.axhline(0.0, color="grey", lw=0.8)
    left.set_xlabel("sparsity (%)")
    left.set_ylabel("test loss change vs. unsplit (%)")
    right.axhline(8.0, color="grey", lw=0.8, ls=":")
    right.set_xlabel("sparsity (%)")
    right.set_ylabel("bytes across splits: dense / DCT-MP (round trip)")
    for axis in (left, right):
        axis.legend()
    figure.suptitle("DCT-MP on DLRM (synthetic Criteo): Table 1 in direction")
    path = out / "table1.png"
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_laplace(bench: Bench, out: Path) -> Path:
    figure, axis = plt.subplots(figsize=(6, 4))
    for sparsity in TABLE1[2]:
        trace = next(iter(bench.results[f"laplace {sparsity:.0%}"]["trace"].values()))
        line = axis.plot(smooth([d for _, d in trace], 20), label=f"target {1 - sparsity:.0%}")
        axis.axhline(1 - sparsity, color=line[0].get_color(), ls=":", lw=0.8)
    axis.set_xlabel("iteration")
    axis.set_ylabel("occupancy of X_act (kept / d)")
    axis.set_title("Laplace threshold estimate: achieved occupancy (MLSys Fig. 6b)")
    axis.legend(fontsize=8)
    path = out / "laplace_occupancy.png"
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/dct_mp"))
    parser.add_argument("--train-size", type=int, default=100_000)
    parser.add_argument("--test-size", type=int, default=10_000)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--life-span", type=int, default=50, help="DCT-DP L in table 3")
    parser.add_argument("--engine-steps", type=int, default=6)
    parser.add_argument("--no-engine", action="store_true", help="skip the multi-process check")
    parser.add_argument("--no-table3", action="store_true")
    parser.add_argument("--laplace", action="store_true", help="add the Laplace table")
    parser.add_argument("--negative", action="store_true", help="add Appendix A's schemes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    base = RunConfig(task="criteo", train_size=args.train_size, test_size=args.test_size,
                     epochs=args.epochs, seed=args.seed)
    start = time.perf_counter()
    bench = Bench(base)
    total = 9 + 1 + sum(len(s) for s in TABLE1.values()) + (0 if args.no_table3 else 4)
    total += (8 if args.laplace else 0) + (6 if args.negative else 0)
    summary: dict[str, Any] = {"config": dataclasses.asdict(base), "oracle": bench.task.oracle}
    sections: list[str] = []
    with tqdm(total=total, desc="dct_mp runs") as bar:
        summary["bytes"] = bytes_table(bench, bar)
        sections.append("## Bytes per step across the split (DLRM bottom.3, d = 256)\n\n" +
                        markdown(summary["bytes"], ["sparsity", "values", "threshold", "X_act",
                                                    "X_grad", "ratio_fwd", "ratio_bwd",
                                                    "ratio_round_trip", "8x_fwd",
                                                    "8x_round_trip"]))
        summary["table1"] = table1(bench, bar)
        columns = ["run", "train_loss", "train_acc", "test_loss", "test_acc",
                   "test_loss_change_%", "X_act", "X_grad", "ratio_round_trip"]
        sections.append("## Table 1: DCT-MP (X_act and X_grad)\n\n" +
                        markdown(summary["table1"], columns))
        if not args.no_table3:
            summary["table3"] = table3(bench, bar, args.life_span)
            sections.append("## Table 3: DCT-DP + DCT-MP, 3 stages x 2 replicas (simulated)\n\n"
                            + markdown(summary["table3"], columns + ["W_grad", "W_grad_ratio"]))
        if args.laplace:
            summary["laplace"] = laplace_table(bench, bar)
            sections.append("## Laplace threshold (MLSys App. B)\n\n" + markdown(
                summary["laplace"], columns + ["target_density", "final_density",
                                               "rows_falling_back_to_topk"]))
        if args.negative:
            summary["negative"] = negative_table(bench, bar)
            sections.append("## Appendix A: what does not work\n\n" +
                            markdown(summary["negative"], columns))
    if not args.no_engine:
        summary["engine"] = engine_check(bench, args.engine_steps)
        engine = summary["engine"]
        sections.append(
            "## Engine check (2 stages x 2 replicas, 1F1B, real processes)\n\n"
            f"{engine['steps']} steps; X_act/X_grad bytes per step equal the one-process "
            f"count: {engine['X_equal']}; replicas bit-identical: "
            f"{engine['replicas_identical']}\n\n```\n{json.dumps(engine['bytes'], indent=1)}\n```")
    summary["fig5"] = {label: result["thresholds"] for label, result in bench.results.items()
                       if result["thresholds"]}
    summary["runs"] = {label: {k: v for k, v in result.items()
                               if k not in ("thresholds", "trace", "overflow")}
                       for label, result in bench.results.items()}
    plots = [plot_fig5(bench, args.out), plot_table1(summary["table1"], args.out)]
    if args.laplace:
        plots.append(plot_laplace(bench, args.out))
    summary["seconds"] = time.perf_counter() - start
    header = (f"# DCT-MP benchmark\n\nsynthetic Criteo, {args.train_size} train / "
              f"{args.test_size} test rows, {args.epochs} epoch(s), seed {args.seed}; oracle "
              f"(teacher) test loss {bench.task.oracle['loss']:.4f}, accuracy "
              f"{bench.task.oracle['accuracy']:.4f}; {summary['seconds']:.0f} s\n")
    text = "\n\n".join([header, *sections]) + "\n"
    (args.out / "tables.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1, default=str))
    print(text)
    print("wrote", ", ".join(str(p) for p in [args.out / "results.json",
                                               args.out / "tables.md", *plots]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
