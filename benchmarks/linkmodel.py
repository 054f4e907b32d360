"""Time to target against link rate, modelled from measured parts, with the two reference rows.

For each worker count, ``thinwire compare``'s job trains the workload under
each scheme until its target (local gloo ranks, the workload's recipe, one
seed) and measures per scheme: steps to target, bytes on the wire per step
(the busier ring direction), the codec's time per step and the collectives per
step; rank 0 alone probes a step's compute. A lone worker trains dense with the
same recipe (alongside, in its own process). Then, at each rate,

    time to target = steps x (compute + codec + bytes / rate + latency),

latency being the collectives per step x the ring's 2(n - 1) hops x the one-way
delay of the rate (``DELAY_S``). The lone worker needs steps x compute and the
compute-only bound dense's steps at n x compute. Nothing here is a wall time of
a shaped link (:mod:`benchmarks.netem` measures those): with more processes
than cores a real run's step is inflated, while these parts are not.

Usage: ``python -m benchmarks.linkmodel --workload text-lm [--workers 2,4]
[--rates 10mbit,100mbit,1gbit] [--out docs/data/linkmodel-text-lm.json]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from thinwire import schemes
from thinwire.jobs import local_run, workloads
from thinwire.jobs.compare import compare, lone_worker, parse_bandwidth, references, split_spelling
from thinwire.jobs.dataparallel import RunOptions, recipe, same_trajectory

SCHEMES = "dense,fp16,topk,dct-dp,powersgd,clt-k"
# One-way delay per link rate: a LAN switch hop for the fast links, between sites over the
# internet for 10 Mbit/s (an assumption stated on the results page, not a measurement).
DELAY_S = {"10mbit": 0.010, "100mbit": 0.0002, "1gbit": 0.0001}
KEPT = ("scheme", "steps_to_target", "compute_ms_per_step", "overhead_ms_per_step",
        "wire_sent_per_step", "bytes_received_per_step", "bytes_sent_per_step",
        "collectives_per_step", "test_score", "test_accuracy", "final_loss", "recipe",
        "replicas_identical", "curve", "probe_compute_ms", "workload", "target", "metric",
        "local", "probe_overhead_ms", "delayed")


def modelled(run: dict[str, Any], workers: int, rate: str) -> float | None:
    """A scheme's time to target at ``rate`` from its measured parts (None: not reached)."""
    return time_at(run, workers, parse_bandwidth(rate), DELAY_S.get(rate, 0.0))


def time_at(run: dict[str, Any], workers: int, rate_bps: float,
            delay_s: float) -> float | None:
    """Time to target at ``rate_bps`` (inf: a free link) and one-way delay ``delay_s``."""
    steps = run.get("steps_to_target")
    if steps is None:
        return None
    wire = max(run["wire_sent_per_step"], run["bytes_received_per_step"])
    latency = run["collectives_per_step"] * 2 * (workers - 1) * delay_s
    busy = (run["compute_ms_per_step"] + run["overhead_ms_per_step"]) / 1000.0
    link = 8.0 * wire / rate_bps + latency
    return float(steps * (busy + exposed(run, link, busy)))


def exposed(run: dict[str, Any], link_s: float, busy_s: float) -> float:
    """The link time per step that training waits for (``link_s`` averaged over steps).

    An exchange that overlaps compute hides behind the steps it overlaps: under
    Streaming DiLoCo the ``delay`` inner steps before a fragment lands, with ``overlap``,
    ``eager`` or ``lookahead`` the whole cycle before the fragment's next sync, and for a
    per-step scheme with ``delayed`` the next step. Each exchange carries the
    link time of the steps between its launches (``every / fragments``; 1 per
    step), and the link carries one exchange at a time, so no more than a step's
    compute hides per step. Otherwise all of ``link_s``.
    """
    local = run.get("local") or {}
    if local.get("overlap") or local.get("eager") or local.get("lookahead"):
        spacing, window = local["every"] / local["fragments"], local["every"]
    elif local.get("delay"):
        spacing, window = local["every"] / local["fragments"], local["delay"]
    elif run.get("delayed"):
        spacing, window = 1, 1
    else:
        return link_s
    return max(0.0, link_s * spacing - window * busy_s, (link_s - busy_s) * spacing) / spacing


