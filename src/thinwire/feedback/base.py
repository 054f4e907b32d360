"""The error-feedback contract and the non-finite gradient policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

NONFINITE_POLICIES = ("raise", "skip")


class Memory(ABC):
    """Error-feedback memory: owns one buffer per key (never ``p.grad``).

    A round is ``p = compensate(key, grad)``, compress and send ``p`` as
    ``sent``, then ``update(key, p, sent)``.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad + e`` as a new tensor; ``grad`` is not modified."""
        error = self.buffers.get(key)
        return grad.clone() if error is None else grad + error

    @abstractmethod
    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Store what ``sent`` left out of ``compensated``."""

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": {k: v.clone() for k, v in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = {k: v.clone() for k, v in state["buffers"].items()}


def check_policy(policy: str) -> str:
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={policy!r} must be one of {NONFINITE_POLICIES}")
    return policy


def all_finite(grads: Mapping[str, torch.Tensor], policy: str) -> bool:
    """Apply the non-finite policy to one round of gradients.

    Returns:
        True when every gradient is finite. False under ``"skip"`` when one is
        not: the caller then sends a zero contribution and leaves its memory
        untouched, so collectives stay in step across ranks.

    Raises:
        FloatingPointError: under ``"raise"``, naming the first bad tensor.
    """
    for key, grad in grads.items():
        if not bool(torch.isfinite(grad).all()):
            if policy == "raise":
                raise FloatingPointError(
                    f"non-finite gradient in {key!r}; pass nonfinite='skip' to drop such steps"
                )
            return False
    return True
