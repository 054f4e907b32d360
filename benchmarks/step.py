"""Step time on loopback: compute alone, plain DDP, thinwire's hooks and torch's own hooks.

Two gloo ranks on one machine train the shaped-link model (MLP
64-2048-2048-10, 4.4 M parameters), batch 32, one intra-op thread per rank.
Every variant holds its own DDP replica of the same initial model; each
round runs every variant for a few steps, in an order that rotates from
round to round (so no variant always runs first or right after another),
and keeps the median step of each. The result is the median over rounds
per variant and the ratios the project tracks:

* ``dense / ddp``: thinwire's dense hook against DDP's built-in all-reduce;
* ``hook-noop / compute`` and ``hook-sync / compute``: what any DDP step with a
  communication hook costs before the hook does any work: DDP with a hook that
  returns the bucket as it is (:func:`noop_hook`: DDP's own bookkeeping and
  copies), and with one that all-reduces a single number (:func:`sync_hook`:
  that, plus waiting for the slower rank);
* ``<scheme> / compute``: a compressed step against the step with no
  communication at all (forward, backward, optimiser);
* ``powersgd / torch-powersgd``: thinwire's PowerSGD against
  ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (one DDP
  bucket: torch's hook deadlocks on gloo with several, see
  ``benchmarks/powersgd_gloo.py``), both at rank 2 after 2 dense steps;
* ``dct-dp / floor-dct-dp``: thinwire's dct-dp against the same work
  written as a plain DDP hook in torch ops (:func:`floor_hook`: momentum
  correction, error feedback, a reused per-tensor threshold with the density
  control, a payload of 16-bit indices and values with room for k, as
  dct-dp's default wire format, one all-gather, the mean decoded into the
  bucket), with none of the library's checks, metering or
  bookkeeping: what the step costs at the least on this machine;
* ``powersgd / floor-powersgd``: the same for PowerSGD (:func:`floor_powersgd_hook`:
  error feedback, ``P = M Q``, a blocking all-reduce of P, QR, ``Q = M^T P_hat``
  with the dense tensors in one asynchronous all-reduce, ``P_hat Q^T`` summed
  elementwise into the bucket as the library does so replicas stay identical).

Loopback moves bytes through memory, so this measures codec and framework
cost, not the network. Results go to ``docs/data/step.json`` with the
machine's load before and after.

Usage::

    python -m benchmarks.step                 # 15 rounds of 5 steps
    python -m benchmarks.step --rounds 3      # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from benchmarks.machine import cpu_model
from thinwire import ddp, optim, schemes
from thinwire.comm.collectives import all_gather_single
from thinwire.launch import spawn

DATA = Path("docs/data/step.json")
SIZES = (64, 2048, 2048, 10)
BATCH = 32
SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {  # thinwire variant -> (scheme, options)
    "dense": ("dense", {}),
    "dct-dp": ("dct-dp", {"ratio": 0.01}),
    "dct-dp-whole": ("dct-dp", {"ratio": 0.01, "piece": 0}),  # one payload, no pieces
    "topk": ("topk", {"ratio": 0.01}),
    "clt-k": ("clt-k", {"ratio": 0.01}),
    "powersgd": ("powersgd", {"rank": 2, "warmup_steps": 2}),
}
VARIANTS = ("compute", "hook-noop", "hook-sync", "ddp", *SCHEMES, "floor-dct-dp",
            "floor-powersgd", "torch-powersgd", "torch-fp16")
# ratio name -> (numerator, denominator)
RATIOS = {"dense/ddp": ("dense", "ddp"),
          **{f"{name}/compute": (name, "compute") for name in SCHEMES if name != "dense"},
          "ddp/compute": ("ddp", "compute"),
          "hook-noop/compute": ("hook-noop", "compute"),
          "hook-sync/compute": ("hook-sync", "compute"),
          "powersgd/torch-powersgd": ("powersgd", "torch-powersgd"),
          "dct-dp/floor-dct-dp": ("dct-dp", "floor-dct-dp"),
          "dct-dp/dct-dp-whole": ("dct-dp", "dct-dp-whole"),
          "floor-dct-dp/compute": ("floor-dct-dp", "compute"),
          "powersgd/floor-powersgd": ("powersgd", "floor-powersgd"),
          "floor-powersgd/compute": ("floor-powersgd", "compute"),
          "torch-fp16/compute": ("torch-fp16", "compute")}


def order(variants: Sequence[str], round_index: int) -> list[str]:
    """The variants of one round, rotated by the round's index."""
    shift = round_index % len(variants)
    return [*variants[shift:], *variants[:shift]]