def codec_ms(run: dict[str, Any], measured: dict[str, float]) -> float | None:
    """``run``'s codec time per step from a codec file's ``measured`` ms per step (None:
    the file lacks its scheme). A local-update run encodes the whole model once per
    ``every`` steps (its fragments in turn), through its inner scheme and that scheme's
    own options: ``diloco+int4:every=50`` costs int4's time / 50."""
    if run["scheme"] in measured:
        return measured[run["scheme"]]
    name, own = split_spelling(run["scheme"])
    if not local_run.is_local(name) or not run.get("local"):
        return None
    local = {f.name for f in dataclasses.fields(local_run.DiLoCoOptions)}
    inner = ":".join([local_run.inner_scheme(name),
                      *(o for o in own if o.partition("=")[0].replace("-", "_") not in local)])
    return measured[inner] / run["local"]["every"] if inner in measured else None


def compared(path: Path, own: dict[str, Any], workers: int) -> list[dict[str, Any]]:
    """The runs in ``path`` (``thinwire compare`` results, any nesting) of ``workers`` workers
    that trained like ``own``, each local-update run named by its period and the inner
    scheme's options that differ from today's defaults (:func:`today`)."""
    def runs(node: Any) -> list[dict[str, Any]]:
        if isinstance(node, list):
            return [r for item in node for r in runs(item)]
        if not isinstance(node, dict):
            return []
        if "steps_to_target" in node and "scheme" in node:
            return [] if node.get("reference") else [node]
        return [r for value in node.values() for r in runs(value)]

    return [{**run, "scheme": today(run)} for run in runs(json.loads(path.read_text()))
            if run.get("workers") == workers and same_trajectory(run["recipe"], own)]


def today(run: dict[str, Any]) -> str:
    """A local-update run's name in today's spelling, from what it ran (its ``config``):
    a period given by ``--option every=H`` and a default changed since are spelled out
    (``diloco+sparseloco`` at H = 30, run when the mean was over ranks, becomes
    ``diloco+sparseloco:every=30:aggregate=ranks``)."""
    name = split_spelling(run["scheme"])[0]
    if not local_run.is_local(name) or not run.get("local"):
        return run["scheme"]
    inner = local_run.inner_scheme(name)
    defaults = dataclasses.asdict(schemes.config_class(inner)()) if inner != "dense" else {}
    changed = [f"{k}={v}" for k, v in run["config"].items() if k in defaults and v != defaults[k]]
    return ":".join([name, f"every={run['local']['every']}", *changed])


def break_even(run: dict[str, Any], workers: int, lone_s: float | None,
               delay_s: float) -> float | None:
    """The link rate (bits/s) above which ``run`` reaches the target before the lone worker,
    at one-way delay ``delay_s``; None: never (or not reached). Time falls as the rate
    rises, so a bisection on the rate's logarithm finds it."""
    free = time_at(run, workers, math.inf, delay_s)
    if lone_s is None or free is None or free >= lone_s:
        return None
    low, high = 1.0, 1e15  # bits/s: slower than any link, and as good as free
    if time_at(run, workers, low, delay_s) < lone_s:
        return low
    while high / low > 1 + 1e-9:
        middle = math.sqrt(low * high)
        if time_at(run, workers, middle, delay_s) < lone_s:
            high = middle
        else:
            low = middle
    return high


