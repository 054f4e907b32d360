"""What a scheme is, declared once: the layers above read this, never a scheme's class."""

from __future__ import annotations

from dataclasses import dataclass

ALL_REDUCE, ALL_GATHER, BROADCAST = "all_reduce", "all_gather", "broadcast"


@dataclass(frozen=True)
class Traits:
    """A scheme's description, as :attr:`thinwire.schemes.Scheme.traits` gives it.

    ``optim`` couples by it, the DDP hook arms its guard and tells whether
    clipping belongs in the hook by it, jobs and benchmarks read diagnostics
    by it, the parameter server refuses what it cannot carry by it
    (:attr:`rounds`).
    """

    density: float | None = None  # target fraction of the entries a step sends; None: all
    memory: str | None = None  # the error-feedback rule kept (Memory.rule); None: none
    streams: bool = False  # large buckets travel in pieces, each sent while the next is chosen
    shared_indices: bool = False  # every rank sends at the same indices, a leader's choice
    energy: bool = False  # records the share of each rank's top-k the shared indices capture
    # the collectives one exchange hands torch.distributed, in order (a bucket whose
    # tensors all travel dense issues only its all-reduce)
    collectives: tuple[str, ...] = (ALL_REDUCE,)
    # dependent rounds: 2 where ranks agree on coordinates first (a leader's indices, a
    # low-rank basis); one rank's payload is then no use alone (no push, no row)
    rounds: int = 1

    @property
    def sparse(self) -> bool:
        """Whether a step sends a fraction of the entries and keeps the rest in memory:
        ``.grad`` after ``backward`` then holds a sparse update."""
        return self.density is not None and self.memory is not None

    @property
    def clips_in_hook(self) -> bool:
        """Whether gradient clipping belongs in the hook (``register(..., max_norm=)``):
        under a sparse update ``clip_grad_norm_`` after ``backward`` would clip what
        was sent, not the gradient, and drop the difference from the error memory."""
        return self.sparse
