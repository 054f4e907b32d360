"""The step check: warn once when SGD's momentum steps past an uncoupled sparse scheme, and
refuse a coupled momentum applied twice.

:func:`thinwire.ddp.register` and :func:`thinwire.fsdp.register` :func:`watch` the
scheme and the parameters it averages; a check before every optimiser step looks them up.

Why a process-wide hook remains: the check is for the script that registered without
``optimizer=``, so thinwire never holds the optimiser and cannot hook that instance
(``Optimizer.register_step_pre_hook``); torch's global step pre-hook
(``register_optimizer_step_pre_hook``) is the one place every optimiser's step passes.
It is installed once per process, looks only at parameters :func:`watch` was given (by
id, their schemes held weakly, so a dropped scheme is forgotten) and costs a dict look-up
per parameter of a group with momentum.

Floor: with :mod:`thinwire.optim`.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from thinwire.feedback import MomentumCorrection
from thinwire.optim._family import default_rule, momentum_of
from thinwire.schemes.base import Scheme

# Schemes registered on a DDP model, by parameter: the step pre-hook below looks them up.
_WATCHED: dict[int, weakref.ReferenceType[Scheme]] = {}
_DECIDED: weakref.WeakSet[Scheme] = weakref.WeakSet()  # schemes couple() has seen
_HOOK: list[Any] = []  # the handle of the global hook, once installed


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
    momentum skips a sparse scheme that :func:`~thinwire.optim.couple` never saw.

    Raises:
        RuntimeError: a coupled scheme's parameters are stepped with momentum
            again (a scheduler that cycles momentum, or an optimiser state
            saved before coupling, set it back after :func:`couple`); nothing
            has been stepped yet.
    """
    for group in optimizer.param_groups:
        momentum = momentum_of(optimizer, group)[0]
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


def seen(scheme: Scheme) -> None:
    """Record that :func:`~thinwire.optim.couple` decided for ``scheme`` (coupled or not):
    the check no longer warns about it."""
    _DECIDED.add(scheme)
