"""PROTOTYPE: Adam's second moment frozen once compression starts (1-bit Adam's rule)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from thinwire.feedback import Memory

FROZEN = "frozen_at"


def frozen_square(state: dict[str, Any], beta2: float) -> torch.Tensor | None:
    at = state.get(FROZEN)
    if at is None:
        return None
    square = state["exp_avg_sq"] / (1 - beta2 ** float(at))
    floor = state.get("floor")
    return square if floor is None else torch.maximum(square, floor)


class Preconditioned(Memory):
    """g / (sqrt(v_hat) + eps) into the inner memory once v is frozen."""

    def __init__(self, inner: Memory, optimizer: torch.optim.Optimizer,
                 params: Mapping[str, torch.nn.Parameter]) -> None:
        self.inner = inner
        self.optimizer = optimizer
        self.params = dict(params)
        self.group = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    @property
    def buffers(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self.inner.buffers

    @property
    def rule(self) -> str:  # type: ignore[override]
        return f"preconditioned+{self.inner.rule}"

    @property
    def forgets_what_is_sent(self) -> bool:  # type: ignore[override]
        return self.inner.forgets_what_is_sent

    def scale(self, key: str) -> torch.Tensor | None:
        param = self.params.get(key)
        if param is None:
            return None
        group = self.group[id(param)]
        square = frozen_square(self.optimizer.state.get(param, {}), float(group["betas"][1]))
        if square is None:
            return None
        return square.sqrt().add_(float(group["eps"]))

    def _pre(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        scale = self.scale(key)
        return grad if scale is None else grad / scale.view(grad.shape)

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        return self.inner.compensate(key, self._pre(key, grad))

    def compensate_(self, key: str, target: torch.Tensor) -> torch.Tensor:
        scale = self.scale(key)
        if scale is not None:
            target.div_(scale.view(target.shape))
        return self.inner.compensate_(key, target)

    def compensate_all_(self, targets: Mapping[str, torch.Tensor]) -> None:
        for key, target in targets.items():
            self.compensate_(key, target)

    def absorb_(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        return self.inner.absorb_(key, self._pre(key, grad))

    def holds(self, key: str, grad: torch.Tensor) -> bool:
        return False

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        self.inner.update(key, compensated, sent)

    def update_sparse(self, key: str, compensated: torch.Tensor, indices: torch.Tensor,
                      sent: torch.Tensor) -> None:
        self.inner.update_sparse(key, compensated, indices, sent)

    def update_selected_(self, key: str, compensated: torch.Tensor,
                         indices: torch.Tensor) -> None:
        self.inner.update_selected_(key, compensated, indices)

    def settle(self, key: str, mean: torch.Tensor) -> torch.Tensor:
        return self.inner.settle(key, mean)

    def settle_(self, key: str, mean: torch.Tensor) -> None:
        self.inner.settle_(key, mean)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class FrozenAdam:
    """Torch's AdamW while the scheme sends dense; then v frozen and m on arrivals."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                 scheme: Any, preconditioned: bool, horizon: int) -> None:
        self.horizon = horizon
        self.names = dict(names)
        self.scheme = scheme
        self.preconditioned = preconditioned
        self.stashed: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = [optimizer.register_step_pre_hook(self._step),
                        optimizer.register_step_post_hook(self._after)]

    def _warm(self) -> bool:
        return bool(getattr(self.scheme, "warm", True))

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                beta1, beta2 = (float(b) for b in group["betas"])
                lr, eps, decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
                for p in group["params"]:
                    if p.grad is None or id(p) not in self.names:
                        continue
                    state = optimizer.state.get(p, {})
                    square = frozen_square(state, beta2)
                    if square is None:
                        continue  # torch's own step
                    grad = p.grad
                    if self.preconditioned:
                        grad = grad * square.sqrt().add_(eps)  # back to gradient units
                    waited = state.setdefault("waited", torch.zeros_like(p))
                    floor = state.setdefault("floor", torch.zeros_like(p))
                    arrived = grad != 0
                    credited = waited.add(1).clamp_(max=self.horizon)
                    mean = grad / credited
                    torch.maximum(floor.mul_(beta2), mean * mean, out=floor)
                    waited.add_(1).clamp_(max=self.horizon - 1).masked_fill_(arrived, 0)
                    scale = frozen_square(state, beta2).sqrt_().add_(eps)
                    state["step"] += 1
                    step = float(state["step"])
                    state["exp_avg"].lerp_(grad, 1 - beta1)
                    if decay:
                        p.mul_(1 - lr * decay)
                    p.addcdiv_(state["exp_avg"], scale, value=-lr / (1 - beta1 ** step))
                    self.stashed.append((p, p.grad))
                    p.grad = None

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for p, grad in self.stashed:
            p.grad = grad
        self.stashed = []
        if not self._warm():
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if id(p) in self.names and state and FROZEN not in state:
                    state[FROZEN] = state["step"].clone()
