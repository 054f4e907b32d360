"""Couple the user's optimiser to a compressed scheme, by a rule chosen per optimiser family.

:func:`couple` applies one of :data:`RULES`. ``"momentum"`` moves SGD's
momentum (and weight decay) in front of error feedback, DGC's momentum
correction (Lin et al., ICLR 2018, §3.2; :class:`MomentumCorrection`), and
through a DDP hook's state takes each worker's gradient at ``x - lr e``
(:class:`~thinwire.optim.virtual.VirtualIterate`); under Adam it moves
``beta1`` instead and steps the scheme's parameters with
:class:`~thinwire.optim.adam.AgedAdam`. ``"none"`` leaves the optimiser as it
is. ``"auto"`` picks ``"momentum"`` for SGD with momentum and ``"none"`` for
Adam and AdamW: with nothing dropped both are then the user's optimiser, to
rounding, and they are what measured fastest (docs/convergence.md). A coupled
optimiser's param groups record what was moved (:data:`MARK`), so its
``state_dict`` loaded before or after :func:`couple` couples the same way. It
reads what it needs from the :class:`~thinwire.schemes.Scheme` contract
(``error_memory``, ``traits``).

Floor: above schemes, below the front doors (the DDP hook couples through it).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from thinwire.feedback import Estimate, Memory, MomentumCorrection
from thinwire.optim.adam import AgedAdam, look_ahead, refuses
from thinwire.optim.virtual import VirtualIterate
from thinwire.schemes.base import Scheme
from thinwire.schemes.registry import WARMUP, fingerprint, rebuild, validate_warmup

__all__ = ["ADAM_OPTIONS", "ADAM_WARMUP", "FEEDBACKS", "MARK", "RULES", "Coupling", "couple",
           "announce", "default_options", "default_rule", "default_warmup", "follow", "prepare",
           "watch"]

RULES = ("auto", "momentum", "none")
FEEDBACKS = ("auto", "ef21", "error")
# The param-group key where coupling records the settings it moved out of the optimiser.
MARK = "thinwire_coupled"


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


# Steps Adam and AdamW average dense before a compressing scheme starts (ScaleCom App. E's
# compression warm-up). On the language model at ADAM_OPTIONS, 20 steps took 1.27x dense's
# steps, 30 1.19x; 50 cost a third more bytes for no fewer steps
# (docs/record/adamw-screening.md, "How long a warm-up").
ADAM_WARMUP = 30


def default_warmup(optimizer: torch.optim.Optimizer, scheme: Scheme) -> int:
    """Steps :func:`thinwire.ddp.register` averages dense before ``scheme`` compresses:
    the scheme's own warm-up where its user chose one (``warmup_steps`` given to
    ``schemes.build``, 0 included) or it has one, else :data:`ADAM_WARMUP` under Adam and
    AdamW for a scheme built by name with error feedback (one that compresses), else 0
    (a scheme not built by name has no config to carry a warm-up)."""
    own = scheme.warmup_steps
    if own or WARMUP in scheme.given or scheme.origin is None or not (
            isinstance(optimizer, _ADAMS) and scheme.traits.memory is not None):
        return own
    return ADAM_WARMUP


# What a scheme sends under Adam and AdamW where its user chose none of these options: more
# entries at 8 bits, a byte an index. At the defaults for SGD (1 %, full-width values) the
# language model missed its target in 1,500 steps; 7 % at 8 bits reached it within 1.25x
# dense's steps and 1/10 of its bytes (docs/record/adamw-screening.md).
ADAM_OPTIONS: dict[str, dict[str, Any]] = {
    "topk": {"ratio": 0.07, "values": "int8", "indices": "delta8"},
    "topk+int8": {"ratio": 0.07, "indices": "delta8"},
    "local-topk": {"ratio": 0.07, "values": "int8"},  # its index list is a bitmap at 7 %
    # one threshold over the bucket: per layer (the papers') took 1.32x dense's steps (dct-dp)
    # or missed the target (laplace); over the bucket 1.22-1.24x. The Laplace fit alone
    # passed about 3 % of the entries: its density control holds the mean at 7 %
    "dct-dp": {"ratio": 0.07, "values": "int8", "indices": "delta8", "scope": "bucket"},
    "laplace": {"ratio": 0.07, "values": "int8", "indices": "delta8", "scope": "bucket",
                "gain": 0.05},
    # the leader's indices, values all-reduced at 16 bits, ScaleCom's low-pass filter: 1.38x
    # dense's steps at 1/8.2 of its bytes, short of both lines, but 1 % missed the target
    "clt-k": {"ratio": 0.07, "values": "fp16", "beta": 0.1},
    # rank 8: 1.32x dense's steps at 1/6.5 of its bytes, short of both lines; rank 2 (the
    # default for SGD) ended 10 % above dense's loss after 1,500 steps, not reaching it
    "powersgd": {"rank": 8},
}


def default_options(optimizer: torch.optim.Optimizer, scheme: Scheme) -> dict[str, Any]:
    """The options ``scheme`` takes under ``optimizer``'s family (:data:`ADAM_OPTIONS`):
    all of them where ``schemes.build`` was given none of them, else none (what a user
    chose is never mixed with what is chosen for them). Empty for other optimisers and for
    a scheme not built by name."""
    if not isinstance(optimizer, _ADAMS) or scheme.origin is None:
        return {}
    options = ADAM_OPTIONS.get(scheme.origin[0], {})
    return {} if scheme.given & options.keys() else dict(options)


def follow(optimizer: torch.optim.Optimizer, scheme: Scheme) -> tuple[Scheme, dict[str, Any]]:
    """``scheme`` rebuilt with :func:`default_options`, and those options; ``scheme`` itself
    and ``{}`` where there are none. Rebuilt by :func:`~thinwire.schemes.rebuild` (its state
    is not carried), so call it before the scheme has run or loaded state (``register``
    does)."""
    options = default_options(optimizer, scheme)
    if not options:
        return scheme, {}
    return rebuild(scheme, **options), options


def prepare(optimizer: torch.optim.Optimizer | None, scheme: Scheme,
            warmup: int | None) -> tuple[Scheme, dict[str, Any], int]:
    """What a front door (``thinwire.ddp.register``, ``thinwire.fsdp.register``) installs:
    ``scheme`` with the optimiser family's options (:func:`follow`) and warm-up
    (:func:`default_warmup`, unless ``warmup`` is given), the options chosen and the
    warm-up's length. A warm-up other than the scheme's own is its config's too: the
    scheme is rebuilt with it (:func:`~thinwire.schemes.rebuild`), so call this before it
    has run or loaded state.

    Raises:
        ValueError: ``warmup`` is not an integer >= 0; a warm-up for a scheme that has
            launched or loaded state (a rebuild would lose it) or that was not built by
            ``schemes.build`` (it has nothing to be rebuilt from).
    """
    chosen: dict[str, Any] = {}
    if optimizer is not None:
        scheme, chosen = follow(optimizer, scheme)
    if warmup is None:
        warmup = scheme.warmup_steps if optimizer is None else default_warmup(optimizer, scheme)
    validate_warmup(warmup)
    if warmup != scheme.warmup_steps:
        if scheme.started:
            raise ValueError("the scheme has launched or loaded state already: build it with "
                             f"{WARMUP}={warmup} (or register it before its first step and "
                             "load its state after)")
        scheme = rebuild(scheme, **{WARMUP: warmup})
    return scheme, chosen, warmup


def announce(optimizer: torch.optim.Optimizer, target: Any, chosen: Mapping[str, Any],
             warmup: int, logger: logging.Logger, *, rule: str = "auto",
             feedback: str = "auto") -> Coupling:
    """:func:`couple`, with what :func:`prepare` chose in the result's ``reason``, logged in
    one line to ``logger``."""
    coupled = couple(optimizer, target, rule=rule, feedback=feedback)
    spelled = ", ".join(f"{key}={value!r}" for key, value in chosen.items())
    coupling = dataclasses.replace(
        coupled, warmup=warmup, options=dict(chosen), reason=coupled.reason
        + (f"; the first {warmup} steps averaged dense" if warmup else "")
        + (f"; sends {spelled}, the {type(optimizer).__name__} defaults (give any to "
           "choose them yourself)" if chosen else ""))
    logger.info("%s: %s coupled by rule %r: %s", logger.name,
                fingerprint(_scheme_of(target))["scheme"], coupled.rule, coupling.reason)
    return coupling


def default_rule(optimizer: torch.optim.Optimizer) -> str:
    """The rule ``"auto"`` applies: ``"momentum"`` for SGD with momentum (or one coupled
    before, :data:`MARK`), else ``"none"`` (Adam and AdamW take the scheme's mean as it is)."""
    if _marked(optimizer) or (isinstance(optimizer, torch.optim.SGD)
                              and any(group["momentum"] for group in optimizer.param_groups)):
        return "momentum"
    return "none"


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
    scheme = _scheme_of(target)
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} must be one of {RULES}")
    if feedback not in FEEDBACKS:
        raise ValueError(f"feedback={feedback!r} must be one of {FEEDBACKS}")
    if feedback == "ef21" and not scheme.traits.shared_indices:
        raise ValueError(f"feedback='ef21' is for clt-k, not {_name(scheme)}: the "
                         "local sparsifiers were slower with it (docs/convergence.md)")
    _DECIDED.add(scheme)
    marked = _marked(optimizer)
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
    if not isinstance(optimizer, (torch.optim.SGD, *_ADAMS)):
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
    adam = isinstance(optimizer, _ADAMS)
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
    if isinstance(optimizer, _ADAMS):
        return ("Adam and AdamW step with the scheme's mean as it is: the user's optimiser "
                "with nothing dropped, and the fastest rule measured under Adam "
                "(docs/convergence.md)")
    return f"{type(optimizer).__name__} applies no momentum to move"


