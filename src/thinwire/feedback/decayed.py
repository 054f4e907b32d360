"""SparseLoCo's error feedback with decay: e <- beta e + delta, send C(e), e <- e - C(e)."""

from __future__ import annotations

import torch

from thinwire.compress.base import check_fraction
from thinwire.feedback.residual import Residual


class Decayed(Residual):
    """Error feedback whose memory decays by ``beta`` before each round (SparseLoCo, Alg. 1).

    A round is ``p = e * beta + delta`` (:meth:`compensate`, two roundings in
    that order on every path), then ``e <- p - sent``
    (:meth:`~thinwire.feedback.Residual.update`): the invariant
    ``e_old * beta + delta == sent + e_new`` holds wherever ``p - sent`` is exact
    (unsent entries, and every entry where the sent value is within a factor 2 of
    ``p``). Under local updates the decayed memory is the outer momentum: it
    carries what was not sent, shrinking by ``beta`` a sync, in place of
    DiLoCo's global Nesterov momentum. ``beta = 1`` is :class:`Residual` to the
    bit; ``beta = 0`` keeps nothing. ``beta`` is configuration, not state.

    Args:
        beta: the decay, in [0, 1] (the paper's 0.95).

    Raises:
        ValueError: ``beta`` outside [0, 1].
    """

    rule = "decayed"

    def __init__(self, beta: float = 0.95) -> None:
        check_fraction("beta", beta, 0.0, 1.0, closed_low=True, closed_high=True)
        super().__init__()
        self.beta = float(beta)

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``e * beta + grad`` as a new tensor; ``grad`` is not modified."""
        error = self.buffers.get(key)
        return grad.clone() if error is None else error.view(grad.shape).mul(self.beta).add_(grad)

    def compensate_(self, key: str, target: torch.Tensor) -> torch.Tensor:
        error = self.buffers.get(key)
        if error is not None:
            target.add_(error.view(target.shape).mul(self.beta))
        return target

    def _absorb_into(self, buffer: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``e <- e * beta + grad`` in place: the buffer then holds ``p``."""
        return buffer.mul_(self.beta).add_(grad)
