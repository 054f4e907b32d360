"""PowerSGD (Vogels et al. 2019, Alg. 1) as the engine's low-rank gradient baseline.

One rank-r step for an (n, m) gradient matrix M, with error feedback e::

    M' = M + e;  P = M'·Q;  all-reduce P;  P̂ = orthonormalize(P)
    Q_s = M'ᵀ·P̂;  e = M' − P̂·Q_sᵀ;  all-reduce Q;  ĝ = P̂·Q̄ᵀ

Q starts from a normal matrix seeded by (parameter name, seed), identical
on every site, and is warm-started from the averaged Q̄ of the step before.
Tensors that do not compress (1-D, or ``(n + m)·r ≥ n·m/2``) are averaged
dense. The collectives belong to the engine; this module keeps the maths
and the state, so it can later be replaced by the shared PowerSGD compressor.
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.compress.lowrank import as_matrix, compressible, orthonormalize, seeded_normal


class PowerSGDState:
    """Per-parameter warm-start Q and error memory, keyed by parameter name.

    Args:
        rank: the approximation rank r.
        seed: seeds the initial Q (the same on every site).
    """

    def __init__(self, rank: int, seed: int = 0) -> None:
        self.rank = rank
        self.seed = seed
        self.q: dict[str, torch.Tensor] = {}
        self.error: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def compresses(self, grad: torch.Tensor) -> bool:
        return compressible(tuple(grad.shape), self.rank)

    def _q(self, key: str, matrix: torch.Tensor) -> torch.Tensor:
        if key not in self.q:
            self.q[key] = seeded_normal(key, (matrix.shape[1], self.rank), self.seed,
                                        dtype=matrix.dtype, device=matrix.device)
        return self.q[key]

    def project(self, key: str, grad: torch.Tensor, contribute: bool = True) -> torch.Tensor:
        """Round 1: ``P = (M + e)·Q`` (zeros, state untouched, when not contributing)."""
        matrix = as_matrix(grad)
        q = self._q(key, matrix)
        if not contribute:
            self._pending.pop(key, None)
            return torch.zeros(matrix.shape[0], self.rank, dtype=matrix.dtype)
        error = self.error.get(key)
        compensated = matrix if error is None else matrix + error
        self._pending[key] = compensated
        return compensated @ q

    def back_project(self, key: str, p_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Round 2: ``P̂`` and this site's ``Q_s = M'ᵀ·P̂``; stores ``e = M' − P̂·Q_sᵀ``.

        Returns:
            (P̂, Q_s); Q_s is zero for a site that did not contribute.
        """
        p_hat = orthonormalize(p_sum)
        compensated = self._pending.pop(key, None)
        if compensated is None:
            return p_hat, torch.zeros_like(self.q[key])
        q_local = compensated.T @ p_hat
        self.error[key] = compensated - p_hat @ q_local.T
        return p_hat, q_local

    def finish(self, key: str, p_hat: torch.Tensor, q_mean: torch.Tensor,
               shape: torch.Size) -> torch.Tensor:
        """``ĝ = P̂·Q̄ᵀ`` in the parameter's shape; Q̄ warm-starts the next step."""
        self.q[key] = q_mean.clone()
        return (p_hat @ q_mean.T).reshape(shape)

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "seed": self.seed,
                "q": {k: v.clone() for k, v in self.q.items()},
                "error": {k: v.clone() for k, v in self.error.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["rank"] != self.rank:
            raise ValueError(f"state has rank={state['rank']}, this engine rank={self.rank}")
        self.seed = state["seed"]
        self.q = {k: v.clone() for k, v in state["q"].items()}
        self.error = {k: v.clone() for k, v in state["error"].items()}
