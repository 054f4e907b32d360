"""Local multi-process launch on torch.multiprocessing, with a deadline.

``spawn`` is for tests, the CLI's local jobs and benchmarks; real jobs use
``torchrun`` (see ``thinwire train``), whose rendezvous handles multi-node.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world_size: int, workdir: str, timeout_s: float,
           backend: str, args: tuple[Any, ...], threads: int) -> None:
    torch.set_num_threads(threads)  # several ranks share few cores
    dist.init_process_group(backend, init_method=f"file://{workdir}/store", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
          backend: str = "gloo", threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in one group.

    ``fn`` must be importable (module level). Each rank's return value is
    saved with ``torch.save`` and returned in rank order.

    Args:
        timeout_s: collective timeout, and the deadline for the whole run.
        threads: intra-op threads per process.

    Raises:
        TimeoutError: the processes did not finish by the deadline (they are killed).
        torch.multiprocessing.ProcessRaisedException: a rank raised.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="thinwire-") as workdir:
        context = mp.start_processes(  # type: ignore[attr-defined]
            _entry, args=(fn, world_size, workdir, timeout_s, backend, args, threads),
            nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s} s")
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False)
                for r in range(world_size)]
