"""An optimiser's family and momentum settings, as coupling and the step check read them.

Adam's ``beta1`` reads as a momentum (:func:`momentum_of`); what an earlier coupling
moved out of the optimiser is recorded in its param groups under :data:`MARK`
(:func:`marked_settings`), so a state saved coupled couples the same way when loaded.

Floor: with :mod:`thinwire.optim`.
"""

from __future__ import annotations

from typing import Any

import torch

# The param-group key where coupling records the settings it moved out of the optimiser.
MARK = "thinwire_coupled"


# The optimisers coupled as Adam (beta1 as the momentum).
ADAMS = (torch.optim.Adam, torch.optim.AdamW)


# (momentum, dampening, nesterov, weight decay by param-group index)
Settings = tuple[float, float, bool, tuple[float, ...]]


def marked_settings(optimizer: torch.optim.Optimizer) -> Settings | None:
    """The settings an earlier coupling recorded in the param groups (:data:`MARK`), if any."""
    marks = [group.get(MARK) for group in optimizer.param_groups]
    if not any(marks):
        return None
    first = marks[0] or {}
    return (float(first["momentum"]), float(first["dampening"]), bool(first["nesterov"]),
            tuple(float((mark or {}).get("weight_decay", 0.0)) for mark in marks))


def momentum_of(optimizer: torch.optim.Optimizer,
                group: dict[str, Any]) -> tuple[float, float, bool]:
    """(momentum, dampening, nesterov) of a param group. Adam's beta1 becomes momentum
    beta1 with dampening 1 - beta1 (``m <- b1 m + b1 g``, 9x Adam's first moment at 0.9:
    measured faster through the look-ahead than Adam's own scale, docs/convergence.md)."""
    if isinstance(optimizer, ADAMS):
        beta1 = float(group["betas"][0])
        return beta1, 1.0 - beta1, False
    if isinstance(optimizer, torch.optim.SGD):
        return float(group["momentum"]), float(group["dampening"]), bool(group["nesterov"])
    return 0.0, 0.0, False


def default_rule(optimizer: torch.optim.Optimizer) -> str:
    """The rule ``"auto"`` applies: ``"momentum"`` for SGD with momentum (or one coupled
    before, :data:`MARK`), else ``"none"`` (Adam and AdamW take the scheme's mean as it is)."""
    if marked_settings(optimizer) or (isinstance(optimizer, torch.optim.SGD)
                              and any(group["momentum"] for group in optimizer.param_groups)):
        return "momentum"
    return "none"
