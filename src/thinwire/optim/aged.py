"""Adam's second moment, each arriving entry credited with the steps it waited.

Error feedback sends an entry once every ``a`` steps, carrying the ``a``
gradients it held back as one burst ``s``. Fed to Adam as one gradient, the
burst adds ``(1 - b2) s^2`` to the second moment where dense training would
have added ``a`` squares of about ``s / a``, so an entry whose gradient keeps
its sign moves ``sqrt(a)`` learning rates where dense Adam moves it ``a``.
:class:`AgedMoment` leaves the user's ``Adam``/``AdamW`` to take its own step
and, just before it, corrects ``exp_avg_sq`` so that the step adds
``(1 - b2^a) (s / a)^2`` instead: Adam's average over the ``a`` steps, each of
the burst's mean. The first moment takes the burst whole, as Adam would take
the ``a`` gradients, so an entry still moves by its gradients' sum over the
root of their mean square. ``a`` counts steps since the entry last arrived,
up to a horizon (the scheme's mean wait); at a horizon of 1 nothing is
changed, so with nothing dropped the step is the user's, bit for bit.

Floor: with :mod:`thinwire.optim`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

WAITED = "waited"  # the optimiser state key: steps since the entry last arrived (0: last step)


class AgedMoment:
    """Correct ``optimizer``'s second moment for entries that arrive after waiting.

    A step pre-hook adds ``((1 - b2^a) (g / a)^2 - (1 - b2) g^2) / b2`` to
    ``exp_avg_sq`` where ``g`` is non-zero (``a = min(waited + 1, horizon)``),
    so the optimiser's own ``b2 v + (1 - b2) g^2`` lands on the credited
    value; a step post-hook counts the waits. The count lives in the
    optimiser's state (``state[p]["waited"]``), so ``optimizer.state_dict()``
    checkpoints it, and it is the same on every rank (every rank steps with
    the same mean).

    Args:
        optimizer: the user's ``torch.optim.Adam`` or ``AdamW`` (any flags).
        parameters: the parameters whose gradients arrive sparse (the scheme's).
        horizon: the most steps a burst is credited with, >= 1: the scheme's mean
            wait ``1 / density``. An entry that waited longer is likelier a one-off
            gradient (an embedding row a batch rarely hits) than a steady one.

    Raises:
        TypeError: ``optimizer`` is not Adam or AdamW.
        ValueError: ``horizon`` < 1.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 parameters: Iterable[torch.nn.Parameter], horizon: int) -> None:
        if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam
            raise TypeError(f"{type(optimizer).__name__} is not Adam or AdamW")
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"horizon={horizon!r} must be an integer >= 1 (steps)")
        self.optimizer = optimizer
        self.horizon = horizon
        self.parameters = {id(p) for p in parameters}
        self.handles = ([] if horizon == 1 else
                        [optimizer.register_step_pre_hook(self._credit),
                         optimizer.register_step_post_hook(self._count)])

    def _mine(self, optimizer: torch.optim.Optimizer) -> Iterable[tuple[dict[str, Any],
                                                                       torch.Tensor]]:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None and id(parameter) in self.parameters:
                    yield group, parameter

    def _credit(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for group, parameter in self._mine(optimizer):
                state = optimizer.state.get(parameter, {})
                if WAITED not in state or "exp_avg_sq" not in state:
                    continue  # the first step: nothing has waited yet
                waited = state[WAITED]
                late = (parameter.grad != 0) & (waited > 0)  # arrived after waiting
                if not bool(late.any()):
                    continue
                grad = _effective(parameter, group)[late]
                beta2 = float(group["betas"][1])
                credited = waited[late].add(1).clamp_(max=self.horizon).to(grad.dtype)
                mean = grad / credited
                gain = 1 - torch.pow(beta2, credited)
                correction = gain * (mean * mean) - (1 - beta2) * (grad * grad)
                state["exp_avg_sq"][late] += correction.div_(beta2)

    def _count(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for _, parameter in self._mine(optimizer):
                state = optimizer.state[parameter]
                waited = state.get(WAITED)
                if waited is None:
                    waited = state[WAITED] = torch.zeros_like(parameter)
                arrived = parameter.grad != 0
                waited.add_(1).clamp_(max=self.horizon - 1).masked_fill_(arrived, 0)

    def remove(self) -> None:
        """Take both hooks off (the optimiser's second moment is its own again)."""
        for handle in self.handles:
            handle.remove()


def _effective(parameter: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """The gradient Adam's moments see: with Adam's L2 ``weight_decay`` (not AdamW's),
    ``grad + weight_decay * p``, as ``torch.optim.Adam`` adds it."""
    grad = parameter.grad
    assert grad is not None
    if group["weight_decay"] and not group.get("decoupled_weight_decay"):
        return grad.add(parameter, alpha=float(group["weight_decay"]))
    return grad
