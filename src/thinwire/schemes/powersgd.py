"""PowerSGD (Vogels et al., NeurIPS 2019) as a scheme: two all-reduce rounds, gloo-safe.

The kernel with a low-rank basis agreed in round 1
(:class:`~thinwire.schemes.agreed.LowRankBasis`), per parameter (never per
bucket, so DDP's re-bucketing cannot mix up state): ``M = grad + error``,
all-reduce ``P = M Q``, ``P_hat = orthonormalize(P)``, all-reduce
``Q = M^T P_hat`` with the dense tensors, ``G_hat = P_hat Q^T``,
``error <- M - G_hat`` (torch's ``powerSGD_hook`` rule; the maths:
:mod:`thinwire.compress.powersgd`). P is waited for in the caller's thread, at
once for the step's last DDP bucket, else at the next launch
(:class:`thinwire.comm.rounds.TwoRounds`), so the backward pass runs while P is
on the wire; no collective is issued or waited on in a callback, which is how
torch 2.13's ``powerSGD_hook`` deadlocks on gloo. Callbacks do elementwise
maths only, so replicas stay bit identical whatever thread runs them. Before
``warmup_steps``, and for tensors that do not compress, gradients are
all-reduced dense.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.compress import Cast
from thinwire.compress.powersgd import PowerSGD
from thinwire.feedback import Residual
from thinwire.schemes.agreed import LowRankBasis
from thinwire.schemes.base import Scheme
from thinwire.schemes.kernel import CompressedScheme
from thinwire.schemes.registry import register, validate_common


@dataclass(frozen=True)
class PowerSGDConfig:
    """Options of ``powersgd``."""

    rank: int = 2  # r, columns of the factors P and Q, >= 1
    warmup_steps: int = 0  # steps all-reduced dense before PowerSGD starts, >= 0
    warm_start: bool = True  # reuse the previous step's Q (else draw a fresh one each step)
    seed: int = 0  # seeds the initial Q, equal on every rank
    error_feedback: bool = True  # keep M - G_hat and add it to the next gradient
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank={self.rank!r} must be an integer >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        for name in ("warm_start", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        validate_common(self)


@register("powersgd", PowerSGDConfig)
def _powersgd(config: PowerSGDConfig) -> Scheme:
    codec = PowerSGD(config.rank, warm_start=config.warm_start, seed=config.seed)
    return CompressedScheme(Cast("native"), LowRankBasis(codec),
                            Residual() if config.error_feedback else None, config.nonfinite)
