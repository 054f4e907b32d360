"""Exact top-k selection without a pass over the whole tensor in ``torch.topk``.

A strided sample of the magnitudes gives a lower bound that, with margin,
the k-th largest entry clears; only the entries at or above that bound (the
candidates, a few times k) go through ``torch.topk``. When the bound turns
out too high (fewer than k candidates: an adversarial layout or heavy ties
the sample missed) the full ``torch.topk`` runs instead, so the result is
always exact: the same values as ``torch.topk`` / ``torch.kthvalue`` on the
whole tensor. Which of several tied indices is returned is, as for
``torch.topk`` itself, unspecified but deterministic.
"""

from __future__ import annotations

import math

import torch

SAMPLE = 4096  # entries sampled to place the lower bound
MAX_FRACTION = 0.1  # above k / N this, torch.topk on everything is as cheap


def _lower_bound(magnitudes: torch.Tensor, k: int) -> torch.Tensor | None:
    """A magnitude that at least k entries probably reach, or None to select directly."""
    numel = magnitudes.numel()
    if numel <= 4 * SAMPLE or k > MAX_FRACTION * numel:
        return None
    stride = numel // SAMPLE
    sample = magnitudes[::stride]
    expected = k * sample.numel() / numel
    # Expected sample hits plus four standard deviations (binomial) and a floor.
    rank = min(sample.numel(), math.ceil(expected + 4.0 * math.sqrt(expected) + 8))
    return torch.topk(sample, rank, sorted=False).values.min()


def _candidates(magnitudes: torch.Tensor, k: int) -> torch.Tensor | None:
    """Indices of the entries at or above the sampled bound, if at least k of them."""
    bound = _lower_bound(magnitudes, k)
    if bound is None:
        return None
    candidates = (magnitudes >= bound).nonzero().squeeze(1)
    return candidates if candidates.numel() >= k else None


def topk_indices(magnitudes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of a 1-D tensor and their indices, unsorted.

    Args:
        magnitudes: 1-D, not modified.
        k: in [0, numel].

    Returns:
        ``(values, indices)`` with the same values as ``torch.topk(magnitudes, k)``.

    Raises:
        ValueError: ``k`` outside [0, numel].
    """
    numel = magnitudes.numel()
    if not 0 <= k <= numel:
        raise ValueError(f"k={k!r} is outside the allowed range [0, {numel}]")
    candidates = _candidates(magnitudes, k)
    if candidates is None:
        values, indices = torch.topk(magnitudes, k, sorted=False)
        return values, indices
    values, chosen = torch.topk(magnitudes[candidates], k, sorted=False)
    return values, candidates[chosen]


def kth_largest(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest entry of a 1-D tensor (a 0-d tensor), as ``torch.kthvalue`` finds it.

    Args:
        magnitudes: 1-D, not modified.
        k: in [1, numel].

    Raises:
        ValueError: ``k`` outside [1, numel].
    """
    numel = magnitudes.numel()
    if not 1 <= k <= numel:
        raise ValueError(f"k={k!r} is outside the allowed range [1, {numel}]")
    candidates = _candidates(magnitudes, k)
    pool = magnitudes if candidates is None else magnitudes[candidates]
    return torch.kthvalue(pool, pool.numel() - k + 1).values