def table(record: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """rate -> "n workers" -> row name -> {time_s, bound_multiple, vs_lone}: every scheme,
    the lone worker and the compute-only bound (whose times do not depend on the rate)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for rate in record["rates"]:
        for n, cell in record["cells"].items():
            rows: dict[str, Any] = {r["scheme"]: modelled(r, int(n), rate) for r in cell["runs"]}
            for ref in cell["references"]:
                rows[ref["scheme"]] = ref["time_to_target_s"]
            bound, lone = rows.get("compute-only bound"), rows.get("lone worker")
            out.setdefault(rate, {})[n] = {
                name: {"time_s": t, "bound_multiple": t / bound if t and bound else None,
                       "vs_lone": lone / t if t and lone else None}
                for name, t in rows.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="text-lm", choices=sorted(workloads.WORKLOADS))
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    parser.add_argument("--schemes", default=SCHEMES,
                        help="comma-separated, each NAME or NAME:KEY=VALUE; dense first "
                             "(with --add-to: any, or none to only recompute the table)")
    parser.add_argument("--rates", default="10mbit,100mbit,1gbit")
    parser.add_argument("--steps", type=int, default=None,
                        help="step budget per run (default: the recipe's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--lone-from", type=Path, default=None,
                        help="take the lone worker from this file of an earlier run with the "
                             "same recipe instead of training it again")
    parser.add_argument("--compute-ms", type=float, default=None,
                        help="a step's compute measured apart (benchmarks.efficiency records "
                             "it) for every row, where the run's own probe shares the cores "
                             "with other work; the probe is kept as probe_compute_ms")
    parser.add_argument("--codec-from", type=Path, default=None,
                        help="a benchmarks.codec file: its codec time for every scheme it has, "
                             "measured apart on a quiet machine, in place of the run's own "
                             "(kept as probe_overhead_ms)")
    parser.add_argument("--add-to", type=Path, default=None,
                        help="add this run's schemes to the cells of this earlier file of the "
                             "same recipe (its dense and lone worker stand; a scheme measured "
                             "again replaces its row), so --schemes need not start with dense")
    parser.add_argument("--runs-from", type=Path, action="append", default=[],
                        help="add the runs of this file of thinwire compare results (any "
                             "nesting of its 'runs' lists) trained with this recipe and seed, "
                             "instead of training them again (a row of the same name and a "
                             "longer budget already in --add-to's file stands); repeatable")
    parser.add_argument("--out", type=Path, default=None,
                        help="default docs/data/linkmodel-WORKLOAD.json, or --add-to's file")
    args = parser.parse_args(argv)
    names = [s for s in args.schemes.split(",") if s]
    earlier = json.loads(args.add_to.read_text()) if args.add_to is not None else None
    if earlier is None and (not names or names[0] != "dense"):
        parser.error("--schemes must start with dense (the bound's steps)")
    own = workloads.RECIPES[args.workload]
    options = RunOptions(workload=args.workload, optimizer=own["optimizer"], lr=own["lr"],
                         momentum=own["momentum"], batch_size=own["batch_size"],
                         steps=args.steps or own["steps"], seed=args.seed,
                         eval_every=args.eval_every, eval_rows=None, until_target=True)
    load = os.getloadavg()
    started = time.perf_counter()
    measured: dict[int, list[dict[str, Any]]] = {}
    if earlier is not None and not same_trajectory(earlier["recipe"], recipe(options)):
        parser.error(f"--add-to {args.add_to}: its recipe {earlier['recipe']} is not this "
                     f"run's {recipe(options)}")
    reuse = args.lone_from is not None or earlier is not None
    with ThreadPoolExecutor(1) as pool:  # the lone worker trains beside the others
        pending = None if reuse else pool.submit(lone_worker, options)
        for n in (int(w) for w in args.workers.split(",")):
            measured[n] = compare(names, n, options, parse_bandwidth("100mbit")) if names else []
            # a run read in gives way to a longer one of its name already in the file: the
            # same trajectory, cut shorter
            longer = {r["scheme"]: r["recipe"]["steps"] for r in
                      (earlier or {}).get("cells", {}).get(str(n), {}).get("runs", [])}
            measured[n] += [r for path in args.runs_from
                            for r in compared(path, recipe(options), n)
                            if longer.get(r["scheme"], 0) < r["recipe"]["steps"]]
            print(n, [(r["scheme"], r["steps_to_target"]) for r in measured[n]], flush=True)
        lone = (pending.result() if pending is not None else earlier["lone"]
                if earlier is not None else json.loads(args.lone_from.read_text())["lone"])
    if not same_trajectory(lone["recipe"], recipe(options)):
        parser.error(f"--lone-from {args.lone_from}: its recipe {lone['recipe']} is not this "
                     f"run's {recipe(options)}")
    print(f"lone worker: {lone['steps_to_target']} steps", flush=True)
    cells: dict[str, Any] = {}
    codec = json.loads(args.codec_from.read_text()) if args.codec_from is not None else None
    for n, results in measured.items():
        if args.compute_ms is not None:  # measured apart, on a quieter machine
            for run in results:
                run["probe_compute_ms"] = run["compute_ms_per_step"]
                run["compute_ms_per_step"] = args.compute_ms
        kept = [{k: r.get(k) for k in KEPT} for r in results]
        if earlier is not None and str(n) in earlier["cells"]:
            new = {r["scheme"] for r in kept}
            kept = [r for r in earlier["cells"][str(n)]["runs"] if r["scheme"] not in new] + kept
        if codec is not None:  # measured apart, on a quieter machine
            for run in kept:
                ms = codec_ms(run, codec["ms_per_step"])
                if ms is not None:
                    if run.get("probe_overhead_ms") is None:  # the run's own, kept once
                        run["probe_overhead_ms"] = run["overhead_ms_per_step"]
                    run["overhead_ms_per_step"] = ms
        if kept:
            cells[str(n)] = {"runs": kept, "references": references(kept, lone, n)}
    if earlier is not None:  # the worker counts this run did not measure stand as they were
        cells = {**earlier["cells"], **cells}
    work = workloads.load(args.workload)
    record: dict[str, Any] = {
        "workload": args.workload, "metric": work.metric, "target": work.target,
        "recipe": recipe(options), "options": dataclasses.asdict(options),
        "rates": args.rates.split(","), "delay_s": DELAY_S, "cells": cells,
        "lone": {k: lone.get(k) for k in KEPT},
        "command": " ".join(["python -m benchmarks.linkmodel",
                             *(sys.argv[1:] if argv is None else argv)]),
        "codec_from": None if codec is None else {
            k: codec.get(k) for k in ("command", "when", "load_before", "load_after")},
        "earlier": None if earlier is None else {
            k: earlier.get(k) for k in ("command", "when", "load_before", "load_after",
                                        "earlier")},
        "when": time.strftime("%Y-%m-%d %H:%M %Z"), "load_before": list(load),
        "load_after": list(os.getloadavg()), "cores": os.cpu_count(),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "seconds": time.perf_counter() - started}
    record["table"] = table(record)
    record["break_even_bps"] = {  # at the fast links' delay: where distributing starts to pay
        n: {r["scheme"]: break_even(r, int(n), next(
            (x["time_to_target_s"] for x in cell["references"] if x["scheme"] == "lone worker"),
            None), DELAY_S["100mbit"]) for r in cell["runs"]}
        for n, cell in cells.items()}
    out = args.out or args.add_to or Path(f"docs/data/linkmodel-{args.workload}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    for rate, by_n in record["table"].items():
        for n, rows in by_n.items():
            print(rate, n, {k: (round(v["time_s"], 2) if v["time_s"] else None,
                                round(v["bound_multiple"], 2) if v["bound_multiple"] else None)
                            for k, v in rows.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


REFERENCE_ROWS = ("lone worker", "compute-only bound")


def measurements(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs that made ``record``, earliest first: each later one added to (--add-to)
    or recomputed the earlier file."""
    chain = []
    while record:
        chain.append(record)
        record = record.get("earlier") or {}
    return chain[::-1]


def section(records: list[tuple[dict[str, Any], Path]], figures: Path, docs: Path) -> str:
    """Markdown: per workload, time to target at each rate and worker count for every scheme
    and the two reference rows, each as a multiple of the bound; one figure per workload."""
    lines = ["### Time to target against link rate (modelled from measured parts)", "",
             "Per workload and worker count, `thinwire compare`'s job trained every scheme to "
             "the target on local ranks and measured its steps, bytes per step (the busier "
             "ring direction), codec time and collectives per step; rank 0 alone measured a "
             "step's compute. Time to target = steps x (compute + codec + bytes / rate + "
             "latency), latency = collectives x 2(n - 1) ring hops x an assumed one-way delay "
             "per rate. These are not wall times of shaped links: with more worker processes "
             "than this machine's cores a real run's step is inflated, so times for n > 2 "
             "are given from their parts. *lone worker*: dense, same recipe and seed, one "
             "worker, no communication (steps x compute); *compute-only bound*: dense's "
             "steps at n x compute, the limit of synchronous training. In brackets: the time "
             "as a multiple of the bound (`x bound`), then how many times sooner than the "
             "lone worker. `dense` and `fp16` send what PyTorch's `allreduce_hook` and "
             "`fp16_compress_hook` send. A local-update row (`diloco...`) spreads each "
             "sync's bytes, calls and codec over the steps between syncs; under Streaming "
             "DiLoCo (`delay` > 0) a fragment's exchange overlaps `delay` steps of compute "
             "and only the rest of its link time counts. `NAME:KEY=VALUE` is a scheme run "
             "with its own options.", ""]
    for record, path in records:
        rates, table_ = record["rates"], record["table"]
        counts = sorted(record["cells"], key=int)
        header = ["scheme"] + [f"{rate}, {n} workers" for n in counts for rate in rates]
        names = [r["scheme"] for r in record["cells"][counts[0]]["runs"]] + list(REFERENCE_ROWS)
        steps = {(n, r["scheme"]): r["steps_to_target"] for n in counts
                 for r in [*record["cells"][n]["runs"], *record["cells"][n]["references"]]}
        compute = record["cells"][counts[0]]["runs"][0]["compute_ms_per_step"]
        recipe = record["recipe"]
        lines += [f"#### {record['workload']}: to {record['target']:g} {record['metric']}", "",
                  f"{recipe['optimizer']} lr {recipe['lr']:g}, momentum {recipe['momentum']}, "
                  f"batch {recipe['batch_size']} per worker, seed {recipe['seed']}; a compute "
                  f"step {compute:.1f} ms. One-way delay assumed: " + ", ".join(
                      f"{rate} {1000 * record['delay_s'][rate]:g} ms" for rate in rates)
                  + f". Source `{path.as_posix()}`, measured by " + "; then ".join(
                      f"`{m['command']}` (load average {m['load_before'][0]:.1f} before, "
                      f"{m['load_after'][0]:.1f} after)" for m in measurements(record))
                  + f", on {record['cores']} cores.", "",
                  "| " + " | ".join(header) + " | steps (" + " / ".join(
                      f"{n} workers" for n in counts) + ") |",
                  "|" + "---|" * (len(header) + 1)]
        for name in names:
            row = [f"**{name}**" if name in REFERENCE_ROWS else name]
            for n in counts:
                for rate in rates:
                    cell = table_[rate][n].get(name)
                    if cell is None or cell["time_s"] is None:
                        row.append("not reached")
                        continue
                    multiple = cell["bound_multiple"]
                    row.append(f"{cell['time_s']:.1f} s ({multiple:.2f}x, "
                               f"{cell['vs_lone']:.2f}x)" if multiple and cell["vs_lone"]
                               else f"{cell['time_s']:.1f} s")
            row.append(" / ".join(str(steps.get((n, name)) or "-") for n in counts))
            lines.append("| " + " | ".join(row) + " |")
        runs = [r for n in counts for r in record["cells"][n]["runs"]]
        missed = [f"{r['scheme']} ({r['test_score']:.2f} {record['metric']} after its "
                  f"{r['recipe']['steps']} steps)" for r in runs
                  if r["steps_to_target"] is None and r.get("test_score") is not None]
        codec = record.get("codec_from")
        probes = sorted({round(r["probe_compute_ms"], 1) for r in runs
                         if r.get("probe_compute_ms") is not None})
        lines += ["", ("Codec ms per step, measured apart on the workload's gradient "
                       f"(`{codec['command']}`, load average {codec['load_before'][0]:.1f}) "
                       "where it has the scheme, else as measured in the run: " if codec else
                       "Codec ms per step as measured in the run (inside the load it ran "
                       "under): ")
                  + ", ".join(f"{r['scheme']} {r['overhead_ms_per_step']:.1f}"
                              for r in runs) + "."
                  + (f" Not reached: {', '.join(missed)}." if missed else "")
                  + (f" The compute step is `--compute-ms`; the run's own probe read "
                     f"{', '.join(map(str, probes))} ms on the busy machine." if probes
                     else "")]
        even = record.get("break_even_bps", {})
        lines += ["", "Link rate above which a scheme reaches the target before the lone "
                  "worker (the fast links' delay): " + "; ".join(
                      f"{n} workers: " + ", ".join(
                          f"{name} {_rate(bps)}" for name, bps in even[n].items())
                      for n in counts if n in even) + "."]
        figure = figures / f"time_vs_rate_{path.stem.removeprefix('linkmodel-')}.png"
        plot(record, figure)
        lines += ["", f"![time to target against link rate]({figure.relative_to(docs)})", "",
                  f"*Figure: {record['workload']}, modelled time to {record['target']:g} "
                  f"{record['metric']} against link rate per scheme, with the lone worker and "
                  "the compute-only bound. Source as the table's.*", ""]
    return "\n".join(lines)


def _rate(bps: float | None) -> str:
    if bps is None:
        return "never"
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.1f} Mbit/s"


