"""PowerSGD (Vogels et al. 2019, Alg. 1) as the engine's low-rank gradient baseline.

One rank-r step for an (n, m) gradient matrix M, with error feedback e::

    M' = M + e;  P = M'·Q;  all-reduce P;  P̂ = orthonormalize(P)
    Q_s = M'ᵀ·P̂;  e = M' − P̂·Q_sᵀ;  all-reduce Q;  ĝ = P̂·Q̄ᵀ

The maths and the per-key Q (seeded by parameter name and seed, identical on
every site, warm-started from the averaged Q̄) are the shared codec,
:class:`thinwire.compress.powersgd.PowerSGD`, which the ``powersgd`` scheme
uses too; this module adds the per-site error and the engine's rounds call it.
Tensors that do not compress (1-D, or ``(n + m)·r ≥ n·m/2``) are averaged dense.
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.compress.powersgd import PowerSGD, as_matrix, orthonormalize, reconstruct, right


class PowerSGDState:
    """The shared PowerSGD codec (Q per parameter) and this site's error, keyed by name.

    Args:
        rank: the approximation rank r.
        seed: seeds the initial Q (the same on every site).
    """

    def __init__(self, rank: int, seed: int = 0) -> None:
        self.codec = PowerSGD(rank, seed=seed)
        self.error: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    @property
    def rank(self) -> int:
        return self.codec.rank

    @property
    def q(self) -> dict[str, torch.Tensor]:
        """Parameter name -> the Q its next step uses."""
        return self.codec.qs

    def compresses(self, grad: torch.Tensor) -> bool:
        return self.codec.compresses(tuple(grad.shape))

    def project(self, key: str, grad: torch.Tensor, contribute: bool = True) -> torch.Tensor:
        """Round 1: ``P = (M + e)·Q`` (zeros, state untouched, when not contributing)."""
        matrix = as_matrix(grad)
        if not contribute:
            self.codec.q(key, matrix)  # every site holds the same Q for round 2
            self._pending.pop(key, None)
            return torch.zeros(matrix.shape[0], self.rank, dtype=matrix.dtype)
        error = self.error.get(key)
        compensated = matrix if error is None else matrix + error
        self._pending[key] = compensated
        return self.codec.left(key, compensated)

    def back_project(self, key: str, p_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Round 2: ``P̂`` and this site's ``Q_s = M'ᵀ·P̂``; stores ``e = M' − P̂·Q_sᵀ``.

        Returns:
            (P̂, Q_s); Q_s is zero for a site that did not contribute.
        """
        p_hat = orthonormalize(p_sum)
        compensated = self._pending.pop(key, None)
        if compensated is None:
            return p_hat, torch.zeros_like(self.q[key])
        q_local = right(compensated, p_hat)
        self.error[key] = compensated - reconstruct(p_hat, q_local)
        return p_hat, q_local

    def finish(self, key: str, p_hat: torch.Tensor, q_mean: torch.Tensor,
               shape: torch.Size) -> torch.Tensor:
        """``ĝ = P̂·Q̄ᵀ`` in the parameter's shape; Q̄ warm-starts the next step."""
        return self.codec.finish(key, p_hat, q_mean).reshape(shape)

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "codec": self.codec.state_dict(),
                "error": {k: v.clone() for k, v in self.error.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["rank"] != self.rank:
            raise ValueError(f"state has rank={state['rank']}, this engine rank={self.rank}")
        self.codec.load_state_dict(state["codec"])
        self.error = {k: v.clone() for k, v in state["error"].items()}
