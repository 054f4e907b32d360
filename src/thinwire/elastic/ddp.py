"""Per-step data parallel whose workers fail and join: DDP with thinwire's hook, on torchft."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchft.manager import Manager
from torchft.process_group import ProcessGroupDummy

from thinwire.comm import Meter
from thinwire.ddp import comm_hook, hook_state
from thinwire.elastic.job import JobRecord
from thinwire.elastic.membership import Membership
from thinwire.elastic.state import Rollback, load_shared, shared_state
from thinwire.schemes import Scheme


class ElasticDDP:
    """A model trained by per-step data parallelism under torchft: a quorum before each
    step, thinwire's DDP hook over the quorum's workers, a commit vote before the step.

    ::

        manager = thinwire.elastic.connect("http://lighthouse:29510", min_workers=2)
        net = ElasticDDP(model, optimizer, build("topk", ratio=0.01), manager)
        for x, y in data:
            net.begin()  # quorum; a worker behind the others is healed here
            loss_fn(net(x), y).backward()
            net.commit()  # optimizer.step(), where every worker's exchange went through

    DDP runs on a process group of its own one worker (torchft's dummy group,
    buckets never rebuilt, so a healed worker's match the others'); the hook
    exchanges each bucket over the quorum's group, and a mean divides by the
    quorum's workers, every one of whom computed a gradient on the same
    weights. A worker behind the others takes the model, the optimiser state
    and the scheme's shared state from a live peer in :meth:`begin`. A step
    that fails anywhere, or lacks ``min_workers``, does not step the optimiser
    and rolls the scheme's state back (:class:`~thinwire.elastic.state.Rollback`).

    Args:
        module: the model (the same on every worker at step 0: torchft heals all but
            one from it).
        optimizer: the user's optimiser of ``module``'s parameters.
        scheme: from :func:`thinwire.schemes.build`.
        manager: from :func:`~thinwire.elastic.connect`.
        meter: records the bytes handed to torch.distributed.
        max_norm: each worker's gradient clipped before the scheme (:mod:`thinwire.ddp.clip`).
        job: the job's record of its latest commit (:class:`~thinwire.elastic.JobRecord`),
            written after each committed step; a worker behind it with no live peer to
            heal it stops with :class:`~thinwire.elastic.StaleWorker` in :meth:`begin`
            rather than train committed steps again. None: no record, no such check.

    Attributes:
        record: counts of ``commits``, ``failures``, ``heals``, seconds of ``quorum_s``
            and ``heal_s``.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheme: Scheme, manager: Manager, *, meter: Meter | None = None,
                 max_norm: float | None = None, job: JobRecord | None = None) -> None:
        self.module = module
        self.optimizer = optimizer
        self.ddp = DistributedDataParallel(module, process_group=ProcessGroupDummy(0, 1),
                                           find_unused_parameters=True)
        self.state = hook_state(module, scheme, None, meter, max_norm=max_norm)
        self.state.agreed = True  # the membership compares the peers of each new quorum
        parameter = next(module.parameters(), None)
        self.membership = Membership(manager, self.state.fields, "the fault-tolerant DDP hook",
                                     parameter.device if parameter is not None else None,
                                     job=job)
        self._rollback: Rollback | None = None
        self.ddp.register_comm_hook(self, _guarded_hook)
        manager.register_state_dict_fn("thinwire data parallel", self._heal, self._shared)

    @property
    def manager(self) -> Manager:
        return self.membership.manager

    @property
    def scheme(self) -> Scheme:
        return self.state.scheme

    @property
    def record(self) -> dict[str, float]:
        return self.membership.record

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def begin(self) -> None:
        """Start a step: the quorum (a worker behind is healed here), gradients zeroed.

        Raises:
            StaleWorker: behind the job's record with no one to heal it (see ``job``).
        """
        self.optimizer.zero_grad()
        self.membership.meet()
        self._rollback = Rollback(self.state.scheme)

    def commit(self) -> bool:
        """End the step: ``optimizer.step()`` if torchft commits it, else the scheme's state
        as it was at :meth:`begin`.

        Returns:
            Whether the step committed.
        """
        if self.membership.commit():
            self.optimizer.step()
            self.membership.committed(self.manager.current_step(),
                                      list(self.module.parameters()))
            return True
        if self._rollback is not None:
            self.state.scheme = self._rollback.restore(self.state.scheme)
        return False

    def _shared(self) -> dict[str, Any]:
        return {"module": copy.deepcopy(self.module.state_dict()),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "scheme": shared_state(self.state.scheme)}

    def _heal(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_shared(self.state.scheme, state["scheme"])
        self.membership.healed()

    def state_dict(self) -> dict[str, Any]:
        """Model, optimiser, scheme and Manager state (torchft needs its step count back)."""
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheme": self.state.scheme.state_dict(), "manager": self.manager.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (before the first :meth:`begin`)."""
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.state.scheme.load_state_dict(state["scheme"])
        self.manager.load_state_dict(state["manager"])


def _guarded_hook(net: ElasticDDP, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """thinwire's hook; a failed exchange leaves the bucket as it is, reported to torchft."""
    buffer = bucket.buffer()
    return net.membership.guard(lambda: comm_hook(net.state, bucket), buffer)