def plot(record: dict[str, Any], path: Path) -> None:
    """Time to target against link rate, one panel per worker count (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(record["cells"], key=int)
    rates = sorted(record["rates"], key=parse_bandwidth)
    fig, axes = plt.subplots(1, len(counts), figsize=(8.5 * len(counts), 4.6), squeeze=False)
    colours = plt.get_cmap("tab20").colors
    for axis, n in zip(axes[0], counts):
        xs = [parse_bandwidth(rate) / 1e6 for rate in rates]
        for index, run in enumerate(record["cells"][n]["runs"]):
            ys = [record["table"][rate][n][run["scheme"]]["time_s"] for rate in rates]
            local = local_run.is_local(split_spelling(run["scheme"])[0])
            if all(y is not None for y in ys):  # local updates dashed, per-step solid
                axis.plot(xs, ys, marker="s" if local else "o", linestyle="--" if local else "-",
                          color=colours[index % len(colours)], label=run["scheme"])
        for name, style in zip(REFERENCE_ROWS, ("k--", "k:")):
            value = record["table"][rates[0]][n][name]["time_s"]
            if value is not None:
                axis.axhline(value, linestyle=style[1:], color="k", label=name)
        axis.set(xscale="log", yscale="log", xlabel="link rate (Mbit/s)",
                 ylabel=f"time to {record['target']:g} {record['metric']} (s)",
                 title=f"{record['workload']}, {n} workers")
        axis.grid(alpha=0.3, which="both")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
