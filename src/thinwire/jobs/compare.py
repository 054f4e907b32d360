"""Train the same model under several schemes side by side: the job behind ``thinwire compare``.

:func:`compare` spawns local worker processes (gloo) and trains one workload
with the same seed and data shards under each scheme; :func:`table_rows` and
:func:`plot` present its results. The modelled time at a bandwidth is
steps x (compute + overhead + bytes / rate), with one compute probe shared by
every scheme. The flags that drive it are in :mod:`thinwire.cli.compare`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import torch

from thinwire.jobs import common, local_run
from thinwire.jobs.dataparallel import RunOptions, shared_compute_seconds
from thinwire.jobs.sharded import NATIVE, check_sites, run_sharded
from thinwire.launch import DEFAULT_TIMEOUT_S, spawn
from thinwire.progress import StepBar
from thinwire.schemes.registry import split_option, split_spelling

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
    configs: dict[str, type] = {}
    for name in names:  # a local-update run takes its local options and its scheme's
        configs.update(local_run.config_classes(name))
    return common.parse_options(options, configs)


def scheme_config(name: str, ratio: float | None, life_span: int | None,
                  options: list[str]) -> dict[str, Any]:
    """Map the shared command-line knobs onto the options scheme ``name`` has.

    ``--ratio`` sets ``ratio`` on every sparsifier; ``--option KEY=VALUE``
    applies to every scheme with KEY (a key no scheme has is rejected by
    :func:`parse_options`).
    """
    fields = local_run.fields(name)
    config: dict[str, Any] = {}
    if ratio is not None and "ratio" in fields:
        config["ratio"] = ratio
    if life_span is not None and "life_span" in fields:
        config["life_span"] = life_span
    config.update({key: value for key, value in map(split_option, options)
                   if key in fields})
    return config


def _worker(rank: int, world_size: int, runs: list[tuple[str, dict[str, Any]]],
            options: RunOptions, sites: int | None = None) -> list[dict[str, Any]]:
    compute_s = shared_compute_seconds(options)
    bar = StepBar(len(runs) * options.steps, show=rank == 0)
    results = []
    for name, config in runs:
        progress = functools.partial(bar.update, description=name)
        result = (local_run.run(name, config, options, compute_s=compute_s, progress=progress)
                  if sites is None else
                  run_sharded(name, config, options, sites, compute_s=compute_s,
                              progress=progress))
        if rank != 0:  # the other ranks only report their weights, to check replicas
            result = {"weights": result["weights"]}
        results.append(result)
    bar.close()
    return results


def lone_worker(options: RunOptions, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Dense under ``options`` on one worker: the same recipe, seed and probe, no peers
    (and no TensorBoard events: those are the compared runs')."""
    alone = dataclasses.replace(options, tensorboard=None)
    result: dict[str, Any] = spawn(_worker, 1, [("dense", {})], alone,
                                   timeout_s=timeout_s)[0][0]
    result.pop("weights", None)
    return result


def references(results: list[dict[str, Any]], lone: dict[str, Any] | None,
               workers: int) -> list[dict[str, Any]]:
    """The rows every time-to-target table carries beside the schemes, and each scheme's
    ``bound_multiple`` (modified in place).

    * ``lone worker``: the same recipe on one worker, with no communication: its steps
      to target x the compute step of ``results``' shared probe.
    * ``compute-only bound``: ``workers`` workers with free communication: dense's steps
      to target at ``workers`` x the same compute step, the limit of synchronous training.

    Each row carries the recipe (``recipe``) of the runs it sits beside; a row whose
    steps are unknown (no dense run, or the target not reached) has time None.
    """
    first = results[0]
    compute_s = first["compute_ms_per_step"] / 1000.0
    dense = next((r for r in results if r["scheme"] == "dense"), None)
    rows = []
    for name, steps, run, count in (
            ("lone worker", None if lone is None else lone["steps_to_target"], lone, 1),
            ("compute-only bound", None if dense is None else dense["steps_to_target"], dense,
             workers)):
        rows.append({"scheme": name, "reference": True, "workers": count,
                     "recipe": dict(first["recipe"]), "workload": first["workload"],
                     "target": first["target"], "metric": first["metric"],
                     "steps_to_target": steps, "compute_ms_per_step": first["compute_ms_per_step"],
                     "time_to_target_s": None if steps is None else steps * compute_s,
                     "test_accuracy": None if run is None else run["test_accuracy"],
                     "test_score": None if run is None else run["test_score"],
                     "final_loss": None if run is None else run["final_loss"]})
    bound = rows[1]["time_to_target_s"]
    for row in [*results, *rows]:
        time_s = row.get("time_to_target_s")
        row["bound_multiple"] = time_s / bound if time_s is not None and bound else None
        row["vs_dense"] = vs_dense(row, dense)
    return rows


