"""PowerSGD maths (Vogels et al., NeurIPS 2019, Alg. 1), one matrix at a time. No collectives.

Worker w's (n x m) matrix ``M_w``: ``P_w = M_w Q`` (line 2, :meth:`PowerSGD.left`),
the caller averages P (line 3), ``P_hat = orthonormalize(P)`` (line 4),
``Q_w = M_w^T P_hat`` (line 5, :func:`right`), the caller averages Q (line 6),
``G_hat = P_hat Q^T`` (line 7, :meth:`PowerSGD.finish`): the projection of the
mean onto the span of ``mean_w(M_w) Q``, exact when the mean has rank <= r.
:class:`PowerSGD` holds Q per key, warm-started (§3) or redrawn, seeded by
(key, seed, draw) so every rank starts alike; error feedback (Alg. 2) is the
caller's. Where the paper is open: a zero column of the averaged Q keeps the
previous one (one zero step does not cost the next its subspace); Q is not
orthonormalised between steps (only span(Q) matters); Householder QR gives a
valid basis for a zero or repeated column of P where Gram-Schmidt gives NaN;
1-D tensors and those with ``(n + m) r >= n m / 2`` travel dense.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from thinwire.compress.lowrank import as_matrix, compressible, orthonormalize, seeded_normal

__all__ = ["PowerSGD", "as_matrix", "compressible", "orthonormalize", "reconstruct", "right"]


def right(matrix: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
    """``Q_w = M_w^T P_hat`` (Alg. 1 line 5): (m, r) from (n, m) and (n, r).

    Computed as ``(P_hat^T M_w)^T``: the same product, but it reads the
    row-major ``M_w`` along its rows and QR's column-major ``P_hat`` along its
    columns, many times faster than ``M_w^T @ P_hat`` on CPU.
    """
    return (p_hat.t() @ matrix).t()


def reconstruct(p_hat: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None,
                scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``P_hat Q^T`` (Alg. 1 line 7): the (n, m) rank-r approximation.

    Summed as r outer products added elementwise, not by one rank-r matrix
    product: every entry is then ``((p_1 q_1 + p_2 q_2) + ...)`` rounded the
    same way whatever the thread count or the thread it runs on. It runs in
    future callbacks, sometimes on the caller's thread and sometimes on a
    gloo thread with another intra-op thread count, where a rank-r BLAS
    product (which may fuse a multiply and an add in some tiles and not in
    others) could round differently on different ranks and the replicas
    would drift apart. Q is laid out column-major first, so that each
    ``q_j`` the broadcast multiply reads is contiguous (read with a stride
    of r, the multiply ran about six times slower on CPU).

    Args:
        out: (n, m) tensor to write into (e.g. a view of a DDP bucket); new if None.
        scratch: 1-D, at least n * m entries of the same dtype and device, for
            the second and later outer products when r > 1; new if None (a
            fresh buffer of that size costs page faults on every call on CPU).
    """
    rows, cols = p_hat.shape[0], q.shape[0]
    if out is None:
        out = torch.empty(rows, cols, dtype=p_hat.dtype, device=p_hat.device)
    q = q.t().contiguous().t()  # column-major (a copy of r x m entries)
    torch.mul(p_hat[:, :1], q[:, 0], out=out)
    if p_hat.shape[1] > 1:
        term = torch.empty_like(out) if scratch is None else scratch[: rows * cols].view(
            rows, cols)
        for j in range(1, p_hat.shape[1]):
            out.add_(torch.mul(p_hat[:, j: j + 1], q[:, j], out=term))
    return out


