"""Plain error feedback (DCT Alg. 1 lines 3 and 11): e <- g + e - g_hat."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from thinwire.feedback.base import Memory


def _uniform(seed: int, key: str, count: int) -> float:
    """A uniform draw in [0, 1) determined by ``(seed, key, count)`` alone."""
    digest = hashlib.blake2b(f"{seed}\0{key}\0{count}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


class Residual(Memory):
    """Keeps what compression left out and adds it back next round.

    Args:
        drain_every: if set, each update empties the key's buffer with
            probability ``1 / drain_every`` -- the stochastic drain of DCT §3.3
            Remark 2, which stops a buffer shared by hogwild threads from
            growing stale ("every 1 million iterations" in the paper, read here
            as an expected period so threads need no shared counter).
        seed: seeds the drain. Each draw is a function of ``(seed, key, n)``
            where n counts the key's updates, so the draws do not depend on
            the order keys are updated in (DDP re-buckets after its first
            step) and a checkpoint resumes them exactly.
    """

    rule = "residual"
    forgets_what_is_sent = True  # e = p - p = 0 (a drain empties a buffer that is empty)

    def __init__(self, drain_every: int | None = None, seed: int = 0) -> None:
        super().__init__()
        if drain_every is not None and (isinstance(drain_every, bool)
                                        or not isinstance(drain_every, int) or drain_every < 1):
            raise ValueError(f"drain_every={drain_every!r} must be None or an integer >= 1")
        self.drain_every = drain_every
        self.seed = seed
        self.drains = 0
        self.updates: dict[str, int] = {}  # key -> updates so far (the drain's counter)
        # keys absorbed together -> the flat tensor their buffers view (absorb_region_)
        self.regions: dict[tuple[str, ...], torch.Tensor] = {}

    def _drained(self, key: str) -> bool:
        """Whether this update of ``key`` empties its buffer (advances the key's counter)."""
        count = self.updates.get(key, 0)
        self.updates[key] = count + 1
        if self.drain_every is None or _uniform(self.seed, key, count) >= 1.0 / self.drain_every:
            return False
        self.drains += 1
        return True

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """``e <- compensated - sent``, into the key's buffer in place when its shape allows."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape != compensated.shape or buffer.dtype != compensated.dtype:
            buffer = torch.empty_like(compensated)
        if self._drained(key):
            buffer.zero_()
        else:
            torch.sub(compensated, sent, out=buffer)
        self.buffers[key] = buffer

    def update_sparse(self, key: str, compensated: torch.Tensor, indices: torch.Tensor,
                      sent: torch.Tensor) -> None:
        """:meth:`update` for a sparse ``sent``, without building it densely.

        The buffer becomes ``compensated`` (in place when ``compensated`` is
        the buffer itself, from :meth:`absorb_`; else a copy) with
        ``compensated[i] - sent_i`` at the sent indices:
        bit for bit what :meth:`update` stores for the decoded payload.

        Args:
            compensated: ``grad + e``, 1-D (a view of a bucket is fine); not modified.
            indices: int64 positions in ``compensated`` that were sent, distinct.
            sent: the values as they travel (any dtype), one per index.
        """
        flat = self._rewrite(key, compensated)
        if flat is not None:
            kept = compensated.index_select(0, indices) - sent.to(compensated.dtype)
            flat.index_copy_(0, indices, kept)

    def update_selected_(self, key: str, compensated: torch.Tensor,
                         indices: torch.Tensor) -> None:
        """:meth:`update_sparse` for values sent exactly: the sent entries become 0.

        ``p_i - p_i`` is +0 for every finite ``p_i``, so zeroing them is bit for
        bit :meth:`update`, without reading the values again.
        """
        flat = self._rewrite(key, compensated.reshape(-1))
        if flat is not None:
            flat.index_fill_(0, indices, 0.0)

    def _rewrite(self, key: str, compensated: torch.Tensor) -> torch.Tensor | None:
        """The key's buffer, flat, holding ``compensated`` (1-D); None once drained to 0."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() != compensated.numel():
            buffer = torch.empty_like(compensated)
        self.buffers[key] = buffer
        flat = buffer.view(-1)
        if self._drained(key):
            flat.zero_()
            return None
        if flat.data_ptr() != compensated.data_ptr():  # not already p (see absorb_)
            flat.copy_(compensated)
        return flat

    def absorb_(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``e <- e + grad`` in the key's buffer: it then holds ``p = grad + e``.

        The in-place form of :meth:`compensate` (``e + g`` and ``g + e`` are the
        same float), for callers that finish with :meth:`subtract_`.

        Returns:
            The buffer, shaped like ``grad``; ``grad`` is not modified.
        """
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() != grad.numel() or buffer.dtype != grad.dtype:
            buffer = grad.clone()
        else:
            buffer = self._absorb_into(buffer.view(grad.shape), grad)
        self.buffers[key] = buffer
        return buffer

    def _absorb_into(self, buffer: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``buffer <- buffer + grad`` (a round's opening), in place; returns ``buffer``."""
        return buffer.add_(grad)

    @property
    def absorbs_regions(self) -> bool:
        """Unless a drain may empty one key's buffer alone."""
        return self.drain_every is None

    def absorb_region_(self, keys: Sequence[str], numels: Sequence[int],
                       grads: torch.Tensor) -> torch.Tensor:
        """:meth:`absorb_` of every key in one op where their buffers already lie back to
        back in one flat tensor (after the first round of the same keys together), else
        gathered there once."""
        region = self.regions.get(tuple(keys))
        if region is not None and self._viewed(region, keys, numels, grads):
            return self._absorb_into(region, grads)
        region = torch.empty_like(grads)
        for key, part, grad in zip(keys, region.split(list(numels)), grads.split(list(numels))):
            buffer = self.buffers.get(key)
            if buffer is None or buffer.numel() != grad.numel() or buffer.dtype != grad.dtype:
                part.copy_(grad)
            else:
                self._absorb_into(part.copy_(buffer.view(-1)), grad)
            self.buffers[key] = part
        self.regions = {other: kept for other, kept in self.regions.items()
                        if not set(other) & set(keys)}
        self.regions[tuple(keys)] = region
        return region

    def _viewed(self, region: torch.Tensor, keys: Sequence[str], numels: Sequence[int],
                grads: torch.Tensor) -> bool:
        """Whether every key's buffer is still its part of ``region``."""
        if region.numel() != grads.numel() or region.dtype != grads.dtype:
            return False
        at, size = region.data_ptr(), region.element_size()
        for key, numel in zip(keys, numels):
            buffer = self.buffers.get(key)
            if buffer is None or buffer.data_ptr() != at or buffer.numel() != numel:
                return False
            at += numel * size
        return True

    def update_region_(self, keys: Sequence[str], p: torch.Tensor, indices: torch.Tensor,
                       sent: torch.Tensor | None) -> None:
        """``e <- p - sent`` at ``indices`` of :meth:`absorb_region_`'s ``p`` (0 there where
        ``sent`` is None: sent exactly), bit for bit each key's :meth:`update_sparse`."""
        for key in keys:
            self._drained(key)  # counts the key's update; no drain here (absorbs_regions)
        if sent is None:
            p.index_fill_(0, indices, 0.0)
        else:
            p.index_copy_(0, indices, p.index_select(0, indices) - sent.to(p.dtype))

    def holds(self, key: str, grad: torch.Tensor) -> bool:
        buffer = self.buffers.get(key)
        return buffer is not None and buffer.numel() == grad.numel() and buffer.dtype == grad.dtype

    def absorb_part_(self, key: str, grad: torch.Tensor, start: int) -> torch.Tensor:
        """``e[start:stop] += grad`` in the key's buffer (see :meth:`Memory.absorb_part_`)."""
        flat = self.buffers[key].view(-1)
        self._absorb_into(flat[start: start + grad.numel()], grad)
        return flat

    def subtract_(self, key: str, sent: torch.Tensor) -> None:
        """``e <- p - sent`` in place after :meth:`absorb_` (or a drain); one update."""
        buffer = self.buffers[key]
        if self._drained(key):
            buffer.zero_()
        else:
            buffer.sub_(sent.view(buffer.shape))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "drains": self.drains, "seed": self.seed,
                "updates": dict(self.updates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.regions = {}
        self.drains = state["drains"]
        self.seed = state["seed"]
        self.updates = dict(state["updates"])
