"""One fault-tolerant worker's run of a workload (``thinwire train --fault-tolerant``).

A local-update name (``diloco+SCHEME``) trains with
:class:`~thinwire.elastic.ElasticLocalUpdates`, any other scheme per step with
:class:`~thinwire.elastic.ElasticDDP`. The run lasts ``options.steps``: inner
steps under local updates (a healed worker takes the others' count), committed
steps per step. Every worker samples the whole training split with a stream of
its own (``seed * 1000 + replica``), so a worker that joins needs no share.
After each sync (local updates) or committed step, every worker logs the
step, its wall time, the quorum's size and a hash of the weights every worker
shares; the worker ranked first in the quorum also evaluates them every
``eval_every`` steps.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire import schemes
from thinwire.comm import Meter
from thinwire.data.digits import batches
from thinwire.elastic import ElasticDDP, ElasticLocalUpdates, JobRecord
from thinwire.elastic.job import weights_hash
from thinwire.jobs import local_run, workloads
from thinwire.jobs.dataparallel import PRECISIONS, RunOptions, backward
from thinwire.launch import phase
from thinwire.local import LocalUpdates, nesterov

# One entry per sync (local updates) or step (per-step) this worker took part in; "time" is
# Unix time, so the events of several workers line up.
EVENT_FIELDS = ("step", "time", "workers", "committed", "weights_hash", "score")

OnStep = Callable[[int, "tuple[Any, ...] | None", dict[str, float]], None]


def run_elastic(name: str, config: dict[str, Any], options: RunOptions,
                connect: Callable[[], Any], replica: int,
                progress: Callable[[int], None] | None = None,
                on_step: OnStep | None = None, job: JobRecord | None = None) -> dict[str, Any]:
    """Train ``options.workload`` as one fault-tolerant worker.

    Args:
        name: a scheme, or ``diloco+SCHEME`` (``diloco``) for local updates.
        config: the scheme's options (and the local ones, for local updates).
        connect: makes this worker's torchft Manager (:func:`thinwire.elastic.connect`),
            called once the model and data are ready: from then on the Lighthouse
            counts the worker as alive, and a quorum waits for it; shut down at the end.
        replica: this worker's number (seeds its batch stream).
        progress: called with 1 after each step (a progress bar).
        on_step: called after each step with the step count, the event it logged (None if
            none) and the counts of commits, failures and heals so far (for monitoring).
        job: the job's record of its latest commit, its ``steps`` this run's: a job that is
            over stops this worker before it connects, and a worker left behind the
            record with no one to heal it stops at its quorum (None: no record).

    Returns:
        ``events`` (:data:`EVENT_FIELDS`, one per sync or step), ``record`` (commits,
        failures, heals, seconds waiting for quorums and heals), the meter's summary and
        ``wall_s``.

    Raises:
        StaleWorker: behind ``job``'s latest commit with no one to heal it.
    """
    phase(f"{name} setup, worker {replica}")
    if job is not None:
        job.check(0, in_quorum=False)  # a job that is over takes no one
    if options.precision == "fp16":
        raise ValueError("--precision fp16 is not supported with --fault-tolerant "
                         "(its loss scale is a per-step vote of its own); use bf16 or fp32")
    if options.schedule != "constant" or options.lr_warmup:
        raise ValueError(f"--schedule {options.schedule} with --lr-warmup {options.lr_warmup} "
                         "is not supported with --fault-tolerant (a schedule would follow "
                         "each worker's own step count, not the job's committed one); use "
                         "--schedule constant --lr-warmup 0")
    work = options.load(options.device)
    model = work.model(options.seed)
    inner, _ = options.build_optimizer(model.parameters())
    stream = batches(work.train, options.batch_size, seed=options.seed * 1000 + replica)
    run = _Run(name, options, work, model, inner, stream, Meter(replica, 1), on_step, progress,
               job)
    manager = connect()
    try:
        record, settings = (run.local(config, manager) if local_run.is_local(name)
                            else run.per_step(config, manager))
    finally:
        manager.shutdown(wait=False)
    return {"scheme": name, "workload": work.name, "replica": replica, "config": settings,
            "target": work.target, "metric": work.metric, "lower_is_better": work.lower_is_better,
            "events": run.events, "record": dict(record), "wall_s": run.wall_s(),
            **run.meter.summary()}


class _Run:
    """One worker's training loop and its log of events."""

    def __init__(self, name: str, options: RunOptions, work: workloads.Workload,
                 model: nn.Module, inner: torch.optim.Optimizer, stream: Any, meter: Meter,
                 on_step: OnStep | None, progress: Callable[[int], None] | None,
                 job: JobRecord | None) -> None:
        self.name, self.options, self.work, self.model = name, options, work, model
        self.job = job
        self.inner, self.stream, self.meter = inner, stream, meter
        self.on_step, self.progress = on_step, progress
        self.dtype = PRECISIONS[options.precision]
        self.events: list[tuple[Any, ...]] = []
        self.start = time.perf_counter()

    def wall_s(self) -> float:
        return time.perf_counter() - self.start

    def backward(self, model: nn.Module) -> None:
        """One batch's forward and backward into fresh gradients."""
        backward(self.work, model, self.work.train.rows(next(self.stream)), self.inner,
                 self.dtype)

    def log(self, step: int, committed: bool, workers: int, shared: list[torch.Tensor],
            evaluated: nn.Module) -> None:
        """An event of a quorum of ``workers``; its first worker evaluates ``evaluated`` every
        eval_every."""
        options = self.options
        first = dist.is_initialized() and dist.get_rank() == 0
        due = step % options.eval_every == 0 or step >= options.steps
        score = (self.work.score(evaluated, options.eval_rows) if committed and first and due
                 else None)
        self.events.append((step, time.time(), workers, committed, weights_hash(shared), score))

    def stepped(self, step: int, logged: int, record: dict[str, float]) -> None:
        self.meter.next_step()
        if self.on_step is not None:
            self.on_step(step, self.events[-1] if len(self.events) > logged else None, record)
        if self.progress is not None:
            self.progress(1)

    def local(self, config: dict[str, Any], manager: Any) -> tuple[dict[str, float], Any]:
        """Local updates, ``options.steps`` inner steps (a healed worker's are its peers')."""
        local, scheme_config = local_run.parts(self.name, config)
        scheme = schemes.build(local_run.inner_scheme(self.name), **scheme_config)
        local = local.resolved(scheme)
        assert local.outer_lr is not None and local.outer_momentum is not None
        updates = ElasticLocalUpdates(LocalUpdates(
            self.model, self.inner, scheme, every=local.every, fragments=local.fragments,
            delay=local.delay, mix=local.mix, overlap=local.overlap,
            outer=nesterov(local.outer_lr, local.outer_momentum), meter=self.meter), manager,
            job=self.job)
        probe = copy.deepcopy(self.model)  # holds the global weights, for evaluation
        while updates.steps < self.options.steps:
            phase(f"{self.name} step {updates.steps + 1}")
            self.backward(self.model)
            self.inner.step()
            commits, logged = updates.record["commits"], len(self.events)
            if updates.step():
                shared = list(updates.updates.global_state().values())
                with torch.no_grad():
                    torch._foreach_copy_(list(probe.parameters()), shared)
                self.log(updates.steps, updates.record["commits"] > commits,
                         manager.num_participants(), shared, probe)
            self.stepped(updates.steps, logged, updates.record)
        updates.finish()
        return updates.record, {**asdict(local), **scheme_config}

    def per_step(self, config: dict[str, Any], manager: Any) -> tuple[dict[str, float], Any]:
        """Per-step DDP, ``options.steps`` committed steps."""
        net = ElasticDDP(self.model, self.inner, schemes.build(self.name, **config), manager,
                         meter=self.meter, max_norm=self.options.max_norm, job=self.job)
        while manager.current_step() < self.options.steps:
            phase(f"{self.name} step {manager.current_step() + 1}")
            net.begin()
            self.backward(net.ddp)
            committed, logged = net.commit(), len(self.events)
            self.log(manager.current_step(), committed, manager.num_participants(),
                     list(self.model.parameters()), self.model)
            self.stepped(manager.current_step(), logged, net.record)
        return net.record, config
