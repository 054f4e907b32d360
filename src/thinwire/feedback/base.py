"""The error-feedback contract and the non-finite gradient policy."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

NONFINITE_POLICIES = ("raise", "skip")


class Memory(ABC):
    """Error-feedback memory: owns one buffer per key (never ``p.grad``).

    A round is ``p = compensate(key, grad)``, compress and send ``p`` as
    ``sent``, then ``update(key, p, sent)``.
    """

    rule = "error"  # the update rule's name, as a scheme's traits report it
    # True when ``update(key, p, p)`` leaves no error behind (the next compensate adds
    # nothing), so a tensor sent whole and exactly need not be recorded at all.
    forgets_what_is_sent = False

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad + e`` as a new tensor; ``grad`` is not modified."""
        error = self.buffers.get(key)
        return grad.clone() if error is None else grad + error

    def compensate_(self, key: str, target: torch.Tensor) -> torch.Tensor:
        """Add ``key``'s error into ``target`` in place (bit for bit :meth:`compensate`).

        Args:
            target: the gradient, modified in place; any shape of the key's numel.

        Returns:
            ``target``.
        """
        error = self.buffers.get(key)
        if error is not None:
            target.add_(error.view(target.shape))
        return target

    def advance_(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Begin a round for every tensor of ``grads`` at once (not modified).

        Called before their :meth:`compensate_` / :meth:`absorb_` by engines
        that hold a whole round; here nothing.
        :class:`~thinwire.feedback.MomentumCorrection` advances every
        velocity in two batched ops instead of two per tensor.
        """
        return None

    def compensate_all_(self, targets: Mapping[str, torch.Tensor]) -> None:
        """:meth:`compensate_` for every key of ``targets``, batched where a memory can."""
        for key, target in targets.items():
            self.compensate_(key, target)

    def absorb_(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``p = grad + e`` in a tensor the memory may own and reuse (here: a new one).

        Hand the result to :meth:`update` / :meth:`update_sparse` as ``compensated``.
        """
        return self.compensate(key, grad)

    def holds(self, key: str, grad: torch.Tensor) -> bool:
        """Whether :meth:`absorb_part_` can take parts of ``key``'s gradient ``grad``.

        It can once the memory owns in-place state of ``grad``'s size and
        dtype for the key (from an earlier round); here never.
        """
        return False

    def absorb_part_(self, key: str, grad: torch.Tensor, start: int) -> torch.Tensor:
        """:meth:`absorb_` for entries ``[start, start + grad.numel())`` of ``key``'s flat tensor.

        Bit for bit what :meth:`absorb_` does to those entries (elementwise ops
        do not depend on the rest), so a tensor may be absorbed part by part
        and sent while the rest waits. Only when :meth:`holds` is true.

        Returns:
            The key's whole flat ``p`` buffer (the other parts as they stand);
            hand it to :meth:`update_selected_` / :meth:`update_sparse` once
            every part is absorbed.
        """
        raise NotImplementedError(f"{type(self).__name__} does not absorb parts")

    @property
    def absorbs_regions(self) -> bool:
        """Whether :meth:`absorb_region_` and :meth:`update_region_` serve (here not: an
        engine absorbs key by key)."""
        return False

    def absorb_region_(self, keys: Sequence[str], numels: Sequence[int],
                       grads: torch.Tensor) -> torch.Tensor:
        """:meth:`absorb_` of every key at once, their gradients back to back in the 1-D
        ``grads`` (not modified): one flat ``p`` of them all, which the keys' buffers
        view, for :meth:`update_region_`. Only where :attr:`absorbs_regions`."""
        raise NotImplementedError(f"{type(self).__name__} does not absorb regions")

    def update_region_(self, keys: Sequence[str], p: torch.Tensor, indices: torch.Tensor,
                       sent: torch.Tensor | None) -> None:
        """:meth:`update_sparse` (``sent`` None: :meth:`update_selected_`) of every key at
        once, on :meth:`absorb_region_`'s ``p`` and indices into it."""
        raise NotImplementedError(f"{type(self).__name__} does not absorb regions")

    @abstractmethod
    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Store what ``sent`` left out of ``compensated``."""

    def update_sparse(self, key: str, compensated: torch.Tensor, indices: torch.Tensor,
                      sent: torch.Tensor) -> None:
        """:meth:`update` where ``sent`` is ``sent`` at ``indices`` of a 1-D ``compensated``
        and zero elsewhere. Subclasses avoid building that dense tensor."""
        dense = torch.zeros_like(compensated)
        dense[indices] = sent.to(compensated.dtype)
        self.update(key, compensated, dense)

    def update_selected_(self, key: str, compensated: torch.Tensor,
                         indices: torch.Tensor) -> None:
        """:meth:`update` with ``sent = compensated`` at ``indices`` of its flat view, else 0.

        ``compensated`` may be a view of a DDP bucket and is not modified. Here
        ``sent`` is built at full size; :class:`~thinwire.feedback.LowPass`
        updates its buffer in place instead.
        """
        flat = compensated.reshape(-1)
        sent = torch.zeros_like(flat)
        sent[indices] = flat[indices]
        self.update(key, compensated, sent.view(compensated.shape))

    def settle(self, key: str, mean: torch.Tensor) -> torch.Tensor:
        """What the optimiser steps with, given the mean over ranks of what was sent.

        Here: ``mean`` itself. :class:`~thinwire.feedback.Estimate` adds it to
        a dense estimate every rank keeps alike.
        """
        return mean

    def settle_(self, key: str, mean: torch.Tensor) -> None:
        """:meth:`settle` in place: ``mean`` (a view of a bucket is fine) becomes what the
        optimiser steps with. This default copies what :meth:`settle` returns, if another
        tensor; :class:`~thinwire.feedback.Estimate` works without the copy."""
        settled = self.settle(key, mean)
        if settled is not mean:
            mean.copy_(settled.view(mean.shape))

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": {k: v.clone() for k, v in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = {k: v.clone() for k, v in state["buffers"].items()}


def check_policy(policy: str) -> str:
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={policy!r} must be one of {NONFINITE_POLICIES}")
    return policy


def all_finite(grads: Mapping[str, torch.Tensor], policy: str,
               flat: torch.Tensor | None = None) -> bool:
    """Apply the non-finite policy to one round of gradients.

    A sum is finite unless an entry is not (or the sum overflows), so one
    reduction decides the common case; the per-tensor check, which names the
    bad tensor, runs only when that sum is not finite.

    Args:
        grads: the round's gradients by name.
        policy: one of :data:`NONFINITE_POLICIES`.
        flat: all of ``grads`` in one buffer (a DDP bucket), if there is one:
            then the fast check is one reduction over it.

    Returns:
        True when every gradient is finite. False under ``"skip"`` when one is
        not: the caller then sends a zero contribution and leaves its memory
        untouched, so collectives stay in step across ranks.

    Raises:
        FloatingPointError: under ``"raise"``, naming the first bad tensor.
    """
    if flat is not None:
        total = flat.sum(dtype=torch.float32)
    elif grads:
        total = torch.stack([t.sum(dtype=torch.float32) for t in grads.values()]).sum()
    else:
        return True
    if math.isfinite(total.item()):  # one read of the sum (torch.isfinite is four kernels)
        return True
    for key, grad in grads.items():
        if not bool(torch.isfinite(grad).all()):
            if policy == "raise":
                raise FloatingPointError(
                    f"non-finite gradient in {key!r}; pass nonfinite='skip' to drop such steps "
                    "(under fp16 autocast, pass the GradScaler to thinwire.ddp.register as "
                    "scaler=, which skips overflowing steps on every rank)"
                )
            return False
    return True
