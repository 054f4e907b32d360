"""Training with DCT-MP splits: tasks, a single-process loop, and pipeline / hybrid workers.

:func:`train_local` runs the split model's stages one after the other in this
process (:class:`thinwire.pipeline.Pipeline`), full batches, the boundaries'
meters recording what would cross: a pipeline schedule's computation up to the
order of float sums across microbatches, fast enough for the paper's sparsity
sweeps, with data-parallel replicas simulated (:class:`SimulatedReplicas`).
:func:`train_engine` runs ``stages × replicas`` processes on
``torch.distributed.pipelining`` (GPipe or 1F1B) with DDP and a registered scheme
on each stage's replicas. Both evaluate the split model with its boundaries
(DCT-MP applies at test time too, as in the paper) and report loss, accuracy
and bytes per entity per step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from thinwire import schemes
from thinwire.comm import Meter
from thinwire.compress import TensorInfo
from thinwire.data import criteo
from thinwire.launch import DEFAULT_TIMEOUT_S, phase, spawn
from thinwire.models import dlrm, transformer
from thinwire.pipeline import (
    Layout,
    Pipeline,
    Stage,
    build_schedule,
    build_stage,
    data_parallel,
    make_groups,
    row_thresholds,
    split,
)
from thinwire.pipeline.split import split_positions, steps
from thinwire.progress import StepBar


@dataclass(frozen=True)
class Batches:
    """A split of a task: model inputs, side inputs and targets, row-aligned."""

    inputs: torch.Tensor
    side: dict[str, torch.Tensor]
    targets: torch.Tensor

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def rows(self, index: torch.Tensor | slice) -> Batches:
        return Batches(self.inputs[index], {k: v[index] for k, v in self.side.items()},
                       self.targets[index])


@dataclass(frozen=True)
class Task:
    """A model family on a data set, with its loss, accuracy and default splits."""

    name: str
    model: Callable[[int], nn.Sequential]  # seed -> a fresh model
    train: Batches
    test: Batches
    splits: dict[int, tuple[str, ...]]  # stages -> default split names
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # mean over the batch
    correct: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # count of right answers
    oracle: dict[str, float] = field(default_factory=dict)  # best achievable, when known


@dataclass(frozen=True)
class RunConfig:
    """One training run (what ``thinwire pipeline`` and the benchmark configure)."""

    task: str = "criteo"  # a key of TASKS
    stages: int = 2  # pipeline stages (1 = the unsplit model)
    splits: tuple[str, ...] | None = None  # split names; None: the task's default
    boundary: str = "dct-mp"  # boundary kind: dct-mp, sketch, xgrad-topk
    boundary_options: dict[str, Any] = field(default_factory=dict)  # e.g. {"ratio": 0.1}
    replicas: int = 1  # data-parallel copies of each stage (engine only)
    dp_scheme: str = "dense"  # registered scheme reducing W_grad across replicas
    dp_options: dict[str, Any] = field(default_factory=dict)  # its config
    schedule: str = "gpipe"  # gpipe or 1f1b (engine only)
    microbatches: int = 4  # per step and replica (engine only)
    batch_size: int = 256  # rows per step, all replicas together
    epochs: float = 1.0  # passes over the training set
    max_steps: int | None = None  # stop earlier
    optimizer: str = "adam"  # adam or sgd
    lr: float = 1e-3  # learning rate
    weight_decay: float = 0.0  # L2 penalty of the optimizer
    decay: bool = True  # decay the learning rate linearly to 0 over the run (stable final iterate)
    seed: int = 0  # model initialisation and data order (same for every run)
    train_size: int = 100_000  # synthetic criteo: training rows
    test_size: int = 10_000  # synthetic criteo: test rows
    probe: tuple[float, ...] = ()  # ratios whose mean row threshold to trace (Fig. 5)
    train_eval_rows: int | None = 20_000  # train loss/accuracy over the first rows (None: all)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} must be one of {sorted(TASKS)}")
        for name in ("stages", "replicas", "microbatches", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.batch_size % (self.replicas * self.microbatches):
            raise ValueError(f"batch_size={self.batch_size} must divide into replicas "
                             f"({self.replicas}) × microbatches ({self.microbatches})")
        if not self.epochs > 0:
            raise ValueError(f"epochs={self.epochs!r} must be > 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps!r} must be None or >= 1")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r} must be one of {sorted(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if self.splits is not None and len(self.splits) != self.stages - 1:
            raise ValueError(f"{self.stages} stages need {self.stages - 1} split names, got "
                             f"{list(self.splits)}")


def _binary_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _binary_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ((logits > 0).to(labels.dtype) == labels).sum()


def _class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)


def _class_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(dim=1) == labels).sum()


def _tabular(data: criteo.Tabular) -> Batches:
    return Batches(data.dense, {"categorical": data.categorical}, data.labels)


def _dlrm_task(name: str, train: criteo.Tabular, test: criteo.Tabular) -> Task:
    cardinalities = [int(max(train.categorical[:, j].max(), test.categorical[:, j].max())) + 1
                     for j in range(train.categorical.shape[1])]
    return Task(name, lambda seed: dlrm.dlrm(train.dense.shape[1], cardinalities, seed=seed),
                _tabular(train), _tabular(test), dict(dlrm.SPLITS), _binary_loss,
                _binary_correct, test.oracle())


def criteo_task(config: RunConfig) -> Task:
    """DLRM on the synthetic Criteo-shaped set (§3.1's model, a known teacher)."""
    train, test = criteo.synthetic_criteo(config.train_size, config.test_size, seed=config.seed)
    return _dlrm_task("criteo", train, test)


def breast_cancer_task(config: RunConfig) -> Task:
    """DLRM on scikit-learn's breast cancer set (real, 569 rows)."""
    train, test = criteo.breast_cancer(seed=config.seed)
    return _dlrm_task("breast-cancer", train, test)


def digits_task(config: RunConfig) -> Task:
    """The small transformer encoder on digits as 8-token sequences (§3.2's split points)."""
    (train_x, train_y), (test_x, test_y) = transformer.digits_sequences(seed=config.seed)
    layers = 2
    return Task("digits", lambda seed: transformer.encoder(layers=layers, seed=seed),
                Batches(train_x, {}, train_y), Batches(test_x, {}, test_y),
                {s: transformer.splits(layers, s) for s in range(1, layers + 2)},
                _class_loss, _class_correct)


TASKS: dict[str, Callable[[RunConfig], Task]] = {
    "criteo": criteo_task,
    "breast-cancer": breast_cancer_task,
    "digits": digits_task,
}

# Task -> RunConfig fields that suit it better than the defaults (which suit criteo).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "criteo": {},
    "breast-cancer": {"batch_size": 32, "epochs": 5.0},  # 426 rows: small batches
    "digits": {"batch_size": 64, "epochs": 20.0, "lr": 3e-3},
}

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
}


