"""One rank of a shaped-link benchmark, started inside its network namespace.

    ip netns exec tw-<pid>-w0 env GLOO_SOCKET_IFNAME=eth0 \\
        python -m benchmarks.netem.worker --rank 0 --world-size 2 \\
        --init-method tcp://10.77.0.1:29500 --spec spec.json --out run/

Trains the demo MLP (scaled up) on digits, or a workload of ``thinwire
compare`` (``options["workload"]``), under each scheme of the spec in turn,
timing every step and reading what the shapers charged over the timed window.
With ``options["sites"]`` the model is sharded as ``thinwire compare --sites``
shards it (:func:`thinwire.jobs.sharded.shard_model`: FSDP2 inside a site, the
scheme or native HSDP across sites) instead of wrapped in DDP.
Rank 0 appends one JSON line per scheme to ``out/results.jsonl`` as soon as
the scheme ends, so the harness keeps what finished even if a later one hangs.
A scheme that raises ends the process: the group may be out of step after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.netem.anchors import ANCHORS, Installed
from benchmarks.netem.net import SITE, WORKER, host_of, port
from thinwire import ddp, schemes
from thinwire.comm import Meter
from thinwire.data.digits import batches, load_digits, shard
from thinwire.jobs import local_run, workloads
from thinwire.jobs.dataparallel import accuracy, compute_seconds, step_seconds
from thinwire.jobs.sharded import NATIVE, shard_model
from thinwire.local import LocalUpdates, nesterov
from thinwire.models.mlp import mlp


def shaper_bytes(interface: str, namespace: str | None = None) -> int | None:
    """Bytes the root qdisc of ``interface`` has passed, or None if it cannot be read.

    This is what tbf charged against the rate: every frame's full length with
    its Ethernet, IP and TCP headers, also for segmentation-offloaded batches
    (the interface's own counters charge their headers once per batch).
    """
    where = ["-n", namespace] if namespace else []
    try:
        done = subprocess.run(["tc", *where, "-s", "-j", "qdisc", "show", "dev", interface],
                              capture_output=True, text=True, timeout=10, check=True)
        return int(json.loads(done.stdout)[0]["bytes"])
    except (OSError, subprocess.SubprocessError, ValueError, LookupError):
        return None


def loopback_bytes() -> int | None:
    """Bytes this network namespace's loopback has sent (``/proc/net/dev``), or None."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[8])  # receive has 8 columns, then transmit bytes
    except (OSError, ValueError, IndexError):
        pass
    return None


class WireMeter:
    """What the shaper charged in each direction of this host's link, between two reads.

    Sent: the tbf on the host's own interface. Received: the tbf on the
    bridge port towards it, in the bridge's namespace (None outside the harness).
    Loopback: what the namespace's loopback carried (a site's ranks among themselves).
    A site's ranks share all three: each reads the whole site's traffic.
    """

    def __init__(self, interface: str, bridge_namespace: str | None, host: int,
                 kind: str = WORKER) -> None:
        self.interface = interface
        self.bridge = bridge_namespace
        self.port = port(host, kind)
        self.start: tuple[int | None, ...] = (None, None, None)

    def read(self) -> tuple[int | None, ...]:
        return (shaper_bytes(self.interface),
                shaper_bytes(self.port, self.bridge) if self.bridge else None,
                loopback_bytes())

    def begin(self) -> None:
        self.start = self.read()

    def per_step(self, steps: int) -> tuple[float | None, ...]:
        """Mean (sent, received, loopback) bytes per step since :meth:`begin` over ``steps``."""
        end = self.read()

        def mean(first: int | None, last: int | None) -> float | None:
            return None if first is None or last is None or steps < 1 else (last - first) / steps

        return tuple(mean(first, last) for first, last in zip(self.start, end))


def label_of(entry: dict[str, Any]) -> str:
    """What a scheme entry's results are filed under: its label (a variant), else its name."""
    return str(entry.get("label", entry["name"]))


def install(entry: dict[str, Any], model: nn.Module, meter: Meter, rank: int,
            optimizer: torch.optim.Optimizer) -> Installed:
    """PyTorch's own anchor, or DDP with a thinwire scheme's hook, registered with
    ``optimizer`` as a user's script registers it (its family's coupling and defaults)."""
    if entry["name"] in ANCHORS:
        return ANCHORS[entry["name"]](model, meter, rank)
    net = DistributedDataParallel(model)
    step, scheme_config = local_run.step_parts(entry["config"])
    hook = ddp.register(net, schemes.build(entry["name"], **scheme_config), meter=meter,
                        delay=step.delayed, optimizer=optimizer)
    scheme = hook.scheme  # rebuilt with the optimiser family's options, if any

    def details() -> dict[str, Any]:
        # Threshold recomputations (DCT-DP's selections) per tensor, and the buckets dct-dp
        # chose to send in pieces (stream="auto"), where the scheme keeps them.
        return {"skipped_steps": scheme.skipped, **scheme.diagnostics()}

    return Installed(net, lambda: None, lambda: scheme.overhead_s, details, scheme, hook)


def install_sharded(entry: dict[str, Any], model: nn.Module, meter: Meter, sites: int,
                    optimizer_of: Callable[[Any], torch.optim.Optimizer]
                    ) -> tuple[Installed, torch.optim.Optimizer]:
    """``model`` sharded as ``thinwire compare --sites`` shards it: FSDP2 over each site's
    ranks, native HSDP (``native-hsdp``) or ``thinwire.fsdp`` with the scheme across sites,
    registered with the optimiser built on the shards; and that optimiser."""
    sharded = shard_model(entry["name"], entry["config"], model, sites, meter, "cpu",
                          optimizer_of)
    scheme = sharded.scheme

    def details() -> dict[str, Any]:
        return {"skipped_steps": 0 if scheme is None else scheme.skipped,
                "dense_shard_bytes": sharded.shard_bytes}

    return Installed(model, sharded.after_step,
                     lambda: 0.0 if scheme is None else scheme.overhead_s, details, scheme,
                     sharded.state), sharded.optimizer


def install_local(entry: dict[str, Any], model: nn.Module, inner: torch.optim.Optimizer,
                  meter: Meter) -> tuple[Installed, LocalUpdates]:
    """``diloco`` or ``diloco+SCHEME``: the workers train their own replicas with
    ``inner`` and sync through :class:`thinwire.local.LocalUpdates`, as ``thinwire compare``
    runs them; the installed step hook counts an inner step (and lands or launches syncs)."""
    name = entry["name"]
    local_options, scheme_config = local_run.parts(name, entry["config"])
    scheme = schemes.build(local_run.inner_scheme(name), **scheme_config)
    local_options = local_options.resolved(scheme)
    assert local_options.outer_lr is not None and local_options.outer_momentum is not None
    updates = LocalUpdates(model, inner, scheme, every=local_options.every,
                           fragments=local_options.fragments, delay=local_options.delay,
                           mix=local_options.mix, overlap=local_options.overlap,
                           outer=nesterov(local_options.outer_lr, local_options.outer_momentum),
                           meter=meter)
    syncs = []

    def after_step() -> None:
        syncs.extend(updates.step())

    def details() -> dict[str, Any]:
        return {"skipped_steps": scheme.skipped,
                "local": {**dataclasses.asdict(local_options), "syncs": len(syncs)}}

    return Installed(model, after_step, lambda: scheme.overhead_s, details, scheme), updates


@contextmanager
def global_weights(model: nn.Module, updates: LocalUpdates | None) -> Iterator[None]:
    """Within: ``model`` holds the global weights of ``updates`` (what a local-update run is
    judged by, as ``thinwire compare`` judges it); after: its own again."""
    if updates is None:
        yield
        return
    params = dict(model.named_parameters())
    own = {key: p.detach().clone() for key, p in params.items()}
    with torch.no_grad():
        for key, value in updates.global_state().items():
            params[key].copy_(value)
    try:
        yield
    finally:
        with torch.no_grad():
            for key, value in own.items():
                params[key].copy_(value)


def window_traffic(meter: Meter, first_step: int) -> dict[str, float]:
    """Mean bytes per step from step index ``first_step`` on: handed, ring sent, received."""
    steps = max(1, meter.step - first_step)
    chosen = [r for r in meter.records if r.step >= first_step]
    return {"bytes_handed_per_step": sum(r.nbytes for r in chosen) / steps,
            "wire_sent_per_step": sum(r.sent for r in chosen) / steps,
            "bytes_received_per_step": sum(r.received for r in chosen) / steps}


@dataclass(frozen=True)
class Task:
    """What one rank trains: its model, a step's loss through the wrapped model, accuracy."""

    model: nn.Module
    compute_s: float  # median local forward + backward + update, without communication
    loss: Callable[[nn.Module], torch.Tensor]  # the next batch's loss through ``net``
    accuracy: Callable[[], float]  # the test metric of ``model`` (the workload's score)


def task(options: dict[str, Any], rank: int, world_size: int) -> Task:
    """The demo MLP on digits, or ``options["workload"]`` of thinwire's workloads."""
    seed, batch_size = options["seed"], options["batch_size"]
    name = options.get("workload", "demo")
    if name == "demo":
        train_split, test = load_digits(seed=seed)
        local = shard(train_split, rank, world_size)
        torch.manual_seed(seed)
        model = mlp(train_split.x.shape[1], options["hidden"], options["depth"], classes=10)
        stream = batches(local, batch_size, seed=seed * 1000 + rank)

        def demo_loss(net: nn.Module) -> torch.Tensor:
            index = next(stream)
            return nn.functional.cross_entropy(net(local.x[index]), local.y[index])

        return Task(model, compute_seconds(model, local, batch_size), demo_loss,
                    lambda: accuracy(model, test))
    work = workloads.load(name, seed=seed)
    rows = work.train.shard(rank, world_size)
    model = work.model(seed)
    order = batches(rows, batch_size, seed=seed * 1000 + rank)

    def loss(net: nn.Module) -> torch.Tensor:
        batch = rows.rows(next(order))
        return work.loss(net(batch.inputs, **batch.side), batch.targets)

    return Task(model, step_seconds(model, work, rows, batch_size), loss,
                lambda: work.score(model))


def train(entry: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """Train under one scheme until the target accuracy or the time cap; time every step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    job = task(options, rank, world_size)
    model, compute_s = job.model, job.compute_s
    meter = Meter(rank, world_size, window=None)  # window_traffic reads every record
    sites = options.get("sites")
    local = local_run.is_local(entry["name"])

    def optimizer_of(parameters: Any) -> torch.optim.Optimizer:
        return workloads.optimizer(options.get("optimizer", "sgd"), parameters, options["lr"],
                                   options["momentum"])

    updates = None
    if local:  # the workers' own replicas, synced every H steps
        optimizer = optimizer_of(model.parameters())
        installed, updates = install_local(entry, model, optimizer, meter)
    elif sites is None:  # registered with the optimiser, as the README's quick start does
        optimizer = optimizer_of(model.parameters())  # DDP keeps the model's parameters
        installed = install(entry, model, meter, options["rank"], optimizer)
    else:  # the optimiser steps FSDP's sharded parameters: built once they are
        installed, optimizer = install_sharded(entry, model, meter, sites, optimizer_of)
    wire = WireMeter(options["interface"], options.get("bridge_namespace"),
                     host_of(rank, world_size, sites), WORKER if sites is None else SITE)
    warmup, target = options["warmup"], options["target"]
    step_s: list[float] = []
    losses: list[float] = []
    curve: list[tuple[int, float, float]] = []  # (step, training seconds so far, accuracy)
    reached: tuple[int, float] | None = None
    status, note = "ok", ""
    dist.barrier()
    for step in range(1, options["max_steps"] + 1):
        if step == warmup + 1:  # outside the timed steps; the checks' tiny all-reduces
            wire.begin()        # between later steps are counted too (~100 bytes each)
        start = time.perf_counter()
        loss = job.loss(installed.net)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        installed.after_step()  # timed: a local-update sync waits here for its exchange
        step_s.append(time.perf_counter() - start)
        meter.next_step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            status, note = "failed", f"loss became {losses[-1]} at step {step}"
            break
        if step % options["eval_every"] and step != options["max_steps"]:
            continue
        elapsed = sum(step_s)
        with global_weights(model, updates):
            acc = job.accuracy()
        curve.append((step, elapsed, acc))
        # Every rank must stop at the same step: agree on (reached, elapsed) first.
        met = acc <= target if options.get("lower_is_better") else acc >= target
        flags = torch.tensor([float(met), elapsed], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if reached is None and flags[0] > 0:
            reached = (step, elapsed)
        if (reached is not None and step >= options["min_steps"]) or flags[1] >= options[
                "cap_s"]:
            break
    steps = len(step_s)
    window = slice(min(warmup, max(0, steps - 1)), steps)
    first = window.start
    wire_tx, wire_rx, loopback = (wire.per_step(steps - warmup) if steps > warmup
                                  else (None, None, None))
    return {
        "scheme": label_of(entry),
        "kind": "torch" if entry["name"] in (*ANCHORS, NATIVE) else "thinwire",
        "recipe": {key: options.get(key) for key in RECIPE},
        "config": entry["config"],
        "status": status,
        "note": note,
        "steps": steps,
        "window_first_step": first + 1,
        "median_step_s": statistics.median(step_s[window]),
        "p10_step_s": _quantile(step_s[window], 0.1),
        "p90_step_s": _quantile(step_s[window], 0.9),
        "train_s": sum(step_s),
        "compute_s": compute_s,
        "overhead_s_per_step": installed.overhead_s() / max(1, steps),
        **window_traffic(meter, first),
        "shaper_tx_per_step": wire_tx,
        "shaper_rx_per_step": wire_rx,
        **({"sites": sites, "shards_per_site": world_size // sites,
            "loopback_tx_per_step": loopback} if sites is not None else {}),
        "bytes_per_entity": meter.bytes_per_step("entity"),
        "reached_step": None if reached is None else reached[0],
        "reached_train_s": None if reached is None else reached[1],
        "final_accuracy": curve[-1][2] if curve else float("nan"),
        "curve": curve,
        "losses": losses,
        "dense_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        **installed.details(),
    }


# What makes two runs the same recipe: the reference rows must agree with the schemes on these.
RECIPE = ("workload", "optimizer", "lr", "momentum", "batch_size", "seed", "target", "hidden",
          "depth")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="tcp://<address>:<port>")
    parser.add_argument("--spec", type=Path, required=True, help="schemes and options (JSON)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    options = spec["options"]
    torch.set_num_threads(options["threads"])
    dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank,
                            world_size=args.world_size,
                            timeout=timedelta(seconds=options["timeout_s"]))
    lines = args.out / "results.jsonl"
    try:
        for entry in spec["schemes"]:
            print(f"rank {args.rank}: {label_of(entry)}", flush=True)
            try:
                result = train(entry, options)
            except Exception as error:  # noqa: BLE001  (reported, then this launch ends)
                result = {"scheme": label_of(entry), "status": "failed",
                          "note": f"{type(error).__name__}: {error}"}
                print(result["note"], file=sys.stderr, flush=True)
            if args.rank == 0:
                with lines.open("a") as handle:
                    handle.write(json.dumps(result) + "\n")
            if result["status"] == "failed":
                return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