def summarise(times: dict[str, list[float]]) -> dict[str, Any]:
    """Median over rounds of each variant's per-round step time, and the tracked ratios.

    Args:
        times: variant -> one step time (seconds) per round.

    Returns:
        ``{"median_s": {variant: s}, "ratios": {name: ratio}}``; a ratio whose
        variants were not measured is left out.
    """
    median = {name: statistics.median(values) for name, values in times.items() if values}
    ratios = {name: median[top] / median[bottom] for name, (top, bottom) in RATIOS.items()
              if top in median and bottom in median and median[bottom] > 0}
    return {"median_s": median, "ratios": ratios}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in zip(SIZES[:-2], SIZES[1:-1], strict=True):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(SIZES[-2], SIZES[-1]))


def noop_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP hook that communicates nothing: the bucket is its own result."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def sync_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP hook that all-reduces one number and returns the bucket as it is."""
    work = dist.all_reduce(bucket.buffer()[:1].clone(), async_op=True)
    assert work is not None
    return work.get_future().then(lambda _: bucket.buffer())


class FloorState:
    """Per-tensor state of :func:`floor_hook`, keyed by parameter (DDP re-buckets)."""

    def __init__(self, density: float = 0.01, momentum: float = 0.9, gain: float = 0.05,
                 min_numel: int = 1024) -> None:
        self.density, self.momentum, self.gain, self.min_numel = density, momentum, gain, min_numel
        self.velocity: dict[int, torch.Tensor] = {}
        self.error: dict[int, torch.Tensor] = {}
        self.tau: dict[int, float] = {}


