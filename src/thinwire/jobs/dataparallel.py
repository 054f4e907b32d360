"""One data-parallel training run: DDP + a scheme's hook on one of the workloads.

Shared by ``thinwire compare`` (local ranks) and ``thinwire train`` (torchrun).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire import ddp, optim, schemes
from thinwire.comm import Meter
from thinwire.data.digits import Split, batches
from thinwire.jobs import workloads
from thinwire.jobs.board import MeterBoard
from thinwire.launch import phase

# What couple() may put behind a coupled clt-k for every scheme of a run: "ef21" is clt-k's
# only, so a run of several schemes says "auto" for it.
RUN_FEEDBACKS = ("auto", "error")
# Where --max-norm clips: "worker", each worker's gradient in the hook for sparse schemes
# (thinwire.ddp.register's max_norm) and clip_grad_norm_ after backward for the others;
# "after-backward", clip_grad_norm_ after backward for every scheme, as an unchanged script.
CLIP_AT = ("worker", "after-backward")
# Autocast precision of a run's forward and loss: fp16 adds a GradScaler, registered with the
# hook (thinwire.ddp.amp); bf16 needs none.
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class RunOptions:
    steps: int = 500  # optimiser steps per scheme
    batch_size: int = 32  # samples per worker per step
    lr: float = 0.05  # SGD learning rate
    momentum: float = 0.9  # SGD momentum
    weight_decay: float | None = None  # the optimiser's; None: torch's default (SGD 0, AdamW 0.01)
    beta2: float = 0.999  # AdamW's second-moment decay (nanoGPT: 0.99 or 0.95)
    schedule: str = "constant"  # the learning rate's, one of workloads.SCHEDULES
    lr_warmup: int = 0  # steps the learning rate rises linearly to lr first
    min_lr: float = 0.1  # "cosine": the rate at the last step, as a fraction of lr
    max_norm: float | None = None  # gradient clipping threshold; None: no clipping
    clip_at: str = "worker"  # where max_norm clips, one of CLIP_AT
    precision: str = "fp32"  # autocast of the forward and loss, one of PRECISIONS
    hidden: int = 256  # width of the MLP's two hidden layers
    width: int | None = None  # a language model's width; None: its own (workloads.LMShape)
    layers: int | None = None  # a language model's blocks; None: its own
    context: int | None = None  # a language model's window in bytes; None: its own
    tied: bool = False  # a language model shares its embedding with its head (nanoGPT)
    target: float | None = None  # the test metric that counts as trained; None: the workload's
    seed: int = 0  # model initialisation, data order and split
    eval_every: int = 25  # steps between test-metric points of the curves
    workload: str = "digits-mlp"  # a name of thinwire.jobs.workloads.WORKLOADS
    optimizer: str = "sgd"  # "sgd", "nesterov" or "adamw" (beta1 = momentum)
    coupling: str = "auto"  # the optimiser's coupling rule (thinwire.optim.RULES)
    warmup: int | None = None  # steps sent dense first; None: the optimiser family's
    feedback: str = "auto"  # clt-k's coupled memory (thinwire.optim.couple's feedback)
    eval_rows: int | None = 2000  # test rows per evaluation point (None: all)
    until_target: bool = False  # stop at the first evaluation that reaches the target
    device: str = "cpu"  # where the model, its data and the scheme's state live
    tensorboard: str | None = None  # rank 0 logs each scheme to TensorBoard in DIR/<scheme>

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "hidden", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum={self.momentum!r} must be in [0, 1)")
        if self.weight_decay is not None and not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be None or >= 0")
        if self.max_norm is not None and not (math.isfinite(self.max_norm)
                                              and self.max_norm > 0):
            raise ValueError(f"max_norm={self.max_norm!r} must be None or a finite number > 0")
        if self.clip_at not in CLIP_AT:
            raise ValueError(f"clip_at={self.clip_at!r} must be one of {CLIP_AT}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {list(PRECISIONS)}")
        if self.workload not in workloads.WORKLOADS:
            raise ValueError(f"workload={self.workload!r} must be one of "
                             f"{sorted(workloads.WORKLOADS)}")
        if self.coupling not in optim.RULES:
            raise ValueError(f"coupling={self.coupling!r} must be one of {optim.RULES}")
        if self.warmup is not None and (not isinstance(self.warmup, int) or self.warmup < 0):
            raise ValueError(f"warmup={self.warmup!r} must be None or an integer >= 0")
        if self.feedback not in RUN_FEEDBACKS:
            raise ValueError(f"feedback={self.feedback!r} must be one of {RUN_FEEDBACKS}")
        if not 0 <= self.beta2 < 1:
            raise ValueError(f"beta2={self.beta2!r} must be in [0, 1)")
        if self.schedule not in workloads.SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of "
                             f"{list(workloads.SCHEDULES)}")
        if (isinstance(self.lr_warmup, bool) or not isinstance(self.lr_warmup, int)
                or not 0 <= self.lr_warmup < self.steps):
            raise ValueError(f"lr_warmup={self.lr_warmup!r} must be an integer in "
                             f"[0, {self.steps}) (the steps)")
        if not 0 <= self.min_lr <= 1:
            raise ValueError(f"min_lr={self.min_lr!r} must be in [0, 1] (a fraction of lr)")
        if self.target is not None and not math.isfinite(self.target):
            raise ValueError(f"target={self.target!r} must be None or a finite number")
        self.shape()  # a shape out of range, or one for a workload with none, fails here
        if self.optimizer not in workloads.OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} must be one of "
                             f"{list(workloads.OPTIMIZERS)}")
        try:
            torch.device(self.device)
        except RuntimeError as error:
            raise ValueError(f"device={self.device!r} must name a torch device such as "
                             f"'cpu', 'cuda' or 'cuda:1'") from error


    def shape(self) -> workloads.LMShape | None:
        """The language model's shape these options give (None: no shape option is set).

        Raises:
            ValueError: a shape option out of range, or one set for a workload that is
                no language model.
        """
        given: dict[str, int | bool] = {
            key: value for key, value in (("width", self.width), ("layers", self.layers),
                                          ("context", self.context)) if value is not None}
        if self.tied:
            given["tied"] = True
        if not given:
            return None
        if self.workload not in workloads.CORPORA:
            raise ValueError(f"workload={self.workload!r} takes no {', '.join(given)}: only "
                             f"the language models {sorted(workloads.CORPORA)} do")
        return workloads.LMShape(**given)  # type: ignore[arg-type]  # checked there

    def load(self, device: torch.device | str = "cpu") -> workloads.Workload:
        """The workload these options name, at their seed, shape and target, on ``device``."""
        work = workloads.load(self.workload, seed=self.seed, hidden=self.hidden,
                              shape=self.shape()).to(device)
        return work if self.target is None else replace(work, target=self.target)

    def build_optimizer(self, params: Any) -> tuple[torch.optim.Optimizer,
                                              torch.optim.lr_scheduler.LambdaLR]:
        """The user's optimiser on ``params`` and its learning-rate schedule (step it after
        each optimiser step)."""
        built = workloads.optimizer(self.optimizer, params, self.lr, self.momentum,
                                    self.weight_decay, self.beta2)
        return built, self.schedule_of(built)

    def schedule_of(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """``optimizer``'s learning-rate schedule under these options."""
        return workloads.schedule(optimizer, self.schedule, self.steps, self.lr_warmup,
                                  self.min_lr)


