"""The optimiser steps with a dense estimate of the mean gradient, refreshed sparsely (EF21).

EF21 (Richtarik, Sokolov, Fatkhullin, NeurIPS 2021, Alg. 1): worker i keeps
an estimate ``g_i`` of its gradient and sends ``C(g - g_i)`` (line 4), then
``g_i += sent`` (line 5); every rank keeps ``G = mean_i g_i`` by
``G += mean(sent)`` (line 6) and steps with ``G``. Lines 4-5 are the
workers' error memory (:class:`WorkerEstimate`); line 6 is on the
optimiser's side: a step pre-hook adds what arrived to ``G`` and hands the
optimiser ``G`` as the gradient. An entry not refreshed keeps its last
estimate, so Adam's moments see a gradient that changes as the estimate
does, never a burst. With nothing dropped ``G`` is the mean gradient.

Floor: with :mod:`thinwire.optim`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from thinwire.feedback import Estimate


class WorkerEstimate(Estimate):
    """EF21 with line 6 left to the optimiser's side: the scheme's ``settle`` leaves what
    arrived as it is, and :meth:`estimate` adds it to ``G``."""

    def settle(self, key: str, mean: torch.Tensor) -> torch.Tensor:
        return mean

    def settle_(self, key: str, mean: torch.Tensor) -> None:
        return None

    def estimate(self, key: str, mean: torch.Tensor) -> torch.Tensor:
        """``G += mean`` (EF21 Alg. 1 line 6); a copy of ``G``."""
        return Estimate.settle(self, key, mean)


class SteppedEstimate:
    """Hand ``optimizer`` the estimate ``G += mean(sent)`` as the gradient of ``names``.

    Args:
        optimizer: any ``torch.optim`` optimiser.
        names: ``id(parameter) -> name`` of the parameters the scheme sends.
        memory: the scheme's :class:`WorkerEstimate`, which keeps ``G`` by name.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                 memory: WorkerEstimate) -> None:
        self.names = dict(names)
        self.memory = memory
        self.stashed: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = [optimizer.register_step_pre_hook(self._estimate),
                        optimizer.register_step_post_hook(self._give_back)]

    def _estimate(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for parameter in group["params"]:
                    grad = parameter.grad
                    if grad is None or id(parameter) not in self.names:
                        continue
                    self.stashed.append((parameter, grad))
                    parameter.grad = self.memory.estimate(self.names[id(parameter)], grad)

    def _give_back(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for parameter, grad in self.stashed:
            parameter.grad = grad
        self.stashed = []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
