"""Each scheme's codec on a workload's own gradient: milliseconds per step, in one process.

    python -m benchmarks.codec --workload text-lm --schemes powersgd,powersgd:rank=4,topk

A time-to-target model adds a scheme's codec time to every step. Measured inside
a training run, that time carries the run's load (other ranks share the cores);
here every scheme encodes and decodes the same real gradient of the workload's
model (one backward pass on a training batch), laid out as DDP's bucket of all
parameters, through :meth:`~thinwire.schemes.base.Scheme.launch_flat` over a group
of one (collectives are no-ops), the schemes interleaved round by round
(:func:`benchmarks.overhead.interleaved`), medians over rounds of this thread's CPU
time (with one torch thread the work runs here, and other processes' load does not add
to it). ``floor`` is the least any exchange does with the bucket: one copy of it (what
an all-reduce reads).

Beside each scheme that has one, its plain version (:mod:`benchmarks.floors`: the same
arithmetic as the fewest plain torch ops on one flat bucket and one flat error memory)
runs in the same rounds, and one more step of each is counted in torch operator calls
(:class:`CallCount`): thinwire's time and calls over the plain version's are what its
engine costs beyond the arithmetic. ``--synthetic N`` times a made-up model's gradient of
N tensors (:func:`synthetic`: a few large matrices, many small vectors), where the cost
per tensor shows; ``--entries N`` one matrix of N entries (:func:`entries`), where the
cost per entry does.

A scheme is spelled as ``thinwire compare`` spells it, ``NAME:KEY=VALUE`` for its
own options. The record goes to ``docs/data/codec-WORKLOAD.json`` (or
``codec-synthetic-N.json``, ``codec-entries-N.json``; with the machine's load before
and after), which
``benchmarks.linkmodel --codec-from`` reads in place of the codec times its runs
measured under their own load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import floors
from benchmarks.overhead import interleaved
from thinwire import schemes
from thinwire.comm.collectives import ALONE
from thinwire.compress import TensorInfo
from thinwire.jobs import workloads
from thinwire.jobs.compare import parse_options, scheme_config, split_spelling


def gradient(workload: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """One worker's gradient of ``workload``'s model on a batch of its recipe's size."""
    work = workloads.load(workload, seed)
    model = work.model(seed)
    rows = torch.arange(workloads.RECIPES[workload]["batch_size"])
    inputs, side, targets = work.train.inputs[rows], work.train.side, work.train.targets[rows]
    work.loss(model(inputs, **{k: v[rows] for k, v in side.items()}), targets).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if p.grad is not None}


