"""Each scheme's codec on a workload's own gradient: milliseconds per step, in one process.

    python -m benchmarks.codec --workload text-lm --schemes powersgd,powersgd:rank=4,topk

A time-to-target model adds a scheme's codec time to every step. Measured inside
a training run, that time carries the run's load (other ranks share the cores);
here every scheme encodes and decodes the same real gradient of the workload's
model (one backward pass on a training batch), laid out as DDP's bucket of all
parameters, through :meth:`~thinwire.schemes.base.Scheme.launch_flat` over a group
of one (collectives are no-ops), the schemes interleaved round by round
(:func:`benchmarks.overhead.interleaved`), medians over rounds. ``floor`` is the
least any exchange does with the bucket: one copy of it (what an all-reduce reads).

A scheme is spelled as ``thinwire compare`` spells it, ``NAME:KEY=VALUE`` for its
own options. The record goes to ``docs/data/codec-WORKLOAD.json`` (with the
machine's load before and after), which ``benchmarks.linkmodel --codec-from``
reads in place of the codec times its runs measured under their own load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

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


def codec_steps(spellings: list[str], grads: dict[str, torch.Tensor]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per spelling, one untimed refill of the bucket and one timed encode and decode."""
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
    copy = torch.empty_like(flat)
    rows["floor"] = lambda: copy.copy_(flat)
    return rows, prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="text-lm", choices=sorted(workloads.WORKLOADS))
    parser.add_argument("--schemes", default="dense,fp16,topk,dct-dp,powersgd,clt-k",
                        help="comma-separated, each NAME or NAME:KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=51, help="timed rounds")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (a rank of a run on this machine has one)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default docs/data/codec-WORKLOAD.json")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    torch.set_num_threads(args.threads)
    spellings = [s for s in args.schemes.split(",") if s]
    try:
        rows, prepare = codec_steps(spellings, gradient(args.workload))
    except ValueError as error:
        parser.error(str(error))
    load = os.getloadavg()
    seconds = interleaved(rows, args.repeats, prepare)
    record = {
        "workload": args.workload, "threads": args.threads, "repeats": args.repeats,
        "ms_per_step": {name: 1000.0 * s for name, s in seconds.items()},
        "over_floor": {name: s / seconds["floor"] for name, s in seconds.items()},
        "command": " ".join(["python -m benchmarks.codec",
                             *(sys.argv[1:] if argv is None else argv)]),
        "when": time.strftime("%Y-%m-%d %H:%M %Z"), "load_before": list(load),
        "load_after": list(os.getloadavg()), "cores": os.cpu_count(),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "torch": torch.__version__}
    out = args.out or Path(f"docs/data/codec-{args.workload}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    for name, ms in record["ms_per_step"].items():
        print(f"{name:40s} {ms:8.3f} ms  {record['over_floor'][name]:8.1f}x floor")
    print(f"wrote {out} (load {load[0]:.2f} before)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
