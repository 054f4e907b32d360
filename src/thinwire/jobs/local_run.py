"""One local-update run (``diloco``, ``diloco+SCHEME``) of a workload, as ``run_scheme`` does DDP.

``diloco`` averages dense pseudo-gradients; ``diloco+SCHEME`` averages them
through any registered scheme (``diloco+int4``, ``diloco+dct-dp``,
``diloco+topk+int2``). The local options (:class:`DiLoCoOptions`) and the
scheme's own are both set by ``--option KEY=VALUE``. Accuracy is measured on
the global weights (what every worker shares after a sync), so steps to
target fall on sync points; the result's keys are :func:`run_scheme`'s, so a
compare table holds both families alike.

A sync's exchange is launched at the step that lands it (delay 0) or ``delay``
steps before: the meter charges its bytes to the launching step. A per-step
scheme takes :class:`StepOptions` the same way (``dense:delayed=true``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire import schemes
from thinwire.comm import Meter
from thinwire.data.digits import batches
from thinwire.jobs.board import MeterBoard
from thinwire.jobs.dataparallel import (
    PRECISIONS,
    RunOptions,
    _anyone,
    backward,
    evaluation_point,
    prepare,
    run_record,
    run_scheme,
)
from thinwire.launch import phase
from thinwire.local import LocalConfig, LocalUpdates, default_every, nesterov, outer_defaults

PREFIX = "diloco"


@dataclass(frozen=True)
class DiLoCoOptions:
    every: int | None = None  # H, inner steps between syncs; None: the scheme's (10 or 50)
    fragments: int = 1  # Streaming DiLoCo's F, parts synced at staggered steps
    delay: int = 0  # tau, inner steps a fragment's exchange overlaps, < every // fragments
    mix: float = 0.0  # weight of the local weights when a fragment lands, in [0, 1)
    overlap: bool = False  # each exchange lands one sync late, under the next H steps
    # as overlap, each worker stepping at once with its own fresh share (Kale et al. 2025)
    eager: bool = False
    # as overlap, each replica starting from the outer step its own fresh pseudo-gradient
    # would take
    lookahead: bool = False
    # the outer Nesterov SGD's learning rate, > 0; None: the scheme's (outer_defaults:
    # 0.7, or 1.0 for sparseloco)
    outer_lr: float | None = None
    outer_momentum: float | None = None  # its momentum, in [0, 1); 0: plain SGD; None: 0.9, or 0

    def __post_init__(self) -> None:
        if self.outer_lr is not None and not (
                isinstance(self.outer_lr, (int, float)) and math.isfinite(self.outer_lr)
                and self.outer_lr > 0):
            raise ValueError(f"outer_lr={self.outer_lr!r} must be a finite number > 0")
        if self.outer_momentum is not None and not (
                isinstance(self.outer_momentum, (int, float))
                and 0.0 <= self.outer_momentum < 1.0):
            raise ValueError(f"outer_momentum={self.outer_momentum!r} is outside the allowed "
                             "range [0, 1)")

    def resolved(self, scheme: schemes.Scheme) -> DiLoCoOptions:
        """These options with H and the outer optimiser's settings the scheme calls for
        filled in."""
        lr, momentum = outer_defaults(scheme)
        return dataclasses.replace(
            self, every=default_every(scheme) if self.every is None else self.every,
            outer_lr=lr if self.outer_lr is None else self.outer_lr,
            outer_momentum=momentum if self.outer_momentum is None else self.outer_momentum)


@dataclass(frozen=True)
class StepOptions:
    delayed: bool = False  # apply each step's mean one step later (ddp.register's delay)

    def __post_init__(self) -> None:
        if not isinstance(self.delayed, bool):
            raise ValueError(f"delayed={self.delayed!r} must be True or False")


STEP = "ddp"  # the label of StepOptions in messages


def is_local(name: str) -> bool:
    """Whether ``name`` spells a local-update run (``diloco`` or ``diloco+SCHEME``)."""
    return name == PREFIX or name.startswith(PREFIX + "+")


def inner_scheme(name: str) -> str:
    """The scheme that averages the pseudo-gradients of ``diloco+SCHEME`` (dense alone)."""
    return name[len(PREFIX) + 1:] if name.startswith(PREFIX + "+") else "dense"


def config_classes(name: str) -> dict[str, type]:
    """The config dataclasses whose fields a run of ``name`` takes, by a label for messages.

    Raises:
        ValueError: an unknown scheme (after ``diloco+``, too).
    """
    if not is_local(name):
        return {name: schemes.config_class(name), STEP: StepOptions}
    return {PREFIX: DiLoCoOptions, inner_scheme(name): schemes.config_class(inner_scheme(name))}


def fields(name: str) -> set[str]:
    """Every option a run of ``name`` takes."""
    return {f.name for config in config_classes(name).values() for f in dataclasses.fields(config)}


def parts(name: str, config: dict[str, Any]) -> tuple[DiLoCoOptions, dict[str, Any]]:
    """``config`` split into the local options and the scheme's own (validated)."""
    local = {f.name for f in dataclasses.fields(DiLoCoOptions)}
    options = DiLoCoOptions(**{k: v for k, v in config.items() if k in local})
    scheme = {k: v for k, v in config.items() if k not in local}
    return options, scheme


def step_parts(config: dict[str, Any]) -> tuple[StepOptions, dict[str, Any]]:
    """A per-step run's ``config`` split into :class:`StepOptions` and the scheme's own."""
    step = {f.name for f in dataclasses.fields(StepOptions)}
    return (StepOptions(**{k: v for k, v in config.items() if k in step}),
            {k: v for k, v in config.items() if k not in step})