def synthetic(count: int, width: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """A made-up transformer's gradient of ``count`` tensors (at least 4): token and
    position embeddings and a final norm, then blocks of twelve (fused qkv and output
    projections, two MLP matrices, their biases, two norms' weights and biases) of
    model width ``width``, the rest norm-sized vectors. Each tensor's entries are
    normal at its own scale, log-uniform in [1e-4, 1e-1], as layers' gradients differ.

    Raises:
        ValueError: ``count`` below 4.
    """
    if count < 4:
        raise ValueError(f"count={count!r} must be >= 4 (embeddings and a final norm)")
    d = width
    Shapes = list[tuple[str, tuple[int, ...]]]
    block: Shapes = [("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
                     ("attn.out.weight", (d, d)), ("attn.out.bias", (d,)),
                     ("norm1.weight", (d,)), ("norm1.bias", (d,)),
                     ("mlp.fc1.weight", (4 * d, d)), ("mlp.fc1.bias", (4 * d,)),
                     ("mlp.fc2.weight", (d, 4 * d)), ("mlp.fc2.bias", (d,)),
                     ("norm2.weight", (d,)), ("norm2.bias", (d,))]
    shapes: Shapes = [("embed.weight", (8 * d, d)), ("position.weight", (2 * d, d))]
    blocks = (count - 4) // len(block)
    shapes += [(f"blocks.{b}.{name}", shape) for b in range(blocks) for name, shape in block]
    shapes += [(f"extra.{i}.weight", (d,)) for i in range(count - 2 - len(shapes))]
    shapes += [("norm.weight", (d,)), ("norm.bias", (d,))]
    generator = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.empty(len(shapes)).uniform_(-4.0, -1.0, generator=generator)
    return {name: torch.randn(shape, generator=generator) * float(scale)
            for (name, shape), scale in zip(shapes, scales)}


def entries(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One made-up matrix gradient of ``count`` entries, normal at scale 1e-2, with as many
    columns as the largest power of two up to 4096 that divides ``count``.

    Raises:
        ValueError: ``count`` below 1.
    """
    if count < 1:
        raise ValueError(f"count={count!r} must be >= 1")
    cols = math.gcd(count, 4096)
    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(count // cols, cols, generator=generator).mul_(1e-2)}


class CallCount(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the torch operator calls (``aten`` ops, after Python-level composites) made
    while it is active (``with count: ...``; then ``count.calls``)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def calls(step: Any) -> int:
    """Torch operator calls ``step()`` makes."""
    count = CallCount()
    with count:
        step()
    return count.calls


PLAIN = " (plain)"  # a plain version's row: its scheme's spelling and this


def codec_steps(spellings: list[str], grads: dict[str, torch.Tensor]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per spelling, one untimed refill of the bucket and one timed encode and decode;
    beside each with a floor (:func:`benchmarks.floors.floor_of`), its plain version,
    a row named the spelling and :data:`PLAIN`, with its own flat error memory."""
    infos = [TensorInfo.of(name, grad) for name, grad in grads.items()]
    flat = torch.cat([grad.reshape(-1) for grad in grads.values()])
    rows: dict[str, Any] = {}
    prepare: dict[str, Any] = {}
    for spelling in spellings:
        name, own = split_spelling(spelling)
        parse_options(own, [name])
        scheme = schemes.build(name, **scheme_config(name, None, None, own))
        bucket = flat.clone()
        rows[spelling] = (lambda s=scheme, b=bucket: s.launch_flat(b, infos, ALONE).wait())
        prepare[spelling] = (lambda b=bucket: b.copy_(flat))
        floor = floors.floor_of(name, scheme.origin[1], infos) if scheme.origin else None
        if floor is not None:
            plain, state = floor
            bucket, error = flat.clone(), torch.zeros_like(flat)
            rows[spelling + PLAIN] = (lambda f=plain, b=bucket, e=error, s=state: f(b, e, s))
            prepare[spelling + PLAIN] = (lambda b=bucket: b.copy_(flat))
    copy = torch.empty_like(flat)
    rows["floor"] = lambda: copy.copy_(flat)
    return rows, prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="text-lm", choices=sorted(workloads.WORKLOADS))
    made_up = parser.add_mutually_exclusive_group()
    made_up.add_argument("--synthetic", type=int, default=None, metavar="N",
                         help="a made-up model's gradient of N tensors instead of the workload's")
    made_up.add_argument("--entries", type=int, default=None, metavar="N",
                         help="one made-up matrix of N entries instead of the workload's")
    parser.add_argument("--schemes", default="dense,fp16,topk,dct-dp,powersgd,clt-k",
                        help="comma-separated, each NAME or NAME:KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=51, help="timed rounds")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (a rank of a run on this machine has one)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default docs/data/codec-WORKLOAD.json, or --add-to's file")
    parser.add_argument("--add-to", type=Path, default=None, metavar="FILE",
                        help="keep FILE's schemes (an earlier run on the same gradient) and "
                             "add these: a large gradient's schemes need not all fit in "
                             "memory at once")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    earlier = json.loads(args.add_to.read_text()) if args.add_to is not None else None
    torch.set_num_threads(args.threads)
    spellings = [s for s in args.schemes.split(",") if s]
    workload = (f"synthetic-{args.synthetic}" if args.synthetic is not None
                else f"entries-{args.entries}" if args.entries is not None else args.workload)
    if earlier is not None and (earlier["workload"], earlier["threads"]) != (
            workload, args.threads):
        parser.error(f"--add-to {args.add_to}: its gradient and threads "
                     f"({earlier['workload']}, {earlier['threads']}) are not this run's "
                     f"({workload}, {args.threads})")
    try:
        grads = (synthetic(args.synthetic) if args.synthetic is not None
                 else entries(args.entries) if args.entries is not None
                 else gradient(args.workload))
        rows, prepare = codec_steps(spellings, grads)
    except ValueError as error:
        parser.error(str(error))
    load = os.getloadavg()
    seconds = interleaved(rows, args.repeats, prepare, clock=time.thread_time)
    step_calls = {}
    for name, run in rows.items():  # one more step of each, counted (untimed)
        if name in prepare:
            prepare[name]()
        step_calls[name] = calls(run)
    ms = {name: 1000.0 * s for name, s in seconds.items()}
    record = {
        "workload": workload, "threads": args.threads, "repeats": args.repeats,
        "clock": "thread CPU time",
        "tensors": len(grads), "entries": sum(grad.numel() for grad in grads.values()),
        "ms_per_step": {name: t for name, t in ms.items() if not name.endswith(PLAIN)},
        "over_floor": {name: s / seconds["floor"] for name, s in seconds.items()
                       if not name.endswith(PLAIN)},
        "plain_ms_per_step": {name.removesuffix(PLAIN): t for name, t in ms.items()
                              if name.endswith(PLAIN)},
        "calls_per_step": {name: n for name, n in step_calls.items()
                           if not name.endswith(PLAIN)},
        "plain_calls_per_step": {name.removesuffix(PLAIN): n for name, n in step_calls.items()
                                 if name.endswith(PLAIN)},
        "command": " ".join(["python -m benchmarks.codec",
                             *(sys.argv[1:] if argv is None else argv)]),
        "when": time.strftime("%Y-%m-%d %H:%M %Z"), "load_before": list(load),
        "load_after": list(os.getloadavg()), "cores": os.cpu_count(),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "torch": torch.__version__}
    if earlier is not None:
        record = added(earlier, record)
    out = args.out or args.add_to or Path(f"docs/data/codec-{workload}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(table(record))
    print(f"wrote {out} (load {load[0]:.2f} before, {record['load_after'][0]:.2f} after)")
    return 0


RUN = ("repeats", "command", "when", "load_before", "load_after", "uptime")  # a run's own
ROWS = ("ms_per_step", "over_floor", "plain_ms_per_step", "calls_per_step",
        "plain_calls_per_step")  # per scheme


def added(earlier: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """``record``'s schemes added to ``earlier``'s (a scheme in both: ``record``'s), with
    ``earlier``'s runs listed under ``"earlier"``. ``over_floor`` is each run's own: the
    floor row of each is timed in that run."""
    merged = {**record, **{key: {**earlier[key], **record[key]} for key in ROWS}}
    runs = earlier.get("earlier", []) + [{key: earlier[key] for key in RUN}]
    return {**merged, "earlier": runs}


def table(record: dict[str, Any]) -> str:
    """The record's rows: ms and calls a step, thinwire's and the plain version's."""
    plain_ms, plain_calls = record["plain_ms_per_step"], record["plain_calls_per_step"]
    width = max(len("scheme"), *map(len, record["ms_per_step"]))
    lines = [f"{record['workload']}: {record['tensors']} tensors, {record['entries']} entries",
             f"{'scheme':{width}s} {'ms':>8s} {'x floor':>8s} {'plain ms':>9s} {'ratio':>6s} "
             f"{'calls':>6s} {'plain':>6s} {'ratio':>6s}"]
    for name, ms in record["ms_per_step"].items():
        line = (f"{name:{width}s} {ms:8.3f} {record['over_floor'][name]:8.1f} ")
        if name in plain_ms:
            line += (f"{plain_ms[name]:9.3f} {ms / plain_ms[name]:6.2f} "
                     f"{record['calls_per_step'][name]:6d} {plain_calls[name]:6d} "
                     f"{record['calls_per_step'][name] / plain_calls[name]:6.1f}")
        else:
            line += f"{'':9s} {'':6s} {record['calls_per_step'][name]:6d}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def section(records: Sequence[tuple[dict[str, Any], Path]]) -> str:
    """Markdown for the results page: per record, each scheme's codec beside its plain
    version (time and torch calls a step, and their ratios)."""
    lines = ["## Codec against its plain-torch version", "",
             "Each scheme's encode and decode of one gradient bucket (a group of one: the "
             "collectives are no-ops), beside the same arithmetic written as the fewest plain "
             "torch ops on one flat bucket and one flat error memory "
             "([how](bench.md#reading-the-numbers)): median thread CPU time of one "
             "torch thread over interleaved rounds, and torch operator calls a step. The "
             "ratios are what thinwire's engine adds to the arithmetic (the plain versions "
             "leave out what the wire alone needs: index codes, byte layouts, the "
             "finiteness check).", ""]
    for record, path in records:
        plain_ms, plain_calls = record["plain_ms_per_step"], record["plain_calls_per_step"]
        tensors = record["tensors"]
        lines += [f"### {record['workload']}: {tensors} tensor{'s' * (tensors != 1)}, "
                  f"{record['entries']:,} entries", "",
                  f"Source `{path.as_posix()}`: `{record['command']}` ({record['when']}, load "
                  f"average {record['load_before'][0]:.1f} before, "
                  f"{record['load_after'][0]:.1f} after, {record['cores']} cores).", "",
                  "| scheme | ms | plain ms | ratio | calls | plain calls | ratio |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, ms in record["ms_per_step"].items():
            if name not in plain_ms:
                continue
            calls = record["calls_per_step"][name]
            lines.append(f"| `{name}` | {ms:.2f} | {plain_ms[name]:.2f} | "
                         f"{ms / plain_ms[name]:.2f} | {calls} | {plain_calls[name]} | "
                         f"{calls / plain_calls[name]:.1f} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