def split_names(config: RunConfig, task: Task) -> tuple[str, ...]:
    """The split points of a run: given ones, or the task's default for its stage count."""
    if config.splits is not None:
        return config.splits
    if config.stages not in task.splits:
        raise ValueError(f"task {task.name!r} has default splits for {sorted(task.splits)} "
                         f"stages; pass split names for {config.stages}")
    return task.splits[config.stages]


def build_split(config: RunConfig, task: Task, meter: Meter | None
                ) -> tuple[nn.Sequential, list[Stage], tuple[str, ...]]:
    """The model and its stages (one stage when ``config.stages == 1``)."""
    model = task.model(config.seed)
    names = split_names(config, task)
    example = task.train.rows(slice(0, 2))
    stages = split(model, names, example.inputs, side=example.side, boundary=config.boundary,
                   meter=meter, **config.boundary_options)
    return model, stages, names


def batch_order(config: RunConfig, rows: int) -> list[torch.Tensor]:
    """Row indices of every step: same permutation for every run with the same seed."""
    generator = torch.Generator().manual_seed(config.seed + 1)
    per_epoch = rows // config.batch_size
    if per_epoch == 0:
        raise ValueError(f"batch_size={config.batch_size} exceeds the {rows} training rows")
    total = int(config.epochs * per_epoch)
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    order: list[torch.Tensor] = []
    while len(order) < total:
        permutation = torch.randperm(rows, generator=generator)
        order.extend(permutation[i * config.batch_size: (i + 1) * config.batch_size]
                     for i in range(per_epoch))
    return order[: max(1, total)]