def floor_largest(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending positions of the k largest entries, by ``torch.topk``'s k-th value and a
    mask (the 16-bit index code needs them ascending; a sort of k would cost more).
    With ties at the k-th value, the first k positions at or above it."""
    kth = torch.topk(magnitudes, k, sorted=False).values.min()
    return (magnitudes >= kth).nonzero().squeeze(1)[:k]


def floor_dct_select(magnitudes: torch.Tensor, tau: float, k: int,
                     gain: float) -> tuple[torch.Tensor, float]:
    """dct-dp's selection in plain torch ops: the ascending indices of ``magnitudes >= tau``
    (the k largest of them when more pass), and tau for the next call, moved by the
    density control ``exp(gain (sent / k - 1))`` (a count beyond twice k counting in
    full, as in ``DCTThreshold``)."""
    index = (magnitudes >= tau).nonzero().squeeze(1)
    count = index.numel()
    if count > k:
        index = index[floor_largest(magnitudes[index], k)]
    sent = count if count > 2 * k else min(count, k)
    return index, tau * math.exp(gain * (min(sent / k, 16.0) - 1.0))


def floor_encode(indices: torch.Tensor, values: torch.Tensor, room: int,
                 numel: int) -> torch.Tensor:
    """dct-dp's and topk's default wire format written in plain torch ops, as int32 words:
    the count; ``room`` 16-bit offsets of the ascending ``indices`` in their blocks of
    65536 entries; for each of the ``numel // 65536 + 1`` blocks, how many indices lie
    before its end; ``room`` fp32 values. The same bytes as
    :class:`thinwire.compress.payload.SparseLayout` ``"delta16"``."""
    offset_words, blocks = (room + 1) // 2, numel // 65536 + 1
    payload = torch.zeros(1 + offset_words + blocks + room, dtype=torch.int32,
                          device=values.device)
    count = indices.numel()
    payload[0] = count
    payload[1: 1 + offset_words].view(torch.int16)[:count] = indices  # the low 16 bits
    ends = torch.arange(1, blocks + 1, device=values.device) * 65536
    payload[1 + offset_words: 1 + offset_words + blocks] = torch.searchsorted(indices, ends)
    start = 1 + offset_words + blocks
    payload[start: start + count].view(torch.float32).copy_(values)
    return payload


def floor_decode(row: torch.Tensor, room: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of one :func:`floor_encode` payload."""
    offset_words, blocks = (room + 1) // 2, numel // 65536 + 1
    count = int(row[0])
    offsets = row[1: 1 + offset_words].view(torch.int16)[:count].long().bitwise_and_(0xFFFF)
    ends = row[1 + offset_words: 1 + offset_words + blocks]
    block = torch.searchsorted(ends, torch.arange(count, dtype=torch.int32, device=row.device),
                               side="right")
    start = 1 + offset_words + blocks
    return offsets + block * 65536, row[start: start + count].view(torch.float32)


def floor_hook(state: FloorState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """dct-dp's step in plain torch ops: the floor that thinwire's hook is measured against.

    Per tensor: ``v <- mu v + g``, ``p = e + v``; tensors under ``min_numel``
    entries travel dense (added to a dense part), the others send the entries
    of ``|p| >= tau`` (the k largest of them when more pass), ``e`` keeps ``p``
    with those zeroed and tau moves by ``exp(gain (sent / k - 1))`` (a count
    beyond twice the room counting in full, as in ``DCTThreshold``). One
    all-gather carries every rank's payload in dct-dp's wire format
    (:func:`floor_encode`: 16-bit indices and values, padded to the room)
    with the dense part after it; the mean is decoded into the bucket.
    """
    buffer = bucket.buffer()
    world = dist.get_world_size()
    chosen, sent, dense = [], [], []
    offset = 0
    params = bucket.parameters()
    for param, view in zip(params, buffer.split([p.numel() for p in params])):
        key = id(param)
        velocity = state.velocity.get(key)
        if velocity is None:
            velocity = state.velocity[key] = view.clone()
            state.error[key] = torch.zeros_like(view)
        else:
            velocity.mul_(state.momentum).add_(view)
        p = state.error[key].add_(velocity)
        if view.numel() < state.min_numel:
            dense.append((offset, p.clone()))
            p.zero_()
        else:
            k = max(1, math.ceil(view.numel() * state.density))
            magnitudes = p.abs()
            if key not in state.tau:
                state.tau[key] = float(torch.kthvalue(magnitudes, view.numel() - k + 1).values)
            index, state.tau[key] = floor_dct_select(magnitudes, state.tau[key], k, state.gain)
            chosen.append(index + offset)
            sent.append(p[index])
            p[index] = 0.0
        offset += view.numel()
    room = sum(max(1, math.ceil(p.numel() * state.density)) for p in params
               if p.numel() >= state.min_numel)
    numel = buffer.numel()
    empty = torch.zeros(0, dtype=torch.int64, device=buffer.device)
    sparse = floor_encode(torch.cat(chosen) if chosen else empty,
                          torch.cat(sent) if sent else buffer[:0], room, numel)
    payload = torch.cat([sparse, *(part.view(torch.int32) for _, part in dense)])
    gathered = payload.new_empty(world * payload.numel())
    work = all_gather_single(gathered, payload, async_op=True)

    def decode(_: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.zero_()
        for row in gathered.view(world, -1):
            index, values = floor_decode(row, room, numel)
            buffer.index_add_(0, index, values)
            start = sparse.numel()
            for at, part in dense:
                buffer[at: at + part.numel()] += row[start: start + part.numel()].view(
                    torch.float32)
                start += part.numel()
        return buffer.div_(world)

    return work.get_future().then(decode)


class PowerFloorState:
    """Per-tensor error and warm-started Q of :func:`floor_powersgd_hook`, keyed by parameter."""

    def __init__(self, rank: int = 2) -> None:
        self.rank = rank
        self.error: dict[int, torch.Tensor] = {}
        self.q: dict[int, torch.Tensor] = {}  # (cols, rank), column-major


def floor_powersgd_hook(state: PowerFloorState,
                        bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD's step (Vogels et al. Alg. 1 with error feedback) in plain torch ops.

    Matrices go through rank-r PowerSGD, 1-D tensors travel dense with Q.
    Round 1 (P) is waited for in the hook, round 2 (Q and the dense tensors)
    is the future; the approximation is written into the bucket, the error
    keeps ``M - P_hat Q^T``.
    """
    buffer = bucket.buffer()
    world = dist.get_world_size()
    params = bucket.parameters()
    views = buffer.split([p.numel() for p in params])
    low = [(id(p), v.view(p.shape[0], -1)) for p, v in zip(params, views) if p.dim() > 1]
    dense = [v for p, v in zip(params, views) if p.dim() <= 1]
    matrices, ps = [], []
    for key, view in low:
        error = state.error.get(key)
        matrix = state.error[key] = view.clone() if error is None else error.add_(view)
        q = state.q.get(key)
        if q is None:
            q = state.q[key] = torch.randn(state.rank, view.shape[1],
                                           device=view.device).t()
        matrices.append(matrix)
        ps.append((matrix @ q).reshape(-1))
    first = torch.cat(ps).div_(world)
    dist.all_reduce(first)
    p_hats, parts, offset = [], [], 0
    for matrix in matrices:
        rows = matrix.shape[0]
        p_hat = torch.linalg.qr(first[offset: offset + rows * state.rank].view(rows, -1)).Q
        offset += rows * state.rank
        p_hats.append(p_hat)
        parts.append((p_hat.t() @ matrix).reshape(-1))
    second = torch.cat(parts + dense).div_(world)
    work = dist.all_reduce(second, async_op=True)
    assert work is not None

    def decode(_: torch.futures.Future[Any]) -> torch.Tensor:
        at = 0
        for (key, view), matrix, p_hat in zip(low, matrices, p_hats):
            cols = view.shape[1]
            q = state.q[key] = second[at: at + cols * state.rank].view(state.rank, cols).t()
            at += cols * state.rank
            torch.mul(p_hat[:, :1], q[:, 0], out=view)
            for j in range(1, state.rank):
                view.add_(p_hat[:, j: j + 1] * q[:, j])
            matrix.sub_(view)
        for view in dense:
            view.copy_(second[at: at + view.numel()])
            at += view.numel()
        return buffer

    return work.get_future().then(decode)


def _install(variant: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh replica set up as ``variant`` (all start from the same weights)."""
    model = _model()
    state: ddp.HookState | None = None
    if variant == "compute":
        net: torch.nn.Module = model
    elif variant == "torch-powersgd":  # one bucket: torch's hook deadlocks with several
        net = DistributedDataParallel(model, bucket_cap_mb=64)
        torch_state = torch_powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        net.register_comm_hook(torch_state, torch_powersgd.powerSGD_hook)
    else:
        net = DistributedDataParallel(model)
        if variant == "torch-fp16":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif variant == "hook-noop":
            net.register_comm_hook(None, lambda state, bucket: noop_hook(state, bucket))
        elif variant == "hook-sync":
            net.register_comm_hook(None, lambda state, bucket: sync_hook(state, bucket))
        elif variant == "floor-dct-dp":  # its momentum is in the hook, as coupled thinwire's
            # No annotations reach DDP's check (this module's are strings).
            net.register_comm_hook(FloorState(), lambda state, bucket: floor_hook(state, bucket))
            return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.0)
        elif variant == "floor-powersgd":
            net.register_comm_hook(PowerFloorState(), lambda state, bucket:
                                   floor_powersgd_hook(state, bucket))
        elif variant in SCHEMES:
            name, options = SCHEMES[variant]
            state = ddp.register(net, schemes.build(name, **options))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if state is not None:
        optim.couple(optimizer, state)  # as the quick start does
    return net, optimizer


def _steps(net: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any],
           clock: Callable[[], float] = time.perf_counter) -> list[float]:
    out = []
    for inputs, labels in batches:
        begin = clock()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(inputs), labels)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        out.append(clock() - begin)
    return out


def _worker(rank: int, world_size: int, variants: list[str], rounds: int, steps: int,
            warmup: int) -> dict[str, list[float]]:
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(BATCH, SIZES[0], generator=generator),
                torch.randint(SIZES[-1], (BATCH,), generator=generator)) for _ in range(steps)]
    installed = {variant: _install(variant) for variant in variants}
    for variant in variants:  # DDP rebuilds buckets after step 1; PowerSGD starts at 2
        _steps(*installed[variant], batches[:1] * warmup)
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for index in range(rounds):
        for variant in order(variants, index):
            dist.barrier()  # both ranks start a variant together
            times[variant].append(statistics.median(_steps(*installed[variant], batches)))
    return times


