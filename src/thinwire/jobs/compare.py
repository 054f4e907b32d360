"""Train the same model under several schemes side by side: the job behind ``thinwire compare``.

:func:`compare` spawns N local ranks (gloo) and trains under each scheme with
the same seed and data shards; :func:`markdown_table` and :func:`plot` present
its results. The flags that drive it are in :mod:`thinwire.cli.compare`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from thinwire import schemes
from thinwire.jobs.dataparallel import RunOptions, run_scheme
from thinwire.launch import DEFAULT_TIMEOUT_S, spawn

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bps": 1, "kbps": 1e3, "mbps": 1e6,
          "gbps": 1e9}


def parse_bandwidth(text: str) -> float:
    """Bits per second from tc-style rates: ``100mbit``, ``1gbit``, ``500kbit``."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)(/s)?\s*", text)
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"bandwidth={text!r} must be a positive rate such as 100mbit or 1gbit "
                         f"(units: {', '.join(_UNITS)})")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def parse_options(options: list[str], names: list[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` texts to a dict, each KEY an option of at least one of ``names``.

    Raises:
        ValueError: a text without ``=``, or a key no scheme in ``names`` has (the
            message lists the valid keys).
    """
    valid = sorted({f.name for name in names
                    for f in dataclasses.fields(schemes.config_class(name))})
    parsed = dict(_split(option) for option in options)
    unknown = [key for key in parsed if key not in valid]
    if unknown:
        raise ValueError(f"--option {unknown[0]!r} is not an option of {', '.join(names)}; "
                         f"valid keys: {', '.join(valid)}")
    return parsed


def _split(option: str) -> tuple[str, Any]:
    key, sep, value = option.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ValueError(f"--option {option!r} must look like KEY=VALUE, e.g. rank=2")
    return key, _parse_value(value)


def scheme_config(name: str, sparsity: float | None, life_span: int | None,
                  options: list[str]) -> dict[str, Any]:
    """Map the shared command-line knobs onto the options scheme ``name`` has.

    ``--sparsity`` sets ``sparsity``, or ``ratio = 1 - sparsity`` for schemes
    that keep a ratio; ``--option KEY=VALUE`` applies to every scheme with KEY
    (a key no scheme has is rejected by :func:`parse_options`).
    """
    fields = {f.name for f in dataclasses.fields(schemes.config_class(name))}
    config: dict[str, Any] = {}
    if sparsity is not None and "sparsity" in fields:
        config["sparsity"] = sparsity
    if sparsity is not None and "ratio" in fields:
        config["ratio"] = 1.0 - sparsity
    if life_span is not None and "life_span" in fields:
        config["life_span"] = life_span
    config.update({key: value for key, value in map(_split, options) if key in fields})
    return config


def _parse_value(value: str) -> Any:
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


def _worker(rank: int, world_size: int, runs: list[tuple[str, dict[str, Any]]],
            options: RunOptions) -> list[dict[str, Any]]:
    bar: tqdm[Any] | None = None

    def advance(steps: int) -> None:
        # The bar starts at the first training step, so data loading, the compute
        # probe and the peers' check do not count as a step (nor inflate its ETA).
        nonlocal bar
        if bar is None:
            bar = tqdm(total=len(runs) * options.steps, disable=rank != 0, unit="step",
                       dynamic_ncols=True, mininterval=1.0)
        bar.set_description(name)
        bar.update(steps)

    results = []
    for name, config in runs:
        result = run_scheme(name, config, options, progress=advance)
        if rank != 0:  # the other ranks only report their weights, to check replicas
            result = {"weights": result["weights"]}
        results.append(result)
    if bar is not None:
        bar.close()
    return results


def compare(names: list[str], workers: int, options: RunOptions, bandwidth_bps: float,
            sparsity: float | None = None, life_span: int | None = None,
            extra: list[str] | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run every scheme in ``names`` on ``workers`` local ranks; rank 0's results.

    Args:
        timeout_s: the process group's timeout: a rank waiting longer on a peer
            fails the run with a message naming the ranks and their steps.

    Raises:
        ValueError: a bad scheme, option or count (before anything is spawned).
        RankFailed: a rank failed or a peer stalled past ``timeout_s``.
    """
    if workers < 1:
        raise ValueError(f"workers={workers!r} must be >= 1")
    parse_options(extra or [], names)  # validate before spawning anything
    runs = [(name, scheme_config(name, sparsity, life_span, extra or [])) for name in names]
    for name, config in runs:
        schemes.build(name, **config)
    per_rank = spawn(_worker, workers, runs, options, timeout_s=timeout_s)
    results: list[dict[str, Any]] = per_rank[0]
    for index, result in enumerate(results):
        weights = [rank_results[index].pop("weights") for rank_results in per_rank]
        result["replicas_identical"] = all(
            all(torch.equal(a, b) for a, b in zip(weights[0], other)) for other in weights[1:])
        dense_bytes = sum(w.numel() * w.element_size() for w in weights[0])
        result["dense_bytes_per_step"] = dense_bytes
        result["compression_ratio"] = dense_bytes / max(result["bytes_sent_per_step"], 1e-9)
        wire = max(result["wire_sent_per_step"], result["bytes_received_per_step"])
        per_step = (result["compute_ms_per_step"] + result["overhead_ms_per_step"]) / 1000.0
        result["modelled_s"] = options.steps * (per_step + 8.0 * wire / bandwidth_bps)
        result["bandwidth_bps"] = bandwidth_bps
        result["workers"] = workers
    return results


def markdown_table(results: list[dict[str, Any]], bandwidth: str) -> str:
    header = ["scheme", "test acc", "final loss", "bytes/step/worker", "ratio vs dense",
              "overhead ms/step", "wall s", f"modelled s @ {bandwidth}", "steps to target"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        rows.append(
            f"| {r['scheme']} | {r['test_accuracy']:.4f} | {r['final_loss']:.4f} | "
            f"{r['bytes_sent_per_step']:,.0f} | {r['compression_ratio']:.1f}x | "
            f"{r['overhead_ms_per_step']:.3f} | {r['wall_s']:.2f} | {r['modelled_s']:.2f} | "
            f"{r['steps_to_target'] or 'not reached'} |")
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy against bytes on the wire; the sparsifiers' thresholds across steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in results:
        steps, handed, acc = zip(*r["curve"])
        ax.plot(handed, acc, marker=".", label=r["scheme"])
    ax.set(xscale="log", xlabel="cumulative bytes handed to torch.distributed per worker",
           ylabel="test accuracy", title="Accuracy against bytes on the wire")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_bytes.png", dpi=120)
    plt.close(fig)
    written.append(out / "accuracy_vs_bytes.png")
    traced = [r for r in results if r["threshold_trace"]]
    if traced:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for r in traced:
            for layer, points in r["threshold_trace"].items():
                if not layer.endswith("weight"):
                    continue
                calls, taus, densities = zip(*points)
                axes[0].plot(calls, taus, label=f"{r['scheme']} {layer}")
                axes[1].plot(calls, densities, label=f"{r['scheme']} {layer}")
        axes[0].set(xlabel="step", ylabel="threshold tau", yscale="log",
                    title="Sparsification threshold per layer (DCT Fig. 2)")
        axes[1].set(xlabel="step", ylabel="fraction of entries sent", yscale="log",
                    title="Achieved density")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "threshold.png", dpi=120)
        plt.close(fig)
        written.append(out / "threshold.png")
    return written