def vs_dense(row: dict[str, Any], dense: dict[str, Any] | None) -> float | None:
    """``row``'s final test metric relative to dense's after the same steps (``0.02``: 2 %
    above it), the figure a user of a fixed step budget reads; None without dense or a
    final metric (the bound is dense itself)."""
    score = row.get("test_score")
    if dense is None or score is None or row.get("scheme") == "compute-only bound":
        return None
    return float(score / dense["test_score"] - 1.0)


def compare(names: list[str], workers: int, options: RunOptions, bandwidth_bps: float,
            ratio: float | None = None, life_span: int | None = None,
            extra: list[str] | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S,
            sites: int | None = None) -> list[dict[str, Any]]:
    """Run every scheme in ``names`` on ``workers`` local ranks; rank 0's results.

    Each result carries what the rank handed to torch.distributed per step
    (``bytes_sent_per_step``), the ring traffic out of and into it
    (``wire_sent_per_step``, ``bytes_received_per_step``, and per collective
    in ``traffic_per_collective``), ``modelled_s``: steps x (the shared
    compute probe + overhead + the larger ring direction / ``bandwidth_bps``), and
    ``time_to_target_s``: the same per-step time x its steps to target (None: not
    reached).

    Args:
        timeout_s: the process group's timeout: a rank waiting longer on a peer
            fails the run with a message naming the ranks and their steps.
        sites: shard the model with FSDP2 inside each of this many sites and send
            the shards across sites through each scheme (traffic and modelled time
            are the cross-site link's); ``native-hsdp`` then names torch's own HSDP.
            None: DDP.

    Raises:
        ValueError: a bad scheme, option or count (before anything is spawned).
        RankFailed: a rank failed or a peer stalled past ``timeout_s``.
    """
    if workers < 1:
        raise ValueError(f"workers={workers!r} must be >= 1")
    spelled = [split_spelling(spelling) for spelling in names]
    bare = [name for name, _ in spelled]
    if sites is not None:
        check_sites(sites, workers)
        local = [name for name in bare if local_run.is_local(name)]
        if local:
            raise ValueError(f"{local[0]!r} takes no --sites: local updates run on the "
                             "workers' own replicas (thinwire.local takes a sharded model "
                             "in Python)")
    elif NATIVE in bare:
        raise ValueError(f"{NATIVE!r} is the sharded anchor: give --sites with it")
    built = [name for name, _ in spelled if name != NATIVE or sites is None]
    parse_options(extra or [], built)  # validate before spawning anything
    runs = []
    for name, own in spelled:
        config: dict[str, Any] = {}
        if name in built:
            parse_options(own, [name])
            config = scheme_config(name, ratio, life_span, [*(extra or []), *own])
            local_run.validate(name, config)
        elif own:
            raise ValueError(f"{name!r} takes no options (got {':'.join(own)})")
        runs.append((name, config))
    per_rank = spawn(_worker, workers, runs, options, sites, timeout_s=timeout_s)
    results: list[dict[str, Any]] = per_rank[0]
    for index, result in enumerate(results):
        result["scheme"] = names[index]  # as spelled: a scheme's settings tell rows apart
        weights = [rank_results[index].pop("weights") for rank_results in per_rank]
        # eager local updates keep each worker's own outer weights: None, nothing to compare
        result["replicas_identical"] = None if (result.get("local") or {}).get("eager") else all(
            all(torch.equal(a, b) for a, b in zip(weights[0], other)) for other in weights[1:])
        dense_bytes = result.pop("dense_shard_bytes", None) or sum(  # sharded: the shard's
            w.numel() * w.element_size() for w in weights[0])
        result["dense_bytes_per_step"] = dense_bytes
        result["compression_ratio"] = dense_bytes / max(result["bytes_sent_per_step"], 1e-9)
        busiest = max(result["wire_sent_per_step"], result["bytes_received_per_step"])
        per_step = (result["compute_ms_per_step"] + result["overhead_ms_per_step"]) / 1000.0
        result["modelled_s"] = options.steps * (per_step + 8.0 * busiest / bandwidth_bps)
        steps = result["steps_to_target"]
        result["time_to_target_s"] = (None if steps is None
                                      else steps * (per_step + 8.0 * busiest / bandwidth_bps))
        result["bandwidth_bps"] = bandwidth_bps
        result["workers"] = workers
    return results


