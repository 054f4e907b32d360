"""ScaleCom's low-pass filtered error memory: m <- (1 - beta) m + beta (p - C(p))."""

from __future__ import annotations

import torch

from thinwire.compress.base import check_fraction
from thinwire.feedback.base import Memory


class LowPass(Memory):
    """Error feedback through a first-order low-pass filter (ScaleCom, Alg. 1 memory update).

    With ``p = m + g`` (:meth:`compensate`) and ``C(p)`` what this worker
    sent, the update is ``m <- (1 - beta) * m + beta * (p - C(p))``.
    ``beta = 1`` is plain error feedback (identical to
    :class:`~thinwire.feedback.Residual`); a small ``beta`` (the paper uses
    0.1 for large batches, App. E.2-E.4) damps the memory so that stale
    gradients leak out slowly. ``beta = 0`` would freeze the memory forever,
    so the range is (0, 1]. (Appendix E calls the unfiltered runs "beta = 0";
    in the update written above, which the main text uses, that case is
    ``beta = 1``.)

    ``beta`` is configuration, not state: :meth:`state_dict` holds the
    buffers only, so a schedule (App. E.2 raises beta to 1 late in training)
    is a new memory with the new beta loading the old one's state.

    Args:
        beta: the filter's discount factor, in (0, 1].

    Raises:
        ValueError: ``beta`` outside (0, 1].
    """

    rule = "low-pass"

    def __init__(self, beta: float = 1.0) -> None:
        check_fraction("beta", beta, 0.0, 1.0, closed_low=False, closed_high=True)
        super().__init__()
        self.beta = float(beta)

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Filter what ``sent`` left out of ``compensated`` into ``key``'s memory."""
        residual = compensated - sent
        previous = self.buffers.get(key)
        if self.beta == 1.0 or previous is None:
            # With no previous memory, (1 - beta) * 0 vanishes.
            self.buffers[key] = residual if self.beta == 1.0 else residual.mul_(self.beta)
            return
        self.buffers[key] = previous.mul(1.0 - self.beta).add_(residual, alpha=self.beta)

    def update_selected_(self, key: str, compensated: torch.Tensor,
                         indices: torch.Tensor) -> None:
        """:meth:`update` with ``sent = compensated`` at ``indices`` and 0 elsewhere, in place.

        Bit for bit what :meth:`update` stores for
        :func:`~thinwire.compress.cltk.sparsify` of ``compensated``, without
        building ``sent`` or the residual at full size: the key's buffer is
        reused when it has ``compensated``'s size and dtype.

        Args:
            compensated: ``p = m + g``, any shape (a view of a DDP bucket is fine); not modified.
            indices: int64 positions in ``compensated``'s flat view that were sent, distinct.
        """
        source = compensated.reshape(-1)
        previous = self.buffers.get(key)
        reuse = (previous is not None and previous.numel() == compensated.numel()
                 and previous.dtype == compensated.dtype)
        if previous is None or not reuse or self.beta == 1.0:
            buffer = previous if reuse else torch.empty_like(compensated)
            assert buffer is not None
            flat = buffer.view(-1)
            flat.copy_(source).index_fill_(0, indices, 0.0)  # p - C(p): exact zeros
            if self.beta != 1.0:  # no previous memory: (1 - beta) * 0 vanishes
                flat.mul_(self.beta)
            self.buffers[key] = buffer
            return
        flat = previous.view(-1)
        kept = flat.index_select(0, indices)
        flat.mul_(1.0 - self.beta).add_(source, alpha=self.beta)
        # At the sent entries the residual is 0: the same two operations on a 0.
        kept.mul_(1.0 - self.beta).add_(torch.zeros_like(kept), alpha=self.beta)
        flat.index_copy_(0, indices, kept)
