"""Train one scheme as one rank of a real job launched by torchrun.

    torchrun --nproc-per-node 4 -m thinwire train --scheme dct-dp --ratio 0.01
    torchrun --nproc-per-node 4 -m thinwire train --scheme topk --sites 2   # FSDP2 in 2 sites
    torchrun --nproc-per-node 4 -m thinwire train --scheme diloco+int4 --option every=50
    torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint host:29500 -m thinwire train ...
    thinwire train --fault-tolerant --lighthouse http://host:29510 --replica-id 0 \
        --min-workers 2 --scheme diloco+int4 --out runs/job1   # one per worker, relaunched

Rendezvous, multi-node included, is torchrun's; this only reads its environment.
Under --fault-tolerant each worker is a process of its own (or a torchrun of one
process), torchft's Lighthouse forms the quorums (docs/guide/fault-tolerance.md);
--out is the job's folder, shared by its workers.
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
from thinwire.launch import RankFailed, add_timeout, current_phase, end_process_group
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
    elastic = parser.add_argument_group(
        "fault tolerance (torchft)", "workers that fail and join: each worker is launched, "
        "and relaunched, on its own (docs/guide/fault-tolerance.md)")
    elastic.add_argument("--fault-tolerant", action="store_true",
                         help="train under torchft: a quorum of the live workers at each sync "
                              "(diloco+SCHEME) or step, healing of workers that join")
    elastic.add_argument("--lighthouse", default=None, metavar="ADDRESS",
                         help="the Lighthouse, http://HOST:PORT (default: $TORCHFT_LIGHTHOUSE; "
                              "start one with thinwire lighthouse)")
    elastic.add_argument("--min-workers", type=int, default=1, metavar="N",
                         help="the fewest workers a sync or step commits with")
    elastic.add_argument("--replica-id", type=int, default=None, metavar="N",
                         help="this worker's number, >= 0: names it to the Lighthouse and "
                              "seeds its batches (a relaunched worker takes its old one)")
    elastic.add_argument("--heartbeat-timeout", type=float, default=5.0, metavar="SECONDS",
                         help="a worker of the quorum silent this long (stopped, swapped out) "
                              "fails the exchange in flight on the others at once, rather "
                              "than after --timeout; the Lighthouse's --heartbeat-timeout")
    elastic.add_argument("--quorum-timeout", type=float, default=600.0, metavar="SECONDS",
                         help="the longest a worker waits for a quorum (a joining worker "
                              "waits for the others' next sync)")


def run(args: argparse.Namespace) -> int:
    """One rank of the job; rank 0 prints the summary and writes the run folder."""
    if args.fault_tolerant:
        return _run_elastic(args)
    for flag in ("lighthouse", "replica_id"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} needs --fault-tolerant")
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
        end_process_group()
    return 0


def _run_elastic(args: argparse.Namespace) -> int:
    """One fault-tolerant worker: its own results in ``--out``/worker-N, the job's latest
    commit in ``--out``/job.json (a stale or late worker stops instead of retraining)."""
    if args.replica_id is None:
        raise ValueError("--fault-tolerant needs --replica-id N: a number >= 0, a different "
                         "one for each worker")
    if args.replica_id < 0:
        raise ValueError(f"--replica-id {args.replica_id} must be >= 0")
    if args.sites is not None:
        raise ValueError("--fault-tolerant takes no --sites: each worker is one process")
    if args.min_workers < 1:
        raise ValueError(f"--min-workers {args.min_workers} must be >= 1")
    if not args.heartbeat_timeout > 0:
        raise ValueError(f"--heartbeat-timeout {args.heartbeat_timeout:g} must be > 0 seconds")
    options = run_options(args)
    parse_options(args.option, [args.scheme])
    config = scheme_config(args.scheme, args.ratio, args.life_span, args.option)
    local_run.validate(args.scheme, config)
    if args.out is None:
        raise ValueError("--fault-tolerant needs --out DIR: the job's folder, the same for "
                         "every worker and every relaunch (it holds job.json, the job's "
                         "latest commit, and each worker's results in worker-N)")
    device = rank_device(args.device)
    options = dataclasses.replace(options, device=str(device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's own logging, read at its import
    from thinwire import elastic
    from thinwire.jobs.elastic_run import run_elastic

    def connect() -> Any:
        return elastic.connect(args.lighthouse, min_workers=args.min_workers,
                               replica_id=f"worker{args.replica_id}",
                               backend=args.backend or ("nccl" if device.type == "cuda"
                                                        else "gloo"),
                               timeout_s=args.timeout, quorum_timeout_s=args.quorum_timeout,
                               heartbeat_timeout_s=args.heartbeat_timeout)

    out = common.run_folder(args.out, "train") / f"worker-{args.replica_id}"
    job = elastic.JobRecord(out.parent / elastic.job.FILE, steps=options.steps,
                            worker=f"worker{args.replica_id}", where=str(out))
    bar = StepBar(options.steps, show=True)
    try:
        result = run_elastic(args.scheme, config, options, connect, args.replica_id,
                             progress=bar.update, job=job)
    except (elastic.QuorumLost, elastic.StaleWorker) as error:
        raise RankFailed(f"worker {args.replica_id}: {error}") from error
    finally:
        bar.close()
        end_process_group()
    out.mkdir(parents=True, exist_ok=True)
    record = result["record"]
    rows = [[result["scheme"], str(args.replica_id), str(int(record["commits"])),
             str(int(record["failures"])), str(int(record["heals"])),
             f"{result['bytes_sent_per_step']:,.0f}", f"{result['wall_s']:.2f}"]]
    header = ["scheme", "worker", "commits", "failed", "heals", "handed B/step", "wall s"]
    common.write_results(out, "train", args, [result],
                         f"# thinwire train --fault-tolerant\n\n"
                         f"{common.markdown_table(header, rows)}\n")
    print(common.text_table(header, rows))
    print(f"wrote {out}/results.json, results.md")
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