def table_rows(results: list[dict[str, Any]],
               reference_rows: list[dict[str, Any]] | None = None) -> list[list[str]]:
    """One row per reference row (the lone worker and the bound lead), then one per scheme,
    in the order of :func:`header`."""
    def cell(row: dict[str, Any], key: str, form: str) -> str:
        value = row.get(key)
        return "-" if value is None else format(value, form)

    def reached(row: dict[str, Any]) -> str:
        return str(row["steps_to_target"]) if row["steps_to_target"] else "not reached"

    def relative(row: dict[str, Any]) -> str:
        value = row.get("vs_dense")
        return "-" if value is None else f"{100 * value:+.1f} %"

    rows = []
    for r in reference_rows or []:  # no bytes alone; the bound's are free, not measured
        wire = "0" if r["scheme"] == "lone worker" else "-"
        rows.append([f"{r['scheme']} ({r['workers']})", cell(r, "test_score", ".4f"),
                     relative(r), cell(r, "final_loss", ".4f"), wire, wire, wire, "-", "-",
                     "-", "-", reached(r), cell(r, "time_to_target_s", ".2f"),
                     cell(r, "bound_multiple", ".2f")])
    rows += [[r["scheme"], f"{r['test_score']:.4f}", relative(r), f"{r['final_loss']:.4f}",
             f"{r['bytes_sent_per_step']:,.0f}", f"{r['wire_sent_per_step']:,.0f}",
             f"{r['bytes_received_per_step']:,.0f}", f"{r['compression_ratio']:.1f}x",
             f"{r['overhead_ms_per_step']:.3f}", f"{r['wall_s']:.2f}", f"{r['modelled_s']:.2f}",
             reached(r), cell(r, "time_to_target_s", ".2f"), cell(r, "bound_multiple", ".2f")]
             for r in results]
    return rows


def header(bandwidth: str, metric: str = "test accuracy") -> list[str]:
    return ["scheme", metric, "vs dense", "final loss", "handed B/step", "ring sent B/step",
            "ring recv B/step", "ratio vs dense", "overhead ms/step", "wall s",
            f"modelled s @ {bandwidth}", "steps to target", f"s to target @ {bandwidth}",
            "x bound"]


def plot(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """Accuracy against bytes on the wire; the sparsifiers' thresholds across steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    positive = True
    for r in results:
        steps, handed, acc = zip(*r["curve"])
        ax.plot(handed, acc, marker=".", label=r["scheme"])
        positive = positive and min(handed) > 0
    # One worker hands nothing to torch.distributed: no log scale then.
    ax.set(xscale="log" if positive else "linear",
           xlabel="cumulative bytes handed to torch.distributed per worker",
           ylabel=results[0].get("metric", "test accuracy"),
           title=f"{results[0].get('metric', 'test accuracy').capitalize()} against bytes on "
                 "the wire")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_bytes.png", dpi=120)
    plt.close(fig)
    written.append(out / "accuracy_vs_bytes.png")
    traced = [r for r in results if r["threshold_trace"]]
    if traced:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
        for r in traced:
            for layer, points in r["threshold_trace"].items():
                if not layer.endswith("weight"):
                    continue
                calls, taus, densities = zip(*points)
                label = f"{r['scheme']} {layer}"
                line, = axes[0].plot(calls, taus, label=label)
                axes[1].plot(calls, densities, color=line.get_color(), label=label)
        # symlog: a threshold or density of exactly 0 (nothing sent) sits on the axis
        # instead of vanishing from a log scale
        for axis, ylabel, title in ((axes[0], "threshold tau", "Threshold per layer (DCT Fig. 2)"),
                                    (axes[1], "fraction of entries sent", "Achieved density")):
            axis.set_yscale("symlog", linthresh=_floor(axis))
            axis.set_ylim(bottom=0.0)
            axis.set(xlabel="step", ylabel=ylabel, title=title)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="center right", fontsize=7, title="scheme, layer",
                   title_fontsize=7)
        fig.tight_layout(rect=(0.0, 0.0, 0.84, 1.0))
        fig.savefig(out / "threshold.png", dpi=120)
        plt.close(fig)
        written.append(out / "threshold.png")
    return written


def _floor(axis: Any) -> float:
    """Half the smallest positive value plotted on ``axis``: where its log scale starts."""
    positive = [y for line in axis.get_lines() for y in line.get_ydata() if y > 0]
    return min(positive) / 2 if positive else 1e-6