def section(record: dict[str, Any]) -> str:
    """The results-page section: median step per variant and the tracked ratios."""
    load = f"load {record['load_before'][0]:.1f} before, {record['load_after'][0]:.1f} after"
    lines = ["## Step time on loopback", "",
             f"`{record['command']}` ({record['date']}, {record['machine']['cpu']}, {load}; "
             "data: `docs/data/step.json`). Two gloo ranks on one machine, MLP "
             f"{'-'.join(map(str, record['model']))}, batch {record['batch']}, one thread per "
             f"rank; medians over {record['rounds']} interleaved rounds of "
             f"{record['steps_per_round']} steps. Loopback: codec and framework cost, not the "
             "network.", "", "| variant | median ms/step |", "|---|---|"]
    lines += [f"| {name} | {1e3 * s:.1f} |" for name, s in record["median_s"].items()]
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in record["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    begin = time.time()
    per_rank = spawn(_worker, 2, args.variants, args.rounds, args.steps, args.warmup,
                     timeout_s=600.0, threads=1)
    given = sys.argv[1:] if argv is None else argv
    record = {"command": " ".join(["python -m benchmarks.step", *given]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "machine": {"cpu": cpu_model(),
                                                                   "cores": os.cpu_count()},
              "load_before": load_before, "load_after": os.getloadavg(),
              "wall_s": time.time() - begin, "model": list(SIZES), "batch": BATCH,
              "world_size": 2, "threads_per_rank": 1, "rounds": args.rounds,
              "steps_per_round": args.steps, "per_round_s": per_rank[0],
              **summarise(per_rank[0])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps({"median_ms": {k: round(1e3 * v, 2) for k, v in record["median_s"].items()},
                      "ratios": {k: round(v, 3) for k, v in record["ratios"].items()},
                      "load": [load_before, record["load_after"]]}, indent=1))


if __name__ == "__main__":
    main()
