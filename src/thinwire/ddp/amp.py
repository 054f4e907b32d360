"""fp16 autocast with a ``GradScaler``: the loss scale kept out of the scheme's state.

``GradScaler`` multiplies the loss by ``S`` (a power of two) and, when a step
overflowed, skips it and lowers ``S``. A sparse scheme keeps state across
steps, so ``S g`` must not enter it, and a rank that overflowed must not leave
the others stepping without it. Registered with the scaler, at a step's last
bucket (:class:`~thinwire.ddp.hold.StepHold`) every rank votes by one
all-reduce (MAX) whether its gradient is finite; if any is not, it sends
nothing, leaves every state as it was and fills its buckets with NaN, so every
rank's scaler skips alike; else it divides its buckets by ``S`` (exact) before
the scheme and multiplies the decoded mean by ``S`` after. With every entry
sent, training under a scaler is bit-identical to training without one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm import Meter
from thinwire.comm.collectives import Future, Group
from thinwire.ddp.hold import Launch, Stage


class LossScale(Stage):
    """Take ``scaler``'s loss scale out before the scheme and put it back after.

    Attributes:
        skipped: steps that some rank's overflow skipped on every rank.
    """

    def __init__(self, scaler: torch.amp.GradScaler, group: Group = None,
                 meter: Meter | None = None) -> None:
        self.scaler, self.group, self.meter = scaler, group, meter
        self.skipped = 0
        self._scale = 1.0

    def prepare(self, buffers: list[torch.Tensor]) -> bool:
        total = torch.stack([b.sum(dtype=torch.float32) for b in buffers]).sum()
        vote = (~torch.isfinite(total)).to(torch.float32).reshape(1)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
        if self.meter is not None:
            self.meter.record("W_grad", "overflow vote", "all_reduce", vote.element_size(),
                              world_size=dist.get_world_size(self.group))
        if vote.item() > 0:
            for buffer in buffers:
                buffer.fill_(float("nan"))
            self.skipped += 1
            return False
        self._scale = float(self.scaler.get_scale())
        if self._scale != 1.0:
            torch._foreach_div_(buffers, self._scale)
        return True

    def launch(self, start: Launch) -> Launch:
        scale = self._scale

        def rescaled(last: bool) -> Future[Any]:
            future = start(last)
            return future if scale == 1.0 else future.then(lambda f: f.value().mul_(scale))

        return rescaled
