"""Couple the user's optimiser to a sparse scheme: its momentum moves into the workers.

Error feedback releases what it held back in bursts, which a momentum applied
after the all-reduce carries on for ``1 / (1 - mu)`` steps more. :func:`couple`
moves SGD's momentum (Adam's first moment) in front of error feedback, DGC's
momentum correction (Lin et al., ICLR 2018, §3.2; :class:`MomentumCorrection`),
and through a DDP hook's state takes each worker's gradient at ``x - lr e``
(:class:`~thinwire.optim.virtual.VirtualIterate`); under Adam the scheme's
parameters step with :class:`~thinwire.optim.adam.AgedAdam`. It reads what it
needs from the :class:`~thinwire.schemes.Scheme` contract (``error_memory``,
``traits``). Schemes without error feedback and optimisers
without momentum are left as they were, so calling it is always safe. Measured
effects: docs/notes/engine.md and docs/convergence.md.

Floor: above schemes, below the front doors (the DDP hook couples through it).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from thinwire.feedback import Estimate, Memory, MomentumCorrection
from thinwire.optim.adam import AgedAdam, look_ahead, refuses
from thinwire.optim.virtual import VirtualIterate
from thinwire.schemes.base import Scheme


@dataclass(frozen=True)
class Coupling:
    """What :func:`couple` did."""

    coupled: bool  # True when the momentum moved into the scheme
    momentum: float  # the optimiser's momentum before coupling
    nesterov: bool  # the optimiser's Nesterov flag before coupling
    reason: str  # why it did or did not couple, in a sentence
    virtual: VirtualIterate | None = None  # gradients at x - lr e (its remove() undoes it)
    adam: AgedAdam | None = None  # Adam's step for the scheme's parameters (remove() too)


def sparse_memory(scheme: Scheme) -> Memory | None:
    """The error-feedback memory :func:`couple` couples (:attr:`Scheme.error_memory`)."""
    return scheme.error_memory


FEEDBACKS = ("auto", "ef21", "error")


def _feedback(scheme: Scheme, memory: Memory, feedback: str) -> Memory:
    """The memory the velocity goes into: the scheme's own, or EF21 where every rank sends
    at shared indices (CLT-k), whose plain error feedback refreshes one k-th of a layer per
    step while the rest waits; measured, EF21 pays only without the virtual iterate
    (docs/notes/engine.md).

    Raises:
        ValueError: CLT-k's memory already holds state (couple before training).
    """
    if not scheme.traits.shared_indices or feedback == "error":
        return memory
    if memory.buffers:
        raise ValueError(f"{_name(scheme)} has already run a step: call thinwire.optim.couple "
                         "before the first step (or before loading a coupled checkpoint)")
    return Estimate()


def _name(scheme: Scheme) -> str:
    return scheme.origin[0] if scheme.origin else type(scheme).__name__


def _scheme_of(target: Any) -> Scheme:
    scheme = getattr(target, "scheme", target)  # a ddp.HookState or a Scheme
    if not isinstance(scheme, Scheme):
        raise TypeError(f"expected a Scheme or a thinwire.ddp hook state, got {type(target)}")
    return scheme


def couple(optimizer: torch.optim.Optimizer, target: Any, *,
           feedback: str = "auto", virtual: bool = True) -> Coupling:
    """Move ``optimizer``'s SGD momentum into ``target``'s error feedback, if both have one.

    Args:
        optimizer: the user's optimiser, built as usual.
        target: the scheme, or the state :func:`thinwire.ddp.register` returned.
        feedback: what CLT-k's velocity goes into: ``"ef21"``, EF21 (:class:`Estimate`);
            ``"error"``, CLT-k's own error feedback; ``"auto"``, its own where the
            virtual iterate below is installed, else EF21 (what measured fastest in
            each case, docs/convergence.md). The other sparsifiers always use their
            own (``"auto"`` or ``"error"``).
        virtual: through a DDP hook's state (:func:`thinwire.ddp.register`) and
            plain error feedback: each worker computes its gradient at ``x - lr * e``,
            its weights with its pending error applied (:class:`VirtualIterate`);
            under Adam/AdamW scaled as Adam's step, which :class:`AgedAdam` then
            takes for the scheme's parameters (not for ``amsgrad``, ``maximize`` or
            Adam's L2 ``weight_decay``: :func:`thinwire.optim.adam.refuses`).

    Returns:
        What was done. Side effects when coupled: every param group's
        ``momentum``, ``dampening`` and ``nesterov`` (Adam: ``betas[0]``) are set
        to 0/False, SGD's ``weight_decay`` is multiplied by the momentum's gain
        ``(1 - dampening) / (1 - momentum)``, and the scheme's memory is wrapped in
        :class:`MomentumCorrection`.

    Raises:
        ValueError: param groups with different momentum settings (one
            velocity rule per scheme), or a ``feedback`` the scheme does not take.
        TypeError: ``target`` is neither a scheme nor a hook state.
    """
    scheme = _scheme_of(target)
    if feedback not in FEEDBACKS:
        raise ValueError(f"feedback={feedback!r} must be one of {FEEDBACKS}")
    if feedback == "ef21" and not scheme.traits.shared_indices:
        raise ValueError(f"feedback='ef21' is for clt-k, not {_name(scheme)}: the "
                         "local sparsifiers were slower with it (docs/convergence.md)")
    every = read_momentum(optimizer)
    settings = every[0] if every else (0.0, 0.0, False)
    momentum, _, nesterov = settings
    memory = scheme.error_memory
    if isinstance(memory, MomentumCorrection):
        return Coupling(True, memory.momentum, memory.nesterov, "already coupled")
    if not isinstance(optimizer, (torch.optim.SGD, *_ADAMS)):
        return Coupling(False, momentum, nesterov, f"{type(optimizer).__name__} is not SGD, "
                        "Adam or AdamW: any momentum of its own stays in the optimiser")
    if momentum == 0.0:
        return Coupling(False, momentum, nesterov, "the optimiser applies no momentum")
    if len(every) > 1:
        raise ValueError(f"param groups use different (momentum, dampening, nesterov) "
                         f"{every}; couple needs one setting for all groups")
    if memory is None:
        return Coupling(False, momentum, nesterov, "the scheme does not sparsify with feedback")
    module = getattr(target, "module", None)
    adam = isinstance(optimizer, _ADAMS)
    refusal = refuses(optimizer) if adam else ""
    wanted = virtual and not refusal
    ahead = wanted and module is not None
    coupled = wrap_memory(scheme, memory, settings,
                          "error" if feedback == "auto" and ahead else feedback,
                          float(optimizer.param_groups[0]["betas"][1]) if adam else None,
                          wanted and ahead)
    reason = take_momentum(optimizer, settings)
    pending = wanted and not isinstance(coupled.inner, Estimate)  # EF21 steps with all it has
    if not (pending and ahead):
        if refusal:
            reason += f"; gradients stay at x and the optimiser steps as Adam: {refusal}"
        elif pending:
            reason += ("; gradients stay at x: pass the state thinwire.ddp.register returned "
                       "for gradients at x - lr e")
        return Coupling(True, momentum, nesterov, reason)
    moved, stepped = install_virtual(optimizer, target, scheme, coupled)
    return Coupling(True, momentum, nesterov, reason, moved, stepped)


def read_momentum(optimizer: torch.optim.Optimizer) -> list[tuple[float, float, bool]]:
    """The distinct ``(momentum, dampening, nesterov)`` of the param groups, sorted (one
    for a usual optimiser; Adam's beta1 reads as a momentum, :func:`_momentum`)."""
    return sorted({_momentum(optimizer, group) for group in optimizer.param_groups})


def wrap_memory(scheme: Scheme, memory: Memory, settings: tuple[float, float, bool],
                feedback: str, beta2: float | None, ahead: bool) -> MomentumCorrection:
    """Wrap ``scheme``'s error memory in momentum correction and put it in its place.

    Args:
        feedback: ``"error"``, ``"ef21"`` or ``"auto"`` (as :func:`couple` resolved it).
        beta2: Adam's second-moment decay, for the look-ahead of the virtual iterate.
        ahead: whether gradients will be taken at the virtual iterate.
    """
    momentum, dampening, nesterov = settings
    inner = _feedback(scheme, memory, feedback)
    pending = ahead and not isinstance(inner, Estimate)
    coupled = MomentumCorrection(inner, momentum, dampening, nesterov,
                                 beta2 if pending else None)
    scheme.couple_memory(coupled)
    return coupled


def take_momentum(optimizer: torch.optim.Optimizer,
                  settings: tuple[float, float, bool]) -> str:
    """Set the optimiser's momentum to 0 (Adam: ``betas[0]``); SGD's ``weight_decay`` is
    multiplied by the momentum's steady-state gain ``(1 - dampening) / (1 - mu)``, which
    it no longer passes through. Returns what was done, in words."""
    momentum, dampening, _ = settings
    groups = optimizer.param_groups
    adam = isinstance(optimizer, _ADAMS)
    gain = (1.0 - dampening) / (1.0 - momentum)
    for group in groups:
        if adam:
            group["betas"] = (0.0, group["betas"][1])
        else:
            group.update(momentum=0.0, dampening=0.0, nesterov=False,
                         weight_decay=group["weight_decay"] * gain)
    reason = "momentum moved into the scheme's memory"
    if not adam and any(group["weight_decay"] for group in groups):
        reason += f"; weight_decay multiplied by the momentum's gain {gain:g}"
    return reason


def install_virtual(optimizer: torch.optim.Optimizer, target: Any, scheme: Scheme,
                    coupled: MomentumCorrection) -> tuple[VirtualIterate, AgedAdam | None]:
    """Gradients at ``x - lr e`` (:class:`VirtualIterate`) through ``target``, a DDP hook's
    state; under Adam, :class:`AgedAdam` steps the scheme's parameters."""
    adam = isinstance(optimizer, _ADAMS)
    names = target.names
    moved = VirtualIterate(optimizer, target.module, names, coupled,
                           look_ahead(coupled) if adam else None)
    stepped = (AgedAdam(optimizer, names, coupled, _mean_wait(scheme))  # after moved: from x
               if adam else None)
    return moved, stepped


_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def _mean_wait(scheme: Scheme) -> int:
    """Steps an entry waits on average at the scheme's density, ``1 / density``."""
    density = scheme.traits.density
    return max(1, round(1 / density)) if density else 1


def _momentum(optimizer: torch.optim.Optimizer,
              group: dict[str, Any]) -> tuple[float, float, bool]:
    """(momentum, dampening, nesterov) of a param group. Adam's beta1 becomes momentum
    beta1 with dampening 1 - beta1 (``m <- b1 m + b1 g``, 9x Adam's first moment at 0.9:
    measured faster through the look-ahead than Adam's own scale, docs/convergence.md)."""
    if isinstance(optimizer, _ADAMS):
        beta1 = float(group["betas"][0])
        return beta1, 1.0 - beta1, False
    if isinstance(optimizer, torch.optim.SGD):
        return float(group["momentum"]), float(group["dampening"]), bool(group["nesterov"])
    return 0.0, 0.0, False


# Schemes registered on a DDP model, by parameter: the step pre-hook below looks them up.
_WATCHED: dict[int, weakref.ReferenceType[Scheme]] = {}
_HOOK: list[Any] = []


def watch(scheme: Scheme, parameters: Iterable[torch.nn.Parameter]) -> None:
    """Warn once if a momentum optimiser steps ``parameters`` while ``scheme`` is uncoupled.

    :func:`thinwire.ddp.register` calls this; a global optimiser step pre-hook
    (installed once) does the check.
    """
    if scheme.error_memory is None:
        return
    reference = weakref.ref(scheme)
    for parameter in parameters:
        _WATCHED[id(parameter)] = reference
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check))


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before a step: warn if the momentum skips a sparse scheme, raise if it is applied twice.

    Raises:
        RuntimeError: a coupled scheme's parameters are stepped with momentum
            again (a scheduler that cycles momentum, or an optimiser state
            saved before coupling, set it back after :func:`couple`); nothing
            has been stepped yet.
    """
    for group in optimizer.param_groups:
        momentum = _momentum(optimizer, group)[0]
        if momentum == 0.0:
            continue
        for parameter in group["params"]:
            scheme = _WATCHED.get(id(parameter), lambda: None)()
            memory = None if scheme is None else scheme.error_memory
            if isinstance(memory, MomentumCorrection):
                raise RuntimeError(
                    f"the optimiser's momentum is {momentum} again after "
                    "thinwire.optim.couple moved it into the scheme, so it would be applied "
                    "twice. A scheduler that cycles momentum (OneCycleLR, CyclicLR: build it "
                    "with cycle_momentum=False) or an optimiser state_dict saved before "
                    "coupling sets it back")
            if memory is not None:
                for key in [k for k, ref in _WATCHED.items() if ref() is scheme]:
                    del _WATCHED[key]  # once per scheme
                warnings.warn(
                    "the optimiser's momentum is applied after a sparse error-feedback scheme, "
                    "which then needs about twice the steps it needs coupled; call "
                    "thinwire.optim.couple(optimizer, hook_state) after building both "
                    "(docs/convergence.md)", stacklevel=3)
                return
