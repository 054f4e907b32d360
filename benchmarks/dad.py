"""dAD paper experiments: exactness (Table 2), bytes, AUC by rank (Fig. 3), rank (Fig. 4–5).

Part 1, the feed-forward network of §4.1.1 (two hidden layers of 1024, ReLU)
on an image set with labels split across 2 sites, batch 32 per site: dSGD,
dAD, edAD, rank-dAD and PowerSGD at ranks 1, 2, 4, 8, 10. Reports the
maximum gradient error against pooled training over the first epoch
(Table 2), bytes handed to torch.distributed per step per site, and the
test AUC.

Part 2, the GRU of §4.1.2 (hidden 64, head 512-256) on a UEA set that sktime
ships (JapaneseVowels by default): dSGD, dAD, edAD (Fig. 2), rank-dAD and
PowerSGD by rank, with the effective rank per layer (Fig. 5; rank-dAD stops
by the paper's rule, ``stopping="paper"``). Skipped, with a message, when
sktime is not installed (``pip install 'thinwire[bench]'``).

Usage::

    python -m benchmarks.dad --out results/dad-bench
    python -m benchmarks.dad --image-set fashion-mnist --steps-per-epoch 100

Fashion-MNIST needs Debian's dataset-fashion-mnist; without it the script
says so and uses scikit-learn's digits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from thinwire.data import sitedata
from thinwire.jobs import dad_plots as plots
from thinwire.jobs.dad import Run, run_all, table

QUICK = {"ranks": [2, 4], "epochs": 3, "seeds": 2}  # --quick: what fits a busy 2-core machine


def _runs(modes: list[str], ranks: list[int], introspect: int, **common: Any) -> list[Run]:
    runs = [Run(mode, mode, **common) for mode in modes if mode in ("dsgd", "dad", "edad")]
    for rank in ranks:
        runs.append(Run(f"rank-dad r={rank}", "rank-dad", {"rank": rank}, **common))
    for rank in ranks:
        runs.append(Run(f"powersgd r={rank}", "powersgd", {"rank": rank}, **common))
    if introspect:
        runs.append(Run(f"rank-dad r={introspect}", "rank-dad", {"rank": introspect}, **common))
    return runs


def _by_label(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["label"]: r for r in results}


def _table2(results: list[dict[str, Any]]) -> str:
    """Maximum |g − g_pooled| per weight matrix over the first epoch (Table 2)."""
    exact = [r for r in results if r["mode"] in ("dsgd", "dad", "edad")]
    if not exact:
        return ""
    names = [n for n in exact[0]["max_grad_error_first_epoch"] if n.endswith("weight")]
    lines = [f"{'layer':12s} " + " ".join(f"{r['label']:>11s}" for r in exact)]
    for name in reversed(names):  # output layer first, as in the paper
        row = " ".join(f"{r['max_grad_error_first_epoch'][name]:11.3e}" for r in exact)
        lines.append(f"{name:12s} {row}")
    return "\n".join(lines)


def _summary(results: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    runs = _by_label(results)
    out: dict[str, Any] = {}
    if "dad" in runs and "edad" in runs:
        out["edad_over_dad_bytes"] = max(runs["edad"]["bytes_per_site"]) / max(
            runs["dad"]["bytes_per_site"])
    if "dsgd" in runs and "dad" in runs:
        out["dad_over_dsgd_bytes"] = max(runs["dad"]["bytes_per_site"]) / max(
            runs["dsgd"]["bytes_per_site"])
    for mode in ("dsgd", "dad", "edad"):
        if mode in runs and runs[mode]["max_grad_error"]:
            out[f"{mode}_max_grad_error"] = max(runs[mode]["max_grad_error"].values())
    ours, theirs = runs.get(f"rank-dad r={rank}"), runs.get(f"powersgd r={rank}")
    if ours and theirs:
        out[f"rank{rank}"] = {
            "rank_dad_auc": ours["history"][-1]["auc"],
            "powersgd_auc": theirs["history"][-1]["auc"],
            "rank_dad_bytes": max(ours["bytes_per_site"]),
            "powersgd_bytes": max(theirs["bytes_per_site"]),
            "auc_per_epoch": {"rank-dad": [h["auc"] for h in ours["history"]],
                              "powersgd": [h["auc"] for h in theirs["history"]]},
        }
    out["median_sync_ms"] = {r["label"]: 1e3 * r["median_sync_seconds"] for r in results}
    return out


def _report(name: str, results: list[dict[str, Any]], out: str, rank: int) -> dict[str, Any]:
    print(f"\n== {name}: {results[0]['steps_per_epoch']} steps per epoch, "
          f"{len(results[0]['history'])} epochs")
    print(table(results))
    print("\nmax |g - g_pooled| over the first epoch (Table 2):")
    print(_table2(results))
    summary = _summary(results, rank)
    print("\nmedian synchronize() ms: " + ", ".join(
        f"{k} {v:.1f}" for k, v in summary["median_sync_ms"].items()))
    for key, value in summary.items():
        if key != "median_sync_ms":
            print(f"{key}: {value}")
    stem = os.path.join(out, name.replace(":", "_"))
    plots.auc(results, f"{stem}_auc.png", f"test AUC, {name}")
    plots.effective_rank([r for r in results if r["mode"] == "rank-dad"],
                         f"{stem}_effective_rank.png", f"effective rank, {name}")
    plots.bytes_per_step(results, f"{stem}_bytes.png", f"bytes per step, {name}")
    return {"results": results, "summary": summary}


def _over_seeds(data: sitedata.Data, results: list[dict[str, Any]], args: argparse.Namespace,
                common: dict[str, Any]) -> dict[str, Any]:
    """rank-dAD (as in the paper, and with error feedback) against PowerSGD at one rank,
    paired over seeds: the same initial weights and the same batches for every mode."""
    rank = args.compare_rank
    variants = {f"rank-dad r={rank}": ("rank-dad", {"rank": rank}),
                f"rank-dad+ef r={rank}": ("rank-dad", {"rank": rank, "error_feedback": True}),
                f"powersgd r={rank}": ("powersgd", {"rank": rank})}
    have = {r["label"] for r in results}
    runs = [Run(label, mode, options, **{**common, "seed": seed, "pooled": False})
            for seed in range(args.seeds) for label, (mode, options) in variants.items()
            if seed > 0 or label not in have]
    seeded = [r for r in results if r["label"] in variants] + (run_all(data, runs, 2)
                                                               if runs else [])
    final = {label: [r["history"][-1]["auc"] for r in sorted(
        (r for r in seeded if r["label"] == label), key=lambda r: r["run"]["seed"])]
        for label in variants}
    sent = {label: max(max(r["bytes_per_site"]) for r in seeded if r["label"] == label)
            for label in variants}
    medians = {k: float(np.median(v)) for k, v in final.items()}
    theirs = final[f"powersgd r={rank}"]
    wins = {k: f"{sum(a >= b for a, b in zip(v, theirs, strict=True))}/{len(v)}"
            for k, v in final.items() if not k.startswith("powersgd")}
    out = {"final_auc": final, "median_final_auc": medians, "max_bytes_per_step": sent,
           "no_worse_than_powersgd": wins}
    print(f"\n{data.name}, rank {rank}, {args.seeds} seeds (final test AUC per seed):")
    for label in variants:
        print(f"  {label:20s} median {medians[label]:.5f}  "
              f"[{', '.join(f'{v:.5f}' for v in final[label])}]  "
              f"max bytes/step {sent[label]:.0f}"
              + (f"  no worse than PowerSGD in {wins[label]}" if label in wins else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/dad-bench")
    parser.add_argument("--image-set", default="digits", choices=["digits", "fashion-mnist"])
    parser.add_argument("--uea", default="JapaneseVowels", choices=sorted(sitedata.UEA_LOADERS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4, 8, 10])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--gru-epochs", type=int, default=20)
    parser.add_argument("--steps-per-epoch", dest="max_steps", type=int, default=0,
                        help="cap steps per epoch (0: whole epochs)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--introspect", type=int, default=32,
                        help="extra rank-dAD run at this maximum rank (§4.2.2: the batch "
                             "size); 0 to skip")
    parser.add_argument("--compare-rank", type=int, default=4,
                        help="rank at which rank-dAD and PowerSGD are compared over seeds")
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds (initial weights and batch order) for that comparison")
    parser.add_argument("--skip-gru", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help=f"a smaller run: {', '.join(f'{k}={v}' for k, v in QUICK.items())}")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    os.makedirs(args.out, exist_ok=True)
    report: dict[str, Any] = {"args": vars(args)}

    try:
        images = sitedata.load(args.image_set, args.seed)
    except sitedata.Unavailable as error:
        print(f"{args.image_set} unavailable ({error}); using digits instead")
        images = sitedata.load("digits", args.seed)
    common = {"epochs": args.epochs, "batch": 32, "hidden": (1024, 1024), "lr": args.lr,
              "seed": args.seed, "max_steps": args.max_steps}
    runs = _runs(["dsgd", "dad", "edad"], args.ranks, args.introspect, **common)
    results = run_all(images, runs, 2)
    report[images.name] = _report(images.name, results, args.out, args.compare_rank)
    report[images.name]["seeds"] = _over_seeds(images, results, args, common)

    if not args.skip_gru:
        try:
            sequences = sitedata.load(f"uea:{args.uea}", args.seed)
        except sitedata.Unavailable as error:
            print(f"\nGRU part skipped: {error}")
        else:
            common = {**common, "epochs": args.gru_epochs, "hidden": (512, 256)}
            runs = _runs(["dsgd", "dad", "edad"], args.ranks, args.introspect, **common)
            results = run_all(sequences, runs, 2)
            report[sequences.name] = _report(sequences.name, results, args.out,
                                             args.compare_rank)
            report[sequences.name]["seeds"] = _over_seeds(sequences, results, args, common)

    with open(os.path.join(args.out, "dad.json"), "w") as handle:
        json.dump(report, handle, indent=1, default=lambda o: o.tolist()
                  if isinstance(o, np.ndarray) else str(o))
    print(f"\nwrote {args.out}/dad.json and figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
