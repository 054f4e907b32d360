"""Adam's step for entries that arrive in bursts.

A sparsifier with error feedback sends an entry once every ``a`` steps,
carrying the ``a`` steps it held back; fed to Adam whole, that burst moves
the entry by about ``sqrt(a)`` learning rates where dense Adam moves it by
``a``. :class:`AgedAdam` takes the optimiser's step for the scheme's
parameters with each entry's second moment an average of the squared
per-step mean ``(s / a)^2``, weighted as ``a`` steps of it (Kingma & Ba,
Alg. 1, with ``m`` the workers' first moment); ``a`` counts steps since the
entry last arrived, up to the scheme's mean wait ``1 / density``. The rule is
ours: Adam's own average once a burst is spread over its steps, at no byte
on the wire, identical on every rank. Measured effect: docs/notes/engine.md.

Floor: with :mod:`thinwire.optim`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch

from thinwire.feedback import MomentumCorrection
from thinwire.optim.virtual import Move

STATE_KEYS = ("age", "square", "weight")


class AgedAdam:
    """Take ``optimizer``'s Adam(W) step for the parameters named in ``names``.

    A step pre-hook updates those parameters itself and hands the optimiser
    ``grad=None`` for them (``torch.optim.Adam``/``AdamW`` skip such a
    parameter entirely, so its own state for them stays empty); a step
    post-hook gives the gradients back. The per-entry state (age, second
    moment, its weight; :data:`STATE_KEYS`) lives in ``memory.arrivals`` by
    name, so the scheme's ``state_dict`` checkpoints and resumes it exactly.

    Every group's ``lr``, ``betas[1]``, ``eps`` and ``weight_decay`` are read at
    each step (schedulers act); ``weight_decay`` is AdamW's, decoupled. The
    first moment is the workers' (``betas[0]`` is 0 once coupled).

    Args:
        optimizer: the user's ``Adam`` (no weight decay) or ``AdamW``, without
            ``amsgrad`` or ``maximize``.
        names: ``id(parameter) -> name`` of the parameters to step.
        memory: the coupled scheme's memory, which keeps the state.
        horizon: the most steps a burst is credited with (``a`` above is
            ``min(age, horizon)``); :func:`thinwire.optim.couple` passes the scheme's
            mean wait, ``1 / density``. An entry that waited longer is more likely a
            one-off gradient (an embedding row a batch rarely hits) than a steady one,
            and crediting all its steps moved such rows by hundreds of learning rates.

    Raises:
        ValueError: an optimiser or group setting this step does not reproduce.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                 memory: MomentumCorrection, horizon: int = 100) -> None:
        refusal = refuses(optimizer)
        if refusal:
            raise ValueError(refusal)
        if horizon < 1:
            raise ValueError(f"horizon={horizon!r} must be >= 1 (steps)")
        self.horizon = horizon
        self.optimizer = optimizer
        self.names = dict(names)
        self.memory = memory
        self.stashed: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its grad)
        # group index -> (its names, the arrivals dict seen, flat age/square/weight)
        self._flats: dict[int, tuple[tuple[str, ...], Any, list[torch.Tensor]]] = {}
        self.handles = [optimizer.register_step_pre_hook(self._step),
                        optimizer.register_step_post_hook(self._give_back)]

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for index, group in enumerate(optimizer.param_groups):
                mine = [p for p in group["params"]
                        if p.grad is not None and id(p) in self.names]
                if not mine:
                    continue
                self._move(index, mine, group)
                for parameter in mine:
                    self.stashed.append((parameter, parameter.grad))
                    parameter.grad = None

    def _flat(self, index: int, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """Group ``index``'s state as flat (age, square, weight), one entry per element of
        ``parameters`` in order; ``memory.arrivals`` holds views of them by name.

        Kept across steps while the same parameters step and ``memory.arrivals`` is the
        same dict (a ``load_state_dict`` replaces it: the flats are then rebuilt from it).
        """
        names = tuple(self.names[id(p)] for p in parameters)
        kept = self._flats.get(index)
        if kept is not None and kept[0] == names and kept[1] is self.memory.arrivals:
            return kept[2]
        # at least float32: a half-precision age stops counting at 2048
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in parameters],
                                 torch.float32)
        total = sum(p.numel() for p in parameters)
        flats = [torch.zeros(total, dtype=dtype, device=parameters[0].device)
                 for _ in STATE_KEYS]
        start = 0
        for name, parameter in zip(names, parameters):
            stop = start + parameter.numel()
            old = self.memory.arrivals.get(name, {})
            views = {key: flat[start:stop].view(parameter.shape)
                     for key, flat in zip(STATE_KEYS, flats)}
            for key, view in views.items():
                if key in old and old[key].numel() == view.numel():
                    view.copy_(old[key].view(view.shape))
            self.memory.arrivals[name] = views
            start = stop
        self._flats[index] = (names, self.memory.arrivals, flats)
        return flats

    def _move(self, index: int, parameters: list[torch.Tensor], group: dict[str, Any]) -> None:
        """Adam's step for ``parameters`` (one group), on flat buffers: a few kernels per
        group rather than per tensor, and the moments touched only where an entry arrived
        (a sparsifier sends about one in ``1 / density``; elsewhere nothing changes but the
        age, so a pass over every entry per moment would cost more than the step)."""
        age, square, weight = self._flat(index, parameters)
        grad = torch.cat([p.grad.reshape(-1).to(age.dtype)  # type: ignore[union-attr]
                          for p in parameters])
        age.add_(1)
        arrived = grad.nonzero().squeeze(1)
        sent = grad[arrived]
        credited = age[arrived].clamp_(max=self.horizon)
        mean = sent / credited
        # beta2^a for an entry that arrived with its a steps
        decay = credited.mul_(math.log(float(group["betas"][1]))).exp_()
        gain = 1 - decay
        moment = weight[arrived].mul_(decay).add_(gain)
        weight[arrived] = moment
        averaged = square[arrived].mul_(decay).addcmul_(mean.mul_(mean), gain)
        square[arrived] = averaged
        age[arrived] = 0
        lr = float(group["lr"])
        if group["weight_decay"]:
            torch._foreach_mul_(parameters, 1 - lr * float(group["weight_decay"]))
        denominator = (averaged / moment).sqrt_()  # moment >= 1 - beta2 > 0 where arrived
        step = torch.zeros_like(grad).index_copy_(
            0, arrived, sent.div_(denominator.add_(float(group["eps"]))))
        torch._foreach_add_(parameters, [part.view(p.shape).to(p.dtype) for part, p in
                                         zip(step.split([p.numel() for p in parameters]),
                                             parameters)], alpha=-lr)

    def _give_back(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for parameter, grad in self.stashed:
            parameter.grad = grad
        self.stashed = []

    def remove(self) -> None:
        """Take both hooks off (the optimiser steps those parameters itself again)."""
        for handle in self.handles:
            handle.remove()


def refuses(optimizer: torch.optim.Optimizer) -> str:
    """Why :class:`AgedAdam` cannot take ``optimizer``'s step, or ``""`` when it can."""
    if not isinstance(optimizer, torch.optim.Adam):  # AdamW is an Adam with decoupled decay
        return f"{type(optimizer).__name__} is not Adam or AdamW"
    if len({float(group["betas"][1]) for group in optimizer.param_groups}) > 1:
        return "param groups with different betas[1] (one local second moment per worker)"
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "differentiable"):
            if group.get(flag):
                return f"{flag}=True is not reproduced by the burst-aware Adam step"
        if group["weight_decay"] and not group.get("decoupled_weight_decay"):
            return ("Adam's L2 weight_decay adds to every gradient entry; use AdamW "
                    "(decoupled) for the burst-aware Adam step")
    return ""


def look_ahead(memory: MomentumCorrection) -> Move:
    """The virtual iterate's move per unit lr under Adam: ``e / (sqrt(s_hat) + eps)``.

    ``s_hat`` is the worker's own second moment (``memory`` keeps it); None
    (no move) for an entry's tensor before its first gradient.
    """

    def move(name: str, error: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        square = memory.second_moment(name)
        if square is None:
            return None
        return error / square.view(error.shape).sqrt().add_(float(group["eps"]))

    return move
