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
import hashlib
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
from thinwire.elastic import ElasticDDP, ElasticLocalUpdates
from thinwire.jobs import local_run, workloads
from thinwire.jobs.dataparallel import PRECISIONS, RunOptions, backward
from thinwire.launch import phase
from thinwire.local import LocalUpdates, nesterov

# One entry per sync (local updates) or step (per-step) this worker took part in; "time" is
# Unix time, so the events of several workers line up.
EVENT_FIELDS = ("step", "time", "workers", "committed", "weights_hash", "score")


def weights_hash(tensors: list[torch.Tensor]) -> str:
    """The first 16 hex digits of the sha256 of ``tensors``' bytes, in order."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
                      .numpy().tobytes())
    return hasher.hexdigest()[:16]


def run_elastic(name: str, config: dict[str, Any], options: RunOptions, manager: Any,
                replica: int, progress: Callable[[int], None] | None = None,
                on_step: Callable[[int, tuple[Any, ...] | None, dict[str, float]], None]
                | None = None) -> dict[str, Any]:
    """Train ``options.workload`` as one fault-tolerant worker under ``manager``.

    Args:
        name: a scheme, or ``diloco+SCHEME`` (``diloco``) for local updates.
        config: the scheme's options (and the local ones, for local updates).
        manager: from :func:`thinwire.elastic.connect`.
        replica: this worker's number (seeds its batch stream).
        progress: called with 1 after each step (a progress bar).
        on_step: called after each step with the step count, the event it logged (None if
            none) and the counts of commits, failures and heals so far (for monitoring).

    Returns:
        ``events`` (:data:`EVENT_FIELDS`, one per sync or step), ``record`` (commits,
        failures, heals, seconds waiting for quorums and heals), the meter's summary,
        ``wall_s`` and the final weights' hash.
    """
    phase(f"{name} setup, worker {replica}")
    device = torch.device(options.device)
    work = workloads.load(options.workload, seed=options.seed, hidden=options.hidden).to(device)
    model = work.model(options.seed)
    meter = Meter(replica, 1)
    dtype = PRECISIONS[options.precision]
    if dtype == torch.float16:
        raise ValueError("--precision fp16 is not supported with --fault-tolerant "
                         "(its loss scale is a per-step vote of its own); use bf16 or fp32")
    inner = workloads.optimizer(options.optimizer, model.parameters(), options.lr,
                                options.momentum, options.weight_decay)
    stream = batches(work.train, options.batch_size, seed=options.seed * 1000 + replica)
    events: list[tuple[Any, ...]] = []
    start = time.perf_counter()

    def log(step: int, committed: bool, shared: list[torch.Tensor], probe: nn.Module) -> None:
        first = dist.is_initialized() and dist.get_rank() == 0
        score = (work.score(probe, options.eval_rows)
                 if committed and first and (step % options.eval_every == 0
                                             or step >= options.steps) else None)
        events.append((step, time.time(), dist.get_world_size() if dist.is_initialized() else 0,
                       committed, weights_hash(shared), score))

    def stepped(step: int, logged: int, record: dict[str, float]) -> None:
        if on_step is not None:
            on_step(step, events[-1] if len(events) > logged else None, record)

    if local_run.is_local(name):
        local, scheme_config = local_run.parts(name, config)
        scheme = schemes.build(local_run.inner_scheme(name), **scheme_config)
        updates = ElasticLocalUpdates(LocalUpdates(
            model, inner, scheme, every=local.every, fragments=local.fragments,
            delay=local.delay, mix=local.mix, outer=nesterov(local.outer_lr,
                                                             local.outer_momentum),
            meter=meter), manager)
        probe = copy.deepcopy(model)  # holds the global weights, for evaluation
        while updates.steps < options.steps:
            phase(f"{name} step {updates.steps + 1}, worker {replica}")
            backward(work, model, work.train.rows(next(stream)), inner, dtype)
            inner.step()
            commits, logged = updates.record["commits"], len(events)
            if updates.step():
                globals_ = list(updates.updates.global_state().values())
                with torch.no_grad():
                    for target, value in zip(probe.parameters(), globals_):
                        target.copy_(value)
                log(updates.steps, updates.record["commits"] > commits, globals_, probe)
            meter.next_step()
            stepped(updates.steps, logged, updates.record)
            if progress is not None:
                progress(1)
        updates.finish()
        record, settings = updates.record, {**asdict(local), **scheme_config}
    else:
        net = ElasticDDP(model, inner, schemes.build(name, **config), manager, meter=meter,
                         max_norm=options.max_norm)
        while manager.current_step() < options.steps:
            phase(f"{name} step {manager.current_step() + 1}, worker {replica}")
            net.begin()
            backward(work, net.ddp, work.train.rows(next(stream)), inner, dtype)
            committed, logged = net.commit(), len(events)
            log(manager.current_step(), committed, list(model.parameters()), model)
            meter.next_step()
            stepped(manager.current_step(), logged, net.record)
            if progress is not None and committed:
                progress(1)
        record, settings = net.record, config
    return {"scheme": name, "workload": work.name, "replica": replica, "config": settings,
            "target": work.target, "metric": work.metric, "lower_is_better": work.lower_is_better,
            "events": events, "record": dict(record), "wall_s": time.perf_counter() - start,
            **meter.summary()}
