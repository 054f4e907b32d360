"""Exact selection without a full sort: top-k, the k-th largest, the indices of a sparse mask.

A strided sample of the magnitudes gives a lower bound that, with margin,
the k-th largest entry clears; only the entries at or above that bound (the
candidates, a few times k) go through ``torch.topk``. When the bound turns
out too high (fewer than k candidates: an adversarial layout or heavy ties
the sample missed) the full ``torch.topk`` runs instead, so the result is
always exact: the same values as ``torch.topk`` / ``torch.kthvalue`` on the
whole tensor. Of several entries tied at the k-th largest value, the
lowest positions are kept, and the k positions come out ascending, so no
sort follows (:func:`largest_in_order`). On a GPU, below :data:`GPU_DIRECT`
entries, ``torch.topk`` and a sort of its k positions do the same in two
kernel launches and no wait on the GPU: there the candidates' extra launches and
host synchronisations cost more than the full selection they avoid.
"""

from __future__ import annotations

import math

import torch

SAMPLE = 4096  # entries sampled to place the lower bound
MAX_FRACTION = 0.1  # above k / N this, torch.topk on everything is as cheap
WORD = 8  # mask bytes read as one int64 word by sparse_nonzero
# From this expected fraction of true entries on, plain ``nonzero`` is the faster on one CPU
# thread: the word pass finds most words hot and only adds a pass over them.
WORDWISE_BELOW = 0.03
# Up to this many entries a GPU selects by torch.topk and a sort of the positions: on one
# H100 that was the faster of the two at 1M and 4M entries, the candidates at 25M.
GPU_DIRECT = 1 << 23


def sparse_nonzero(mask: torch.Tensor, density: float | None = None) -> torch.Tensor:
    """The indices of the true entries of a 1-D bool mask, ascending (``mask.nonzero()``).

    A mask that is mostly false (a threshold passing about 1 % of a layer) is
    read eight bytes at a time: one ``nonzero`` over the int64 words finds the
    words with a true byte, a second one over just those words' bytes places
    the entries. On one CPU thread that is about half the time of
    ``nonzero`` on the bytes themselves for a 4M-entry layer at 1 %. When
    more than two thirds of the words hold a true byte, or on a GPU (where
    ``nonzero`` is one parallel pass, and the two extra passes and their
    host synchronisations cost more than they save), plain ``nonzero`` is
    used. Exact: the same indices, in the same order.

    Args:
        mask: 1-D bool, contiguous; not modified.
        density: the fraction of true entries expected, if the caller knows it: at
            :data:`WORDWISE_BELOW` or more, plain ``nonzero`` without the word pass.

    Returns:
        int64 indices of shape ``(count,)`` on ``mask``'s device.
    """
    numel = mask.numel()
    whole = numel // WORD * WORD
    if (whole < 4 * SAMPLE or mask.device.type != "cpu" or not mask.is_contiguous()
            or mask.storage_offset() % WORD
            or (density is not None and density >= WORDWISE_BELOW)):
        return mask.nonzero().squeeze(1)
    words = mask[:whole].view(torch.int64)
    hot = words.nonzero().squeeze(1)
    if 3 * hot.numel() > 2 * words.numel():  # dense: nothing to skip
        return mask.nonzero().squeeze(1)
    within = words.index_select(0, hot).view(torch.bool).nonzero().squeeze(1)
    indices = hot.index_select(0, within >> 3).mul_(WORD).add_(within & (WORD - 1))
    if whole == numel:
        return indices
    return torch.cat([indices, mask[whole:].nonzero().squeeze(1).add_(whole)])


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
    candidates = sparse_nonzero(magnitudes >= bound, density=2 * k / magnitudes.numel())
    return candidates if candidates.numel() >= k else None


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
    pool = magnitudes if candidates is None else magnitudes.index_select(0, candidates)
    if pool.device.type == "cpu":
        return torch.kthvalue(pool, pool.numel() - k + 1).values
    return kth_by_topk(pool, k)


def kth_by_topk(pool: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest entry of 1-D ``pool`` as the end of ``torch.topk``'s selection.

    The same value as ``torch.kthvalue`` (the smallest of the k largest, or the
    largest of the ``numel - k + 1`` smallest, whichever selection is shorter),
    for a GPU, where ``kthvalue`` sorts and is many times slower than ``topk``.
    """
    smallest = pool.numel() - k + 1
    if k <= smallest:
        return torch.topk(pool, k, sorted=False).values.min()
    return torch.topk(pool, smallest, largest=False, sorted=False).values.max()


def largest_in_order(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest entries of a 1-D tensor, in ascending order.

    Ties at the k-th largest value are broken towards the lowest positions,
    so the choice is the same on every call and device, and the positions come
    out ascending (a sparse payload's 16-bit index code needs them so). Only the
    candidates above a sampled bound are ranked when there are enough of them;
    they come out of ``nonzero`` ascending, so keeping the k largest of them
    keeps the order. On a GPU, up to :data:`GPU_DIRECT` entries: ``torch.topk``
    and a sort of the k positions.

    Args:
        magnitudes: 1-D, not modified.
        k: in [0, numel].

    Raises:
        ValueError: ``k`` outside [0, numel].
    """
    numel = magnitudes.numel()
    if not 0 <= k <= numel:
        raise ValueError(f"k={k!r} is outside the allowed range [0, {numel}]")
    if k == numel:
        return torch.arange(numel, device=magnitudes.device)
    if k == 0:
        return torch.zeros(0, dtype=torch.int64, device=magnitudes.device)
    if magnitudes.device.type != "cpu" and numel <= GPU_DIRECT:
        # torch.topk on a GPU keeps the lowest positions of the entries tied at the k-th
        # value, as below (tests/test_cuda.py checks it on tied inputs).
        return torch.topk(magnitudes, k, sorted=False).indices.sort().values
    candidates = _candidates(magnitudes, k)
    if candidates is not None and candidates.numel() < numel:
        return candidates.index_select(
            0, largest_in_order(magnitudes.index_select(0, candidates), k))
    kth = torch.topk(magnitudes, k, sorted=False).values.min()
    keep = magnitudes >= kth
    extra = int(keep.sum()) - k  # entries tied at the k-th value beyond k: the highest go
    if extra:
        ties = (magnitudes == kth).nonzero().squeeze(1)
        keep[ties[ties.numel() - extra:]] = False
    return keep.nonzero().squeeze(1)
