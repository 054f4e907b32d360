"""PROTOTYPE: each worker runs Adam's moments on its own gradient and sends its update."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from thinwire.feedback import Memory, MomentumCorrection


class LocalAdamMemory(MomentumCorrection):
    def __init__(self, inner: Memory, beta1: float, beta2: float, eps: float) -> None:
        super().__init__(inner, beta1, 1.0 - beta1, False, beta2)
        self.eps = eps

    def advance_(self, grads: Mapping[str, torch.Tensor]) -> None:
        self._advanced = set()

    def holds(self, key: str, grad: torch.Tensor) -> bool:
        return False

    def _advance(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        velocity = super()._advance(key, grad)
        square = self.second_moment(key)
        assert square is not None
        return velocity / square.view(velocity.shape).sqrt().add_(self.eps)


class SGDStep:
    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> None:
        self.names = dict(names)
        self.stashed: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = [optimizer.register_step_pre_hook(self._step),
                        optimizer.register_step_post_hook(self._give_back)]

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                lr, decay = float(group["lr"]), float(group["weight_decay"])
                for parameter in group["params"]:
                    grad = parameter.grad
                    if grad is None or id(parameter) not in self.names:
                        continue
                    if decay:
                        parameter.mul_(1 - lr * decay)
                    parameter.add_(grad, alpha=-lr)
                    self.stashed.append((parameter, grad))
                    parameter.grad = None

    def _give_back(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for parameter, grad in self.stashed:
            parameter.grad = grad
        self.stashed = []