# What makes two runs the same recipe: rows compared in one table must agree on all of these.
RECIPE_FIELDS = ("workload", "optimizer", "lr", "momentum", "weight_decay", "beta2", "schedule",
                 "lr_warmup", "min_lr", "batch_size", "steps", "seed", "precision", "max_norm",
                 "hidden", "width", "layers", "context", "tied", "target")


def recipe(options: RunOptions) -> dict[str, Any]:
    """The fields of ``options`` that make a run's recipe (:data:`RECIPE_FIELDS`)."""
    return {name: getattr(options, name) for name in RECIPE_FIELDS}


def evaluation_point(step: int, score: float, work: workloads.Workload, meter: Meter,
                     curve: list[tuple[int, float, float]], steps_to_target: int | None,
                     board: MeterBoard | None = None) -> int | None:
    """Add ``(step, bytes handed so far, score)`` to ``curve`` (and the board); return the
    first step whose score reached the workload's target (None: not yet)."""
    curve.append((step, meter.bytes_per_step().get("total", 0.0) * meter.step, score))
    if board is not None:
        board.score(step, score, work.metric)
    return step if steps_to_target is None and work.reached(score) else steps_to_target


def same_trajectory(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two recipes train alike, step for step: all fields but the step budget,
    which only cuts a run short where the learning rate is constant (the batch stream is
    endless); a decaying schedule depends on it."""
    budget = () if first.get("schedule", "constant") != "constant" else ("steps",)
    # a record written before a field existed trained at the field's default
    defaults = {f.name: f.default for f in fields(RunOptions)
                if f.name in RECIPE_FIELDS and f.name not in budget}
    return ({**defaults, **{k: v for k, v in first.items() if k not in budget}}
            == {**defaults, **{k: v for k, v in second.items() if k not in budget}})


def accuracy(model: nn.Module, split: Split) -> float:
    with torch.no_grad():
        return float((model(split.x).argmax(dim=1) == split.y).float().mean())


def compute_seconds(model: nn.Module, data: Split, batch_size: int, repeats: int = 15) -> float:
    """Median time of one local forward + backward + update, without communication."""
    probe = copy.deepcopy(model)
    optimizer = torch.optim.SGD(probe.parameters(), lr=0.0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loss = nn.functional.cross_entropy(probe(data.x[:batch_size]), data.y[:batch_size])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _finished(model: nn.Module) -> float:
    """``time.perf_counter()`` once the work queued on ``model``'s GPU is done (a wall-clock
    time of GPU work must wait for it); at once on the CPU."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def step_seconds(model: nn.Module, work: workloads.Workload, data: workloads.Data,
                 batch_size: int, repeats: int = 15) -> float:
    """:func:`compute_seconds` for any workload's model and loss."""
    probe = copy.deepcopy(model)
    optimizer = torch.optim.SGD(probe.parameters(), lr=0.0)
    batch = data.rows(slice(0, batch_size))
    times = []
    for _ in range(repeats):
        start = _finished(probe)
        loss = work.loss(probe(batch.inputs, **batch.side), batch.targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(_finished(probe) - start)
    return statistics.median(times)


def shared_compute_seconds(options: RunOptions, group: dist.ProcessGroup | None = None) -> float:
    """One probe of a step's compute (:func:`step_seconds`), taken by rank 0 alone.

    The other ranks wait at a barrier, so the probe is not slowed by their work
    on shared cores; every rank gets rank 0's value. Schemes compared in one
    job share it: the modelled time then differs only by bytes and overhead.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    phase("probing a step's compute time")
    dist.barrier(group=group)
    seconds = [0.0]
    if rank == 0:
        work = options.load(options.device)
        seconds[0] = step_seconds(work.model(options.seed), work,
                                  work.train.shard(rank, world_size), options.batch_size)
    dist.broadcast_object_list(seconds, src=0, group=group)
    return float(seconds[0])


def prepare(options: RunOptions, device: torch.device, rank: int, world_size: int,
            compute_s: float | None) -> tuple[workloads.Workload, workloads.Data, nn.Module, float]:
    """The workload on ``device``, this rank's shard of it, the fresh model and the compute
    step (``compute_s``, else probed here on this model)."""
    work = options.load(device)
    local = work.train.shard(rank, world_size)
    model = work.model(options.seed)
    if compute_s is None:
        compute_s = step_seconds(model, work, local, options.batch_size)
    return work, local, model, compute_s


def backward(work: workloads.Workload, model: nn.Module, batch: workloads.Data,
             optimizer: torch.optim.Optimizer, dtype: torch.dtype | None,
             scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
    """One step's forward (autocast to ``dtype``, if any) and backward into fresh gradients;
    under ``scaler`` the gradients are unscaled before the caller clips or steps, as torch's
    AMP recipe does. Returns the loss."""
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = work.loss(model(batch.inputs, **batch.side), batch.targets)
    optimizer.zero_grad()
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    return loss


def run_scheme(name: str, config: dict[str, Any], options: RunOptions,
               progress: Callable[[int], None] | None = None,
               group: dist.ProcessGroup | None = None,
               compute_s: float | None = None, delayed: bool = False) -> dict[str, Any]:
    """Train ``options.workload`` under scheme ``name`` in the current process group.

    The optimiser is the user's (``options.optimizer``, ``lr``, ``momentum``),
    registered with the scheme as a user's script does, coupled by
    ``options.coupling`` with ``options.warmup`` (:func:`thinwire.ddp.register`).
    Every rank calls this with the same arguments.

    Args:
        compute_s: a step's compute time for the modelled time (see
            :func:`shared_compute_seconds`); None probes this run's model here.
        delayed: apply each step's mean one step later (``thinwire.ddp.register``'s delay).

    Returns:
        This rank's results: accuracy, loss, bytes handed and the ring traffic
        per collective, overhead, timings, curves, steps to the workload's
        target, achieved density per layer, final weights.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    phase(f"{name} setup")
    device = torch.device(options.device)
    work, local, model, compute_s = prepare(options, device, rank, world_size, compute_s)
    net = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                  process_group=group)
    meter = Meter(rank, world_size)
    scheme = schemes.build(name, **config)
    in_hook = (options.max_norm is not None and options.clip_at == "worker"
               and scheme.traits.clips_in_hook)
    dtype = PRECISIONS[options.precision]
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    optimizer, schedule = options.build_optimizer(net.parameters())
    state = ddp.register(net, scheme, meter=meter,
                         max_norm=options.max_norm if in_hook else None, scaler=scaler,
                         optimizer=optimizer, coupling=options.coupling, warmup=options.warmup,
                         feedback=options.feedback, delay=delayed)
    scheme = state.scheme
    after_backward = options.max_norm if options.max_norm is not None and not in_hook else None
    if scheme.traits.energy:  # a shared-index scheme's diagnostic (clt-k): turn it on
        scheme.energy = {}  # how much of each rank's top-k the leader's indices capture
    coupled = state.coupling is not None and state.coupling.coupled
    stream = batches(local, options.batch_size, seed=options.seed * 1000 + rank)
    curve: list[tuple[int, float, float]] = []  # (step, cumulative bytes, test metric)
    losses = []
    norms: list[float] = []  # .grad's norm before clip_grad_norm_, per step
    steps_to_target = None
    board = (MeterBoard(Path(options.tensorboard) / name,
                        sum(p.numel() * p.element_size() for p in model.parameters()))
             if options.tensorboard is not None and rank == 0 else None)
    live_trace = scheme.trace  # filled as the steps run
    start = time.perf_counter()
    for step in range(1, options.steps + 1):
        phase(f"{name} step {step}")
        loss = backward(work, net, local.rows(next(stream)), optimizer, dtype, scaler)
        if after_backward is not None:  # the norm .grad had: the step's update, if sparse
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(),
                                                              after_backward)))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        schedule.step()
        meter.next_step()
        losses.append(float(loss.detach()))
        if board is not None:
            board.step(meter, losses[-1], live_trace)
        if not math.isfinite(losses[-1]):
            break
        if step % options.eval_every == 0 or step == options.steps:
            steps_to_target = evaluation_point(step, work.score(model, options.eval_rows), work,
                                               meter, curve, steps_to_target, board)
            if options.until_target and _anyone(steps_to_target is not None, group, device):
                break
        if progress is not None:
            progress(1)
    wall_s = time.perf_counter() - start
    if board is not None:
        board.close()
    # the scheme as registered: under Adam, register may have chosen options (ADAM_OPTIONS)
    registered = (scheme.origin[1] if scheme.origin is not None
                  else schemes.config_class(name)(**config))
    result = run_record(name, work, options, model, device=device, coupled=coupled,
                        config=asdict(registered),
                        steps_to_target=steps_to_target, losses=losses, meter=meter,
                        scheme=scheme, compute_s=compute_s, wall_s=wall_s, curve=curve)
    result.update({
        "clipped_steps": None if state.clip is None else state.clip.clipped,
        "grad_norm_after_backward": ({"median": statistics.median(norms), "max": max(norms)}
                                     if norms else None),
        "overflow_steps": None if state.loss_scale is None else state.loss_scale.skipped,
        "captured_energy_per_layer": {key: statistics.fmean(shares) for key, shares in
                                      (scheme.energy or {}).items()},
        "delayed": delayed,
    })
    return result


