"""Index codes for chunk-wise top-k: each chunk's ascending positions in a fixed number of bits.

Every chunk of ``size`` entries sends exactly ``count`` positions
(:func:`thinwire.compress.chunked.chunk_counts`), so each format's length is
fixed by the chunk plan alone (:func:`nbytes`) and a payload can be
all-gathered without a round of lengths. A chunk sending all or none of its
entries takes no bits. Bits are written least significant first, chunk after
chunk, and the stream is zero-padded to whole bytes.

* ``"fixed"``: ``ceil(log2(size))`` bits a position, as the SparseLoCo reference
  code packs them (12 bits for a chunk of 4096: two positions in three bytes).
* ``"elias-fano"``: the positions' low ``L = floor(log2(size / count))`` bits
  each, then their high parts in unary (bit ``(x_i >> L) + i`` set in
  ``count + ((size - 1) >> L)`` bits; Elias 1974, Fano 1971): at most
  ``2 + log2(size / count)`` bits a position, 8 for 64 of 4096 against 12.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FORMATS = ("elias-fano", "fixed")


def _low_bits(size: int, count: int) -> int:
    """Elias-Fano's ``L`` for ``count`` positions below ``size``."""
    return max(0, int(math.floor(math.log2(size / count)))) if count else 0


def chunk_bits(size: int, count: int, fmt: str) -> int:
    """Bits of one chunk's ``count`` positions in ``[0, size)`` under ``fmt``."""
    if count in (0, size):
        return 0
    if fmt == "fixed":
        return count * max(1, (size - 1).bit_length())
    low = _low_bits(size, count)
    return count * low + count + ((size - 1) >> low)


def nbytes(plan: Sequence[tuple[int, int]], fmt: str) -> int:
    """Bytes of the code of a chunk plan (``(size, count)`` per chunk, in order)."""
    check(fmt)
    return (sum(chunk_bits(size, count, fmt) for size, count in plan) + 7) // 8


def check(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"indices={fmt!r} must be one of {FORMATS}")
    return fmt


def _bits_of(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values`` (int64, any shape) as ``width`` bits each, least significant first (uint8)."""
    shifts = torch.arange(width, device=values.device)
    return values.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1).to(torch.uint8)


def _value_of(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_bits_of` over the last dimension (int64)."""
    shifts = torch.arange(bits.shape[-1], device=bits.device)
    return bits.to(torch.int64).bitwise_left_shift(shifts).sum(-1)


def _runs(plan: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(size, count, chunks)``: consecutive chunks of one shape, coded together."""
    runs: list[tuple[int, int, int]] = []
    for size, count in plan:
        if runs and runs[-1][:2] == (size, count):
            runs[-1] = (size, count, runs[-1][2] + 1)
        else:
            runs.append((size, count, 1))
    return runs


def _encode_rows(rows: torch.Tensor, size: int, count: int, fmt: str) -> torch.Tensor:
    """The bits (chunks, chunk_bits) of ``rows`` (chunks, count) of ascending positions."""
    if fmt == "fixed":
        return _bits_of(rows, max(1, (size - 1).bit_length())).reshape(rows.shape[0], -1)
    low = _low_bits(size, count)
    lows = _bits_of(rows.bitwise_and((1 << low) - 1), low).reshape(rows.shape[0], -1)
    high = torch.zeros(rows.shape[0], count + ((size - 1) >> low), dtype=torch.uint8,
                       device=rows.device)
    ones = rows.bitwise_right_shift(low) + torch.arange(count, device=rows.device)
    high.scatter_(1, ones, 1)
    return torch.cat([lows, high], dim=1)


def _decode_rows(bits: torch.Tensor, size: int, count: int, fmt: str) -> torch.Tensor:
    """Inverse of :func:`_encode_rows`: (chunks, count) positions within each chunk."""
    chunks = bits.shape[0]
    if fmt == "fixed":
        return _value_of(bits.view(chunks, count, -1))
    low = _low_bits(size, count)
    lows = _value_of(bits[:, : count * low].reshape(chunks, count, low))
    ones = bits[:, count * low:].nonzero()[:, 1].view(chunks, count)  # row-major: per row
    highs = ones - torch.arange(count, device=bits.device)
    return highs.bitwise_left_shift(low).bitwise_or_(lows)


def encode(indices: torch.Tensor, plan: Sequence[tuple[int, int]], fmt: str) -> torch.Tensor:
    """Pack ``indices`` (positions in the flat tensor, ascending within each chunk, the
    chunks' in order) under ``fmt``: :func:`nbytes` ``(plan, fmt)`` bytes (uint8).

    Raises:
        ValueError: an unknown format, or not as many indices as the plan counts.
    """
    check(fmt)
    if indices.numel() != sum(count for _, count in plan):
        raise ValueError(f"{indices.numel()} indices for a plan of "
                         f"{sum(count for _, count in plan)}")
    device = indices.device
    streams, start, taken = [], 0, 0
    for size, count, chunks in _runs(plan):
        rows = indices[taken: taken + chunks * count].view(chunks, count)
        offsets = torch.arange(start, start + chunks * size, size, device=device)
        if chunk_bits(size, count, fmt):
            streams.append(_encode_rows(rows - offsets.unsqueeze(1), size, count, fmt)
                           .reshape(-1))
        start += chunks * size
        taken += chunks * count
    bits = torch.cat(streams) if streams else torch.zeros(0, dtype=torch.uint8, device=device)
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8)).view(-1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=device)).sum(1, dtype=torch.uint8)


def decode(code: torch.Tensor, plan: Sequence[tuple[int, int]], fmt: str) -> torch.Tensor:
    """Inverse of :func:`encode`: the int64 positions in the flat tensor, ascending.

    Args:
        code: the :func:`nbytes` bytes :func:`encode` wrote (uint8; any trailing bytes
            are ignored).
    """
    check(fmt)
    device = code.device
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = code[: nbytes(plan, fmt)].unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1)
    bits = bits.reshape(-1)
    parts, start, read = [], 0, 0
    for size, count, chunks in _runs(plan):
        width = chunk_bits(size, count, fmt)
        offsets = torch.arange(start, start + chunks * size, size, device=device).unsqueeze(1)
        if width:
            rows = bits[read: read + chunks * width].view(chunks, width)
            parts.append((_decode_rows(rows, size, count, fmt) + offsets).reshape(-1))
        elif count:  # every entry of each chunk
            parts.append((torch.arange(size, device=device) + offsets).reshape(-1))
        start += chunks * size
        read += chunks * width
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