def _scheme_of(target: Any) -> Scheme:
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


# (momentum, dampening, nesterov, weight decay by param-group index)
Settings = tuple[float, float, bool, tuple[float, ...]]


def _settings(optimizer: torch.optim.Optimizer) -> Settings:
    """The optimiser's momentum settings, the same in every group (Adam's beta1 reads as a
    momentum, :func:`_momentum`), and each group's weight decay.

    Raises:
        ValueError: param groups with different ``(momentum, dampening, nesterov)``.
    """
    every = sorted({_momentum(optimizer, group) for group in optimizer.param_groups})
    if len(every) > 1:
        raise ValueError(f"param groups use different (momentum, dampening, nesterov) "
                         f"{every}; couple needs one setting for all groups")
    momentum, dampening, nesterov = every[0] if every else (0.0, 0.0, False)
    decays = tuple(float(group.get("weight_decay", 0.0)) for group in optimizer.param_groups)
    return momentum, dampening, nesterov, decays


def _marked(optimizer: torch.optim.Optimizer) -> Settings | None:
    """The settings an earlier coupling recorded in the param groups (:data:`MARK`), if any."""
    marks = [group.get(MARK) for group in optimizer.param_groups]
    if not any(marks):
        return None
    first = marks[0] or {}
    return (float(first["momentum"]), float(first["dampening"]), bool(first["nesterov"]),
            tuple(float((mark or {}).get("weight_decay", 0.0)) for mark in marks))


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
    adam = isinstance(optimizer, _ADAMS)
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
_DECIDED: weakref.WeakSet[Scheme] = weakref.WeakSet()  # schemes couple() has seen
_HOOK: list[Any] = []


def watch(scheme: Scheme, parameters: Iterable[torch.nn.Parameter]) -> None:
    """Warn once if SGD with momentum steps ``parameters`` while ``scheme`` is uncoupled.

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
    """Before a step: raise if a coupled momentum is applied twice; warn once if SGD's
    momentum skips a sparse scheme that :func:`couple` never saw.

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
            if (memory is not None and scheme not in _DECIDED
                    and default_rule(optimizer) == "momentum"):
                for key in [k for k, ref in _WATCHED.items() if ref() is scheme]:
                    del _WATCHED[key]  # once per scheme
                warnings.warn(
                    "SGD's momentum is applied after a sparse error-feedback scheme, which "
                    "then needs about twice the steps it needs coupled; pass optimizer= to "
                    "thinwire.ddp.register, or call thinwire.optim.couple(optimizer, "
                    "hook_state) after building both (docs/convergence.md)", stacklevel=3)
                return
