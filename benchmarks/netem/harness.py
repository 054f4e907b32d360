"""Time to accuracy and step time on real shaped links, against PyTorch's own hooks.

    sudo python -m benchmarks.netem            # the full run: 1gbit and 100mbit, 2 and 4 workers
    sudo python -m benchmarks.netem --quick    # ~2 minutes: 100mbit, 2 workers, short runs
    sudo python -m benchmarks.netem --cleanup  # remove namespaces left by a killed run
    sudo python -m benchmarks.netem --sites 2 --workers 4 --workload text-lm --rates 100mbit

One network namespace per worker, each joined by a veth pair to a bridge
namespace; both directions of every link shaped by tbf at the chosen rate.
For each rate and worker count, one worker per namespace (``ip netns exec``,
gloo bound to the veth, ``tcp://`` rendezvous on the namespace addresses)
trains the demo MLP (or ``--workload NAME``, a workload of ``thinwire
compare`` with its recipe) under each scheme in turn until the target
accuracy or the time cap. With ``--sites S``, one namespace per site holds that site's
ranks (FSDP2 over them, on the namespace's loopback) and only the links between sites
are shaped; the workers train as ``thinwire compare --sites`` does, and each run records
whether the shaped ports carried the cross-site bytes alone. Writes
``results/netem/<time>/results.json`` (and the workers' logs beside it);
``python -m benchmarks.report`` turns it into docs/results.md.
Everything it creates is removed on exit, Ctrl-C, SIGTERM or failure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from tqdm import tqdm

import thinwire
from benchmarks.machine import CpuWatch, cpu_model
from benchmarks.netem import net
from benchmarks.netem.anchors import ANCHORS
from benchmarks.netem.summary import (
    derive,
    fmt_seconds,
    median_runs,
    reference_rows,
    site_check_summary,
)
from benchmarks.netem.worker import label_of
from thinwire import schemes
from thinwire.jobs import local_run
from thinwire.jobs.compare import parse_bandwidth, scheme_config, split_spelling
from thinwire.jobs.sharded import NATIVE
from thinwire.jobs.workloads import RECIPES, WORKLOADS, load
from thinwire.schemes.registry import split_option

# The line-up: PyTorch's own anchors, then thinwire's schemes (skipped until registered).
DEFAULT_SCHEMES = ("torch-dense", "torch-fp16", "torch-powersgd", "dct-dp", "topk", "clt-k",
                   "powersgd")
# With --sites: torch's own HSDP as the anchor (DDP's anchors do not shard), then thinwire's.
SITE_SCHEMES = (NATIVE, "dense", "topk", "powersgd")
REPO = Path(__file__).resolve().parents[2]
BASE_PORT = 29500

# The default workload: the demo MLP, widened, on digits, and the recipe it trains with.
DEMO = "demo"
DEMO_RECIPE = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "batch_size": 32,
               "target": 0.95, "metric": "test accuracy", "lower_is_better": False}

# Defaults of the full run and of --quick (explicit flags win over both).
FULL = {"rates": "1gbit,100mbit", "workers": "2,4", "cap_s": 30.0, "reference_cap_s": 90.0,
        "max_steps": 400}
QUICK = {"rates": "100mbit", "workers": "2", "cap_s": 8.0, "reference_cap_s": 8.0,
         "max_steps": 200}

DCT_LIFE_SPAN = schemes.config_class("dct-dp")().life_span  # dct-dp's own default
LONE = {"name": "torch-dense", "config": {}}  # run on one worker: the lone-worker row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.netem", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"a ~2 minute check: {QUICK}")
    parser.add_argument("--cleanup", action="store_true",
                        help=f"only remove leftover '{net.PREFIX}*' namespaces of runs that "
                             "are no longer running, then exit")
    parser.add_argument("--rates", default=None,
                        help=f"comma-separated tc rates, fastest first (default {FULL['rates']})")
    parser.add_argument("--workers", default=None,
                        help=f"comma-separated worker counts (default {FULL['workers']})")
    parser.add_argument("--sites", type=int, default=None,
                        help="hybrid sharding across S sites: the ranks of a site share one "
                             "namespace (FSDP2 inside it, on loopback) and only the links "
                             "between sites are shaped; every worker count must be a "
                             "multiple of S (default: no sites, one namespace per worker)")
    parser.add_argument("--schemes", default=None,
                        help="comma-separated (default: "
                             f"{','.join(DEFAULT_SCHEMES)}; with --sites "
                             f"{','.join(SITE_SCHEMES)}); torch-dense, torch-fp16, "
                             f"torch-powersgd are PyTorch's own DDP anchors and {NATIVE} "
                             "its HSDP (with --sites only), the rest thinwire's; "
                             "'all' = every one. "
                             "NAME:KEY=VALUE[:KEY=VALUE] runs a variant of thinwire's "
                             "scheme NAME under that label, e.g. dct-dp:scope=bucket")
    parser.add_argument("--workload", default=DEMO, choices=[DEMO, *sorted(WORKLOADS)],
                        help=f"what the workers train: '{DEMO}' (default), the MLP of --hidden "
                             "and --depth on digits, or a workload of thinwire compare with "
                             "its recipe (optimiser, lr, momentum, batch size, target)")
    parser.add_argument("--hidden", type=int, default=2048,
                        help=f"MLP width (default 2048; {DEMO} only)")
    parser.add_argument("--depth", type=int, default=2,
                        help=f"MLP hidden layers (default 2; {DEMO} only)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"samples per worker (default: {DEMO_RECIPE['batch_size']}, or "
                             "the workload's)")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"default: {DEMO_RECIPE['lr']}, or the workload's")
    parser.add_argument("--momentum", type=float, default=None,
                        help=f"SGD momentum or AdamW's beta1 (default: "
                             f"{DEMO_RECIPE['momentum']}, or the workload's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every scheme this many times, interleaved round by round; "
                             "tables and the page take each scheme's median run")
    parser.add_argument("--target", type=float, default=None,
                        help=f"test metric to reach (default: {DEMO_RECIPE['target']} accuracy, or "
                             "the workload's)")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--steps", dest="max_steps", type=int, default=None,
                        help=f"steps per run at most (default {FULL['max_steps']})")
    parser.add_argument("--cap-s", type=float, default=None,
                        help="training seconds after which a run stops at its next "
                             f"evaluation (default {FULL['cap_s']})")
    parser.add_argument("--reference-cap-s", type=float, default=None,
                        help="the cap at the first (fastest) rate, whose runs give the steps "
                             "to target that slower links project with (default "
                             f"{FULL['reference_cap_s']})")
    parser.add_argument("--warmup", type=int, default=3,
                        help="first steps left out of medians and bytes per step")
    parser.add_argument("--min-steps", type=int, default=20,
                        help="steps timed at least, even once the target is reached")
    parser.add_argument("--ratio", type=float, default=0.01,
                        help="fraction of the entries sparsifiers keep, in (0, 1]")
    parser.add_argument("--life-span", type=int, default=DCT_LIFE_SPAN,
                        help=f"DCT threshold life-span (default {DCT_LIFE_SPAN}, dct-dp's own)")
    parser.add_argument("--rank", type=int, default=2,
                        help="low-rank factor rank (torch-powersgd and schemes with 'rank')")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="set KEY on every thinwire scheme that has it")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="collective timeout inside the workers")
    parser.add_argument("--out", type=Path, default=Path("results/netem"))
    return parser


def recipe(workload: str, seed: int = 0) -> dict[str, Any]:
    """Optimiser, lr, momentum, batch size and target of ``workload``.

    Raises:
        FileNotFoundError: the workload's data set is not installed (Fashion-MNIST).
    """
    if workload == DEMO:
        return dict(DEMO_RECIPE)
    chosen = RECIPES[workload]
    work = load(workload, seed=seed)
    return {key: chosen[key] for key in ("optimizer", "lr", "momentum", "batch_size")} | {
        "target": work.target, "metric": work.metric, "lower_is_better": work.lower_is_better}


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick and --workload and validate the numbers."""
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key, value in recipe(args.workload, args.seed).items():  # explicit flags win
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.schemes is None:
        args.schemes = ",".join(SITE_SCHEMES if args.sites is not None else DEFAULT_SCHEMES)
    args.rate_list = [r.strip() for r in args.rates.split(",") if r.strip()]
    args.rate_bps = [parse_bandwidth(r) for r in args.rate_list]
    try:
        args.worker_list = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"workers={args.workers!r} must be comma-separated integers") from None
    if not args.worker_list or min(args.worker_list) < 2 or max(args.worker_list) > 64:
        raise ValueError(f"workers={args.workers!r} must list counts in [2, 64]")
    if args.sites is not None:
        check_site_counts(args.sites, args.worker_list)
    if not args.lower_is_better and not 0 < args.target <= 1:
        raise ValueError(f"target={args.target!r} must be in (0, 1]")
    if args.lower_is_better and not args.target > 0:
        raise ValueError(f"target={args.target!r} ({args.metric}) must be > 0")
    for name in ("eval_every", "max_steps", "hidden", "depth", "batch_size", "rank", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name}={getattr(args, name)!r} must be >= 1")
    for name in ("cap_s", "reference_cap_s"):
        if getattr(args, name) <= 0:
            raise ValueError(f"{name}={getattr(args, name)!r} must be > 0")
    if args.warmup < 0 or args.warmup >= args.max_steps:
        raise ValueError(f"warmup={args.warmup!r} must be in [0, max_steps)")
    return args


