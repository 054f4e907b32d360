"""Couple the user's optimiser to a sparse scheme: its momentum moves into the workers.

Error-feedback sparsification releases what it held back in delayed
bursts, and ``torch.optim.SGD``'s momentum, applied after the all-reduce,
carries each burst on for ``1 / (1 - mu)`` steps more; measured, 99 %-sparse
topk and dct-dp then need 2.5-3.3x dense's steps (``docs/convergence.md``).
:func:`couple` moves the momentum in front of error feedback (DGC's
momentum correction, :class:`MomentumCorrection`), which brings them to
1.3-1.5x (docs/convergence.md):

    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = thinwire.ddp.register(net, thinwire.schemes.build("topk"))
    thinwire.optim.couple(optimizer, state)

Afterwards the optimiser runs with momentum 0 and the scheme's memory keeps
each worker's velocity (it travels in the scheme's ``state_dict``).
``Adam``/``AdamW`` are coupled the same way with their first moment: the
workers keep ``m <- beta1 m + beta1 g`` (started at the first ``g``), which
settles at ``beta1 / (1 - beta1)`` times Adam's own first moment, and the
optimiser's ``betas`` become ``(0, beta2)``. The burst-aware step does not
see that scale; the look-ahead does, and with Adam's own scale it needed
1.25-2.25x dense's steps on the transformer against 1.00-1.25x
(docs/convergence.md, "The first moment's scale").

Through a DDP hook's state, each worker also takes its gradients at
``x - lr * e``, its weights with its pending error applied
(:class:`~thinwire.optim.virtual.VirtualIterate`, ``virtual=True``). Under
Adam/AdamW the move is Adam's, ``lr e / (sqrt(s_hat) + eps)`` with the
worker's own second moment, and Adam's step for the scheme's parameters is
taken by :class:`~thinwire.optim.adam.AgedAdam`, whose second moment counts
a burst that waited ``a`` steps as ``a`` steps of its mean. Together they
brought topk, dct-dp and clt-k to about dense's steps on every workload of
docs/convergence.md (SGD on three, AdamW on the transformer).

CLT-k is coupled the same way; where the virtual iterate is not installed
(a bare scheme, Adam with ``amsgrad``) its workers' velocity goes into EF21
(:class:`~thinwire.feedback.Estimate`) instead of plain error feedback:
every rank steps with a dense estimate of the mean velocity that each
step's shared indices refresh (see :func:`_feedback` for why).

Schemes without sparsification (dense, fp16, PowerSGD) and optimisers
without momentum are left exactly as they were, so ``couple`` is safe to
call always. Call it right after building both, before the first step and
before loading checkpoints. The momentum then stays fixed: a scheduler that
cycles it (``OneCycleLR``, ``CyclicLR``) would set the optimiser's momentum
back and apply it twice, so the next step raises ``RuntimeError`` (build
those with ``cycle_momentum=False``). Optimisers other than SGD, Adam and
AdamW are left as they are.
SGD's ``weight_decay`` stays in the optimiser, where it no longer passes
through the momentum, whose steady-state gain ``(1 - dampening) / (1 - mu)``
(10 at 0.9) it had there; ``couple`` multiplies each group's
``weight_decay`` by that gain, so the decay per step is plain SGD's once its
velocity has settled (our choice: DGC adds the decay to each worker's
gradient before its momentum, which costs a pass over the weights and delays
the decay of unsent entries with the error memory).

Forgetting it: training is still correct, only slower. The first
``step()`` of a momentum optimiser over parameters whose DDP hook runs an
uncoupled sparse scheme warns once (see :func:`watch`).

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

from thinwire.compress import Sparsifier
from thinwire.feedback import Estimate, Memory, MomentumCorrection
from thinwire.optim.adam import AgedAdam, look_ahead, refuses
from thinwire.optim.virtual import VirtualIterate
from thinwire.schemes.base import CompressedScheme, Scheme
from thinwire.schemes.scalecom import CyclicLocalTopK, LocalTopK


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
    """The error-feedback memory of a scheme that :func:`couple` couples, else None.

    Those are the sparsifiers: topk, dct-dp, laplace, local-topk and clt-k.
    """
    if isinstance(scheme, CompressedScheme) and isinstance(scheme.compressor, Sparsifier):
        return scheme.memory
    if isinstance(scheme, (LocalTopK, CyclicLocalTopK)):
        return scheme.memory
    return None


FEEDBACKS = ("auto", "ef21", "error")


def _feedback(scheme: Scheme, memory: Memory, feedback: str) -> Memory:
    """The memory the velocity goes into: the scheme's own, or EF21 for CLT-k.

    CLT-k's shared index set refreshes one k-th of each layer per step; with
    plain error feedback the rest waits, and momentum correction alone did
    not help (3.7x -> 3.9x dense's steps). Stepping with a dense estimate of
    the mean velocity refreshed at those indices (:class:`Estimate`, EF21)
    brought it to 2.9x. With gradients at the virtual iterate, plain error
    feedback was faster than EF21 on every workload measured (1.0-1.2x), so
    :func:`couple` asks for EF21 only where that is not installed
    (docs/convergence.md).

    Raises:
        ValueError: CLT-k's memory already holds state (couple before training).
    """
    if not isinstance(scheme, CyclicLocalTopK) or feedback == "error":
        return memory
    if memory.buffers:
        raise ValueError("clt-k has already run a step: call thinwire.optim.couple before "
                         "the first step (or before loading a coupled checkpoint)")
    return Estimate()


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
    if feedback == "ef21" and not isinstance(scheme, CyclicLocalTopK):
        raise ValueError(f"feedback='ef21' is for clt-k, not {type(scheme).__name__}: the "
                         "local sparsifiers were slower with it (docs/convergence.md)")
    groups = optimizer.param_groups
    settings = {_momentum(optimizer, group) for group in groups}
    momentum, dampening, nesterov = next(iter(settings)) if settings else (0.0, 0.0, False)
    memory = sparse_memory(scheme)
    if isinstance(memory, MomentumCorrection):
        return Coupling(True, memory.momentum, memory.nesterov, "already coupled")
    if not isinstance(optimizer, (torch.optim.SGD, *_ADAMS)):
        return Coupling(False, momentum, nesterov, f"{type(optimizer).__name__} is not SGD, "
                        "Adam or AdamW: any momentum of its own stays in the optimiser")
    if momentum == 0.0:
        return Coupling(False, momentum, nesterov, "the optimiser applies no momentum")
    if len(settings) > 1:
        raise ValueError(f"param groups use different (momentum, dampening, nesterov) "
                         f"{sorted(settings)}; couple needs one setting for all groups")
    if memory is None:
        return Coupling(False, momentum, nesterov, "the scheme does not sparsify with feedback")
    module = getattr(target, "module", None)
    adam = isinstance(optimizer, _ADAMS)
    refusal = refuses(optimizer) if adam else ""
    wanted = virtual and not refusal
    ahead = wanted and module is not None
    inner = _feedback(scheme, memory, "error" if feedback == "auto" and ahead else feedback)
    pending = wanted and not isinstance(inner, Estimate)  # EF21 steps with all it has
    beta2 = float(groups[0]["betas"][1]) if adam and pending and ahead else None
    coupled = MomentumCorrection(inner, momentum, dampening, nesterov, beta2)
    scheme.memory = coupled  # type: ignore[attr-defined]
    gain = (1.0 - dampening) / (1.0 - momentum)  # SGD momentum's, in the steady state
    for group in groups:
        if adam:
            group["betas"] = (0.0, group["betas"][1])
        else:  # the decay no longer goes through the momentum: it gets the gain here
            group.update(momentum=0.0, dampening=0.0, nesterov=False,
                         weight_decay=group["weight_decay"] * gain)
    reason = "momentum moved into the scheme's memory"
    if not adam and any(group["weight_decay"] for group in groups):
        reason += f"; weight_decay multiplied by the momentum's gain {gain:g}"
    if not (pending and ahead):
        if refusal:
            reason += f"; gradients stay at x and the optimiser steps as Adam: {refusal}"
        elif pending:
            reason += ("; gradients stay at x: pass the state thinwire.ddp.register returned "
                       "for gradients at x - lr e")
        return Coupling(True, momentum, nesterov, reason)
    names = target.names
    moved = VirtualIterate(optimizer, module, names, coupled,  # type: ignore[arg-type]
                           look_ahead(coupled) if adam else None)
    stepped = (AgedAdam(optimizer, names, coupled, _mean_wait(scheme))  # after moved: from x
               if adam else None)
    return Coupling(True, momentum, nesterov, reason, moved, stepped)


_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def _mean_wait(scheme: Scheme) -> int:
    """Steps an entry waits on average at the scheme's density, ``1 / density``."""
    if isinstance(scheme, CompressedScheme) and isinstance(scheme.compressor, Sparsifier):
        density = scheme.compressor.density
    else:  # CLT-k and local top-k keep a ratio of each layer
        density = float(getattr(scheme, "ratio", 0.01))
    return max(1, round(1 / density))


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
    if sparse_memory(scheme) is None:
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
            memory = None if scheme is None else sparse_memory(scheme)
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
