"""EF21 error feedback: each worker sends what changed in its gradient estimate."""

from __future__ import annotations

from typing import Any

import torch

from thinwire.feedback.base import Memory


class Estimate(Memory):
    """Every rank keeps a dense estimate of the mean gradient and refreshes it sparsely.

    EF21 (Richtarik, Sokolov, Fatkhullin, NeurIPS 2021, Alg. 1; with momentum
    in front, EF21-SGDM of Fatkhullin et al., ICML 2023, Alg. 1):
    worker i keeps ``g_i`` and sends ``c_i = C(v_i - g_i)`` (line 4), then
    ``g_i <- g_i + c_i`` (line 5); every rank keeps ``G = mean_i g_i`` as
    ``G <- G + mean_i c_i`` (line 6), and the optimiser steps with ``G``, a
    dense tensor, instead of the sparse mean. Plain error feedback
    (:class:`~thinwire.feedback.Residual`) instead steps with the sparse mean
    and delays the rest; under CLT-k, whose shared index set refreshes one
    k-th of each layer per step, stepping with the whole estimate was faster
    (docs/convergence.md).

    In the :class:`Memory` contract: :meth:`compensate` returns
    ``p = v - g_i`` (what the compressor chooses from), :meth:`update` adds
    what was sent to ``g_i`` (``buffers`` hold ``g_i``), and :meth:`settle`
    turns the averaged sent tensor into ``G``. ``G`` starts at zero, as do
    the ``g_i``, so with nothing dropped ``G`` is the mean of the ``v_i``
    up to rounding.

    Attributes:
        estimates: key -> ``G``, the same on every rank.
    """

    rule = "ef21"

    def __init__(self) -> None:
        super().__init__()
        self.estimates: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``grad - g_i`` as a new tensor; ``grad`` is not modified."""
        estimate = self.buffers.get(key)
        return grad.clone() if estimate is None else grad - estimate.view(grad.shape)

    def compensate_(self, key: str, target: torch.Tensor) -> torch.Tensor:
        """In place: ``target`` (the gradient) becomes ``target - g_i``."""
        estimate = self.buffers.get(key)
        if estimate is not None:
            target.sub_(estimate.view(target.shape))
        return target

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """``g_i <- g_i + sent`` (EF21 Alg. 1 line 5); ``compensated`` is not needed."""
        estimate = self.buffers.get(key)
        if estimate is None:
            self.buffers[key] = sent.to(compensated.dtype).reshape(compensated.shape).clone()
        else:
            estimate.add_(sent.view(estimate.shape).to(estimate.dtype))

    def update_sparse(self, key: str, compensated: torch.Tensor, indices: torch.Tensor,
                      sent: torch.Tensor) -> None:
        """:meth:`update` for ``sent`` at ``indices`` of a 1-D ``compensated``."""
        estimate = self.buffers.get(key)
        if estimate is None:
            estimate = self.buffers[key] = torch.zeros_like(compensated)
        estimate.view(-1).index_add_(0, indices, sent.to(estimate.dtype))

    def settle(self, key: str, mean: torch.Tensor) -> torch.Tensor:
        """``G <- G + mean`` (EF21 Alg. 1 line 6); returns a copy of ``G``, shaped as ``mean``."""
        estimate = self.estimates.get(key)
        if estimate is None:
            estimate = self.estimates[key] = mean.clone()
        else:
            estimate.add_(mean.view(estimate.shape))
        return estimate.clone().view(mean.shape)

    def settle_(self, key: str, mean: torch.Tensor) -> None:
        """:meth:`settle` in place: ``G <- G + mean``, then ``mean`` holds ``G`` (no copy kept
        for the caller: ``mean`` is the caller's own buffer)."""
        estimate = self.estimates.get(key)
        if estimate is None:
            self.estimates[key] = mean.clone()
        else:
            mean.copy_(estimate.add_(mean.view(estimate.shape)).view(mean.shape))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "estimates": {k: v.clone() for k, v in self.estimates.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.estimates = {k: v.clone() for k, v in state["estimates"].items()}