def lr_schedule(config: RunConfig, optimizer: torch.optim.Optimizer,
                total: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear decay to zero over ``total`` steps when ``config.decay``, else constant."""
    if not config.decay:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / total)


def train_rows(config: RunConfig, task: Task) -> Batches:
    """The training rows the train loss and accuracy are measured on."""
    if config.train_eval_rows is None:
        return task.train
    return task.train.rows(slice(0, config.train_eval_rows))


@torch.no_grad()
def evaluate(model: nn.Module, data: Batches, task: Task,
             batch_size: int = 1024) -> dict[str, float]:
    """Mean loss and accuracy of ``model`` (split or not) over ``data``, in eval mode."""
    was_training = model.training
    model.eval()
    loss, correct = 0.0, 0.0
    for start in range(0, len(data), batch_size):
        chunk = data.rows(slice(start, start + batch_size))
        logits = model(chunk.inputs, **chunk.side)
        loss += float(task.loss(logits, chunk.targets)) * len(chunk)
        correct += float(task.correct(logits, chunk.targets))
    model.train(was_training)
    return {"loss": loss / len(data), "accuracy": correct / len(data)}


def _probe(model: nn.Module, names: tuple[str, ...], ratios: tuple[float, ...],
           trace: dict[str, list[float]]) -> Callable[[], None]:
    """Trace the mean row threshold at the first split for each ratio kept (Fig. 5)."""
    if not ratios or not names:
        return lambda: None
    module = steps(model)[split_positions(model, names[:1])[0]][1]

    def hook(_: nn.Module, __: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            acts = output[-1] if isinstance(output, tuple) else output
            for ratio in ratios:
                trace.setdefault(str(ratio), []).append(
                    float(row_thresholds(acts, ratio).mean()))

    return module.register_forward_hook(hook).remove


class SimulatedReplicas:
    """Data parallelism over ``n`` replicas simulated in one process (for sweeps).

    Each replica has its own copy of the scheme and encodes its gradients through the
    real kernel as one row (:meth:`~thinwire.schemes.Scheme.encode_row`): the same
    selection, error memory and payload as a rank of a real job. :meth:`mean`
    averages the rows as the exchange does (:meth:`~thinwire.schemes.Scheme.decode_rows`).
    The meter records what each replica hands each collective, at a world size of ``n``.

    Raises:
        ValueError: the scheme agrees on its coordinates in a first round (clt-k,
            powersgd: they need processes), or gradients of several dtypes.
    """

    def __init__(self, name: str, options: Mapping[str, Any], replicas: int,
                 meter: Meter) -> None:
        self.schemes = [schemes.build(name, **options) for _ in range(replicas)]
        if self.schemes[0].traits.rounds > 1:
            raise ValueError(f"scheme {name!r} cannot be simulated in one process; run "
                             "with processes (train_engine)")
        self.meter = meter
        self.infos: list[TensorInfo] = []

    def encode(self, replica: int, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """What replica ``replica`` contributes: its row (``grads`` are not modified)."""
        infos = [TensorInfo.of(key, grad) for key, grad in grads.items()]
        if len({info.dtype for info in infos}) > 1:
            raise ValueError("simulated replicas need gradients of one dtype")
        self.infos = infos
        row, segments = self.schemes[replica].encode_row(
            torch.cat([grad.reshape(-1) for grad in grads.values()]), infos)
        seen: set[str] = set()  # a collective's later parts join its first (one call)
        for collective, layer, nbytes in segments:
            if collective != "row":
                self.meter.record("W_grad", layer, collective, nbytes,
                                  world_size=len(self.schemes), joined=collective in seen)
                seen.add(collective)
        return row

    def mean(self, rows: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The replicas' rows averaged as the engine's exchange averages them."""
        flat = self.schemes[0].decode_rows(rows, self.infos)
        views = flat.split([info.numel for info in self.infos])
        return {info.key: view.view(info.shape) for info, view in zip(self.infos, views)}


def train_local(config: RunConfig, *, progress: bool = False, task: Task | None = None,
                evaluation: bool = True) -> dict[str, Any]:
    """Train the split model in this process; see the module docstring.

    With ``config.replicas > 1`` the data-parallel side is simulated
    (:class:`SimulatedReplicas`): each step, every replica's shard runs
    through the split model, and the parameters step on the average of the
    replicas' compressed gradients.

    Args:
        progress: show a progress bar.
        task: a task already built for ``config`` (saves rebuilding its data).
        evaluation: evaluate on the train and test sets at the end (else NaN).

    Returns:
        ``{"config", "splits", "train", "test", "oracle", "bytes_per_entity",
        "bytes_per_layer", "steps", "seconds", "thresholds", "trace", "overflow"}``.
    """
    task = task if task is not None else TASKS[config.task](config)
    meter = Meter()
    model, stages, names = build_split(config, task, meter)
    pipeline = Pipeline(stages)
    optimizer = OPTIMIZERS[config.optimizer](model.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay)
    replicas = (SimulatedReplicas(config.dp_scheme, config.dp_options, config.replicas, meter)
                if config.replicas > 1 else None)
    thresholds: dict[str, list[float]] = {}
    remove = _probe(model, names, config.probe, thresholds)
    order = batch_order(config, len(task.train))
    scheduler = lr_schedule(config, optimizer, len(order))
    start = time.perf_counter()
    bar = StepBar(len(order), show=progress)
    pipeline.train()
    parameters = dict(model.named_parameters())
    for rows in order:
        if replicas is None:
            batch = task.train.rows(rows)
            loss = task.loss(pipeline(batch.inputs, **batch.side), batch.targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        else:
            shard = len(rows) // config.replicas
            parts = []
            for replica in range(config.replicas):
                batch = task.train.rows(rows[replica * shard: (replica + 1) * shard])
                optimizer.zero_grad(set_to_none=True)
                task.loss(pipeline(batch.inputs, **batch.side), batch.targets).backward()
                grads = {k: p.grad for k, p in parameters.items() if p.grad is not None}
                parts.append(replicas.encode(replica, grads))
            for key, mean in replicas.mean(parts).items():
                parameters[key].grad = mean
        optimizer.step()
        scheduler.step()
        meter.next_step()
        bar.update()
    bar.close()
    seconds = time.perf_counter() - start
    remove()
    summary = meter.summary()
    return {
        "config": _config_dict(config),
        "splits": list(names),
        "train": (evaluate(pipeline, train_rows(config, task), task) if evaluation
                  else _NOT_EVALUATED),
        "test": evaluate(pipeline, task.test, task) if evaluation else _NOT_EVALUATED,
        "oracle": task.oracle,
        "bytes_per_entity": summary["bytes_per_entity"],
        "bytes_per_layer": summary["bytes_per_layer"],
        "steps": meter.step,
        "seconds": seconds,
        "thresholds": thresholds,
        "trace": {s.sender.name: getattr(s.sender, "trace", []) for s in stages
                  if s.sender is not None},
        "overflow": {s.sender.name: getattr(s.sender, "overflow", []) for s in stages
                     if s.sender is not None},
    }


_NOT_EVALUATED = {"loss": math.nan, "accuracy": math.nan}


def _config_dict(config: RunConfig) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(config).items()}


def _stage_state(model: nn.Module, stage: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters that belong to ``stage``, by their name in the model."""
    owned = {id(p) for p in stage.parameters()}
    return {name: p.detach().clone() for name, p in model.named_parameters() if id(p) in owned}


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """A hash of the exact bytes of a set of named tensors (equal iff bit-identical)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def engine_worker(rank: int, world_size: int, config: RunConfig,
                  return_state: bool = False, progress: bool = False) -> dict[str, Any]:
    """One rank of a ``stages × replicas`` run (module level, for ``spawn``).

    With ``progress``, rank 0 draws a bar of the training steps, from the first.

    Returns:
        This rank's ``{"rank", "stage", "replica", "meter", "losses", "seconds",
        "initial_digest", "digest"}`` (digests of its stage's parameters; plus
        ``"state"``, its stage's parameters, when asked); rank 0 adds the
        train/test metrics of the assembled replica-0 model.
    """
    layout = Layout(config.stages, config.replicas)
    groups = make_groups(layout)
    index, replica = layout.stage_of(rank), layout.replica_of(rank)
    task = TASKS[config.task](config)
    model, stages, names = build_split(config, task, None)
    meter = Meter(rank, world_size)
    wrap = None
    if config.replicas > 1:
        scheme = schemes.build(config.dp_scheme, **config.dp_options)
        data_group = groups.data
        assert data_group is not None  # make_groups gives one whenever replicas > 1

        def wrap(module: nn.Module) -> nn.Module:
            return data_parallel(module, scheme, data_group, meter)

    shard = config.batch_size // config.replicas
    example = task.train.rows(slice(0, shard))
    stage = build_stage(stages, index, example.inputs, config.microbatches, side=example.side,
                        group=groups.pipeline, meter=meter, names=names, wrap=wrap)
    schedule = build_schedule(config.schedule, stage, config.microbatches, task.loss)
    initial = state_digest(_stage_state(model, stages[index]))
    optimizer = OPTIMIZERS[config.optimizer](stages[index].parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay)
    losses: list[float] = []
    order = batch_order(config, len(task.train))
    scheduler = lr_schedule(config, optimizer, len(order))
    bar = StepBar(len(order), show=progress and rank == 0)
    start = time.perf_counter()
    for step, rows in enumerate(order, 1):
        phase(f"stage {index} replica {replica} step {step}")
        batch = task.train.rows(rows[replica * shard: (replica + 1) * shard])
        optimizer.zero_grad(set_to_none=True)
        first, last = index == 0, index == config.stages - 1
        step_losses: list[torch.Tensor] = []
        schedule.step(*((batch.inputs,) if first else ()),
                      **({"target": batch.targets, "losses": step_losses} if last else {}),
                      **batch.side)
        if last:
            losses.append(float(torch.stack(step_losses).detach().mean()))
        optimizer.step()
        scheduler.step()
        meter.next_step()
        bar.update()
    bar.close()
    seconds = time.perf_counter() - start
    state = _stage_state(model, stages[index])
    result: dict[str, Any] = {"rank": rank, "stage": index, "replica": replica,
                              "meter": meter.summary(), "losses": losses, "seconds": seconds,
                              "initial_digest": initial, "digest": state_digest(state)}
    if return_state:
        result["state"] = state
    gathered: list[Any] = [None] * world_size if rank == 0 else []
    dist.gather_object(state if replica == 0 else {}, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        for part in gathered:
            model.load_state_dict(part, strict=False)
        pipeline = Pipeline(stages)
        result.update(train=evaluate(pipeline, train_rows(config, task), task),
                      test=evaluate(pipeline, task.test, task), oracle=task.oracle,
                      splits=list(names))
    return result


def merge_meters(results: list[Mapping[str, Any]]) -> dict[str, float]:
    """Bytes per step per entity, summed over ranks (each byte is sent once)."""
    total: dict[str, float] = {}
    for result in results:
        for entity, nbytes in result["meter"]["bytes_per_entity"].items():
            total[entity] = total.get(entity, 0.0) + nbytes
    return total


def train_engine(config: RunConfig, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 return_state: bool = False, progress: bool = False) -> dict[str, Any]:
    """Run ``config`` on ``stages × replicas`` gloo processes; merge what they report.

    ``timeout_s`` is the process group's: the longest a rank waits on a stalled peer.
    ``progress`` shows a bar of the training steps once the processes have met.
    """
    layout = Layout(config.stages, config.replicas)
    results = spawn(engine_worker, layout.world_size, config, return_state, progress,
                    timeout_s=timeout_s)
    head = results[0]
    return {
        "config": _config_dict(config),
        "splits": head["splits"],
        "train": head["train"],
        "test": head["test"],
        "oracle": head["oracle"],
        "bytes_per_entity": merge_meters(results),
        "steps": head["meter"]["steps"],
        "seconds": max(r["seconds"] for r in results),
        "ranks": results,
    }
