"""What the parameter-server runs train: a small classifier on an image set.

:class:`TaskSpec` meets :class:`thinwire.ps.config.TaskBuilder` and
:class:`ClassifierTask` meets :class:`thinwire.ps.config.Task`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from thinwire.data.imagesets import ImageSet, load_image_set
from thinwire.models.convnet import SmallConvNet, SoftmaxRegression
from thinwire.ps.layout import Layout

Batch = tuple[torch.Tensor, torch.Tensor]

# model name -> factory(classes, image shape (C, H, W))
MODELS: dict[str, Callable[[int, tuple[int, ...]], nn.Module]] = {
    "convnet": lambda classes, shape: SmallConvNet(classes, shape[0]),
    "linear": lambda classes, shape: SoftmaxRegression(classes, math.prod(shape)),
}


@dataclass(frozen=True)
class TaskSpec:
    """A classification task every process rebuilds identically from these fields."""

    dataset: str = "digits"  # image set: "digits" or "fashion-mnist"
    model: str = "convnet"  # one of MODELS
    batch_size: int = 32  # examples per gradient, >= 1
    seed: int = 0  # model initialisation and shuffling
    train_limit: int | None = None  # use only the first N training examples (smoke runs)
    holdout: int = 0  # hold the last N training examples out; evaluate on them, not the test set
    steps: int | None = None  # gradients per stream at most, >= 1; None: every pass in full

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r} must be one of {sorted(MODELS)}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r} must be an integer >= 1")
        if self.train_limit is not None and (not isinstance(self.train_limit, int)
                                             or self.train_limit < 1):
            raise ValueError(f"train_limit={self.train_limit!r} must be None or an integer >= 1")
        if isinstance(self.holdout, bool) or not isinstance(self.holdout, int) or self.holdout < 0:
            raise ValueError(f"holdout={self.holdout!r} must be an integer >= 0")
        if self.steps is not None and (isinstance(self.steps, bool)
                                       or not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(f"steps={self.steps!r} must be None or an integer >= 1")

    def build(self) -> ClassifierTask:
        """The task these fields describe (loads the image set, initialises the model)."""
        return ClassifierTask(self)


@functools.lru_cache(maxsize=4)
def _images(name: str) -> ImageSet:
    return load_image_set(name)


class ClassifierTask:
    """Cross-entropy training of a small classifier on an image set, sharded by stream.

    Stream ``s`` of ``S`` owns the training examples ``s, s + S, s + 2S, ...``
    and visits them once per pass in an order shuffled by ``(seed, s, pass)``,
    so every method sees each example equally often ("equal passes"). The
    gradient is a pure function of (weights, batch): the model is called
    functionally on views of the flat weights, on a per-thread copy because
    ``functional_call`` swaps a module's parameters while it runs.

    Args:
        spec: the task's fields.

    Raises:
        ValueError: unknown dataset or model.
        FileNotFoundError: the dataset's files are not installed.
    """

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec
        self.data = _images(spec.dataset)
        limit = spec.train_limit or self.data.x_train.shape[0]
        if not spec.holdout < limit:
            raise ValueError(f"holdout={spec.holdout} must leave training examples: it must be "
                             f"below the {limit} available")
        train = limit - spec.holdout
        self.x_train, self.y_train = self.data.x_train[:train], self.data.y_train[:train]
        # model selection reads only this split; the test set is not touched when it is set
        self.x_held, self.y_held = (self.data.x_train[train:limit],
                                    self.data.y_train[train:limit])
        with torch.random.fork_rng():
            torch.manual_seed(spec.seed)
            self.model = MODELS[spec.model](self.data.classes, tuple(self.x_train.shape[1:]))
        parameters = dict(self.model.named_parameters())
        self.layout = Layout.of(parameters)
        self._initial = self.layout.flatten(parameters)
        self._local = threading.local()

    @property
    def train_size(self) -> int:
        return int(self.x_train.shape[0])

    def initial_weights(self) -> torch.Tensor:
        """w_0, the flat initial weights (a new tensor)."""
        return self._initial.clone()

    def fingerprint(self) -> dict[str, Any]:
        """What every worker must share with the server (checked at join)."""
        return {**dataclasses.asdict(self.spec), "parameters": self.layout.describe()}

    def shard(self, stream: int, streams: int) -> torch.Tensor:
        """Indices of the training examples stream ``stream`` of ``streams`` owns."""
        if not 0 <= stream < streams:
            raise ValueError(f"stream={stream!r} must be in [0, {streams})")
        return torch.arange(stream, self.train_size, streams)

    def steps(self, stream: int, streams: int, passes: int) -> int:
        """Gradients stream ``stream`` computes in ``passes`` passes over its shard."""
        return passes * math.ceil(self.shard(stream, streams).numel() / self.spec.batch_size)

    def batches(self, stream: int, streams: int, passes: int,
                first_pass: int = 0) -> Iterator[Batch]:
        """The stream's mini-batches, ``passes`` times over its shard (last one may be short),
        and no more than ``spec.steps`` of them.

        ``first_pass`` numbers the passes (their shuffles) from there, for resumed runs.
        """
        shard = self.shard(stream, streams)
        left = self.spec.steps
        for epoch in range(first_pass, first_pass + passes):
            generator = torch.Generator().manual_seed(
                (self.spec.seed * 1_000_003 + stream) * 1_009 + epoch)
            order = shard[torch.randperm(shard.numel(), generator=generator)]
            for start in range(0, order.numel(), self.spec.batch_size):
                if left is not None:
                    if left == 0:
                        return
                    left -= 1
                chosen = order[start:start + self.spec.batch_size]
                yield self.x_train[chosen], self.y_train[chosen]

    def _module(self) -> nn.Module:
        module = getattr(self._local, "module", None)
        if module is None:
            module = copy.deepcopy(self.model)
            self._local.module = module
        return module

    def loss(self, weights: torch.Tensor, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy of the model with flat ``weights`` on ``batch``."""
        images, labels = batch
        logits = functional_call(self._module(), self.layout.split(weights), (images,))
        return nn.functional.cross_entropy(logits, labels)

    def gradient(self, weights: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The flat gradient of :meth:`loss` at ``weights`` (not modified)."""
        leaf = weights.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(self.loss(leaf, batch), leaf)
        return grad

    @torch.no_grad()
    def evaluate(self, weights: torch.Tensor) -> dict[str, float]:
        """Error and loss of the model with flat ``weights`` on the test set, or on the
        held-out training examples when ``spec.holdout > 0`` (keys ``validation_*``)."""
        if self.spec.holdout:
            split, images, labels = "validation", self.x_held, self.y_held
        else:
            split, images, labels = "test", self.data.x_test, self.data.y_test
        logits = functional_call(self._module(), self.layout.split(weights), (images,))
        error = float((logits.argmax(1) != labels).float().mean())
        return {f"{split}_error": error,
                f"{split}_loss": float(nn.functional.cross_entropy(logits, labels))}
