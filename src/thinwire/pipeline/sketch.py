"""What does not work across a split (DCT KDD'21 Appendix A), as boundary kinds.

Both exist so users can measure why DCT-MP is the default.

``sketch`` (Table 6) sends ``Y = X S`` with ``S`` (d, m) of i.i.d. N(0, 1/m)
entries and receives ``X S^T``; both sides draw S from the seed, the split's
name and a checkpointed count of training calls, so no bytes carry it. S is
fresh at every training call (unbiased, noisy), or fixed with
``resample=False``. The backward sends the exact gradient of the sketched
network, (B, m), the gradient of what went forward, as a schedule requires.

``xgrad-topk`` (Table 7) sends the activation dense and each row's top
``ceil(d ratio)`` of ``X_grad`` plus a residual keyed by the gradient's shape (DCT Alg. 1 lines 3,
11). It runs in one process only: a schedule sends back only the gradient of a
tensor sent forward, with its shape. More: ``docs/dct-mp.md``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from thinwire.comm import Meter
from thinwire.compress.base import check_fraction, keep_count
from thinwire.compress.lowrank import seeded_normal
from thinwire.feedback import Residual
from thinwire.pipeline.boundary import (
    Receiver,
    Sender,
    check_activation,
    check_ratio,
    index_dtype,
)
from thinwire.pipeline.registry import register_boundary


def sketch_matrix(name: str, width: int, compression: float, seed: int = 0,
                  draw: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Draw number ``draw`` of the (width, m) Gaussian sketch, N(0, 1/m) entries.

    Depends only on its arguments, so both sides of a split draw the same S.
    """
    columns = keep_count(width, 1.0 - compression)
    normal = seeded_normal(f"sketch:{name}:{draw}", (width, columns), seed, dtype)
    return normal / math.sqrt(columns)


class _Sketch:
    """What both sides share: which S to use for the current call."""

    def __init__(self, name: str, width: int, compression: float, seed: int,
                 resample: bool) -> None:
        self.name, self.width, self.compression = name, width, compression
        self.seed, self.resample = seed, resample
        self.calls = 0
        self.fixed = sketch_matrix(name, width, compression, seed)

    def matrix(self, training: bool) -> torch.Tensor:
        if not (training and self.resample and torch.is_grad_enabled()):
            return self.fixed
        self.calls += 1
        return sketch_matrix(self.name, self.width, self.compression, self.seed, self.calls)


class SketchSender(Sender):
    """Sends ``X S`` (Appendix A, Table 6)."""

    def __init__(self, sketch: _Sketch, meter: Meter | None = None) -> None:
        super().__init__(sketch.name, meter)
        self.sketch = sketch

    def encode(self, acts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        check_activation(acts)
        return (acts @ self.sketch.matrix(self.training).to(acts.dtype),)

    def get_extra_state(self) -> dict[str, int]:
        return {"calls": self.sketch.calls}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.sketch.calls = state["calls"]


class SketchReceiver(Receiver):
    """Rebuilds ``X~ = Y S^T`` with the sender's S."""

    def __init__(self, sketch: _Sketch, meter: Meter | None = None) -> None:
        super().__init__(sketch.name, meter)
        self.sketch = sketch

    def decode(self, *payload: torch.Tensor) -> torch.Tensor:
        (sketched,) = payload
        return sketched @ self.sketch.matrix(self.training).to(sketched.dtype).T

    def get_extra_state(self) -> dict[str, int]:
        return {"calls": self.sketch.calls}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.sketch.calls = state["calls"]


@dataclasses.dataclass(frozen=True)
class SketchConfig:
    """Options of the ``sketch`` boundary."""

    compression: float = 0.5  # fraction of the width removed by the sketch, in [0, 1)
    seed: int = 0  # seeds S (with the split's name); both sides must agree
    resample: bool = True  # a fresh S every training call (False: one fixed S)

    def __post_init__(self) -> None:
        check_fraction("compression", self.compression, 0.0, 1.0, closed_low=True,
                       closed_high=False)


@register_boundary("sketch", SketchConfig)
def _sketch_pair(config: SketchConfig, name: str, width: int, dtype: torch.dtype,
                 meter: Meter | None) -> tuple[Sender, Receiver]:
    # Each side has its own counter: in one process they advance in step, across
    # processes each rank owns one side.
    def side() -> _Sketch:
        return _Sketch(name, width, config.compression, config.seed, config.resample)

    return SketchSender(side(), meter), SketchReceiver(side(), meter)


class _TopKGrad(torch.autograd.Function):
    """Identity forward; backward keeps each row's top-k of ``X_grad + e``."""

    @staticmethod
    def forward(ctx: Any, acts: torch.Tensor,
                receiver: XGradTopKReceiver) -> torch.Tensor:
        ctx.receiver = receiver
        return acts.view_as(acts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.receiver.compress_grad(grad), None


class XGradTopKSender(Sender):
    """The activation crosses dense (Appendix A, Table 7)."""

    pipelines = False

    def encode(self, acts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        check_activation(acts)
        return (acts,)


class XGradTopKReceiver(Receiver):
    """Compresses ``X_grad`` by per-row top-k, optionally with error feedback.

    Args:
        ratio: fraction of each gradient row kept, in (0, 1].
        error_feedback: keep what was not sent and add it to the next gradient.

    The residual memory is part of the module's ``state_dict``.
    """

    pipelines = False
    records_grad = False  # meters the (values, indices) it sends, not a dense gradient

    def __init__(self, ratio: float, error_feedback: bool = True, name: str = "",
                 meter: Meter | None = None) -> None:
        check_ratio(ratio)
        super().__init__(name, meter)
        self.ratio = ratio
        self.memory = Residual() if error_feedback else None

    def decode(self, *payload: torch.Tensor) -> torch.Tensor:
        (acts,) = payload
        out: torch.Tensor = _TopKGrad.apply(acts, self)
        return out

    def compress_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient the sender receives: each row's top-k of ``grad + e``."""
        key = f"{self.name}{tuple(grad.shape)}"
        compensated = grad if self.memory is None else self.memory.compensate(key, grad)
        width = grad.shape[-1]
        k = keep_count(width, self.ratio)
        indices = torch.topk(compensated.abs(), k, dim=-1, sorted=False).indices
        values = compensated.gather(-1, indices)
        sent = torch.zeros_like(compensated).scatter_(-1, indices, values)
        if self.memory is not None:
            self.memory.update(key, compensated, sent)
        if self.meter is not None:
            small = index_dtype(width - 1).itemsize
            self.meter.record("X_grad", self.name, "send",
                              values.numel() * (values.element_size() + small))
        return sent

    def get_extra_state(self) -> dict[str, Any]:
        return {"memory": None if self.memory is None else self.memory.state_dict()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if self.memory is not None and state["memory"] is not None:
            self.memory.load_state_dict(state["memory"])


@dataclasses.dataclass(frozen=True)
class XGradTopKConfig:
    """Options of the ``xgrad-topk`` boundary."""

    ratio: float = 0.5  # fraction of each X_grad row kept, in (0, 1]
    error_feedback: bool = True  # add the unsent remainder to the next X_grad

    def __post_init__(self) -> None:
        check_ratio(self.ratio)


@register_boundary("xgrad-topk", XGradTopKConfig)
def _xgrad_topk_pair(config: XGradTopKConfig, name: str, width: int, dtype: torch.dtype,
                     meter: Meter | None) -> tuple[Sender, Receiver]:
    return (XGradTopKSender(name, meter),
            XGradTopKReceiver(config.ratio, config.error_feedback, name, meter))
