"""Chunk-wise top-k: the k largest ``|x|`` of every chunk of a tensor (SparseLoCo's selection).

A tensor's flat view is cut into chunks of ``chunk`` entries; each full chunk
keeps exactly ``k`` entries, a last partial chunk of ``m`` entries keeps
``ceil(k m / chunk)`` (the same density, at least one). Ties go to the lower
position, so every device and every reimplementation picks the same entries.
A fixed count per chunk fixes the payload's size and bounds each index by the
chunk (12 bits for 4096: :mod:`thinwire.compress.chunk_index`, the index codes
:meth:`ChunkTopK.plan` lets a payload carry).

Choices where the paper is open: chunks run along the flat view (the
reference code tiles a matrix in 64 x 64 blocks; a flat chunk of 4096 has the
same count and index width and needs no divisor of each dimension), and a
tensor of one dimension (biases, norms) bypasses selection, as the reference
code's chunking sends every entry of those.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from thinwire.compress.base import TensorInfo
from thinwire.compress.sparse import Sparsifier

CHUNK = 4096  # entries per chunk: the paper's 64 x 64 tiles
K = 64  # entries kept per chunk: 1.56 %, the paper's and Covenant-72B's density


def chunk_counts(numel: int, chunk: int, k: int) -> list[tuple[int, int]]:
    """``(chunk size, entries kept)`` of each chunk of a ``numel``-entry flat tensor, in order.

    Full chunks come first as one entry ``(chunk, k)`` repeated; a partial last
    chunk keeps ``ceil(k * m / chunk)`` of its ``m`` entries.
    """
    full, rest = divmod(numel, chunk)
    counts = [(chunk, k)] * full
    if rest:
        counts.append((rest, min(rest, math.ceil(k * rest / chunk))))
    return counts


def kept(numel: int, chunk: int, k: int) -> int:
    """Entries chunk-wise top-k keeps of a ``numel``-entry flat tensor."""
    return sum(count for _, count in chunk_counts(numel, chunk, k))


def _largest_ascending(rows: torch.Tensor, count: int) -> torch.Tensor:
    """Per row of ``rows`` (2-D), the positions of its ``count`` largest entries, ascending;
    of entries equal to a row's ``count``-th largest, the lowest positions.

    ``torch.topk`` finds each row's threshold (its tie order is unspecified, so
    only its values are used); every entry above it is kept, then the first of
    those equal to it, up to ``count`` (the usual case, no tie, skips that step).
    """
    threshold = torch.topk(rows, count, dim=1, sorted=False).values.amin(1, keepdim=True)
    keep = rows >= threshold
    if int(keep.sum()) != rows.shape[0] * count:  # ties at some row's threshold
        above = rows > threshold
        tied = keep & ~above
        room = count - above.sum(1, keepdim=True)
        keep = above | (tied & (tied.cumsum(1) <= room))
    return keep.nonzero()[:, 1].view(rows.shape[0], count)


def chunk_topk(magnitudes: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Ascending positions in the 1-D ``magnitudes`` of each chunk's ``k`` largest entries.

    Args:
        magnitudes: ``|x|``, 1-D (a view of a flat bucket is fine); not modified.
        chunk: entries per chunk, >= 1.
        k: entries kept per full chunk, in [1, chunk].

    Returns:
        int64 positions, :func:`kept` of them, ascending.
    """
    numel = magnitudes.numel()
    full = numel // chunk
    parts = []
    if full:
        body = _largest_ascending(magnitudes[: full * chunk].view(full, chunk), k)
        offsets = torch.arange(0, full * chunk, chunk, device=magnitudes.device)
        parts.append((body + offsets.unsqueeze(1)).reshape(-1))
    if numel > full * chunk:
        size, count = chunk_counts(numel, chunk, k)[-1]
        tail = magnitudes[full * chunk:].view(1, size)
        parts.append(_largest_ascending(tail, count).reshape(-1) + full * chunk)
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=magnitudes.device)
    return torch.cat(parts)


class ChunkTopK(Sparsifier):
    """:func:`chunk_topk` as a :class:`~thinwire.compress.Sparsifier`, per tensor.

    Args:
        chunk: entries per chunk, in [2, 65536] (:data:`CHUNK`).
        k: entries kept per chunk, in [1, chunk] (:data:`K`).
        kwargs: :class:`~thinwire.compress.Sparsifier`'s (``min_numel``,
            ``exclude``); its ``scope`` is ``"layer"`` (chunks lie inside a tensor).

    Raises:
        ValueError: ``chunk`` or ``k`` out of range.
    """

    def __init__(self, chunk: int = CHUNK, k: int = K, **kwargs: Any) -> None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 2 <= chunk <= 1 << 16:
            raise ValueError(f"chunk={chunk!r} must be an integer in [2, 65536]")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= chunk:
            raise ValueError(f"k={k!r} must be an integer in [1, chunk={chunk}]")
        super().__init__(scope="layer", **kwargs)
        self.chunk = chunk
        self.k = k

    @property
    def density(self) -> float:
        return self.k / self.chunk

    def is_dense(self, info: TensorInfo) -> bool:
        """Also every tensor of one dimension (module docstring)."""
        return len(info.shape) <= 1 or super().is_dense(info)

    def capacity(self, numel: int) -> int:
        """Exactly :func:`kept`: every chunk sends its count."""
        return kept(numel, self.chunk, self.k)

    def plan(self, infos: Sequence[TensorInfo]) -> tuple[tuple[int, int], ...]:
        """Each tensor's :func:`chunk_counts`, tensor after tensor."""
        return tuple(part for info in infos
                     for part in chunk_counts(info.numel, self.chunk, self.k))

    def select_joined(self, magnitudes: torch.Tensor,
                      infos: Sequence[TensorInfo]) -> tuple[torch.Tensor, list[int]]:
        """One :func:`chunk_topk` over the tensors back to back where each but the last is
        a whole number of chunks, so its chunks are the tensors' own: the same indices
        as tensor by tensor, and per tensor the same call count, threshold (the least
        ``|x|`` it sends) and trace point. Else tensor by tensor."""
        numels = [info.numel for info in infos]
        if len(infos) < 2 or 0 in numels or any(n % self.chunk for n in numels[:-1]):
            return super().select_joined(magnitudes, infos)
        indices = chunk_topk(magnitudes, self.chunk, self.k)  # ascending, exactly kept()
        counts = [kept(numel, self.chunk, self.k) for numel in numels]
        least = torch.segment_reduce(magnitudes.index_select(0, indices), "min",
                                     lengths=torch.tensor(counts, device=indices.device))
        for info, count, tau in zip(infos, counts, least.tolist()):
            call = self._calls.get(info.key, 0)
            self._calls[info.key] = call + 1
            self._trace(info.key, call, tau, count / info.numel)
        return indices, counts

    def _select(self, magnitudes: torch.Tensor, info: TensorInfo,
                call: int) -> tuple[torch.Tensor, float]:
        indices = chunk_topk(magnitudes, self.chunk, self.k)
        tau = float(magnitudes.index_select(0, indices).min()) if indices.numel() else 0.0
        return indices, tau