def check_site_counts(sites: int, workers: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``sites`` >= 2 sites split every worker count evenly.

    One site would leave no link to shape; a count that ``sites`` does not divide has no
    equal shards per site (:func:`thinwire.jobs.sharded.check_sites`).
    """
    if isinstance(sites, bool) or not isinstance(sites, int) or not 2 <= sites <= 250:
        raise ValueError(f"sites={sites!r} must be an integer in [2, 250] (one site has no "
                         "link between sites to shape)")
    uneven = [w for w in workers if w % sites]
    if uneven:
        raise ValueError(f"workers={','.join(map(str, workers))!r}: {uneven[0]} workers do not "
                         f"split into {sites} sites evenly; give multiples of {sites}")


def plan(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """The scheme entries to run, and notes on requested names that are not available."""
    sited = getattr(args, "sites", None) is not None
    anchors = (NATIVE,) if sited else tuple(ANCHORS)
    requested = ([*anchors, *schemes.names()] if args.schemes == "all"
                 else [s.strip() for s in args.schemes.split(",") if s.strip()])
    entries, notes = [], []
    options = [f"rank={args.rank}", *args.option]  # an explicit --option KEY=VALUE wins
    for label in requested:
        name, variant = split_spelling(label)
        if name in (*ANCHORS, NATIVE) and name not in anchors:
            raise ValueError(f"{label!r} is a {'DDP' if sited else 'sharded (--sites)'} "
                             f"anchor; {'with' if sited else 'without'} --sites use "
                             f"{', '.join(anchors)}")
        if name in anchors:
            if variant:
                raise ValueError(f"{label!r}: PyTorch's {name} takes no options")
            entries.append({"name": name, "config": {}})
        elif name in schemes.names() or local_run.is_local(name):
            if sited and local_run.is_local(name):
                raise ValueError(f"{label!r} takes no --sites: local updates run on the "
                                 "workers' own replicas")
            fields = local_run.fields(name)  # diloco+SCHEME: the local options and SCHEME's
            unknown = sorted(key for key, _ in map(split_option, variant) if key not in fields)
            if unknown:
                raise ValueError(f"{label!r}: {name} has no option {', '.join(unknown)} "
                                 f"(it has {', '.join(sorted(fields))})")
            config = scheme_config(name, args.ratio, args.life_span, [*options, *variant])
            local_run.validate(name, config)  # a bad option fails here, before any namespace
            entries.append({"name": name, "config": config, **({"label": label} if variant
                                                                 else {})})
        else:
            notes.append(f"skipping {label!r}: not registered in this build of thinwire "
                         f"(registered: {', '.join(schemes.names())})")
    return entries, notes


def worker_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"workload": args.workload, "optimizer": args.optimizer,
            "hidden": args.hidden, "depth": args.depth, "batch_size": args.batch_size,
            "lr": args.lr, "momentum": args.momentum, "seed": args.seed, "target": args.target,
            "metric": args.metric, "lower_is_better": args.lower_is_better,
            "eval_every": args.eval_every, "max_steps": args.max_steps, "cap_s": args.cap_s,
            "warmup": args.warmup, "min_steps": max(args.min_steps, args.warmup + 1),
            "rank": args.rank, "timeout_s": args.timeout_s, "threads": 1,
            "interface": net.WORKER_IF, "sites": getattr(args, "sites", None)}


def worker_command(namespace: str, python: str, rank: int, world_size: int, port: int,
                   spec: Path, out: Path) -> list[str]:
    """``ip netns exec`` line that starts one worker inside its namespace."""
    return ["ip", "netns", "exec", namespace, python, "-m", "benchmarks.netem.worker",
            "--rank", str(rank), "--world-size", str(world_size),
            "--init-method", f"tcp://{net.address(0)}:{port}", "--spec", str(spec),
            "--out", str(out)]


def worker_env() -> dict[str, str]:
    """Gloo bound to the veth; thinwire and benchmarks importable; one thread each."""
    paths = [str(REPO), str(Path(thinwire.__file__).resolve().parents[1])]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "GLOO_SOCKET_IFNAME": net.WORKER_IF, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(paths)}


class Launcher:
    """Starts workers in the namespaces and stops them (only them) on any exit."""

    def __init__(self, topology: net.Topology, folder: Path, deadline_s: float) -> None:
        self.topology = topology
        self.folder = folder
        self.deadline_s = deadline_s  # seconds without a finished scheme before giving up
        self.processes: list[subprocess.Popen[bytes]] = []
        self.launches = 0

    def run(self, workers: int, entries: list[dict[str, Any]], options: dict[str, Any],
            label: str, progress: tqdm) -> list[dict[str, Any]]:
        """Run ``entries`` on ``workers`` ranks; relaunch after a failed or hung scheme."""
        results: list[dict[str, Any]] = []
        remaining = list(entries)
        while remaining:
            done = self._launch(workers, remaining, options, label, progress)
            results += done
            if len(done) < len(remaining):  # the next scheme left no line: it hung or crashed
                results.append({"scheme": label_of(remaining[len(done)]), "status": "failed",
                                "note": "no result: the workers hung or died (see the logs)"})
                progress.update(1)
            remaining = remaining[len(done) + 1:]
        return results

    def _launch(self, workers: int, entries: list[dict[str, Any]], options: dict[str, Any],
                label: str, progress: tqdm) -> list[dict[str, Any]]:
        self.launches += 1
        folder = self.folder / f"{label}-{self.launches}"
        folder.mkdir(parents=True, exist_ok=True)
        spec = folder / "spec.json"
        spec.write_text(json.dumps({"schemes": entries, "options": options}, indent=2))
        port = BASE_PORT + self.launches
        env = worker_env()
        for rank in range(workers):
            log = (folder / f"rank{rank}.log").open("wb")
            command = worker_command(self.topology.namespace(rank, workers), sys.executable,
                                     rank, workers, port, spec, folder)
            self.processes.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=log,
                                                   stderr=subprocess.STDOUT,
                                                   start_new_session=True))
            log.close()
        lines = folder / "results.jsonl"
        seen, last_change = 0, time.monotonic()
        while any(p.poll() is None for p in self.processes):
            time.sleep(0.5)
            done = finished(lines)
            if len(done) > seen:
                for result in done[seen:]:
                    tqdm.write(describe(result, label))
                progress.update(len(done) - seen)
                seen, last_change = len(done), time.monotonic()
            failed = any(p.poll() not in (None, 0) for p in self.processes)
            if time.monotonic() - last_change > (30.0 if failed else self.deadline_s):
                tqdm.write(f"{label}: stopping the workers (no progress; see {folder})")
                self.stop()
        self.stop()
        done = finished(lines)
        for result in done[seen:]:
            tqdm.write(describe(result, label))
        progress.update(len(done) - seen)
        return done

    def stop(self) -> None:
        """Kill the workers this launcher started (by process id), then reap them."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait()
        self.processes.clear()


def finished(lines: Path) -> list[dict[str, Any]]:
    """The complete result lines rank 0 has written so far (a line being written is not)."""
    if not lines.exists():
        return []
    return [json.loads(line) for line in lines.read_text().split("\n")[:-1] if line]


def link_check(topology: net.Topology, rate_bps: float, seconds: float = 1.0) -> float:
    """Goodput (bits/s) of a bulk TCP transfer from host 0's namespace to host 1's."""
    nbytes = int(rate_bps / 8 * seconds)
    env = worker_env()
    module = [sys.executable, "-m", "benchmarks.netem.linkcheck"]
    server = subprocess.Popen(["ip", "netns", "exec", topology.host_namespace(1), *module,
                               "serve",
                               net.address(1), "5201"], env=env, cwd=REPO,
                              start_new_session=True)
    try:
        sent = subprocess.run(["ip", "netns", "exec", topology.host_namespace(0), *module, "send",
                               net.address(1), "5201", str(nbytes)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=60 + 20 * seconds,
                              check=True)
        server.wait(timeout=30)
        return float(sent.stdout.strip())
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def describe(result: dict[str, Any], label: str) -> str:
    if result.get("status") != "ok":
        return f"{label} {result['scheme']}: {result.get('status')} {result.get('note', '')}"
    reached = (f"target at step {result['reached_step']} after "
               f"{fmt_seconds(result['reached_train_s'])} s" if result["reached_step"]
               else f"target not reached in {result['steps']} steps")
    return (f"{label} {result['scheme']}: median step {1000 * result['median_step_s']:.1f} ms "
            f"(compute {1000 * result['compute_s']:.1f} ms), "
            f"{result['wire_sent_per_step']:,.0f} B sent/step, {reached}")


def machine() -> dict[str, Any]:
    import torch

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__}


def cleanup() -> int:
    """Remove namespaces left by runs whose process is gone (and what runs inside them)."""
    listing = net.run(["ip", "netns", "list"])
    alive = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    stale = net.leftovers(listing, alive)
    errors = net.kill_inside(stale)
    for command in net.teardown_commands(stale):
        try:
            net.run(command)
        except RuntimeError as error:
            errors.append(str(error))
    print(f"removed {len(stale)} namespace(s): {' '.join(stale) or '-'}")
    for message in errors:
        print(f"warning: {message}", file=sys.stderr)
    return 1 if errors else 0


class Interrupted(Exception):
    """SIGTERM or SIGINT arrived: unwind so that every finally block runs."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        args = resolve(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"benchmarks.netem: error: {error}", file=sys.stderr)
        return 2
    problem = net.missing_requirements()
    if problem:
        print(f"benchmarks.netem: {problem}", file=sys.stderr)
        return 2
    if args.cleanup:
        return cleanup()
    try:
        entries, notes = plan(args)
    except ValueError as error:
        print(f"benchmarks.netem: error: {error}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}")
    if not entries:
        print("benchmarks.netem: nothing to run", file=sys.stderr)
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = args.out / stamp
    folder.mkdir(parents=True, exist_ok=True)
    options = worker_options(args)
    total = len(args.rate_list) * len(args.worker_list) * len(entries) * args.rounds + 1
    per_rate = len(args.worker_list) * len(entries) * args.rounds
    bound = per_rate * (args.reference_cap_s + (len(args.rate_list) - 1) * args.cap_s
                        + 8 * len(args.rate_list))
    goal = (f"{args.target:.0%} test accuracy" if args.metric == "test accuracy"
            else f"{args.target:g} {args.metric}")
    print(f"{total} runs of {args.workload}; each stops at {goal} "
          f"(after at least {options['min_steps']} steps) or at its first evaluation after "
          f"{args.cap_s:g} s of training ({args.reference_cap_s:g} s at {args.rate_list[0]}); "
          f"at most ~{bound / 60:.0f} min plus start-up")
    record: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.netem", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(),
        "load_before": list(os.getloadavg()), "quick": args.quick,
        "options": {**options, "reference_cap_s": args.reference_cap_s},
        "ratio": args.ratio, "life_span": args.life_span, "rates": args.rate_list,
        "workers": args.worker_list, "rounds": args.rounds, "notes": notes,
        "sites": args.sites,
        "tbf": {rate: vars(net.tbf_for(bps)) for rate, bps in zip(args.rate_list,
                                                                  args.rate_bps)},
    }
    cores = os.cpu_count() or 1
    if max(args.worker_list) > cores:  # what the wall times include beside the link
        notes.append(f"{max(args.worker_list)} worker processes on {cores} cores: they "
                     "compute in turn, so step and wall times are inflated against one "
                     "core per worker (the compute column is measured in the same crowd)")
    load = os.getloadavg()[0]
    if load > 1.5 * cores:
        notes.append(f"the machine was busy: 1-minute load {load:.1f} on {cores} cores "
                     "before the run")
    watch = CpuWatch()
    topology = net.Topology(f"{net.PREFIX}{os.getpid()}", max(args.worker_list), args.sites)
    options["bridge_namespace"] = net.names(topology.prefix, topology.hosts, topology.kind)[0]
    launcher = Launcher(topology, folder,
                        deadline_s=3 * max(args.cap_s, args.reference_cap_s) + 180)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    runs: list[dict[str, Any]] = []
    status = 0
    try:
        topology.build()
        record["tcp_congestion_control"] = topology.congestion_control()
        with tqdm(total=total, unit="run", dynamic_ncols=True) as progress:
            # The lone worker: dense with the same recipe on one worker, no link to wait on.
            lone = launcher.run(1, [LONE], {**options, "cap_s": args.reference_cap_s,
                                            "sites": None}, "lone", progress)
            record["lone"] = lone[0] if lone else None
            for index, (rate, rate_bps) in enumerate(zip(args.rate_list, args.rate_bps)):
                # The first rate's runs establish the steps to target: give them longer.
                cap = args.reference_cap_s if index == 0 else args.cap_s
                rate_options = {**options, "cap_s": cap}
                topology.shape(rate_bps)
                goodput = link_check(topology, rate_bps)
                record.setdefault("link_check", {})[rate] = goodput
                tqdm.write(f"{rate}: bulk TCP goodput {goodput / 1e6:.1f} Mbit/s "
                           f"({goodput / rate_bps:.3f} of the rate)")
                for workers in args.worker_list:
                    label = f"{rate}-{workers}w"
                    before = topology.qdisc_stats()
                    loop_before = topology.loopback_stats() if args.sites else {}
                    for round_ in range(args.rounds):  # each round runs every scheme once
                        for result in launcher.run(workers, entries, rate_options, label,
                                                   progress):
                            runs.append({**result, "rate": rate, "rate_bps": rate_bps,
                                         "workers": workers, "cap_s": cap, "round": round_})
                    record.setdefault("qdisc", {})[label] = _delta(before,
                                                                   topology.qdisc_stats())
                    if args.sites:  # a site's own traffic, which must not meet a shaper
                        record.setdefault("loopback", {})[label] = _delta(
                            loop_before, topology.loopback_stats())
    except Interrupted as why:
        print(f"\ninterrupted ({why}): cleaning up", file=sys.stderr)
        status = 130
    except RuntimeError as error:
        print(f"benchmarks.netem: {error}", file=sys.stderr)
        status = 1
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        launcher.stop()
        for message in topology.teardown():
            print(f"warning: cleanup: {message}", file=sys.stderr)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    record["load_after"] = list(os.getloadavg())
    record["others_cpu_share"] = watch.others_share()
    record["runs"] = derive(runs)
    record["references"] = reference_rows(median_runs(record["runs"]), record.get("lone"))
    if args.sites:
        record["site_traffic_check"] = site_check_summary(record["runs"])
    # An interrupted run is kept for inspection but never taken for the results page.
    path = folder / ("results.json" if status == 0 else "results-incomplete.json")
    path.write_text(json.dumps(record, indent=2))
    print_table(median_runs(record["runs"]))
    print(f"wrote {path}; regenerate the page with: python -m benchmarks.report")
    failed = [r["scheme"] for r in runs if r.get("status") != "ok"]
    if failed and status == 0:
        print(f"warning: runs failed: {failed}", file=sys.stderr)
    return status


def _delta(before: dict[str, dict[str, int]],
           after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {link: {key: after[link][key] - before[link].get(key, 0) for key in after[link]}
            for link in after}


def print_table(runs: list[dict[str, Any]]) -> None:
    print(f"\n{'rate':>8s} {'n':>2s} {'scheme':>15s} {'step ms':>8s} {'floor ms':>8s} "
          f"{'ratio':>6s} {'B/step':>11s} {'target s':>9s}")
    for r in runs:
        if r.get("status") != "ok":
            print(f"{r['rate']:>8s} {r['workers']:2d} {r['scheme']:>15s} {r['status']}: "
                  f"{r.get('note', '')}")
            continue
        kind = {"measured": "", "projected": "*"}.get(r["time_to_target_kind"], "")
        print(f"{r['rate']:>8s} {r['workers']:2d} {r['scheme']:>15s} "
              f"{1000 * r['median_step_s']:8.1f} {1000 * r['floor_s']:8.1f} "
              f"{r['floor_ratio']:6.2f} {r['wire_sent_per_step']:11,.0f} "
              f"{fmt_seconds(r['time_to_target_s']):>8s}{kind or ' '}")
    print("* projected: measured step time x the steps another rate needed")
