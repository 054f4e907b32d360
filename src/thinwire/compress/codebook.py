"""SparseLoCo's 2-bit values: four bins cut at fixed multiples of the spread, each sent as its mean.

The values (a tensor's selected entries) are centred on their mean ``mu``
and cut by ``scale = RANGE * std / BINS`` (``std`` the unbiased standard
deviation, ``RANGE`` = 6 deviations over ``BINS`` = 4 bins) into the bins
``q = clamp(round((x - mu) / scale + 2), 0, 3)``; a receiver reads each code
as the mean of the values in its bin, four fp32 numbers sent after the codes
(an empty bin's is 0; :class:`~thinwire.compress.values.Binned` lays them out).
This is the reference code's statistical quantiser at 4 bins, with its mean
folded into the table. A scale of 0 (one value, or all
equal) or a non-finite one is replaced by 1. Arithmetic runs in fp32 (fp64 for
fp64 values) and each bin's sum is one reduction, so encoding is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thinwire.compress.quantise import SCALE_DTYPE, pack, unpack

BITS = 2
BINS = 1 << BITS
RANGE = 6.0  # the spread the bins cover, in standard deviations


@dataclass(frozen=True)
class Codebook:
    """2-bit codes of ``numel`` values and the four values they stand for."""

    codes: torch.Tensor  # uint8, packed four to a byte, unpadded
    table: torch.Tensor  # SCALE_DTYPE (fp32), one value per bin
    numel: int


def code_bytes(numel: int) -> int:
    """Bytes of the packed codes of ``numel`` values."""
    return (numel * BITS + 7) // 8


TABLE_BYTES = BINS * SCALE_DTYPE.itemsize  # the four values of a codebook's bins


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def encode(values: torch.Tensor) -> Codebook:
    """The codebook of ``values`` (1-D; not modified)."""
    work = values.to(_work_dtype(values.dtype))
    numel = work.numel()
    mean = work.mean() if numel else work.new_zeros(())
    centred = work - mean
    std = centred.norm() / (numel - 1) ** 0.5 if numel > 1 else work.new_zeros(())
    scale = RANGE * std / BINS
    scale = torch.where((scale > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))
    codes = torch.round(centred / scale + BINS // 2).clamp_(0, BINS - 1).to(torch.uint8)
    bins = codes.unsqueeze(0) == torch.arange(BINS, device=codes.device).unsqueeze(1)
    table = torch.where(bins, work, 0.0).sum(1) / bins.sum(1).clamp(min=1)
    return Codebook(pack(codes, BITS), table.to(SCALE_DTYPE), numel)


def decode(book: Codebook, dtype: torch.dtype) -> torch.Tensor:
    """The values ``book`` stands for, 1-D in ``dtype``."""
    codes = unpack(book.codes, book.numel, BITS).to(torch.int64)
    return book.table.to(_work_dtype(dtype)).index_select(0, codes).to(dtype)
