"""What names a tensor for the codecs (:class:`TensorInfo`), and the checks they share."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

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
