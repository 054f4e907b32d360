"""Couple the user's optimiser to a compressed scheme, by a rule chosen per optimiser family.

:func:`couple` applies one of :data:`RULES`. ``"momentum"`` moves SGD's
momentum (and weight decay) in front of error feedback, DGC's momentum
correction (Lin et al., ICLR 2018, §3.2; :class:`MomentumCorrection`), and
through a DDP hook's state takes each worker's gradient at ``x - lr e``
(:class:`~thinwire.optim.virtual.VirtualIterate`); under Adam it moves
``beta1`` instead and steps the scheme's parameters with
:class:`~thinwire.optim.adam.AgedAdam`. ``"none"`` leaves the optimiser as it
is. ``"auto"`` picks ``"momentum"`` for SGD with momentum and ``"none"`` for
Adam and AdamW (docs/convergence.md). It reads what it needs from the
:class:`~thinwire.schemes.Scheme` contract (``error_memory``, ``traits``).

Floor: with :mod:`thinwire.optim`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from thinwire.feedback import Estimate, Memory, MomentumCorrection
from thinwire.optim._family import ADAMS, MARK, Settings, default_rule, marked_settings, momentum_of
from thinwire.optim.adam import AgedAdam, look_ahead, refuses
from thinwire.optim.step_check import seen
from thinwire.optim.virtual import VirtualIterate
from thinwire.schemes.base import Scheme

RULES = ("auto", "momentum", "none")


FEEDBACKS = ("auto", "ef21", "error")


@dataclass(frozen=True)
class Coupling:
    """What :func:`couple` did."""

    rule: str  # the rule applied: "momentum" or "none"
    coupled: bool  # True when the momentum moved into the scheme
    momentum: float  # the optimiser's momentum (Adam: beta1) before coupling
    nesterov: bool  # the optimiser's Nesterov flag before coupling
    reason: str  # why, in a sentence
    virtual: VirtualIterate | None = None  # gradients at x - lr e (its remove() undoes it)
    adam: AgedAdam | None = None  # Adam's step for the scheme's parameters (remove() too)
    warmup: int = 0  # steps the scheme averages dense first (register's choice)
    options: Mapping[str, Any] = field(default_factory=dict)  # scheme options register chose


def couple(optimizer: torch.optim.Optimizer, target: Any, *, rule: str = "auto",
           feedback: str = "auto", virtual: bool = True) -> Coupling:
    """Couple ``optimizer`` to ``target``'s scheme by ``rule``.

    Args:
        optimizer: the user's optimiser, built as usual (its state may be loaded
            already: an earlier coupling's settings are read back from :data:`MARK`).
        target: the scheme, or the state :func:`thinwire.ddp.register` returned.
        rule: one of :data:`RULES` (``"auto"``: :func:`default_rule`).
        feedback: under ``"momentum"``, what CLT-k's velocity goes into: ``"ef21"``,
            EF21 (:class:`Estimate`); ``"error"``, its own error feedback; ``"auto"``,
            its own where the virtual iterate is installed, else EF21 (what measured
            fastest, docs/convergence.md). The other sparsifiers use their own.
        virtual: under ``"momentum"`` through a DDP hook's state: each worker computes its
            gradient at ``x - lr * e``, its weights with its pending error applied
            (:class:`VirtualIterate`); under Adam scaled as Adam's step, which
            :class:`AgedAdam` then takes (not for ``amsgrad``, ``maximize`` or Adam's L2
            ``weight_decay``: :func:`thinwire.optim.adam.refuses`).

    Returns:
        What was done. Side effects under ``"momentum"``: every param group's
        ``momentum``, ``dampening``, ``nesterov`` and ``weight_decay`` (Adam:
        ``betas[0]``) are set to 0/False and recorded under :data:`MARK`; the scheme's
        memory is wrapped in :class:`MomentumCorrection`, which adds SGD's decay to each
        worker's gradient before its velocity, as ``torch.optim.SGD`` does.

    Raises:
        ValueError: an unknown ``rule`` or ``feedback``; param groups with different
            momentum settings; ``"none"`` for an optimiser whose state was saved coupled;
            ``"momentum"`` with SGD weight decay and a bare scheme (its parameters are
            unknown: pass the hook state).
        TypeError: ``target`` is neither a scheme nor a hook state.
    """
    scheme = scheme_of(target)
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} must be one of {RULES}")
    if feedback not in FEEDBACKS:
        raise ValueError(f"feedback={feedback!r} must be one of {FEEDBACKS}")
    if feedback == "ef21" and not scheme.traits.shared_indices:
        raise ValueError(f"feedback='ef21' is for clt-k, not {_name(scheme)}: the "
                         "local sparsifiers were slower with it (docs/convergence.md)")
    seen(scheme)
    marked = marked_settings(optimizer)
    settings = marked or _settings(optimizer)
    momentum, _, nesterov, _ = settings
    memory = scheme.error_memory
    if isinstance(memory, MomentumCorrection):
        return Coupling("momentum", True, memory.momentum, memory.nesterov, "already coupled")
    chosen = default_rule(optimizer) if rule == "auto" else rule
    if chosen == "none":
        if marked:
            raise ValueError(f"the optimiser's state was saved coupled ({MARK}: {marked}): its "
                             "momentum lives in the scheme's state; couple with rule='momentum' "
                             "or 'auto', or load a state saved without coupling")
        return Coupling("none", False, momentum, nesterov, _why_none(optimizer, rule))
    if not isinstance(optimizer, (torch.optim.SGD, *ADAMS)):
        return Coupling("none", False, momentum, nesterov, f"{type(optimizer).__name__} is "
                        "not SGD, Adam or AdamW: any momentum of its own stays in it")
    if any(group.get("maximize") for group in optimizer.param_groups):
        return Coupling("none", False, momentum, nesterov, "maximize=True: the momentum "
                        "stays in the optimiser, which negates the gradient first")
    if momentum == 0.0:
        return Coupling("none", False, momentum, nesterov, "the optimiser applies no momentum")
    if memory is None:
        return Coupling("none", False, momentum, nesterov,
                        "the scheme does not sparsify with feedback")
    adam = isinstance(optimizer, ADAMS)
    decay = {} if adam else _decay(optimizer, target, settings)
    module = getattr(target, "module", None)
    refusal = refuses(optimizer) if adam else ""
    wanted = virtual and not refusal
    ahead = wanted and module is not None
    coupled = _wrap_memory(scheme, memory, settings,
                          "error" if feedback == "auto" and ahead else feedback,
                          float(optimizer.param_groups[0]["betas"][1]) if adam else None,
                          wanted and ahead, decay)
    if not marked:
        _warn_if_momentum_held(optimizer)
    reason = _take_momentum(optimizer, settings)
    pending = wanted and not isinstance(coupled.inner, Estimate)  # EF21 steps with all it has
    if not (pending and ahead):
        if refusal:
            reason += f"; gradients stay at x and the optimiser steps as Adam: {refusal}"
        elif pending:
            reason += ("; gradients stay at x: pass the state thinwire.ddp.register returned "
                       "for gradients at x - lr e")
        return Coupling("momentum", True, momentum, nesterov, reason)
    moved, stepped = _install_virtual(optimizer, target, scheme, coupled)
    return Coupling("momentum", True, momentum, nesterov, reason, moved, stepped)


def _warn_if_momentum_held(optimizer: torch.optim.Optimizer) -> None:
    """Warn when the optimiser's loaded state holds a momentum of its own (saved without
    coupling): the coupled velocity starts from zero in each worker instead."""
    held = [key for state in optimizer.state.values() for key in ("momentum_buffer", "exp_avg")
            if state.get(key) is not None]
    if held:
        warnings.warn(
            f"the optimiser's state holds {held[0]} (saved without thinwire's coupling); "
            "coupling moves the momentum into each worker's velocity, which starts from "
            "zero: the saved buffer is not used", stacklevel=3)


def _why_none(optimizer: torch.optim.Optimizer, rule: str) -> str:
    if rule == "none":
        return "rule='none' asked for: the optimiser steps with the scheme's mean as it is"
    if isinstance(optimizer, ADAMS):
        return ("Adam and AdamW step with the scheme's mean as it is: the user's optimiser "
                "with nothing dropped, and the fastest rule measured under Adam "
                "(docs/convergence.md)")
    return f"{type(optimizer).__name__} applies no momentum to move"


def scheme_of(target: Any) -> Scheme:
    """The scheme of ``target``, a scheme or a front door's hook state.

    Raises:
        TypeError: ``target`` is neither.
    """
    scheme = getattr(target, "scheme", target)  # a ddp.HookState or a Scheme
    if not isinstance(scheme, Scheme):
        raise TypeError(f"expected a Scheme or a thinwire.ddp hook state, got {type(target)}")
    return scheme


def _name(scheme: Scheme) -> str:
    return scheme.origin[0] if scheme.origin else type(scheme).__name__


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


def _settings(optimizer: torch.optim.Optimizer) -> Settings:
    """The optimiser's momentum settings, the same in every group (Adam's beta1 reads as a
    momentum, :func:`~thinwire.optim._family.momentum_of`), and each group's weight decay.

    Raises:
        ValueError: param groups with different ``(momentum, dampening, nesterov)``.
    """
    every = sorted({momentum_of(optimizer, group) for group in optimizer.param_groups})
    if len(every) > 1:
        raise ValueError(f"param groups use different (momentum, dampening, nesterov) "
                         f"{every}; couple needs one setting for all groups")
    momentum, dampening, nesterov = every[0] if every else (0.0, 0.0, False)
    decays = tuple(float(group.get("weight_decay", 0.0)) for group in optimizer.param_groups)
    return momentum, dampening, nesterov, decays


def _decay(optimizer: torch.optim.Optimizer, target: Any,
           settings: Settings) -> dict[str, tuple[torch.Tensor, float]]:
    """SGD's weight decay by key (``name -> (parameter, decay)``), for the velocity.

    Raises:
        ValueError: a group decays but ``target`` names no parameters (a bare scheme).
    """
    names: dict[int, str] = getattr(target, "names", {})
    decays = settings[3]
    if any(decays) and not names:
        raise ValueError("SGD's weight_decay enters each worker's velocity, which needs the "
                         "parameters' names: pass the state thinwire.ddp.register returned, "
                         "not the bare scheme")
    return {names[id(p)]: (p, decay) for group, decay in zip(optimizer.param_groups, decays)
            for p in group["params"] if decay and id(p) in names}


def _wrap_memory(scheme: Scheme, memory: Memory, settings: Settings, feedback: str,
                beta2: float | None, ahead: bool,
                decay: dict[str, tuple[torch.Tensor, float]]) -> MomentumCorrection:
    """Wrap ``scheme``'s error memory in momentum correction and put it in its place.

    Args:
        feedback: ``"error"``, ``"ef21"`` or ``"auto"`` (as :func:`couple` resolved it).
        beta2: Adam's second-moment decay, for the look-ahead of the virtual iterate.
        ahead: whether gradients will be taken at the virtual iterate.
        decay: SGD's weight decay by key, added to each worker's gradient.
    """
    momentum, dampening, nesterov, _ = settings
    inner = _feedback(scheme, memory, feedback)
    pending = ahead and not isinstance(inner, Estimate)
    coupled = MomentumCorrection(inner, momentum, dampening, nesterov,
                                 beta2 if pending else None, decay)
    scheme.couple_memory(coupled)
    return coupled


def _take_momentum(optimizer: torch.optim.Optimizer, settings: Settings) -> str:
    """Set the optimiser's momentum (Adam: ``betas[0]``) and SGD's weight decay to 0, each
    group recording what it had under :data:`MARK`. Returns what was done, in words."""
    momentum, dampening, nesterov, decays = settings
    adam = isinstance(optimizer, ADAMS)
    for group, decay in zip(optimizer.param_groups, decays):
        group[MARK] = {"momentum": momentum, "dampening": dampening, "nesterov": nesterov,
                       "weight_decay": 0.0 if adam else decay}
        if adam:
            group["betas"] = (0.0, group["betas"][1])
        else:
            group.update(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0)
    reason = "momentum moved into the scheme's memory"
    if not adam and any(decays):
        reason += ", weight decay with it (added to each worker's gradient)"
    return reason


def _install_virtual(optimizer: torch.optim.Optimizer, target: Any, scheme: Scheme,
                    coupled: MomentumCorrection) -> tuple[VirtualIterate, AgedAdam | None]:
    """Gradients at ``x - lr e`` (:class:`VirtualIterate`) through ``target``, a DDP hook's
    state; under Adam, :class:`AgedAdam` steps the scheme's parameters."""
    adam = isinstance(optimizer, ADAMS)
    names = target.names
    moved = VirtualIterate(optimizer, target.module, names, coupled,
                           look_ahead(coupled) if adam else None)
    stepped = (AgedAdam(optimizer, names, coupled, _mean_wait(scheme))  # after moved: from x
               if adam else None)
    return moved, stepped


def _mean_wait(scheme: Scheme) -> int:
    """Steps an entry waits on average at the scheme's density, ``1 / density``."""
    density = scheme.traits.density
    return max(1, round(1 / density)) if density else 1
