"""Train one scheme as one rank of a real job launched by torchrun.

    torchrun --nproc-per-node 4 -m thinwire train --scheme dct-dp --ratio 0.01
    torchrun --nproc-per-node 4 -m thinwire train --scheme topk --sites 2   # FSDP2 in 2 sites
    torchrun --nproc-per-node 4 -m thinwire train --scheme diloco+int4 --option every=50
    torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 -m thinwire train ...

Rendezvous, multi-node included, is torchrun's; this only reads its environment.
Where torch finds a GPU, each rank trains on ``cuda:LOCAL_RANK`` under NCCL.
Rank 0 prints a summary table and writes results.json, results.md,
accuracy_vs_bytes.png and, for a sparsifier, threshold.png to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from thinwire.cli.compare import add_recipe_options, add_scheme_options, add_sites, run_options
from thinwire.jobs import board, common, local_run
from thinwire.jobs.compare import parse_options, plot, scheme_config
from thinwire.jobs.sharded import NATIVE, check_sites, run_sharded
from thinwire.launch import RankFailed, add_timeout, current_phase
from thinwire.progress import StepBar


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheme", default="dct-dp",
                        help="a name from thinwire schemes; diloco or diloco+SCHEME train "
                             "with local updates (docs/local-updates.md)")
    add_sites(parser)
    add_recipe_options(parser)
    add_scheme_options(parser)
    parser.add_argument("--device", default=None,
                        help="cpu, cuda (this rank's GPU: cuda:LOCAL_RANK) or cuda:N "
                             "(default: cuda where a GPU is found, else cpu)")
    parser.add_argument("--backend", default=None,
                        help="gloo or nccl (default: nccl on a GPU, gloo on the CPU)")
    common.add_outputs(parser, "train")
    add_timeout(parser)


def run(args: argparse.Namespace) -> int:
    """One rank of the job; rank 0 prints the summary and writes the run folder."""
    if "RANK" not in os.environ:
        raise ValueError("thinwire train expects torchrun's environment (RANK, WORLD_SIZE, "
                         "MASTER_ADDR); launch it with torchrun, or use thinwire compare")
    options = run_options(args)
    if options.tensorboard is not None:
        board.writer_class()
    sites = args.sites
    if sites is not None:  # validate before joining the job
        check_sites(sites, int(os.environ.get("WORLD_SIZE", "1")))
        if local_run.is_local(args.scheme):
            raise ValueError(f"--scheme {args.scheme!r} takes no --sites: local updates run on "
                             "the workers' own replicas (thinwire.local takes a sharded model "
                             "in Python)")
    native = args.scheme == NATIVE and sites is not None
    config: dict[str, Any] = {}
    if not native:
        parse_options(args.option, [args.scheme])
        config = scheme_config(args.scheme, args.ratio, args.life_span, args.option)
        local_run.validate(args.scheme, config)
    device = rank_device(args.device)
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"--backend nccl needs a GPU; --device {device} is not one "
                         f"(use --backend gloo)")
    options = dataclasses.replace(options, device=str(device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        bar = StepBar(options.steps, show=rank == 0)
        try:
            result = (local_run.run(args.scheme, config, options, progress=bar.update)
                      if sites is None else
                      run_sharded(args.scheme, config, options, sites, progress=bar.update))
        except RuntimeError as error:  # a collective's timeout names neither rank nor step
            raise RankFailed(f"rank {rank} failed during {current_phase()!r} "
                             f"(--timeout {args.timeout:g} s): {error}") from error
        finally:
            bar.close()
        weights = result.pop("weights")
        if rank == 0:
            dense_bytes = result.pop("dense_shard_bytes", None) or sum(  # sharded: the shard's
                w.numel() * w.element_size() for w in weights)
            result.update(workers=world_size, dense_bytes_per_step=dense_bytes,
                          compression_ratio=dense_bytes / max(result["bytes_sent_per_step"],
                                                              1e-9))
            _write(args, result)
    finally:
        dist.destroy_process_group()
    return 0


def rank_device(name: str | None) -> torch.device:
    """This rank's device: ``name``, with a bare ``cuda`` meaning ``cuda:LOCAL_RANK``;
    by default that GPU where CUDA is available, else the CPU.

    Raises:
        ValueError: ``name`` is no device, or a GPU that this machine does not have.
    """
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r} must be cpu, cuda or cuda:N") from error
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"--device {name!r} needs a GPU, and torch finds none here")
    if device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.index >= count:
        raise ValueError(f"--device {name!r} is {device}, but this machine has {count} "
                         f"GPU(s): cuda:0 to cuda:{count - 1}")
    return device


HEADER = ["scheme", "workers", "test acc", "final loss", "handed B/step", "ring sent B/step",
          "ring recv B/step", "ratio vs dense", "wall s"]


def _write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    out = common.run_folder(args.out, "train")
    rows = [[result["scheme"], str(result["workers"]), f"{result['test_accuracy']:.4f}",
             f"{result['final_loss']:.4f}", f"{result['bytes_sent_per_step']:,.0f}",
             f"{result['wire_sent_per_step']:,.0f}", f"{result['bytes_received_per_step']:,.0f}",
             f"{result['compression_ratio']:.1f}x", f"{result['wall_s']:.2f}"]]
    common.write_results(
        out, "train", args, [result],
        f"# thinwire train\n\n{result['workload']}, {result['optimizer']}, "
        f"{result['steps']} steps.\n\n"
        f"{common.markdown_table(HEADER, rows)}\n")
    figures = plot([result], out)
    print(common.text_table(HEADER, rows))
    print(f"wrote {out}/results.json, results.md, " + ", ".join(f.name for f in figures))
