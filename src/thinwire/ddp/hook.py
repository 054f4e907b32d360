"""Front door 1: a DDP communication hook that applies a scheme layer-wise."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire import optim
from thinwire.comm import Meter
from thinwire.comm.collectives import Future, Group
from thinwire.schemes.base import Scheme


@dataclass(slots=True)
class HookState:
    """What the hook needs: the scheme (tunable + state) and parameter names."""

    scheme: Scheme
    names: dict[int, str]  # id(parameter) -> name, so state is keyed by parameter
    group: Group = None


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """Split ``bucket`` into per-parameter gradients, reduce them with the scheme,
    and return a future of the bucket's flat averaged gradient."""
    grads = {state.names[id(p)]: g for p, g in zip(bucket.parameters(), bucket.gradients())}
    buffer = bucket.buffer()

    def flatten(fut: Future[Any]) -> torch.Tensor:  # no collectives here: decode only
        reduced = fut.value()
        return torch.cat([reduced[key].reshape(-1) for key in grads]).to(buffer.dtype)

    return state.scheme.launch(grads, state.group).then(flatten)


def register(ddp_model: DistributedDataParallel, scheme: Scheme, group: Group = None,
             meter: Meter | None = None) -> HookState:
    """Install ``scheme`` as ``ddp_model``'s communication hook.

    Args:
        ddp_model: a DistributedDataParallel model (gloo or NCCL).
        scheme: from :func:`thinwire.schemes.build`.
        group: the process group the hook reduces over (DDP's own by default).
        meter: records the bytes handed to torch.distributed; attached to the scheme.

    Returns:
        The hook state (holds the scheme, whose ``state_dict`` checkpoints it).

    Raises:
        TypeError: ``ddp_model`` is not DistributedDataParallel.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"expected DistributedDataParallel, got {type(ddp_model).__name__}")
    if meter is not None:
        scheme.meter = meter
    names = {id(p): name for name, p in ddp_model.module.named_parameters()}
    state = HookState(scheme, names, group if group is not None else ddp_model.process_group)
    ddp_model.register_comm_hook(state, comm_hook)
    optim.watch(scheme, ddp_model.module.parameters())  # warns if SGD momentum is not coupled
    return state
