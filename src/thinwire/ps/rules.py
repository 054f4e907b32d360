"""Server update rules by name: ASGD (Eq. 3) and DC-ASGD (Eq. 9-10, Algorithm 2).

``build_rule(name, **config)`` returns an :class:`UpdateRule` whose
``apply(weights, grad, backup) -> new_weights`` is the server's update for one
push, usable without a server. It never modifies its inputs, so a server may
hand out a weight tensor as a snapshot without copying it. Where DC-ASGD
(Zheng et al.) leaves room: momentum and weight decay (footnote 7) follow
``torch.optim.SGD``, with delay compensation on the loss gradient only (the
decay is taken at the current weights, which the server knows); milestones
count this rule's updates and multiply lr by ``lr_decay`` and lambda by
``lam_growth`` (§5); the adaptive variant is DC-ASGD-a (ICML 2017): lambda over
``sqrt(MeanSquare + eps)``, the mean square updated with the current gradient
first (never a division by zero) and without bias correction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch

from thinwire.compress.base import check_fraction

Weights = TypeVar("Weights", torch.Tensor, Mapping[str, torch.Tensor])

VARIANTS = ("square", "abs")
# §5 (CIFAR-10): "we set λ_1 = 2 and λ_2 = 0.04 initially", the default lambda of each option
PAPER_LAMBDA = {"abs": 2.0, "square": 0.04}


@dataclass(frozen=True)
class SGDConfig:
    """Plain SGD on a (possibly delayed) gradient: ASGD, Eq. 3."""

    lr: float = 0.1  # eta, the learning rate, > 0
    momentum: float = 0.0  # heavy-ball coefficient mu, in [0, 1)
    weight_decay: float = 0.0  # L2 coefficient added to the gradient, >= 0
    milestones: tuple[int, ...] = ()  # updates after which the learning rate drops
    lr_decay: float = 0.1  # factor applied to the learning rate at each milestone, in (0, 1]

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        check_fraction("momentum", self.momentum, 0.0, 1.0, closed_low=True, closed_high=False)
        _non_negative("weight_decay", self.weight_decay)
        check_fraction("lr_decay", self.lr_decay, 0.0, 1.0, closed_low=False, closed_high=True)
        milestones = tuple(self.milestones)
        if any(not isinstance(m, int) or m < 1 for m in milestones) or list(milestones) != sorted(
                set(milestones)):
            raise ValueError(f"milestones={self.milestones!r} must be strictly increasing "
                             "integers >= 1")
        object.__setattr__(self, "milestones", milestones)


@dataclass(frozen=True)
class DCConfig(SGDConfig):
    """DC-ASGD, Algorithm 2: ``g + lam * phi(g) * (w - w_bak)``."""

    lam: float | None = None  # lambda_2 (square) or lambda_1 (abs), >= 0; None: PAPER_LAMBDA
    variant: str = "square"  # "square": phi = g*g (Option II, Eq. 10); "abs": |g| (Option I, Eq. 9)
    adaptive: bool = False  # divide lambda by sqrt(MeanSquare(g) + eps) (DC-ASGD-a)
    ms_decay: float = 0.95  # m, the MeanSquare moving-average coefficient, in [0, 1)
    eps: float = 1e-7  # added to MeanSquare under the square root, > 0
    lam_growth: float = 10.0  # factor applied to lambda at each milestone, > 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r} must be one of {VARIANTS}")
        lam = PAPER_LAMBDA[self.variant] if self.lam is None else self.lam
        _non_negative("lam", lam)
        object.__setattr__(self, "lam", lam)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive={self.adaptive!r} must be True or False")
        check_fraction("ms_decay", self.ms_decay, 0.0, 1.0, closed_low=True, closed_high=False)
        _positive("eps", self.eps)
        _positive("lam_growth", self.lam_growth)


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")


def _non_negative(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name}={value!r} must be a finite number >= 0")


class UpdateRule:
    """One server update per push: ``w' = w - lr * v``, ``v = mu * v + d(g, w, w_bak)``.

    Subclasses define the direction ``d`` before weight decay and momentum.
    State (momentum buffers, mean squares, the update count) is keyed by
    tensor name; a plain tensor uses the name ``""``.

    Attributes:
        config: the frozen config the rule was built from.
        step: updates applied so far (drives the schedule).
    """

    name = "asgd"

    def __init__(self, config: SGDConfig) -> None:
        self.config = config
        self.step = 0
        self.momentum_buffers: dict[str, torch.Tensor] = {}

    def _milestones_passed(self) -> int:
        return sum(1 for m in self.config.milestones if self.step >= m)

    @property
    def lr(self) -> float:
        """The learning rate of the next update."""
        return self.config.lr * self.config.lr_decay ** self._milestones_passed()

    @overload
    def apply(self, weights: torch.Tensor, grad: torch.Tensor,
              backup: torch.Tensor) -> torch.Tensor: ...

    @overload
    def apply(self, weights: Mapping[str, torch.Tensor], grad: Mapping[str, torch.Tensor],
              backup: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def apply(self, weights: Any, grad: Any, backup: Any) -> Any:
        """The weights after one push of ``grad`` computed at ``backup``.

        Args:
            weights: current global weights w_t (a tensor, or tensors by name).
            grad: the pushed gradient g_m, computed at ``backup``.
            backup: w_bak(m), the weights the pushing worker pulled.

        Returns:
            New tensors; the inputs are not modified. Rule state advances.

        Raises:
            ValueError: names or shapes of the three arguments differ.
        """
        if isinstance(weights, torch.Tensor):
            result: Any = self._apply_one("", weights, grad, backup)
        else:
            if set(weights) != set(grad) or set(weights) != set(backup):
                raise ValueError("weights, grad and backup must name the same tensors; got "
                                 f"{sorted(weights)}, {sorted(grad)}, {sorted(backup)}")
            result = {key: self._apply_one(key, weights[key], grad[key], backup[key])
                      for key in weights}
        self.step += 1
        return result

    def _apply_one(self, key: str, weights: torch.Tensor, grad: torch.Tensor,
                   backup: torch.Tensor) -> torch.Tensor:
        if grad.shape != weights.shape or backup.shape != weights.shape:
            raise ValueError(f"tensor {key!r}: weights {tuple(weights.shape)}, grad "
                             f"{tuple(grad.shape)} and backup {tuple(backup.shape)} differ")
        direction = self.direction(key, weights, grad, backup)
        if self.config.weight_decay != 0.0:
            direction = direction.add(weights, alpha=self.config.weight_decay)
        if self.config.momentum != 0.0:
            previous = self.momentum_buffers.get(key)
            # First step stores d itself, as torch.optim.SGD does (no dampening).
            direction = (direction.clone() if previous is None
                         else previous.mul(self.config.momentum).add_(direction))
            self.momentum_buffers[key] = direction
        return weights.add(direction, alpha=-self.lr)

    def direction(self, key: str, weights: torch.Tensor, grad: torch.Tensor,
                  backup: torch.Tensor) -> torch.Tensor:
        """The gradient estimate at ``weights`` (ASGD: the delayed gradient as is, Eq. 3)."""
        del key, weights, backup
        return grad

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step,
                "momentum": {k: v.clone() for k, v in self.momentum_buffers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        self.momentum_buffers = {k: v.clone() for k, v in state["momentum"].items()}


class DCASGD(UpdateRule):
    """Delay-compensated ASGD (Algorithm 2, Option I / II).

    ``g_dc = g + lam_t * phi(g) * (w_t - w_bak(m))`` with ``phi(g) = g * g``
    (Eq. 10, ``variant="square"``) or ``|g|`` (Eq. 9, ``variant="abs"``): the
    first-order Taylor term of g(w_{t+tau}) around w_t with the diagonal of
    the Hessian approximated from the gradient itself (§3-4).
    """

    name = "dc-asgd"
    config: DCConfig

    def __init__(self, config: DCConfig) -> None:
        super().__init__(config)
        self.mean_squares: dict[str, torch.Tensor] = {}

    @property
    def lam(self) -> float:
        """Lambda of the next update (grows ``lam_growth``-fold at each milestone)."""
        assert self.config.lam is not None  # resolved by DCConfig.__post_init__
        return self.config.lam * self.config.lam_growth ** self._milestones_passed()

    def direction(self, key: str, weights: torch.Tensor, grad: torch.Tensor,
                  backup: torch.Tensor) -> torch.Tensor:
        # In place on one fresh buffer: the server applies this for every push.
        compensation = weights - backup
        if self.config.variant == "square":
            compensation.mul_(grad).mul_(grad)
        else:
            compensation.mul_(grad.abs())
        if self.config.adaptive:
            decay = self.config.ms_decay
            previous = self.mean_squares.get(key)
            mean_square = (grad * grad).mul_(1.0 - decay) if previous is None else (
                previous.mul(decay).addcmul_(grad, grad, value=1.0 - decay))
            self.mean_squares[key] = mean_square
            compensation.mul_(mean_square.add(self.config.eps).rsqrt_().mul_(self.lam))
        else:
            compensation.mul_(self.lam)
        return compensation.add_(grad)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "mean_squares": {k: v.clone() for k, v in self.mean_squares.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.mean_squares = {k: v.clone() for k, v in state["mean_squares"].items()}


RuleFactory = Callable[[Any], UpdateRule]
_RULES: dict[str, tuple[type, RuleFactory]] = {
    "asgd": (SGDConfig, UpdateRule),
    "dc-asgd": (DCConfig, DCASGD),
}

ConfigT = TypeVar("ConfigT")


def rule_names() -> list[str]:
    """Registered rule names."""
    return list(_RULES)


def rule_config_class(name: str) -> type:
    """The config dataclass of rule ``name``."""
    _known(name)
    return _RULES[name][0]


def register_rule(name: str, config: type, factory: RuleFactory) -> None:
    """Register ``factory(config_instance) -> UpdateRule`` under ``name``."""
    if name in _RULES:
        raise ValueError(f"update rule {name!r} is already registered")
    _RULES[name] = (config, factory)


def make_config(name: str, **config: Any) -> Any:
    """Validated config of rule ``name`` (``ValueError`` on unknown or bad options)."""
    _known(name)
    config_type = _RULES[name][0]
    fields = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(config) - fields)
    if unknown:
        raise ValueError(f"update rule {name!r} has no option(s) {unknown}; "
                         f"it takes {sorted(fields)}")
    return config_type(**config)


def build_rule(name: str, **config: Any) -> UpdateRule:
    """Build update rule ``name`` (``"asgd"``, ``"dc-asgd"``) from keyword config.

    Example: ``build_rule("dc-asgd", lr=0.1, lam=0.04, variant="square")``.

    Raises:
        ValueError: unknown name, unknown option or an option out of range.
    """
    built = make_config(name, **config)
    return _RULES[name][1](built)


def _known(name: str) -> None:
    if name not in _RULES:
        raise ValueError(f"unknown update rule {name!r}; choose from {rule_names()}")
