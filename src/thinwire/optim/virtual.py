"""Gradients at the virtual iterate: each worker looks past the error it still holds.

Convergence proofs of error feedback follow a virtual sequence
``x~ = x - lr * mean_i(e_i)`` (ScaleCom App. D.1, Eq. A17), the weights once
every pending entry is sent. Each worker takes its gradient at its own
estimate of that point, ``x - lr * e_i`` (the mean is not known locally; the
workers' errors are alike where their gradients are): our choice, not a
paper's. Before a training forward the parameters are moved there and before
the optimiser's step put back bit for bit, so the step applies to ``x`` and
replicas stay identical. The moved point lives in a spare buffer whose
storage the parameter borrows until the step, so ``x`` is never copied.
Measured effect: docs/notes/engine.md.

Floor: with :mod:`thinwire.optim`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from thinwire.feedback import Memory

# (name, pending error, its param group) -> the move per unit lr, or None for no move
Move = Callable[[str, torch.Tensor, dict[str, Any]], "torch.Tensor | None"]


class VirtualIterate:
    """Move ``module``'s parameters to ``x - lr * e`` before each training forward.

    The parameters stay there through the backward pass (the scheme's hook
    reads gradients taken there) and are restored, bit for bit, before
    ``optimizer`` steps. Only a forward with gradients enabled on a module
    in training mode moves them, and only once until the next step (several
    forwards of gradient accumulation share one point); evaluation under
    ``torch.no_grad`` or ``eval()`` sees ``x``. Between a training forward
    and the step the parameters hold ``x - lr * e``, in a spare storage of
    their own (``data_ptr`` differs): a checkpoint taken there saves that
    point, and code that keeps a view of a parameter's storage sees ``x``.
    From the step on each parameter has its own storage back.

    Args:
        optimizer: the user's SGD optimiser (the ``lr`` of each parameter's group is
            read at each forward, so schedulers act).
        module: the model whose forward computes the gradients (DDP's ``module``).
        names: ``id(parameter) -> name``, the keys of ``memory``'s buffers.
        memory: the scheme's error feedback; its ``buffers`` (name -> the worker's
            pending error ``e``) are read at each forward, never written.
        move: where ``e`` takes the weights per unit lr under another optimiser than
            SGD (Adam: :func:`thinwire.optim.adam.look_ahead`); default ``e`` itself.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                 names: Mapping[int, str], memory: Memory, move: Move | None = None) -> None:
        self.optimizer = optimizer
        self.names = dict(names)
        self.memory = memory
        self.move = move
        self.kept: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, parameter, x)
        self._spare: dict[str, torch.Tensor] = {}  # name -> a buffer for the moved point
        self.moved = False
        self.handles = [module.register_forward_pre_hook(self._move),
                        optimizer.register_step_pre_hook(self._restore)]

    def _move(self, module: torch.nn.Module, args: Any) -> None:
        if self.moved or not module.training or not torch.is_grad_enabled():
            return
        errors = self.memory.buffers  # read now: loading a state replaces the dict
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for parameter in group["params"]:
                    name = self.names.get(id(parameter), "")
                    error = errors.get(name)
                    if error is not None and self.move is not None:
                        error = self.move(name, error, group)
                    if error is None:  # sent dense, or no step yet: nothing pending
                        continue
                    spare = self._spare.pop(name, None)
                    if (spare is None or spare.shape != parameter.shape
                            or spare.dtype != parameter.dtype
                            or spare.device != parameter.device):
                        spare = torch.empty_like(parameter)
                    # The same kernel as parameter.sub_(...): the same bits, in one pass.
                    torch.sub(parameter, error.view(parameter.shape).to(parameter.dtype),
                              alpha=group["lr"], out=spare)
                    self.kept.append((name, parameter, parameter.data))
                    parameter.data = spare
        self.moved = True

    def _restore(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.restore()

    def restore(self) -> None:
        """Put the parameters back at ``x`` (a no-op when they are there)."""
        for name, parameter, x in self.kept:  # x's own storage back: nothing copied
            self._spare[name] = parameter.data
            parameter.data = x
        self.kept = []
        self.moved = False

    def remove(self) -> None:
        """Restore the parameters and take both hooks off."""
        self.restore()
        for handle in self.handles:
            handle.remove()