def validate(name: str, config: dict[str, Any]) -> None:
    """Build what a run of ``name`` builds, so bad options fail before anything is spawned."""
    if not is_local(name):
        schemes.build(name, **step_parts(config)[1])
        return
    options, scheme = parts(name, config)
    options = options.resolved(schemes.build(inner_scheme(name), **scheme))
    assert options.every is not None  # resolved fills it
    LocalConfig(options.every, options.fragments, options.delay, options.mix, options.overlap,
                options.eager, options.lookahead)


def run(name: str, config: dict[str, Any], options: RunOptions,
        progress: Callable[[int], None] | None = None,
        group: dist.ProcessGroup | None = None,
        compute_s: float | None = None) -> dict[str, Any]:
    """:func:`run_local` for a local-update name, else :func:`run_scheme` (with the
    per-step options of ``config``)."""
    if is_local(name):
        return run_local(name, config, options, progress=progress, group=group,
                         compute_s=compute_s)
    step, scheme_config = step_parts(config)
    return run_scheme(name, scheme_config, options, progress=progress, group=group,
                      compute_s=compute_s, delayed=step.delayed)


def _global_copy(model: nn.Module, updates: LocalUpdates) -> nn.Module:
    """A copy of ``model`` holding the global weights (for evaluation)."""
    probe = copy.deepcopy(model)
    params = dict(probe.named_parameters())
    with torch.no_grad():
        for key, value in updates.global_state().items():
            params[key].copy_(value)
    return probe


def run_local(name: str, config: dict[str, Any], options: RunOptions,
              progress: Callable[[int], None] | None = None,
              group: dist.ProcessGroup | None = None,
              compute_s: float | None = None) -> dict[str, Any]:
    """Train ``options.workload`` with local updates in the current process group.

    The inner optimiser is the user's (``options.optimizer``, ``lr``,
    ``momentum``); the outer one Nesterov SGD (``outer_lr``, ``outer_momentum``;
    by default what the scheme calls for, :func:`~thinwire.local.outer_defaults`).
    Every rank calls this with the same arguments.

    Returns:
        :func:`~thinwire.jobs.dataparallel.run_scheme`'s keys, plus ``local``: the
        local options and the syncs landed.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    phase(f"{name} setup")
    local_options, scheme_config = parts(name, config)
    device = torch.device(options.device)
    work, shard, model, compute_s = prepare(options, device, rank, world_size, compute_s)
    meter = Meter(rank, world_size)
    scheme = schemes.build(inner_scheme(name), **scheme_config)
    local_options = local_options.resolved(scheme)
    assert local_options.outer_lr is not None and local_options.outer_momentum is not None
    assert local_options.every is not None
    inner, schedule = options.build_optimizer(model.parameters())
    updates = LocalUpdates(model, inner, scheme, every=local_options.every,
                           fragments=local_options.fragments, delay=local_options.delay,
                           mix=local_options.mix, overlap=local_options.overlap,
                           eager=local_options.eager, lookahead=local_options.lookahead,
                           outer=nesterov(local_options.outer_lr, local_options.outer_momentum),
                           group=group, meter=meter)
    dtype = PRECISIONS[options.precision]
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    stream = batches(shard, options.batch_size, seed=options.seed * 1000 + rank)
    curve: list[tuple[int, float, float]] = []
    losses: list[float] = []
    board = (MeterBoard(Path(options.tensorboard) / name,
                        sum(p.numel() * p.element_size() for p in model.parameters()))
             if options.tensorboard is not None and rank == 0 else None)
    syncs, moved, score = 0, False, math.nan
    steps_to_target = None
    start = time.perf_counter()
    for step in range(1, options.steps + 1):
        phase(f"{name} step {step}")
        loss = backward(work, model, shard.rows(next(stream)), inner, dtype, scaler)
        if options.max_norm is not None:  # each worker's own gradient: nothing is averaged
            torch.nn.utils.clip_grad_norm_(model.parameters(), options.max_norm)
        if scaler is None:
            inner.step()
        else:
            scaler.step(inner)
            scaler.update()
        schedule.step()
        landed = updates.step()
        syncs += len(landed)
        moved = moved or bool(landed)
        meter.next_step()
        losses.append(float(loss.detach()))
        if board is not None:
            board.step(meter, losses[-1])
        if not math.isfinite(losses[-1]):
            break
        if step % options.eval_every == 0 or step == options.steps:
            if moved or not curve:  # the global weights change only when a sync lands
                score = work.score(_global_copy(model, updates), options.eval_rows)
                moved = False
            steps_to_target = evaluation_point(step, score, work, meter, curve, steps_to_target,
                                               board)
            if options.until_target and _anyone(steps_to_target is not None, group, device):
                break
        if progress is not None:
            progress(1)
    updates.finish()
    wall_s = time.perf_counter() - start
    if board is not None:
        board.close()
    final = _global_copy(model, updates)
    result = run_record(name, work, options, final, device=device, coupled=False,
                        config={**asdict(local_options),
                                **asdict(schemes.config_class(inner_scheme(name))(
                                    **scheme_config))},
                        steps_to_target=steps_to_target, losses=losses, meter=meter,
                        scheme=scheme, compute_s=compute_s, wall_s=wall_s, curve=curve)
    result.update({
        "local": {**asdict(local_options), "syncs": syncs},
    })
    return result
