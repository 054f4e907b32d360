"""Generate docs/results.md and its figures from whatever results files exist.

    python -m benchmarks.report [--results results] [--netem FILE] [--docs docs]

Reads the newest ``results/netem/*/results.json`` (from ``python -m
benchmarks.netem``, needs root) and ``results/overhead/overhead.json`` (from
``python -m benchmarks.overhead``); where ``results/`` has none (a fresh
clone), the copies shipped under ``docs/data/``. Writes ``docs/results.md``, PNG figures
under ``docs/figures/`` and a copy of both files under ``docs/data/``; every
table and figure states the command, machine and date that produced its
numbers, and every number comes from those files.
Numbers taken while other processes used more than a tenth of all cores
(records from before that was measured: a 1-minute load average above half
the cores just before the run) or by ``--quick`` are marked provisional.
"""

from __future__ import annotations

import argparse
import json
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import codec as codec_floors
from benchmarks import convergence, efficiency, faults, linkmodel, step, wire_format
from benchmarks.netem.summary import (
    FRAME_OVERHEAD,
    REFERENCE_ROWS,
    fmt_seconds,
    median_runs,
    reference_rows,
    speedups,
)

BASELINES = ("torch-dense", "torch-powersgd")  # time-to-target ratios are taken against these
SHARED = 0.1  # share of all cores other processes used during a run: above, it is provisional
LOADED = 0.5  # the same from the load average per core just before (records without the share)


def newest_netem(results: Path) -> Path | None:
    found = sorted(results.glob("netem/*/results.json"))
    return found[-1] if found else None


def machine_line(record: dict[str, Any]) -> str:
    m = record["machine"]
    return (f"{m['cpu']}, {m['cores']} cores, Linux {m['kernel']}, Python {m['python']}, "
            f"torch {m['torch']}")


def provisional(record: dict[str, Any]) -> str | None:
    """Why these timings are provisional, or None."""
    reasons = []
    machine = record.get("machine")
    cores = (machine.get("cores") if isinstance(machine, dict) else record.get("cores")) or 1
    load = record.get("load_before")
    others = record.get("others_cpu_share")
    if others is not None:  # measured over the run itself: it decides
        if others > SHARED:
            reasons.append(f"other processes used {100 * others:.0f} % of the machine's CPU "
                           "during the run")
    elif load and load[0] > LOADED * cores:  # older records: the load just before
        reasons.append(f"the machine was loaded (1-minute load average {load[0]:.1f} on "
                       f"{cores} cores before the run)")
    if record.get("quick"):
        reasons.append("it was a --quick run")
    return " and ".join(reasons) or None


def activity(record: dict[str, Any]) -> str:
    """What else the machine was doing, as far as the record says."""
    parts = []
    if record.get("load_before"):
        parts.append(f"1-minute load average {record['load_before'][0]:.1f} before the run")
    if record.get("others_cpu_share") is not None:
        parts.append(f"other processes used {100 * record['others_cpu_share']:.0f} % of the "
                     "machine's CPU during it")
    return ("Machine activity: " + "; ".join(parts) + ".") if parts else ""


def stamp(record: dict[str, Any], machine: str) -> str:
    return f"`{record['command']}` · {machine} · {record['date']}"


