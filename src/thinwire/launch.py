"""Local multi-process launch on torch.multiprocessing, with bounded waits.

``spawn`` is for tests, the CLI's local jobs and benchmarks; real jobs use
``torchrun`` (see ``thinwire train``), whose rendezvous handles multi-node.

Every wait is bounded by the process group's timeout: a rank whose peer
stalls (stopped, swapped out, dead) fails its collective after ``timeout_s``,
and the launcher then reports which rank failed, what each rank was last
doing (see :func:`phase`) and whether a process is stopped.

Floor: core, beside comm and feedback; it imports no other part of thinwire.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing.util
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

DEFAULT_TIMEOUT_S = 300.0  # process-group timeout of local jobs: minutes, not torch's 30
_START_S = 600.0  # how long ranks wait for each other to start (a hang guard only)
# Imported once, by the forkserver the ranks fork from; fsdp brings DTensor and sympy, which
# the compare job's ranks import whether or not they shard.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "thinwire.launch"]
_GRACE_S = 2.0  # after a failure, seconds the other ranks get before SIGTERM, then SIGKILL
_phase_file: str | None = None  # set in each spawned rank
_phase = "starting"


class RankFailed(RuntimeError):
    """A rank of a job failed: raised, or waited past the timeout on a stalled peer."""


def phase(text: str) -> None:
    """Record what this rank is doing now (``"dct-dp step 17"``), for stall reports.

    Cheap enough to call every step. Outside :func:`spawn` it is only kept in
    this process (see :func:`current_phase`).
    """
    global _phase
    _phase = text
    if _phase_file is not None:
        with open(_phase_file + ".tmp", "w") as handle:
            handle.write(text)
        os.replace(_phase_file + ".tmp", _phase_file)


def current_phase() -> str:
    """The last text given to :func:`phase` in this process."""
    return _phase


def add_timeout(parser: argparse._ActionsContainer,
                meaning: str = "process-group timeout: a rank waiting longer on a peer fails "
                               "the job, naming ranks and steps") -> None:
    """``--timeout SECONDS``: how long a process waits on a stalled peer; one default for
    every subcommand, ``meaning`` says what waits."""
    parser.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"{meaning} (default: {DEFAULT_TIMEOUT_S:g})")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds > 0")
    return value


def _entry(rank: int, fn: Callable[..., Any], world_size: int, workdir: str, timeout_s: float,
           backend: str, args: tuple[Any, ...], threads: int, environ: dict[str, str]) -> None:
    global _phase_file
    # Forked from the forkserver, which kept the environment of its own start: take the
    # caller's, as a spawned process would.
    os.environ.clear()
    os.environ.update(environ)
    _phase_file = os.path.join(workdir, f"phase{rank}")
    torch.set_num_threads(threads)  # several ranks share few cores
    phase("waiting for every rank to start")
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)  # type: ignore[attr-defined]
    # A slow start (imports on a busy machine) is not a stalled peer: wait for every rank
    # under the start-up guard, so that the short timeout only bounds waits in training.
    store.set_timeout(timedelta(seconds=max(timeout_s, _START_S)))
    store.set(f"started{rank}", "1")
    store.wait([f"started{r}" for r in range(world_size)])
    phase("joining the process group")
    if backend == "nccl":  # NCCL: one GPU per rank
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    phase("running")
    try:
        try:
            result = fn(rank, world_size, *args)
        except RuntimeError as error:  # a collective's timeout names neither rank nor step
            raise RankFailed(f"rank {rank} failed during {current_phase()!r}: {error}") from error
        phase("saving its result")
        torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
    finally:
        end_process_group()
    # The result is saved and the group destroyed; a DDP model built in this process has
    # kept gloo's threads running even so (torch 2.13), and the interpreter's shutdown
    # beside them is where such a process can still abort. Nothing else lives here.
    # os._exit skips the cleanup multiprocessing's bootstrap runs after its target
    # returns: run it here, or the named semaphores created in this rank (tqdm's lock)
    # outlive it and the parent's resource tracker reports them as leaked.
    multiprocessing.util._exit_function()  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def end_process_group() -> None:
    """Destroy torch.distributed's process groups, freeing first what still holds them.

    DDP, schemes, futures and gloo work left in reference cycles keep a group alive
    past ``destroy_process_group``; freed later, during interpreter shutdown, its
    gloo threads can abort the process after the results were written ("terminate
    called without an active exception"). Collected first, the groups end here,
    while the interpreter is whole. (A ``DistributedDataParallel`` keeps the default
    group's gloo threads alive past this in torch 2.13 whatever is collected:
    :func:`spawn`'s ranks therefore end without the interpreter's shutdown.) A no-op
    without a process group.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _process_state(pid: int | None) -> str:
    """``"stopped"``, ``"running"`` ... from /proc (Linux); "" where unknown."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("State:"):
                    return line.split("(", 1)[-1].rstrip(")\n")
    except OSError:
        pass
    return ""


def _report(workdir: str, states: Sequence[str]) -> str:
    """Each rank's last phase and process state, in one line."""
    parts = []
    for rank, state in enumerate(states):
        try:
            with open(os.path.join(workdir, f"phase{rank}")) as handle:
                last = handle.read()
        except OSError:
            last = "not started"
        parts.append(f"rank {rank} last during {last!r}" + (f" ({state})" if state else ""))
    return "; ".join(parts)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any,
          timeout_s: float = DEFAULT_TIMEOUT_S, deadline_s: float | None = None,
          backend: str = "gloo", threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in one group.

    ``fn`` must be importable (module level). Each rank's return value is
    saved with ``torch.save`` and returned in rank order. Ranks are forked from a
    forkserver that has imported torch once; each takes the caller's environment,
    ``sys.path`` and working directory, as a spawned process does.

    Args:
        timeout_s: the process group's timeout: the longest any rank waits on a
            peer in a collective before failing.
        deadline_s: optional limit on the whole run (a hang guard); None: none,
            every wait being bounded by ``timeout_s`` already.
        threads: intra-op threads per process.

    Raises:
        ValueError: ``world_size`` < 1, a timeout <= 0, or more ranks under ``nccl``
            than GPUs (rank r runs on ``cuda:r``).
        RankFailed: a rank failed (a peer stalled past ``timeout_s``, or raised);
            the message names it and every rank's last phase and process state.
        TimeoutError: the run passed ``deadline_s`` (the processes are killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be >= 1")
    for name, value in (("timeout_s", timeout_s), ("deadline_s", deadline_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0 seconds")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"world_size={world_size} under nccl needs a GPU per rank; "
                         f"torch finds {torch.cuda.device_count()} here")
    # A forkserver with torch imported starts each rank in a fraction of a second, where a
    # spawned interpreter imports torch again (seconds of CPU per rank).
    multiprocessing.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="thinwire-") as workdir:
        context = mp.start_processes(  # type: ignore[attr-defined]
            _entry, args=(fn, world_size, workdir, timeout_s, backend, args, threads,
                          dict(os.environ)),
            nprocs=world_size, join=False, start_method="forkserver")
        start = time.monotonic()
        while True:
            # Read before joining: a failed join kills the others, state and all.
            states = [_process_state(process.pid) for process in context.processes]
            try:
                if context.join(timeout=1.0, grace_period=_GRACE_S):
                    break
            except ProcessException as error:
                cause = str(error).strip().splitlines()[-1]
                cause = cause.removeprefix(f"{RankFailed.__module__}.RankFailed: ")
                raise RankFailed(f"{cause}\n{_report(workdir, states)}\n"
                                   f"rank {error.error_index}'s traceback:{error}") from None
            if deadline_s is not None and time.monotonic() - start > deadline_s:
                report = _report(workdir, states)
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {deadline_s} s; "
                                   f"{report}")
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False)
                for r in range(world_size)]
