"""One run of the parameter server: method, workers, rule, pushes, faults and files.

And what the run trains: any :class:`Task`, rebuilt in every process from a
:class:`TaskBuilder`, a small frozen dataclass that pickles across process
starts. The front door holds no model or data set; the experiments' concrete
task is :class:`thinwire.jobs.ps_task.TaskSpec`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from thinwire._version import __version__
from thinwire.ps.layout import Layout
from thinwire.ps.rules import make_config
from thinwire.ps.wire import build_push

# method -> (update rule, synchronous barrier). "sequential" runs one stream in-process.
METHODS: dict[str, tuple[str, bool]] = {
    "sequential": ("asgd", False),
    "ssgd": ("asgd", True),
    "asgd": ("asgd", False),
    "dc-asgd": ("dc-asgd", False),
}


@dataclass(frozen=True)
class AsyncConfig:
    """How to run the parameter server and its workers (see ``docs/async.md``)."""

    method: str = "dc-asgd"  # one of METHODS
    workers: int = 4  # worker processes, >= 1 (sequential always runs one stream)
    threads_per_worker: int = 1  # hogwild threads per worker, each its own stream, >= 1
    passes: int = 10  # passes over the training set in this run, >= 1
    rule: Mapping[str, Any] = field(default_factory=dict)  # update rule options (lr, lam, ...)
    milestones: tuple[float, ...] = ()  # passes after which lr drops and lambda grows
    max_staleness: int | None = None  # drop pushes with a larger delay tau; None keeps all
    push: str = "dense"  # push scheme: dense, fp16, topk, dct-dp, laplace
    push_options: Mapping[str, Any] = field(default_factory=dict)  # that scheme's options
    snapshot_every: float = 1.0  # passes between learning-curve snapshots, > 0
    checkpoint: str | None = None  # path of the server checkpoint (written at the end)
    checkpoint_every: int = 0  # also write it every this many updates; 0: only at the end
    resume: str | None = None  # checkpoint to resume the server from
    interface: str = "lo"  # network interface every RPC agent listens on (loopback)
    init_method: str | None = None  # RPC rendezvous; None: a file in a fresh temporary folder
    rpc_timeout_s: float = 120.0  # seconds before a pull or push RPC fails, > 0
    timeout_s: float = 3600.0  # deadline for the whole run; processes are killed after it
    lease_s: float | None = None  # declare a silent worker dead after this many seconds
    audit: bool = False  # keep a record of every push (stream, seq, tau, outcome)
    journal_dir: str | None = None  # workers save each pushed gradient here (audits)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} must be one of {sorted(METHODS)}")
        for name in ("workers", "threads_per_worker", "passes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.method == "sequential" and self.threads_per_worker != 1:
            raise ValueError("the sequential reference runs one stream: threads_per_worker="
                             f"{self.threads_per_worker!r} must be 1")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every={self.checkpoint_every!r} must be an integer >= 0")
        for name in ("snapshot_every", "rpc_timeout_s", "timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        milestones = tuple(self.milestones)
        if any(not m > 0 for m in milestones) or list(milestones) != sorted(set(milestones)):
            raise ValueError(f"milestones={self.milestones!r} must be increasing passes > 0")
        object.__setattr__(self, "milestones", milestones)
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int)
                                               or self.max_staleness < 0):
            raise ValueError(f"max_staleness={self.max_staleness!r} must be None or >= 0")
        if "milestones" in self.rule:
            raise ValueError("give milestones in passes as AsyncConfig.milestones, not as a "
                             "rule option")
        make_config(self.rule_name, **self.rule)  # validates the options now
        build_push(self.push, **self.push_options)  # here, not first in the server process

    @property
    def rule_name(self) -> str:
        return METHODS[self.method][0]

    @property
    def synchronous(self) -> bool:
        return METHODS[self.method][1]

    @property
    def streams(self) -> int:
        """Pull/push streams: one per thread of each worker (one for sequential)."""
        return 1 if self.method == "sequential" else self.workers * self.threads_per_worker

    def rule_options(self, updates_per_pass: float) -> dict[str, Any]:
        """Rule options with the pass milestones converted to update counts."""
        milestones = tuple(max(1, round(m * updates_per_pass)) for m in self.milestones)
        return {**self.rule, "milestones": tuple(sorted(set(milestones)))}

    def fingerprint(self) -> dict[str, Any]:
        """The part of the configuration a worker must share with the server."""
        return {"push": self.push, "push_options": dict(sorted(self.push_options.items())),
                "threads_per_worker": self.threads_per_worker, "workers": self.workers,
                "synchronous": self.synchronous, "thinwire": __version__}


class Task(Protocol):
    """A model's flat weights, its per-stream batches, its gradient and its evaluation.

    Batches are opaque to the server and workers: they pass each one from
    :meth:`batches` to :meth:`gradient` unchanged.
    """

    layout: Layout  # how the flat weights split into named parameters

    def initial_weights(self) -> torch.Tensor:
        """w_0, the flat initial weights (a new tensor)."""

    def fingerprint(self) -> dict[str, Any]:
        """What every worker must share with the server (checked at join)."""

    def steps(self, stream: int, streams: int, passes: int) -> int:
        """Gradients stream ``stream`` of ``streams`` computes in ``passes`` passes."""

    def batches(self, stream: int, streams: int, passes: int,
                first_pass: int = 0) -> Iterator[Any]:
        """The stream's mini-batches, ``passes`` times over its shard, passes numbered from
        ``first_pass`` (resumed runs)."""

    def gradient(self, weights: torch.Tensor, batch: Any) -> torch.Tensor:
        """The flat gradient of the loss at ``weights`` on ``batch`` (``weights`` unchanged)."""

    def evaluate(self, weights: torch.Tensor) -> dict[str, float]:
        """Error and loss of the model with flat ``weights``, keyed ``<split>_error`` and
        ``<split>_loss``."""


class TaskBuilder(Protocol):
    """A frozen dataclass every process rebuilds the same :class:`Task` from."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # a dataclass: results files list its fields

    def build(self) -> Task:
        """A new task from these fields (every process gets the same one)."""


def pushes_per_pass(config: AsyncConfig, task: Task) -> int:
    """Gradients pushed by all streams together in one pass over the training set."""
    return sum(task.steps(s, config.streams, 1) for s in range(config.streams))


def updates_per_pass(config: AsyncConfig, task: Task) -> int:
    """Server updates in one pass: one per push, or one per round (the longest stream) in SSGD."""
    if config.synchronous:
        return max(task.steps(s, config.streams, 1) for s in range(config.streams))
    return pushes_per_pass(config, task)


def run_fingerprint(config: AsyncConfig, task: Task) -> dict[str, Any]:
    """What a worker must share with the server to join: the task, the model, the pushes."""
    return {**task.fingerprint(), **config.fingerprint()}