def _ok(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The finished runs, one per cell: the median round's (see ``median_runs``)."""
    return median_runs([r for r in record["runs"] if r.get("status") == "ok"])


def _schemes(runs: list[dict[str, Any]]) -> list[str]:
    order: list[str] = []
    for r in runs:
        if r["scheme"] not in order:
            order.append(r["scheme"])
    return order


def _cells(record: dict[str, Any]) -> list[tuple[str, int]]:
    return [(rate, workers) for rate in record["rates"] for workers in record["workers"]]


def netem_section(record: dict[str, Any], source: Path, figures: Path, docs: Path) -> str:
    runs = _ok(record)
    opts = record["options"]
    footer = stamp(record, machine_line(record))
    lines = ["## Shaped links: time to accuracy, step time and its physical limit", "",
             f"Source: `{source}`. Produced by {footer}. {activity(record)}", ""]
    why = provisional(record)
    if why:
        lines += [f"> **Provisional:** {why}; re-run on a quiet machine before quoting.", ""]
    dense_bytes = runs[0]["dense_bytes"] if runs else 0
    lines += [
        f"Model: MLP 64-{'-'.join([str(opts['hidden'])] * opts['depth'])}-10 "
        f"({dense_bytes // 4:,d} parameters, {dense_bytes / 1e6:.1f} MB in fp32) on "
        f"scikit-learn's digits, {opts['batch_size']} samples per worker per step, SGD lr "
        f"{opts['lr']} momentum {opts['momentum']}, seed {opts['seed']}; ratio "
        f"{record.get('ratio', 1 - record.get('sparsity', 0.99)):g}, DCT life-span "
        f"{record['life_span']}, low rank {opts['rank']}. "
        f"Target: {opts['target']:.0%} test accuracy, checked every {opts['eval_every']} steps "
        "(evaluation time is not counted). A run stops at the first check past the target "
        f"(after at least {opts.get('min_steps', '-')} steps) or at its first check after "
        f"{opts.get('cap_s', '-')} s of training ({opts.get('reference_cap_s', '-')} s at "
        f"{record['rates'][0]}, whose runs give the steps that slower links project with), "
        f"and after {opts.get('max_steps', '-')} steps at most. Medians leave out the first "
        f"{opts.get('warmup', '-')} steps. Each worker runs in its own network namespace on a "
        "veth port shaped in both directions:", ""]
    checks = record.get("link_check", {})
    lines += ["| rate | tbf burst (bytes) | tbf queue limit (bytes) | bulk TCP goodput measured |",
              "|---|---|---|---|"]
    lines += [f"| {rate} | {t['burst_bytes']:,d} | {t['limit_bytes']:,d} | "
              + (f"{checks[rate] / 1e6:.1f} Mbit/s ({checks[rate] / t['rate_bps']:.3f} of the "
                 "rate)" if rate in checks else "-") + " |"
              for rate, t in record["tbf"].items()]
    congestion = record.get("tcp_congestion_control")
    lines += ["", f"A perfect link carries {1 / FRAME_OVERHEAD:.3f} of its rate as TCP payload "
              "(1448 bytes per 1514-byte frame)." + drops_sentence(record)
              + (f" The workers' TCP congestion control: {congestion} (the machine's default)."
                 if congestion else ""), ""]
    lines.append("")
    for note in record.get("notes", []):
        lines.append(f"- Note: {note}")
    for r in record["runs"]:
        if r.get("status") != "ok":
            lines.append(f"- {r['scheme']} at {r['rate']}, {r['workers']} workers: "
                         f"{r.get('status')} ({r.get('note', '')})")
    lines.append("")
    lines += time_to_target_table(record, runs)
    figure = figures / "time_to_accuracy.png"
    plot_time_to_target(record, runs, figure, footer)
    lines += [f"![time to accuracy]({figure.relative_to(docs)})", "",
              f"*Figure: time to {opts['target']:.0%} test accuracy per scheme and link. "
              f"{footer}.*", ""]
    lines += floor_tables(record, runs)
    figure = figures / "step_vs_floor.png"
    plot_floor(record, runs, figure, footer)
    lines += [f"![step time against floor]({figure.relative_to(docs)})", "",
              f"*Figure: median step time against its floor compute + bytes/rate. {footer}.*",
              ""]
    lines += bytes_table(record, runs)
    figure = figures / "bytes_vs_workers.png"
    plot_bytes(record, runs, figure, footer)
    lines += [f"![bytes per worker]({figure.relative_to(docs)})", "",
              f"*Figure: bytes each worker sends per step against the number of workers. "
              f"{footer}.*", ""]
    return "\n".join(lines)


def drops_sentence(record: dict[str, Any]) -> str:
    """How many packets the shapers dropped, per rate and worker count."""
    qdisc = record.get("qdisc")
    if not qdisc:
        return ""
    drops = {label: sum(link.get("drops", 0) for link in links.values())
             for label, links in qdisc.items()}
    if not any(drops.values()):
        return " The shapers dropped no packet during the runs."
    return " Packets the shapers dropped: " + ", ".join(
        f"{label} {count:,d}" for label, count in drops.items()) + "."


def time_to_target_table(record: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    target = record["options"]["target"]
    cells = _cells(record)
    ratios = {base: speedups(runs, base) for base in BASELINES}
    header = ["scheme"] + [f"{rate}, {w} workers" for rate, w in cells]
    lines = [f"### Time to {target:.0%} test accuracy (seconds of training)", "",
             "`m` measured in that run; `p` projected: the run hit its time cap first, so it "
             "is the run's own training time plus its median step time for each step a run "
             "of the same scheme needed at another rate (same seed, same trajectory). In "
             "brackets: how many times sooner than torch-dense / torch-powersgd.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_key = {(r["rate"], r["workers"], r["scheme"]): r for r in runs}
    for scheme in _schemes(runs):
        row = [scheme]
        for rate, w in cells:
            r = by_key.get((rate, w, scheme))
            if r is None:
                row.append("")
                continue
            if r["time_to_target_s"] is None:
                row.append(f"not reached ({r['steps']} steps)")
                continue
            kind = "m" if r["time_to_target_kind"] == "measured" else "p"
            vs = " / ".join(f"{ratios[b][(rate, w, scheme)]:.1f}x"
                            if (rate, w, scheme) in ratios[b] else "-" for b in BASELINES)
            row.append(f"{fmt_seconds(r['time_to_target_s'])} {kind} "
                       f"@{r['steps_to_target']} ({vs})")
        lines.append("| " + " | ".join(row) + " |")
    references = reference_rows(runs, record.get("lone"))  # sets each run's bound_multiple
    for name in REFERENCE_ROWS:
        row = [f"**{name}**"]
        for rate, w in cells:
            ref = next((r for r in references if (r["scheme"], r["rate"]) == (name, rate)
                        and (name == "lone worker" or r["workers"] == w)), None)
            row.append("not measured" if ref is None or ref["time_to_target_s"] is None else
                       f"{fmt_seconds(ref['time_to_target_s'])} "
                       f"{'m' if ref['time_to_target_kind'] == 'measured' else 'c'} "
                       f"@{ref['steps_to_target']}")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "**lone worker**: torch-dense with the same recipe and seed on one worker, no "
              "link (`m`: measured; not measured in runs from before the harness ran it); "
              "**compute-only bound**: torch-dense's steps at n workers x the median compute "
              "step (`c`: computed), the limit of synchronous training. Each scheme's time as "
              "a multiple of the bound: " + ", ".join(
                  f"{r['scheme']} {r['rate']} {r['workers']}w {r['bound_multiple']:.2f}x"
                  for r in runs if r.get("bound_multiple")) + "."]
    mismatched = [f"{r['scheme']} at {r['rate']}, {r['workers']} workers" for r in runs
                  if r.get("trajectory_matches") is False]
    lines.append("")
    if mismatched:
        lines += [f"Projected rows whose losses differ from the reference run: "
                  f"{', '.join(mismatched)}.", ""]
    elif any(r.get("trajectory_matches") for r in runs):
        lines += ["Every projected run followed its reference run's losses bit for bit over "
                  "the steps both ran.", ""]
    return lines


def floor_tables(record: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    lines = ["### Step time against the physical limit", "",
             "Floor = compute + bytes / rate, with *bytes* the busier direction of the ring "
             "model of the collectives actually used (thinwire: what its Meter records, "
             "length exchanges included; PyTorch's hooks: counted from the bucket as each "
             "hook's code sends it). *On the wire* is what the link's tbf shapers charged "
             "over the timed steps, sent and received: every frame with its Ethernet, IP "
             "and TCP headers, acknowledgements included (full segments carry "
             f"{100 * (FRAME_OVERHEAD - 1):.1f} % of headers); the wire floor uses it instead. "
             "Compute is one forward, backward and update without communication, timed in the "
             "same processes.", ""]
    header = ["scheme", "step ms (p10-p90)", "compute ms", "codec ms", "ring sent / recv B",
              "on the wire sent / recv B", "floor ms", "step / floor", "step / wire floor"]
    for rate, w in _cells(record):
        chosen = [r for r in runs if (r["rate"], r["workers"]) == (rate, w)]
        if not chosen:
            continue
        lines += [f"**{rate}, {w} workers**", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        for r in chosen:
            refreshes = r.get("threshold_refreshes")
            selected = (f" (thresholds recomputed on {_refresh_share(refreshes, r['steps'])})"
                        if refreshes else "")
            lines.append(
                f"| {r['scheme']} | {1000 * r['median_step_s']:.1f} "
                f"({1000 * r['p10_step_s']:.1f}-{1000 * r['p90_step_s']:.1f}) | "
                f"{1000 * r['compute_s']:.1f} | {1000 * r['overhead_s_per_step']:.1f}{selected} | "
                f"{r['wire_sent_per_step']:,.0f} / {r['bytes_received_per_step']:,.0f} | "
                f"{_bytes(r.get('shaper_tx_per_step'))} / {_bytes(r.get('shaper_rx_per_step'))} "
                f"| {1000 * r['floor_s']:.1f} | {r['floor_ratio']:.2f} | "
                f"{_ratio(r.get('wire_floor_ratio'))} |")
        lines.append("")
    lines += ["*codec ms* is thinwire's own compression and decompression time per step "
              "(inside the step time); PyTorch's hooks do not report theirs.", ""]
    return lines


def _bytes(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _refresh_share(refreshes: dict[str, int], steps: int) -> str:
    """Share of (tensor, step) pairs on which a threshold was selected anew."""
    return f"{100 * sum(refreshes.values()) / max(1, len(refreshes) * steps):.0f} %"


def bytes_table(record: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    rate = record["rates"][0]
    workers = record["workers"]
    header = ["scheme"] + [f"{w} workers: handed / ring sent / on the wire" for w in workers]
    lines = [f"### Bytes per worker per step (at {rate})", "",
             "*handed*: bytes given to torch.distributed; *ring sent*: what the ring "
             "algorithm sends out of each worker; *on the wire*: what the worker's shaper "
             "charged for the frames it sent.",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_key = {(r["workers"], r["scheme"]): r for r in runs if r["rate"] == rate}
    for scheme in _schemes(runs):
        row = [scheme]
        for w in workers:
            r = by_key.get((w, scheme))
            row.append("" if r is None else f"{r['bytes_handed_per_step']:,.0f} / "
                       f"{r['wire_sent_per_step']:,.0f} / "
                       f"{_bytes(r.get('shaper_tx_per_step'))}")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    return lines


def _figure(width: float = 8.0, height: float = 4.4) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def _save(fig: Any, path: Path, footer: str) -> None:
    import matplotlib.pyplot as plt

    wrapped = textwrap.wrap(footer.replace("`", ""), 150)
    fig.text(0.01, 0.01, "\n".join(wrapped), fontsize=6)
    fig.tight_layout(rect=(0, 0.025 + 0.025 * len(wrapped), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_time_to_target(record: dict[str, Any], runs: list[dict[str, Any]], path: Path,
                        footer: str) -> None:
    cells = _cells(record)
    names = _schemes(runs)
    by_key = {(r["rate"], r["workers"], r["scheme"]): r for r in runs}
    fig, ax = _figure()
    width = 0.8 / max(1, len(names))
    for i, scheme in enumerate(names):
        xs, heights, hatches = [], [], []
        for c, (rate, w) in enumerate(cells):
            r = by_key.get((rate, w, scheme))
            if r is not None and r["time_to_target_s"] is not None:
                xs.append(c + i * width)
                heights.append(r["time_to_target_s"])
                hatches.append("//" if r["time_to_target_kind"] == "projected" else "")
        bars = ax.bar(xs, heights, width, label=scheme)
        for bar, hatch in zip(bars, hatches):
            bar.set_hatch(hatch)
    ax.set_xticks([c + width * (len(names) - 1) / 2 for c in range(len(cells))],
                  [f"{rate}\n{w} workers" for rate, w in cells])
    ax.set(ylabel="seconds of training", title=f"Time to {record['options']['target']:.0%} "
                                                "test accuracy (hatched: projected)")
    if any(r["time_to_target_s"] for r in runs):
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no run reached the target", transform=ax.transAxes, ha="center")
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path, footer)


def plot_floor(record: dict[str, Any], runs: list[dict[str, Any]], path: Path,
               footer: str) -> None:
    cells = _cells(record)
    names = _schemes(runs)
    by_key = {(r["rate"], r["workers"], r["scheme"]): r for r in runs}
    fig, ax = _figure()
    width = 0.8 / max(1, len(names))
    for i, scheme in enumerate(names):
        chosen = [(c, by_key[(rate, w, scheme)]) for c, (rate, w) in enumerate(cells)
                  if (rate, w, scheme) in by_key]
        ax.bar([c + i * width for c, _ in chosen],
               [1000 * r["median_step_s"] for _, r in chosen], width, label=scheme)
        ax.scatter([c + i * width for c, _ in chosen], [1000 * r["floor_s"] for _, r in chosen],
                   marker="_", s=200, color="black", zorder=3,
                   label="floor: compute + bytes/rate" if i == 0 else None)
    ax.set_xticks([c + width * (len(names) - 1) / 2 for c in range(len(cells))],
                  [f"{rate}\n{w} workers" for rate, w in cells])
    ax.set(ylabel="ms per step (median, log)", yscale="log",
           title="Measured step time (bars) and its floor (black)")
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path, footer)


def plot_bytes(record: dict[str, Any], runs: list[dict[str, Any]], path: Path,
               footer: str) -> None:
    rate = record["rates"][0]
    fig, ax = _figure(7.0, 4.4)
    for scheme in _schemes(runs):
        chosen = sorted((r["workers"], r) for r in runs
                        if r["rate"] == rate and r["scheme"] == scheme)
        if not chosen:
            continue
        line, = ax.plot([w for w, _ in chosen], [r["wire_sent_per_step"] for _, r in chosen],
                        marker="o", label=scheme)
        charged = [(w, r["shaper_tx_per_step"]) for w, r in chosen
                   if r.get("shaper_tx_per_step") is not None]
        ax.scatter([w for w, _ in charged], [b for _, b in charged], marker="x",
                   color=line.get_color())
    ax.set(xlabel="workers", ylabel="bytes sent per worker per step (log)", yscale="log",
           xticks=record["workers"],
           title="Bytes per worker: ring model (line), charged on the wire (x)")
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path, footer)


def overhead_section(record: dict[str, Any], source: Path, figures: Path, docs: Path,
                     title: str = "Compression overhead per step",
                     figure_name: str = "overhead.png") -> str:
    from benchmarks.overhead import plot

    machine = record["machine"]
    footer = stamp(record, machine)
    sizes = list(record["seconds"])
    codecs = list(record["seconds"][sizes[0]])
    lines = [f"## {title}", "",
             f"Source: `{source}`. Produced by {footer}. {activity(record)}", ""]
    why = provisional(record)
    if why:
        lines += [f"> **Provisional:** {why}; re-run on a quiet machine before quoting.", ""]
    lines += ["Median ms per step, one process; codec rows time compress + decompress of a "
              "flat tensor, `scheme` rows a whole step of the scheme (error feedback "
              "included) on a near-square matrix of the same size. In brackets: against "
              "exact top-k (`topk`), then against the row's floor (the same work in plain "
              "torch ops) where it has one.", "",
              "| codec | " + " | ".join(f"{int(n):,d} entries" for n in sizes) + " |",
              "|" + "---|" * (len(sizes) + 1)]
    for codec in codecs:
        cells = []
        for n in sizes:
            floor = record.get("ratio_vs_floor", {}).get(n, {}).get(codec)
            cells.append(f"{1000 * record['seconds'][n][codec]:.2f} "
                         f"({record['ratio_vs_topk'][n][codec]:.2f}x"
                         + (f"; {floor:.2f}x floor" if floor is not None else "") + ")")
        lines.append(f"| {codec} | " + " | ".join(cells) + " |")
    figure = figures / figure_name
    figure.parent.mkdir(parents=True, exist_ok=True)
    plot(record, figure)
    lines += ["", f"![overhead]({figure.relative_to(docs)})", "",
              f"*Figure: {title[0].lower() + title[1:]}. {footer}.*", ""]
    return "\n".join(lines)


WORKLOAD_FILES = "netem-workload-*.json"  # benchmarks.netem --workload NAME runs, shipped


def workloads_section(records: list[tuple[dict[str, Any], Path]]) -> str:
    """Time to target per scheme on each workload's shaped-link run, one column a workload.

    Args:
        records: ``(results.json of benchmarks.netem --workload NAME, its path)`` each.
    """
    cells = [(record, rate, workers) for record, _ in records
             for rate, workers in _cells(record)]
    header = ["scheme"] + [f"{record['options']['workload']} ({rate}, {workers} workers)"
                           for record, rate, workers in cells]
    lines = ["## Time to target on the workload matrix", "",
             "Each column is one run of `benchmarks.netem --workload NAME` (each workload's "
             "own recipe and target, seed 0; thinwire's sparse schemes couple the momentum). "
             "Seconds of training to the target, `m` measured or `p` projected, `@` the "
             "steps; in brackets how many times sooner than torch-powersgd. With several "
             "rounds (every scheme run once per round, interleaved), a cell is the scheme's "
             "median round and the ratio is of medians.", ""]
    for record, path in records:
        opts = record["options"]
        note = provisional(record)
        rounds = record.get("rounds", 1)
        lines.append(f"- {opts['workload']}: {opts['optimizer']} lr {opts['lr']} momentum "
                     f"{opts['momentum']}, batch {opts['batch_size']} per worker, target "
                     + (f"{opts['target']:g} {opts['metric']}" if opts.get("lower_is_better")
                        else f"{opts['target']:.1%}")
                     + (f", median of {rounds} rounds" if rounds > 1 else "")
                     + f". Source `{path.as_posix()}`: `{record['command']}`, "
                     f"{record['date']}. {activity(record)}"
                     + (f" Provisional: {note}." if note else ""))
    shared = sorted({f"{record['options']['workload']} ({workers} workers)"
                     for record, _, workers in cells
                     if workers > record.get("machine", {}).get("cores", workers)})
    if shared:  # more processes than cores inflate wall time
        lines += ["", f"More workers than cores in {', '.join(shared)}: the workers share "
                  "cores, so each step's compute and time to target are inflated, while the "
                  "lone worker ran alone; the bound there uses the run's own compute step, "
                  "so its multiple is fair."]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    medians = {id(record): median_runs(record["runs"]) for record, _ in records}
    ratios = [speedups(medians[id(record)], "torch-powersgd") for record, _, _ in cells]
    order: list[str] = []
    for record, _, _ in cells:
        order += [name for name in _schemes(record["runs"]) if name not in order]
    for scheme in order:
        row = [scheme]
        for (record, rate, workers), ratio in zip(cells, ratios):
            run = next((r for r in medians[id(record)] if (r["rate"], r["workers"], r["scheme"])
                        == (rate, workers, scheme)), None)
            if run is None:
                row.append("")
            elif run["time_to_target_s"] is None:
                row.append(f"not reached ({run['steps']} steps)")
            else:
                kind = "m" if run["time_to_target_kind"] == "measured" else "p"
                versus = ratio.get((rate, workers, scheme))
                row.append(f"{fmt_seconds(run['time_to_target_s'])} {kind} "
                           f"@{run['steps_to_target']}"
                           + (f" ({versus:.2f}x)" if versus else ""))
        lines.append("| " + " | ".join(row) + " |")
    for name in ("lone worker", "compute-only bound"):  # where the run measured them
        row = [f"**{name}**"]
        for record, rate, workers in cells:  # the lone worker is one worker in every cell
            ref = next((r for r in record.get("references", [])
                        if (r["scheme"], r["rate"]) == (name, rate)
                        and r["workers"] in (1, workers)), None)
            row.append("" if ref is None else "not reached" if ref["time_to_target_s"] is None
                       else f"{fmt_seconds(ref['time_to_target_s'])} "
                            f"{'m' if ref['time_to_target_kind'] == 'measured' else 'c'} "
                            f"@{ref['steps_to_target']}")
        if any(row[1:]):
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "**lone worker**: torch-dense with the same recipe on one worker, no link "
              "(`m` measured); **compute-only bound**: torch-dense's steps at n workers x the "
              "median compute step (`c` computed). A blank: that run predates the rows."]
    return "\n".join(lines) + "\n"


PIECES = "netem-pieces*.json"  # benchmarks.netem --schemes dct-dp,dct-dp:piece=0,...


def pieces_section(records: list[tuple[dict[str, Any], Path]]) -> str:
    """dct-dp's bucket in pieces against one payload: interleaved rounds of netem runs.

    Per file, link and variant, the median over rounds of each round's median
    step, the rounds' range, step / floor and codec time of the median round,
    the median round's time to target, and what ``stream="auto"`` chose.
    """
    lines = ["## dct-dp in pieces", "",
             "dct-dp can send a bucket of at least two pieces' worth of sparse entries in "
             "pieces of `piece` entries (default 1,048,576), each compressed and handed to "
             "torch.distributed before the next is touched "
             "([foundation.md](foundation.md#dct-dp-in-pieces)); "
             "`piece=0` sends one payload, `stream=always` pieces from the first round, and the "
             "default `stream=auto` one payload for a few timed rounds, then pieces where they "
             "pay on the link. Each variant ran once per round, interleaved.", ""]
    for record, path in records:
        lines += [f"Source `{path.as_posix()}`: `{record['command']}` · "
                  f"{machine_line(record)} · {record['date']}. {activity(record)}", "",
                  "| link | variant | median step ms (rounds) | step / floor | codec ms "
                  "| handed B/step | time to target | auto chose |",
                  "|---|---|---|---|---|---|---|---|"]
        medians = median_runs(record["runs"])
        for rate, workers in _cells(record):
            for label in _schemes(record["runs"]):
                rounds = [r for r in record["runs"] if r.get("status") == "ok" and (
                    r["rate"], r["workers"], r["scheme"]) == (rate, workers, label)]
                if not rounds:
                    continue
                steps = sorted(1000 * r["median_step_s"] for r in rounds)
                chosen = next(r for r in medians if (r["rate"], r["workers"], r["scheme"])
                              == (rate, workers, label))
                reached = (f"{fmt_seconds(chosen['time_to_target_s'])} s "
                           f"@{chosen['steps_to_target']}"
                           if chosen["time_to_target_s"] is not None else "not reached")
                choices = sorted({choice for r in rounds
                                  for choice in r.get("streaming", {}).values()})
                auto = ", ".join("pieces" if c else "one payload" for c in choices) or "-"
                lines.append(f"| {rate}, {workers} workers | {label} | "
                             f"{steps[(len(steps) - 1) // 2]:.1f} "
                             f"({', '.join(f'{v:.1f}' for v in steps)}) | "
                             f"{chosen['floor_ratio']:.2f} | "
                             f"{1000 * chosen['overhead_s_per_step']:.1f} | "
                             f"{chosen['bytes_handed_per_step']:,.0f} | {reached} | {auto} |")
        lines += ["", f"Target {record['options']['target']:.0%} test accuracy on the "
                  "shaped-link MLP; *codec ms* counts every piece's compression and decoding, "
                  "most of it while earlier pieces are on the wire."
                  + ("" if any("streaming" in r for r in record["runs"]) else
                     " These runs predate `stream`: `dct-dp` sent in pieces from the first "
                     "round, as `stream=always` does."), ""]
    return "\n".join(lines)


def pays_section(docs: Path, figures: Path) -> list[str]:
    """Where distributing pays: every workload's scaling efficiency, then the modelled time
    to target against link rate with the lone worker and the compute-only bound."""
    scaling = [(json.loads(path.read_text()), path)
               for path in sorted((docs / "data").glob("efficiency-*.json"))]
    modelled = [(json.loads(path.read_text()), path)
                for path in sorted((docs / "data").glob("linkmodel-*.json"))]
    if not scaling and not modelled:
        return []
    parts = ["## Where distributing pays", "",
             "Before any scheme: does the workload gain from more workers at all? A scheme "
             "can at best reach the compute-only bound; where a lone worker beats the bound, "
             "do not distribute.", ""]
    if scaling:
        parts.append(efficiency.section(scaling))
    if modelled:
        parts.append(linkmodel.section(modelled, figures, docs))
    return parts


def render(netem: tuple[dict[str, Any], Path] | None,
           overhead: tuple[dict[str, Any], Path] | None, docs: Path) -> str:
    """The whole page; writes the figures under ``docs/figures``."""
    figures = docs / "figures"
    parts = ["# Measured results", "",
             "<!-- Generated by `python -m benchmarks.report`; do not edit by hand. -->", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M %Z')} by `python -m benchmarks.report` "
             "from the results files named in each section. How the numbers are taken: "
             "[bench.md](bench.md); what they mean for choosing a scheme: "
             "[choosing.md](choosing.md).", ""]
    parts += pays_section(docs, figures)
    if netem is None:
        parts += ["## Shaped links", "", "No results yet. Run `sudo python -m benchmarks.netem` "
                  "(root: network namespaces and tc), then this command again.", ""]
    else:
        parts.append(netem_section(netem[0], netem[1], figures, docs))
    pieces = [(json.loads(path.read_text()), path) for path in sorted((docs / "data").glob(PIECES))]
    if pieces:
        parts.append(pieces_section(pieces))
    workloads = [(json.loads(path.read_text()), path)
                 for path in sorted((docs / "data").glob(WORKLOAD_FILES))]
    if workloads:
        parts.append(workloads_section(workloads))
    if overhead is None:
        parts += ["## Compression overhead per step", "",
                  "No results yet. Run `python -m benchmarks.overhead`, then this command "
                  "again.", ""]
    else:
        parts.append(overhead_section(overhead[0], overhead[1], figures, docs))
    on_gpu = docs / "data" / "overhead-cuda.json"  # benchmarks.overhead --device cuda
    if on_gpu.exists():
        parts.append(overhead_section(json.loads(on_gpu.read_text()), on_gpu, figures, docs,
                                      "Compression overhead per step on a GPU",
                                      "overhead-cuda.png"))
    floors = [(json.loads(path.read_text()), path)  # written by benchmarks.codec
              for path in sorted((docs / "data").glob("codec-floors-*.json"))]
    if floors:
        parts.append(codec_floors.section(floors))
    if (docs / "data" / "convergence.json").exists():  # written by benchmarks.convergence
        record = json.loads((docs / "data" / "convergence.json").read_text())
        parts.append(convergence.section(record, figures, docs))
    for name, render_section in (("wire-format.json", wire_format.section),
                                 ("step.json", step.section)):
        if (docs / "data" / name).exists():  # written by benchmarks.wire_format / .step
            parts.append(render_section(json.loads((docs / "data" / name).read_text())))
    fault_files = sorted((docs / "data").glob("faults-*.json"))  # written by benchmarks.faults
    if fault_files:
        parts.append("## Workers that fail and join\n")
        parts += [faults.section(json.loads(path.read_text()), docs) for path in fault_files]
    return "\n".join(parts).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("results"))
    parser.add_argument("--netem", type=Path, default=None,
                        help="a results.json of benchmarks.netem (default: the newest)")
    parser.add_argument("--overhead", type=Path, default=None,
                        help="an overhead.json (default: results/overhead/overhead.json)")
    parser.add_argument("--docs", type=Path, default=Path("docs"))
    args = parser.parse_args(argv)
    shipped = args.docs / "data"  # a fresh clone has no results/: use what the page ships
    netem_path = args.netem or newest_netem(args.results)
    if netem_path is None and (shipped / "netem.json").exists():
        netem_path = shipped / "netem.json"
    overhead_path = args.overhead or args.results / "overhead" / "overhead.json"
    if not overhead_path.exists() and (shipped / "overhead.json").exists():
        overhead_path = shipped / "overhead.json"
    netem = (json.loads(netem_path.read_text()), netem_path) if netem_path else None
    overhead = ((json.loads(overhead_path.read_text()), overhead_path)
                if overhead_path.exists() else None)
    page = render(netem, overhead, args.docs)
    (args.docs / "results.md").write_text(page)
    shipped.mkdir(parents=True, exist_ok=True)  # the page's numbers travel with it
    for loaded, name in ((netem, "netem.json"), (overhead, "overhead.json")):
        if loaded is not None and loaded[1].resolve() != (shipped / name).resolve():
            (shipped / name).write_text(json.dumps(loaded[0], indent=1))
    print(f"wrote {args.docs / 'results.md'} from {netem_path or 'no netem results'} and "
          f"{overhead_path if overhead else 'no overhead results'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
