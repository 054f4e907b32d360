"""PyTorch's own DDP communication as the anchors users would pick today, metered.

* ``torch-dense``: plain DDP, no hook (its C++ all-reduce of every bucket).
* ``torch-fp16``: ``default_hooks.fp16_compress_hook``.
* ``torch-powersgd``: ``powerSGD_hook.powerSGD_hook`` with one DDP bucket
  (with several, torch 2.13's hook deadlocks on gloo: it waits on an
  all-reduce inside a future callback). ``start_powerSGD_iter=2``, the least
  the hook allows with error feedback, so it compresses from step 3 on;
  torch's default of 1000 would leave a short run uncompressed.

torch's hooks do not report what they send, so the bytes are counted here
from the bucket, following each hook's code: a dense all-reduce of every
bucket in fp32 (plain DDP) or fp16; for PowerSGD, before ``start_powerSGD_iter``
the fp32 bucket, after it one all-reduce of the tensors it leaves
uncompressed, one of all P factors and one of all Q factors (rank
``min(n, m, r)`` per ``n x m`` matrix, compressed only when
``(n + m) r * min_compression_rate < n m``).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations as objects.

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm import Meter

MB = 1024 * 1024


@dataclass
class Installed:
    """A DDP model with its communication, and how to read its cost."""

    net: nn.Module  # DDP, or the model itself when FSDP shards it (it communicates inside)
    after_step: Callable[[], None]  # metering that has no hook to live in
    overhead_s: Callable[[], float]  # compression seconds measured so far (0 if unknown)
    details: Callable[[], dict[str, Any]] = dict  # scheme-specific counters for the results
    scheme: Any = None  # the thinwire scheme behind the hook (None for PyTorch's anchors)
    hook: Any = None  # its thinwire.ddp hook state, what thinwire.optim.couple takes


def powersgd_bytes(shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float,
                   element_size: int = 4) -> tuple[int, int, int]:
    """Bytes of (uncompressed, P, Q) all-reduces of one ``powerSGD_hook`` call.

    Mirrors the hook's Step I: each gradient is viewed as ``shape[0] x rest``
    (a 1-D tensor as ``n x 1``); ``_should_compress`` decides.
    """
    uncompressed = p_numel = q_numel = 0
    for shape in shapes:
        n = int(shape[0]) if len(shape) else 1
        m = math.prod(int(s) for s in shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p_numel += n * r
            q_numel += m * r
        else:
            uncompressed += n * m
    return (uncompressed * element_size, p_numel * element_size, q_numel * element_size)


def _plain(model: nn.Module, meter: Meter, rank: int) -> Installed:
    net = DistributedDataParallel(model)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def after_step() -> None:
        # The ring model is linear in bytes, so how DDP buckets them does not matter.
        meter.record("W_grad", "(all buckets)", "all_reduce", nbytes)

    return Installed(net, after_step, lambda: 0.0)


def _fp16(model: nn.Module, meter: Meter, rank: int) -> Installed:
    net = DistributedDataParallel(model)

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
        meter.record("W_grad", f"(bucket {bucket.index()})", "all_reduce",
                     bucket.buffer().numel() * 2)
        return default_hooks.fp16_compress_hook(state, bucket)

    net.register_comm_hook(None, hook)
    return Installed(net, lambda: None, lambda: 0.0)


def _powersgd(model: nn.Module, meter: Meter, rank: int) -> Installed:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # One bucket: the cap holds the whole model (and sets the first bucket's cap too).
    net = DistributedDataParallel(model, bucket_cap_mb=math.ceil(total / MB) + 1)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=2, random_seed=0)

    def hook(state: powerSGD_hook.PowerSGDState,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
        if bucket.index() != 0 or not bucket.is_last():
            raise RuntimeError("torch-powersgd needs exactly one DDP bucket (several deadlock "
                               f"on gloo); got bucket {bucket.index()}")
        grads = bucket.gradients()
        size = bucket.buffer().element_size()
        if state.iter < state.start_powerSGD_iter:  # the hook all-reduces the bucket as is
            meter.record("W_grad", "(bucket 0)", "all_reduce", bucket.buffer().numel() * size)
        else:
            dense, p, q = powersgd_bytes([g.shape for g in grads],
                                         state.matrix_approximation_rank,
                                         state.min_compression_rate, size)
            meter.record("W_grad", "(uncompressed)", "all_reduce", dense)
            meter.record("factor", "(P)", "all_reduce", p)
            meter.record("factor", "(Q)", "all_reduce", q)
        return powerSGD_hook.powerSGD_hook(state, bucket)

    net.register_comm_hook(state, hook)
    return Installed(net, lambda: None, lambda: 0.0)


# name -> installer(model, meter, low-rank rank) for PyTorch's own communication.
ANCHORS: dict[str, Callable[[nn.Module, Meter, int], Installed]] = {
    "torch-dense": _plain,
    "torch-fp16": _fp16,
    "torch-powersgd": _powersgd,
}
