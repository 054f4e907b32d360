"""SparseLoCo (Sarfi et al. 2025, Alg. 1): the kernel with chunk-wise top-k, 2-bit values and
decayed error feedback.

Per rank and tensor: ``e <- beta e + delta`` (:class:`~thinwire.feedback.Decayed`),
the ``k`` largest ``|e|`` of every chunk (:class:`~thinwire.compress.chunked.ChunkTopK`),
their values as 2-bit codes read as their bins' means, a table per tensor
(:class:`~thinwire.compress.values.Binned`), their positions in a chunk code
(:mod:`~thinwire.compress.chunk_index`), ``e <- e - sent``. A tensor of one
dimension sends every entry as codes. The payload's size is fixed by the shapes,
so one all-gather carries it (:class:`~thinwire.schemes.kernel.CompressedScheme`);
every rank decodes every payload and sums them in rank order, then divides each
entry by the ranks that sent it, as the reference code's scatter-mean does
(``aggregate="ranks"``: by all ranks, Alg. 1's ``1/R``; on text-lm that reached
the target later, docs/local-updates.md). The outer step belongs
to the caller: under :class:`~thinwire.local.LocalUpdates` it is SGD with lr
alpha and no momentum (the decayed memory is the momentum), chosen there from
this scheme's traits (its memory rule, ``"decayed"``).
"""

from __future__ import annotations

from dataclasses import dataclass

from thinwire.compress import chunk_index
from thinwire.compress.base import check_fraction
from thinwire.compress.chunked import CHUNK, ChunkTopK, K
from thinwire.compress.values import Binned
from thinwire.feedback import Decayed, check_policy
from thinwire.schemes.base import Scheme
from thinwire.schemes.kernel import MEANS, CompressedScheme
from thinwire.schemes.registry import register, validate_warmup


@dataclass(frozen=True)
class SparseLoCoConfig:
    chunk: int = CHUNK  # entries per chunk, in [2, 65536] (the paper's 64 x 64 = 4096)
    k: int = K  # entries sent per chunk, in [1, chunk] (the paper's 64: 1.56 %)
    beta: float = 0.95  # the error memory's decay, in [0, 1] (the paper's 0.95)
    indices: str = "elias-fano"  # positions on the wire: "elias-fano" or "fixed" (the paper's)
    aggregate: str = "senders"  # an entry's sum over: "senders" (its code) or "ranks" (Alg. 1)
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite pseudo-gradient
    warmup_steps: int = 0  # launches of each tensor sent dense (full width) first, >= 0

    def __post_init__(self) -> None:
        ChunkTopK(self.chunk, self.k)
        check_fraction("beta", self.beta, 0.0, 1.0, closed_low=True, closed_high=True)
        chunk_index.check(self.indices)
        if self.aggregate not in MEANS:
            raise ValueError(f"aggregate={self.aggregate!r} must be one of {MEANS}")
        check_policy(self.nonfinite)
        validate_warmup(self.warmup_steps)


@register("sparseloco", SparseLoCoConfig)
def _build(config: SparseLoCoConfig) -> Scheme:
    return CompressedScheme(Binned(), ChunkTopK(config.chunk, config.k), Decayed(config.beta),
                            config.nonfinite, indices=config.indices, mean=config.aggregate)
