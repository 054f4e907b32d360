"""Ranks on shaped links, the last reaching each collective late: how long each waits.

    sudo .venv/bin/python -m benchmarks.netem.skew --out docs/data/netem-gather-skew.json

gloo's all-gather sends a rank's data once its peer is ready to receive, then
tells the peer that it is ready in turn. Between two ranks both go over their
one TCP connection, so the rank that arrives second has its notice queued
behind the first half of its own payload; with more ranks the notice goes to
the other ring neighbour. All-reduce posts its receives first. This measures
both collectives on the same bytes per rank, with the last rank arriving
``skew`` later than the others (after a barrier and a pause like a step's
compute), interleaved round by round; each rank's time runs from its own call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.machine import cpu_model
from benchmarks.netem import net
from benchmarks.netem.harness import REPO, worker_env
from benchmarks.netem.summary import FRAME_OVERHEAD
from thinwire.comm.collectives import all_gather_fixed
from thinwire.comm.meter import TRAFFIC
from thinwire.jobs.compare import parse_bandwidth

COLLECTIVES = ("all_gather", "all_reduce", "exchange")
PAUSE_S = 0.03  # between the barrier and the first rank's call: a step's compute
PORT = 29_731


def collective(name: str, nbytes: int, world_size: int) -> Callable[[], None]:
    """One call of ``name`` on ``nbytes`` per rank (all-reduce: the same bytes, as fp32;
    exchange: thinwire's sparse exchange)."""
    if name == "all_gather":
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        rows = torch.empty(world_size * nbytes, dtype=torch.uint8)
        return lambda: dist.all_gather_into_tensor(rows, payload)
    if name == "all_reduce":
        values = torch.zeros(nbytes // 4)
        return lambda: dist.all_reduce(values)
    if name == "exchange":
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        return lambda: all_gather_fixed(payload).wait()
    raise ValueError(f"collective={name!r} must be one of {COLLECTIVES}")


def cases(sizes: Sequence[int], skews_ms: Sequence[float]) -> list[tuple[int, float, str]]:
    """Every (bytes, skew in ms, collective), in the order each round runs them."""
    return [(size, skew, name) for size in sizes for skew in skews_ms for name in COLLECTIVES]


def need_ms(name: str, nbytes: int, world_size: int, rate_bps: float) -> float:
    """What one call puts on the busier direction of a rank's link (the Meter's ring model,
    :data:`thinwire.comm.meter.TRAFFIC`), as TCP frames, at ``rate_bps``."""
    busier = max(TRAFFIC["all_gather" if name == "exchange" else name](nbytes, world_size, 0, 0))
    return 1000 * busier * FRAME_OVERHEAD * 8 / rate_bps


def worker(rank: int, world_size: int, init_method: str, sizes: Sequence[int],
           skews_ms: Sequence[float], rounds: int) -> list[dict[str, Any]]:
    """Time every case ``rounds`` times on this rank; the last rank arrives ``skew`` late."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=world_size)
    late = rank == world_size - 1
    plan = cases(sizes, skews_ms)
    calls = {(size, name): collective(name, size, world_size) for size, _, name in plan}
    seconds: dict[tuple[int, float, str], list[float]] = {case: [] for case in plan}
    for _ in range(rounds + 2):  # two warm-up rounds
        for size, skew, name in plan:
            dist.barrier()
            time.sleep(PAUSE_S + (skew / 1000 if late else 0.0))
            start = time.perf_counter()
            calls[size, name]()
            seconds[size, skew, name].append(time.perf_counter() - start)
    mine = {case: statistics.median(values[2:]) for case, values in seconds.items()}
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, mine)
    dist.destroy_process_group()
    return [{"workers": world_size, "bytes": size, "skew_ms": skew, "collective": name,
             "first_rank_ms": 1000 * every[0][size, skew, name],
             "later_rank_ms": 1000 * every[-1][size, skew, name]}
            for size, skew, name in plan]


def run(rate: str, workers: Sequence[int], sizes: Sequence[int], skews_ms: Sequence[float],
        rounds: int, out: Path) -> dict[str, Any]:
    """For each worker count, build shaped namespaces, time the cases in them; write ``out``."""
    rate_bps = parse_bandwidth(rate)
    load_before = list(os.getloadavg())
    out.parent.mkdir(parents=True, exist_ok=True)
    results = out.with_suffix(".rank0.json")
    common = ["--sizes", ",".join(map(str, sizes)), "--skews-ms", ",".join(map(str, skews_ms)),
              "--rounds", str(rounds)]
    rows: list[dict[str, Any]] = []
    congestion = None
    for count in workers:
        topology = net.Topology(f"{net.PREFIX}{os.getpid()}", count)
        try:
            topology.build()
            topology.shape(rate_bps)
            processes = [subprocess.Popen(
                ["ip", "netns", "exec", topology.namespace(rank), sys.executable, "-m",
                 "benchmarks.netem.skew", "--worker", str(rank), "--workers", str(count),
                 "--init-method", f"tcp://{net.address(0)}:{PORT}", "--out",
                 str(results.resolve()), *common], env=worker_env(), cwd=REPO)
                for rank in range(count)]
            for process in processes:
                if process.wait(timeout=600) != 0:
                    raise RuntimeError(f"a worker failed (exit {process.returncode})")
            rows += json.loads(results.read_text())
            results.unlink()
            congestion = topology.congestion_control()
        finally:
            topology.teardown()
    for row in rows:
        row["bytes_need_ms"] = need_ms(row["collective"], row["bytes"], row["workers"], rate_bps)
    record = {"command": "python -m benchmarks.netem.skew " + " ".join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "torch": torch.__version__},
              "load_before": load_before, "rate": rate, "tbf": vars(net.tbf_for(rate_bps)),
              "tcp_congestion_control": congestion, "pause_ms": 1000 * PAUSE_S,
              "rounds": rounds, "results": rows}
    out.write_text(json.dumps(record, indent=2) + "\n")
    return record


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as aligned text: each rank's median against what the bytes need."""
    lines = [f"{'n':>2} {'bytes':>9} {'skew ms':>7} {'collective':>10} {'first ms':>8} "
             f"{'later ms':>8} {'need ms':>7}"]
    lines += [f"{r['workers']:>2} {r['bytes']:>9,d} {r['skew_ms']:>7g} {r['collective']:>10} "
              f"{r['first_rank_ms']:>8.1f} {r['later_rank_ms']:>8.1f} {r['bytes_need_ms']:>7.1f}"
              for r in rows]
    return "\n".join(lines)


def numbers(text: str, kind: Callable[[str], Any]) -> list[Any]:
    """A comma-separated list of numbers >= 0, each read by ``kind``."""
    values = [kind(part) for part in text.split(",") if part.strip()]
    if not values or any(v < 0 for v in values):
        raise ValueError(f"{text!r} must be a comma-separated list of numbers >= 0")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate of both links' directions")
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts (>= 2)")
    parser.add_argument("--sizes", default="261000,1500000",
                        help="comma-separated bytes per rank (261000: the MLP's sparse payload)")
    parser.add_argument("--skews-ms", default="0,13",
                        help="comma-separated: how much later the last rank calls each collective")
    parser.add_argument("--rounds", type=int, default=12, help="timed calls per case")
    parser.add_argument("--out", type=Path, default=Path("results/netem/gather-skew.json"))
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--init-method", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes, skews = numbers(args.sizes, int), numbers(args.skews_ms, float)
    counts = numbers(args.workers, int)
    if args.rounds < 1:
        raise ValueError(f"rounds={args.rounds!r} must be >= 1")
    if any(count < 2 for count in counts):
        raise ValueError(f"workers={args.workers!r}: every count must be >= 2")
    if args.worker is not None:
        rows = worker(args.worker, counts[0], args.init_method, sizes, skews, args.rounds)
        if args.worker == 0:
            args.out.write_text(json.dumps(rows))
        return 0
    missing = net.missing_requirements()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    record = run(args.rate, counts, sizes, skews, args.rounds, args.out)
    print(table(record["results"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