def run_record(name: str, work: workloads.Workload, options: RunOptions, model: nn.Module, *,
               device: torch.device, coupled: bool, config: dict[str, Any],
               steps_to_target: int | None, losses: list[float], meter: Meter,
               scheme: schemes.Scheme | None, compute_s: float, wall_s: float,
               curve: list[tuple[int, float, float]]) -> dict[str, Any]:
    """The fields every data-parallel run reports, ``model`` evaluated; a front door adds its own.

    ``scheme`` is None for an exchange thinwire does not run (native HSDP).
    """
    trace = threshold_trace(scheme) if scheme is not None else {}
    return {
        "scheme": name,
        "workload": work.name,
        "optimizer": options.optimizer,
        "device": str(device),
        "coupled": coupled,
        "target": work.target,
        "metric": work.metric,
        "lower_is_better": work.lower_is_better,
        "recipe": recipe(options),
        "steps_to_target": steps_to_target,
        "config": config,
        "test_accuracy": work.accuracy(model),
        "test_score": work.score(model),
        "final_loss": statistics.fmean(losses[-options.eval_every:]),
        **meter.summary(),
        "traffic_per_collective": traffic_per_collective(meter),
        # each a latency on the link (of the ring's 2(n-1) hops); a buffer's segments: one
        "collectives_per_step": meter.collectives_per_step(),
        "overhead_ms_per_step": (0.0 if scheme is None
                                 else 1000.0 * scheme.overhead_s / max(1, meter.step)),
        "compute_ms_per_step": 1000.0 * compute_s,
        "wall_s": wall_s,
        "skipped_steps": 0 if scheme is None else scheme.skipped,
        "clipped_steps": None,
        "grad_norm_after_backward": None,
        "overflow_steps": None,
        "precision": options.precision,
        "curve": curve,
        "weights": [p.detach().to("cpu", copy=True) for p in model.parameters()],
        "density_per_layer": {key: statistics.fmean(d for _, _, d in points)
                              for key, points in trace.items() if points},
        "captured_energy_per_layer": {},
        "threshold_trace": trace,
    }


def _anyone(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank (so every rank leaves a loop at the same step)."""
    vote = torch.tensor([int(flag)], device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return bool(vote.item())


def threshold_trace(scheme: schemes.Scheme) -> dict[str, list[tuple[int, float, float]]]:
    """The sparsifier's (step, threshold, density) per layer, if it has one."""
    return {key: list(points) for key, points in scheme.trace.items()}


def traffic_per_collective(meter: Meter) -> dict[str, dict[str, float]]:
    """collective -> mean bytes per step this rank hands it, and moves out and in under the
    ring algorithm (all-reduce 2(n-1)/n of the payload each way, all-gather (n-1) times it)."""
    steps = max(1, meter.step)
    sums = {field: meter.totals(field, by="collective") for field in ("nbytes", "sent", "received")}
    return {collective: {field: sums[field][collective] / steps for field in sums}
            for collective in sums["nbytes"]}
