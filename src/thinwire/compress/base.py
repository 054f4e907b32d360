"""The compressor contract: tensor (+ state) -> payload -> tensor, no collectives."""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.compress.payload import DensePayload, Payload, SparsePayload

ROLES = ("W_grad", "X_act", "X_grad", "delta", "activation", "factor")


@dataclass(frozen=True)
class TensorInfo:
    """Names a tensor for a compressor: which one it is, what it is for, its shape."""

    key: str  # stable name, e.g. the parameter name; state is keyed by it
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    role: str = "W_grad"  # one of ROLES
    device: torch.device = torch.device("cpu")  # where decoded tensors are made

    @functools.cached_property
    def numel(self) -> int:  # computed once: the hot path asks for it per tensor per step
        return math.prod(self.shape)

    @staticmethod
    def of(key: str, tensor: torch.Tensor, role: str = "W_grad") -> TensorInfo:
        return TensorInfo(key, tuple(tensor.shape), tensor.dtype, role, tensor.device)


def check_fraction(name: str, value: float, low: float, high: float, *, closed_low: bool,
                   closed_high: bool) -> None:
    """Raise ``ValueError`` naming ``value`` unless it lies in the stated interval."""
    above = value >= low if closed_low else value > low
    below = value <= high if closed_high else value < high
    if not (isinstance(value, (int, float)) and math.isfinite(value) and above and below):
        interval = f"{'[' if closed_low else '('}{low}, {high}{']' if closed_high else ')'}"
        raise ValueError(f"{name}={value!r} is outside the allowed range {interval}")


def keep_count(numel: int, density: float) -> int:
    """Entries a sparsifier keeps: ceil(numel * density), at least one of a non-empty tensor.

    ``density`` is the kept fraction (a scheme's ``ratio``). Every sparsifier uses this
    one function so that equal targets give equal k.
    """
    if numel == 0 or density <= 0.0:
        return 0
    return min(numel, max(1, math.ceil(numel * density - 1e-9)))


class Compressor(ABC):
    """Turns a tensor into a :data:`Payload` and back. Pure tensor maths.

    Subclasses with state (thresholds, step counters) override
    :meth:`state_dict` / :meth:`load_state_dict`; the state is keyed by
    ``TensorInfo.key`` so it survives DDP re-bucketing.
    """

    value_dtype: torch.dtype = torch.float32  # dtype of sparse payload values on the wire
    identity = False  # every payload is the tensor itself: the engine all-reduces the buffer

    @property
    def density(self) -> float | None:
        """Target fraction of a tensor's entries a payload keeps; None: all (not a sparsifier)."""
        return None

    @abstractmethod
    def compress(self, tensor: torch.Tensor, info: TensorInfo) -> Payload:
        """Encode ``tensor`` (not modified)."""

    def empty(self, info: TensorInfo) -> Payload:
        """The payload of a zero contribution, leaving all state untouched."""
        return self.compress(torch.zeros(info.shape, dtype=info.dtype, device=info.device), info)

    def decompress(self, payload: Payload, info: TensorInfo) -> torch.Tensor:
        """Decode ``payload`` into a tensor of ``info.shape`` and ``info.dtype``."""
        return decode(payload, info)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def decode(payload: Payload, info: TensorInfo) -> torch.Tensor:
    """Dense tensor of ``info``'s shape and dtype from a dense or sparse payload."""
    if isinstance(payload, DensePayload):
        return payload.values.to(info.dtype).reshape(info.shape)
    if isinstance(payload, SparsePayload):
        flat = torch.zeros(info.numel, dtype=info.dtype, device=info.device)
        flat[payload.indices] = payload.values.to(info.dtype)
        return flat.reshape(info.shape)
    raise TypeError(f"cannot decode a {type(payload).__name__} without its transport")
