"""Train one scheme as one rank of a real job launched by torchrun.

    torchrun --nproc-per-node 4 -m thinwire train --scheme dct-dp --sparsity 0.99
    torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 -m thinwire train ...

Rendezvous, multi-node included, is torchrun's; this only reads its environment.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from thinwire import schemes
from thinwire.jobs.compare import parse_options, scheme_config
from thinwire.jobs.dataparallel import RunOptions, run_scheme
from thinwire.launch import RankFailed, add_timeout, current_phase


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheme", default="dct-dp")
    parser.add_argument("--steps", type=int, default=RunOptions.steps)
    parser.add_argument("--batch-size", type=int, default=RunOptions.batch_size)
    parser.add_argument("--lr", type=float, default=RunOptions.lr)
    parser.add_argument("--sparsity", type=float, default=None)
    parser.add_argument("--life-span", type=int, default=None)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl on GPU)")
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes results here")
    add_timeout(parser)


def run(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ:
        raise ValueError("thinwire train expects torchrun's environment (RANK, WORLD_SIZE, "
                         "MASTER_ADDR); launch it with torchrun, or use thinwire compare")
    options = RunOptions(steps=args.steps, batch_size=args.batch_size, lr=args.lr)
    parse_options(args.option, [args.scheme])
    config = scheme_config(args.scheme, args.sparsity, args.life_span, args.option)
    schemes.build(args.scheme, **config)  # validate before joining the job
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        try:
            result = run_scheme(args.scheme, config, options)
        except RuntimeError as error:  # a collective's timeout names neither rank nor step
            raise RankFailed(f"rank {dist.get_rank()} failed during {current_phase()!r} "
                             f"(--timeout {args.timeout:g} s): {error}") from error
        result.pop("weights")
        if dist.get_rank() == 0:
            print(json.dumps({k: result[k] for k in ("scheme", "test_accuracy",
                                                       "bytes_sent_per_step", "wall_s")}))
            if args.json is not None:
                args.json.write_text(json.dumps(result, indent=2, default=str))
    finally:
        dist.destroy_process_group()
    return 0