class PowerSGD:
    """Per-key PowerSGD state (Q) and the steps that use it, for one matrix at a time.

    Typical use for one matrix ``M`` (n x m) under key ``"fc.weight"``::

        codec = PowerSGD(rank=2)
        p = codec.left("fc.weight", M)          # send p, get p_mean
        p_hat = orthonormalize(p_mean)
        q = right(M, p_hat)                     # send q, get q_mean
        approx = codec.finish("fc.weight", p_hat, q_mean)

    Args:
        rank: r, columns of P and Q, >= 1.
        warm_start: reuse the averaged Q of the previous step (True), or draw
            a fresh Q every step (False).
        seed: seeds every initial Q; equal on all ranks, so are the Qs.

    Raises:
        ValueError: ``rank`` < 1, or ``seed`` not an integer.
    """

    def __init__(self, rank: int, *, warm_start: bool = True, seed: int = 0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank={rank!r} must be an integer >= 1")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed={seed!r} must be an integer")
        self.rank = rank
        self.warm_start = warm_start
        self.seed = seed
        self.qs: dict[str, torch.Tensor] = {}  # key -> (m, r) Q for the next step
        self.draws: dict[str, int] = {}  # key -> Qs drawn so far (seeds the next draw)
        self._scratches: dict[int, torch.Tensor] = {}  # thread id -> reconstruct's scratch

    def compresses(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``shape`` goes through PowerSGD (else it travels dense)."""
        return compressible(shape, self.rank)

    def q(self, key: str, matrix: torch.Tensor) -> torch.Tensor:
        """The Q that ``key``'s next :meth:`left` uses: the warm one, or a fresh seeded draw."""
        cols = matrix.shape[1]
        current = self.qs.get(key)
        if self.warm_start and current is not None and current.shape == (cols, self.rank):
            return current.to(matrix.dtype)
        draw = self.draws.get(key, 0)
        self.draws[key] = draw + 1
        # Draw d of key k depends only on (k, seed, d): identical on every rank.
        fresh = seeded_normal(key, (cols, self.rank), seed=self.seed + draw, dtype=matrix.dtype,
                              device=matrix.device)
        self.qs[key] = fresh
        return fresh

    def left(self, key: str, matrix: torch.Tensor) -> torch.Tensor:
        """``P_w = M_w Q`` (Alg. 1 line 2) for ``key``'s (n, m) matrix: (n, r).

        Q is laid out column-major first (a copy of r x m entries): a row-major
        ``M_w`` times a column-major Q runs several times faster on CPU than
        times the row-major Q the all-reduce returns.
        """
        return matrix @ self.q(key, matrix).t().contiguous().t()

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``like``'s size for :func:`reconstruct`, kept per thread.

        Callbacks of different DDP buckets may run at once on different gloo
        threads, so each thread has its own; it grows to the largest matrix.
        """
        thread = threading.get_ident()
        kept = self._scratches.get(thread)
        if (kept is None or kept.numel() < like.numel() or kept.dtype != like.dtype
                or kept.device != like.device):
            kept = self._scratches[thread] = torch.empty(like.numel(), dtype=like.dtype,
                                                         device=like.device)
        return kept

    def finish(self, key: str, p_hat: torch.Tensor, q_mean: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``G_hat = P_hat Q^T`` (Alg. 1 line 7); keeps ``q_mean`` as the next warm start.

        Args:
            p_hat: the orthonormalised averaged P, (n, r).
            q_mean: the averaged Q, (m, r); identical on every rank. Kept as the next
                warm start: as it is when column-major (``q_mean.t()`` contiguous, the
                caller must then leave it alone), else as a column-major copy.
            out: (n, m) tensor to write the approximation into; new if None.

        Returns:
            The (n, m) approximation of the mean matrix.
        """
        if not q_mean.t().is_contiguous():
            # Column-major: reconstruct reads each column contiguously, and it is kept
            # as the next warm start, which left() then uses as it is.
            q_mean = q_mean.new_empty(q_mean.shape[::-1]).t().copy_(q_mean)
        if self.warm_start:
            kept = q_mean
            previous = self.qs.get(key)
            # A zero column (a zero mean gradient, or one of rank below r) would make the
            # next P's column zero too; keep the previous column there instead, chosen on
            # the device (no wait on a GPU). q_mean is identical on every rank, so is this.
            # any(), not a norm: a column of tiny entries has a norm that underflows to 0.
            if previous is not None and previous.shape == kept.shape:
                kept = q_mean.new_empty(q_mean.shape[::-1]).t()
                torch.where(q_mean.any(dim=0), q_mean, previous.to(kept.dtype), out=kept)
            self.qs[key] = kept
        else:
            self.qs.pop(key, None)
        if out is None:
            out = torch.empty(p_hat.shape[0], q_mean.shape[0], dtype=p_hat.dtype,
                              device=p_hat.device)
        return reconstruct(p_hat, q_mean, out, self._scratch(out) if self.rank > 1 else None)

    def state_dict(self) -> dict[str, Any]:
        return {"qs": {k: v.clone() for k, v in self.qs.items()}, "draws": dict(self.draws)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.qs = {k: v.clone() for k, v in state["qs"].items()}
        self.draws = dict(state["draws"])
