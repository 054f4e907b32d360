"""ScaleCom's CLT-k selection maths: the leader's top-k indices and their encoding.

CLT-k (ScaleCom, App. E): the leader ``t mod n`` picks the top-k indices of its
``p = m + g``; every worker sends its ``p`` there, so the values all-reduce and
``mean_i(p_i[I]) == (mean_i p_i)[I]``. ``"chunk"``: App. E / Fig. A2's
chunk-wise quasi-sorting, the largest ``|p|`` of each of exactly ``k``
near-equal contiguous chunks (the appendix leaves the size open; k chunks keep
k entries, so the bytes equal exact top-k's). ``"exact"`` (default): the top-k,
found above a sampled lower bound without a sort; chunks keep only part of
top-k's energy where large entries cluster (:func:`captured_energy`), and CLT-k
then converges far slower (docs/convergence.md). Indices are ascending; a set
travels as int32, the 16-bit code or a bitmap, whichever is smallest, sizes
depending only on ``(k, N)``, so the broadcast needs no size round.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from thinwire.compress._select import largest_in_order
from thinwire.compress.base import keep_count
from thinwire.compress.payload import IndexCodec


def chunk_topk(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Index of the largest entry of each of ``k`` near-equal contiguous chunks.

    Args:
        magnitudes: flat tensor of ``|p|``.
        k: number of chunks (= entries kept), ``0 <= k <= magnitudes.numel()``.

    Returns:
        ``k`` distinct int64 indices, ascending.
    """
    numel = magnitudes.numel()
    _check_k(k, numel)
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=magnitudes.device)
    size, extra = divmod(numel, k)  # `extra` chunks of size + 1, then k - extra of size
    head = extra * (size + 1)
    parts = []
    if extra:
        starts = torch.arange(extra, dtype=torch.int64, device=magnitudes.device) * (size + 1)
        parts.append(magnitudes[:head].reshape(extra, size + 1).argmax(dim=1) + starts)
    if k > extra:
        starts = head + torch.arange(k - extra, dtype=torch.int64, device=magnitudes.device) * size
        parts.append(magnitudes[head:].reshape(k - extra, size).argmax(dim=1) + starts)
    return torch.cat(parts)


def captured_energy(tensor: torch.Tensor, indices: torch.Tensor) -> float:
    """Share of exact top-k's energy that ``indices`` capture: ``sum p[I]^2 / sum topk(p)^2``.

    ``k`` is ``indices.numel()``; 1.0 for exact top-k (and for a zero tensor).
    """
    flat = tensor.reshape(-1).double()
    k = indices.numel()
    best = float(torch.topk(flat.abs(), k, sorted=False).values.square().sum()) if k else 0.0
    return 1.0 if best == 0.0 else float(flat[indices].square().sum()) / best


def exact_topk(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries (``torch.topk``'s values), ascending.

    Of entries tied at the k-th largest value, the first ones are kept
    (:func:`~thinwire.compress._select.largest_in_order`: no sort).
    """
    _check_k(k, magnitudes.numel())
    return largest_in_order(magnitudes, k)


SELECTIONS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "chunk": chunk_topk,
    "exact": exact_topk,
}


def select(tensor: torch.Tensor, k: int, selection: str = "exact",
           out: torch.Tensor | None = None) -> torch.Tensor:
    """The leader's CLT-k index set of ``tensor`` (any shape; indices into its flat view).

    Args:
        out: 1-D room for ``|tensor|`` (its size, same dtype and device), kept by the
            caller: a fresh tensor the size of a large layer costs its page faults on
            every call on CPU. New if None.

    Raises:
        ValueError: unknown ``selection`` or ``k`` outside ``[0, numel]``.
    """
    if selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r} must be one of {sorted(SELECTIONS)}")
    flat = tensor.reshape(-1)
    return SELECTIONS[selection](flat.abs() if out is None else torch.abs(flat, out=out), k)


def layer_k(numel: int, ratio: float, k: int | None = None) -> int:
    """Entries kept of a layer of ``numel``: ``k`` capped at ``numel`` if given, else
    ``keep_count(numel, ratio)`` (ceil, at least one)."""
    if k is not None:
        return min(k, numel)
    return keep_count(numel, ratio)


def sparsify(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``CLT_k(tensor)``: ``tensor`` at ``indices``, zero elsewhere (same shape and dtype)."""
    flat = tensor.reshape(-1)
    out = torch.zeros_like(flat)
    out[indices] = flat[indices]
    return out.reshape(tensor.shape)


def index_nbytes(k: int, numel: int) -> int:
    """Wire bytes of ``k`` indices into ``numel`` entries (:func:`encode_indices`)."""
    return IndexCodec.choose(None, k, numel).nbytes


def encode_indices(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """``indices`` (distinct, ascending) as ``index_nbytes(k, numel)`` uint8: int32, the
    16-bit code or a bitmap, whichever is smallest (:class:`IndexCodec`)."""
    codec = IndexCodec.choose(None, indices.numel(), numel)
    area = torch.zeros(codec.nbytes, dtype=torch.uint8, device=indices.device)
    codec.encode(indices, area)
    return area


def decode_indices(encoded: torch.Tensor, k: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`encode_indices`: ``k`` int64 indices, ascending."""
    return IndexCodec.choose(None, k, numel).decode(encoded, k)


def _check_k(k: int, numel: int) -> None:
    if not 0 <= k <= numel:
        raise ValueError(f"k={k!r} must lie in [0, {numel}] for a tensor of {numel} entries")
