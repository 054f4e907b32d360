"""Payloads: what a compressor produces, with an exact byte encoding for the wire.

Every payload serialises to a flat ``uint8`` tensor (``to_bytes``) and back
(``from_bytes``); ``nbytes`` is the length of that tensor, so the bytes the
Meter records are exactly the bytes handed to torch.distributed.

Sparse layout (all fields 4-byte aligned so they can be viewed in place)::

    int32 header            k >= 0: k int32 indices follow; -1: a bitmap follows
    indices | bitmap        4k bytes, or ceil(N / 8) bytes padded to 4
    values                  k values (fp32, or fp16 padded to 4 bytes)

The index list is used when it is smaller than the bitmap (k < N / 32);
otherwise the bitmap, whose values are then in ascending index order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from thinwire.compress import chunk_index
from thinwire.compress.base import TensorInfo
from thinwire.compress.values import Cast, ValueCodec, align

HEADER_BYTES = 4
# The index codes of an offset per index within blocks of 2**bits entries: 16 bits, or 8
# (smaller than 16 above about 1.6 % of the entries, than a bitmap below about 11 %).
GAP_CODES = {"delta16": 16, "delta8": 8}
_OFFSETS = {16: torch.uint16, 8: torch.uint8}  # how an offset is read back
# index lists of a SparseLayout (a bitmap when smaller); "delta8" only when asked for
INDEX_FORMATS = ("int32", "delta16", "delta8")
CHUNK_FORMATS = chunk_index.FORMATS  # positions of a fixed count per chunk (a chunk plan's)
Plan = tuple[tuple[int, int], ...]  # (entries, positions sent) of each chunk, in order
_BITMAP = -1
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pad4(nbytes: int) -> int:
    return (nbytes + 3) // 4 * 4


def bitmap_bytes(numel: int) -> int:
    """Bytes of a bitmap of ``numel`` entries (:func:`pack_bits`), padded to 4."""
    return _pad4(math.ceil(numel / 8))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)


def _padded(part: torch.Tensor) -> torch.Tensor:
    """``part`` (bytes) zero-padded to a multiple of 4."""
    return torch.nn.functional.pad(part, (0, _pad4(part.numel()) - part.numel()))


def _ascending(indices: torch.Tensor) -> bool:
    """Whether ``indices`` (1-D) are strictly ascending, as the gap codes need them."""
    return indices.numel() < 2 or bool((indices[1:] > indices[:-1]).all())


def gap_bytes(capacity: int, numel: int, bits: int = 16) -> int:
    """Bytes of up to ``capacity`` ascending indices into ``numel`` entries in the ``bits``
    index code (:data:`GAP_CODES`): each index's offset in its block of ``2**bits``
    entries (its low ``bits`` bits), padded to 4, then one int32 per block: how many
    indices lie before its end."""
    return _pad4(capacity * bits // 8) + 4 * (numel >> bits) + 4


def encode_gaps(indices: torch.Tensor, capacity: int, numel: int, area: torch.Tensor,
                bits: int = 16) -> None:
    """Write distinct ascending ``indices`` into ``area`` (zeroed uint8 of
    :func:`gap_bytes`). Fixed sizes only, so nothing waits on a GPU."""
    width, block = bits // 8, 1 << bits
    # copy_ into the narrower integer keeps the low bits
    area[: width * indices.numel()].view(_OFFSETS[bits]).copy_(indices)
    start, blocks = _pad4(width * capacity), (numel >> bits) + 1
    ends = torch.arange(block, block * (blocks + 1), block, device=indices.device)
    torch.searchsorted(indices, ends, out_int32=True,
                       out=area[start: start + 4 * blocks].view(torch.int32))


def decode_gaps(area: torch.Tensor, count: int, capacity: int, numel: int,
                bits: int = 16) -> torch.Tensor:
    """The ``count`` int64 indices, ascending, that :func:`encode_gaps` wrote into ``area``."""
    width = bits // 8
    offsets = area[: width * count].view(_OFFSETS[bits]).to(torch.int64)
    start = _pad4(width * capacity)
    ends = area[start: start + 4 * ((numel >> bits) + 1)].view(torch.int32)
    # Entry j lies in the first block whose end is above j.
    positions = torch.arange(count, dtype=torch.int32, device=area.device)
    return offsets.add_(torch.searchsorted(ends, positions, side="right"), alpha=1 << bits)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool mask into bytes, least significant bit first."""
    pad = (-mask.numel()) % 8
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad))
    return (bits.view(-1, 8) * _BIT_WEIGHTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a flat bool mask of ``numel`` entries."""
    bits = packed.unsqueeze(1).bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0)
    return bits.reshape(-1)[:numel]


@dataclass(frozen=True)
class DensePayload:
    """A whole tensor, possibly cast (fp16); summable, so it travels by all-reduce."""

    values: torch.Tensor  # flat

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def to_bytes(self) -> torch.Tensor:
        return _as_bytes(self.values)


@dataclass(frozen=True)
class SparsePayload:
    """Selected entries of a flat tensor of ``numel`` entries.

    ``indices`` are int64 in memory; on the wire they become int32 or a bitmap,
    whichever is smaller. ``values`` keep the dtype they travel in.
    """

    values: torch.Tensor
    indices: torch.Tensor
    numel: int

    @property
    def count(self) -> int:
        return self.values.numel()

    @property
    def uses_bitmap(self) -> bool:
        return 4 * self.count > bitmap_bytes(self.numel)

    @property
    def nbytes(self) -> int:
        index_bytes = bitmap_bytes(self.numel) if self.uses_bitmap else 4 * self.count
        return HEADER_BYTES + index_bytes + _pad4(self.count * self.values.element_size())

    def to_bytes(self) -> torch.Tensor:
        if self.uses_bitmap:
            order = torch.argsort(self.indices)
            device = self.values.device
            mask = torch.zeros(self.numel, dtype=torch.bool, device=device)
            mask[self.indices] = True
            header = torch.tensor([_BITMAP], dtype=torch.int32, device=device)
            index_part = _padded(pack_bits(mask))
            values = self.values[order]
        else:
            header = torch.tensor([self.count], dtype=torch.int32, device=self.values.device)
            index_part = _as_bytes(self.indices.to(torch.int32))
            values = self.values
        return torch.cat([_as_bytes(header), index_part, _padded(_as_bytes(values))])

    @staticmethod
    def from_bytes(
        buffer: torch.Tensor, numel: int, value_dtype: torch.dtype
    ) -> tuple[SparsePayload, int]:
        """Decode one sparse payload from the start of ``buffer``.

        Returns:
            The payload and the number of bytes it occupied.
        """
        header = int(buffer[:HEADER_BYTES].view(torch.int32)[0])
        offset = HEADER_BYTES
        if header == _BITMAP:
            nbitmap = math.ceil(numel / 8)
            mask = unpack_bits(buffer[offset : offset + nbitmap], numel)
            indices = mask.nonzero().squeeze(1)
            offset += _pad4(nbitmap)
        else:
            indices = buffer[offset : offset + 4 * header].view(torch.int32).to(torch.int64)
            offset += 4 * header
        count = indices.numel()
        value_bytes = count * value_dtype.itemsize
        # A copy: float64 values need 8-byte alignment the 4-byte layout does not give.
        values = buffer[offset : offset + value_bytes].clone().view(value_dtype)
        offset += _pad4(value_bytes)
        return SparsePayload(values, indices, numel), offset


@dataclass(frozen=True)
class LowRankPayload:
    """Factors of a low-rank approximation ``P @ Q.T`` of an (n, m) matrix."""

    p: torch.Tensor  # (n, r)
    q: torch.Tensor  # (m, r)

    @property
    def nbytes(self) -> int:
        return (self.p.numel() + self.q.numel()) * self.p.element_size()

    def to_bytes(self) -> torch.Tensor:
        return torch.cat([_as_bytes(self.p), _as_bytes(self.q)])


@dataclass(frozen=True)
class IndexCodec:
    """Up to ``capacity`` distinct indices into ``numel`` entries, in an area of fixed size.

    Formats: ``"int32"`` (4 bytes an index), ``"delta16"`` and ``"delta8"`` (the 16- and
    8-bit gap codes, :func:`gap_bytes`), ``"bitmap"`` (a bit per entry), and the chunk codes
    ``"elias-fano"`` and ``"fixed"`` (:mod:`~thinwire.compress.chunk_index`) of
    a selection that sends a fixed count of each chunk (``plan``): they carry all
    ``capacity`` positions or none. The gap codes, the bitmap and the chunk codes
    need ascending indices; :meth:`encode` sorts them when they are not, with their
    values, so no order decodes wrong.
    """

    format: str  # "int32", "delta16", "delta8", "bitmap", "elias-fano" or "fixed"
    capacity: int
    numel: int
    plan: Plan = ()  # a chunk code's chunks, covering numel and counting capacity

    @staticmethod
    def choose(preferred: str | None, capacity: int, numel: int,
               plan: Plan = ()) -> IndexCodec:
        """``preferred`` (one of :data:`INDEX_FORMATS` or :data:`CHUNK_FORMATS`, these with
        a ``plan``) unless a bitmap is smaller; None: the smallest of int32, delta16 and
        bitmap (the first on a tie).

        Raises:
            ValueError: an unknown format, or a chunk code without a plan.
        """
        if preferred is not None and preferred not in (*INDEX_FORMATS, *CHUNK_FORMATS):
            raise ValueError(f"indices={preferred!r} must be one of "
                             f"{(*INDEX_FORMATS, *CHUNK_FORMATS)}")
        if preferred in CHUNK_FORMATS and (
                sum(size for size, _ in plan) != numel
                or sum(count for _, count in plan) != capacity):
            raise ValueError(f"indices={preferred!r} needs the plan of a selection that sends "
                             f"a fixed count of each chunk, covering {numel} entries and "
                             f"counting {capacity}")
        candidates = [preferred] if preferred is not None else ["int32", "delta16"]
        codecs = [IndexCodec(name, capacity, numel, plan if name in CHUNK_FORMATS else ())
                  for name in (*candidates, "bitmap")]
        return min(codecs, key=lambda codec: codec.nbytes)  # min keeps the first of equals

    @functools.cached_property
    def nbytes(self) -> int:
        if self.format == "bitmap":
            return bitmap_bytes(self.numel)
        if self.format in GAP_CODES:
            return gap_bytes(self.capacity, self.numel, GAP_CODES[self.format])
        if self.format in CHUNK_FORMATS:
            return chunk_index.nbytes(self.plan, self.format)
        return 4 * self.capacity

    @property
    def entry_bytes(self) -> int:
        """Bytes that grow with each valid index (the rest are fixed)."""
        if self.format in GAP_CODES:
            return GAP_CODES[self.format] // 8
        return 4 if self.format == "int32" else 0

    @property
    def ordered(self) -> bool:
        """Whether the code needs ascending indices (values then follow their order)."""
        return self.format != "int32"

    def encode(self, indices: torch.Tensor, area: torch.Tensor) -> None:
        """Write ``indices`` (distinct, ascending where :attr:`ordered`) into ``area``
        (zeroed uint8 of :attr:`nbytes`)."""
        if self.format == "bitmap":
            mask = torch.zeros(self.numel, dtype=torch.bool, device=area.device)
            mask[indices] = True
            bits = pack_bits(mask)
            area[: bits.numel()] = bits
        elif self.format in GAP_CODES:
            encode_gaps(indices, self.capacity, self.numel, area, GAP_CODES[self.format])
        elif self.format in CHUNK_FORMATS:
            if indices.numel():  # all or nothing: none leaves the area zero
                code = chunk_index.encode(indices, self.plan, self.format)
                area[: code.numel()] = code
        else:
            area[: 4 * indices.numel()].view(torch.int32).copy_(indices)

    def decode(self, area: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` int64 indices :meth:`encode` wrote into ``area``.

        Raises:
            ValueError: a chunk code's count other than 0 or its capacity.
        """
        if self.format in CHUNK_FORMATS:
            if count not in (0, self.capacity):
                raise ValueError(f"a chunk code carries 0 or {self.capacity} positions, "
                                 f"not {count}")
            return (chunk_index.decode(area, self.plan, self.format) if count
                    else area.new_zeros(0, dtype=torch.int64))
        if self.format == "bitmap":
            return unpack_bits(area[: math.ceil(self.numel / 8)], self.numel).nonzero().squeeze(1)
        if self.format in GAP_CODES:
            return decode_gaps(area, count, self.capacity, self.numel, GAP_CODES[self.format])
        return area[: 4 * count].view(torch.int32).long()


@dataclass(frozen=True)
class SparseLayout:
    """A fixed-size sparse payload: room for ``capacity`` entries of a flat region.

    Every rank's payload of one exchange has the same size, so a sparse
    exchange is a single all-gather with no round of lengths before it; the
    header says how many entries are valid. Layout (4-byte aligned)::

        int32 header        valid count c <= capacity
        indices             the index codec's area (:class:`IndexCodec`):
                            ``indices`` ("int32", a gap code, or a chunk code), or a
                            bitmap when that is smaller (the same choice on every rank)
        values              the value codec's area (:mod:`thinwire.compress.values`):
                            capacity values as floats, or codes and their scales;
                            starting and ending aligned to 4 bytes and to a float's
                            width (fp64: 8); with ``groups``, one area per group

    Unused slots and alignment bytes are zero. With a bitmap, a gap code or a chunk
    code, values are in ascending index order. A layout with a ``plan`` or ``groups``
    carries all ``capacity`` entries or none (a round skipped).
    """

    numel: int  # entries of the region the indices point into, < 2**31
    capacity: int  # most entries carried, in [0, numel]
    value_dtype: torch.dtype = torch.float32  # the dtype of the values encoded (a tensor's)
    indices: str = "int32"  # the index list format when no bitmap: "int32" or a gap code
    values: ValueCodec = field(default_factory=lambda: Cast("native"))  # how values travel
    plan: Plan = ()  # the chunks of a selection sending a fixed count of each (chunk codes)
    groups: tuple[int, ...] = ()  # values of each tensor, coded apart (a per-tensor codec)

    def __post_init__(self) -> None:
        if not 0 <= self.numel < 2**31:
            raise ValueError(f"numel={self.numel!r} is outside the allowed range [0, 2**31)")
        if not 0 <= self.capacity <= self.numel:
            raise ValueError(f"capacity={self.capacity!r} is outside the allowed range "
                             f"[0, {self.numel}]")
        if self.indices not in (*INDEX_FORMATS, *CHUNK_FORMATS):
            raise ValueError(f"indices={self.indices!r} must be one of "
                             f"{(*INDEX_FORMATS, *CHUNK_FORMATS)}")
        if self.groups and sum(self.groups) != self.capacity:
            raise ValueError(f"groups={self.groups!r} must add up to capacity={self.capacity}")

    @functools.cached_property
    def index_codec(self) -> IndexCodec:
        return IndexCodec.choose(self.indices, self.capacity, self.numel, self.plan)

    @property
    def whole(self) -> bool:
        """Whether a payload carries all ``capacity`` entries or none."""
        return bool(self.plan or self.groups)

    def _areas(self) -> list[tuple[int, int, int]]:
        """``(start, stop, capacity)`` of each value area: one, or one per group."""
        areas, start = [], self.value_start
        for size in self.groups or (self.capacity,):
            stop = start + self.values.nbytes(size, self.value_dtype)
            areas.append((start, stop, size))
            start = stop
        return areas

    @property
    def uses_bitmap(self) -> bool:
        return self.index_codec.format == "bitmap"

    @property
    def index_bytes(self) -> int:
        return self.index_codec.nbytes

    @property
    def index_entry_bytes(self) -> int:
        """Index bytes that grow with each valid entry (the rest are fixed)."""
        return self.index_codec.entry_bytes

    @property
    def value_start(self) -> int:
        """Where values begin: after header and indices, aligned for the value codec."""
        return align(HEADER_BYTES + self.index_bytes, self.values.width(self.value_dtype))

    @functools.cached_property
    def nbytes(self) -> int:
        return self._areas()[-1][1]

    def encode(self, indices: torch.Tensor, values: torch.Tensor, *,
               ascending: bool = False) -> torch.Tensor:
        """The payload of ``values`` at ``indices``: :meth:`pack`'s payload."""
        return self.pack(indices, values, ascending=ascending)[0]

    def pack(self, indices: torch.Tensor, values: torch.Tensor, *,
             ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The payload of ``values`` at ``indices`` (distinct, at most ``capacity``), and
        what every receiver decodes of the values, in the order given.

        Args:
            ascending: the caller vouches that ``indices`` ascend strictly (a
                sparsifier's selection does, :meth:`~thinwire.compress.Sparsifier.select_all`),
                so the gap codes and the bitmap skip the check, a pass and a wait on a
                GPU; else they sort when needed.

        Returns:
            ``nbytes`` uint8 on ``values``' device, and the decoded values.

        Raises:
            ValueError: more entries than ``capacity``, or (:attr:`whole`) neither all
                nor none.
        """
        count = indices.numel()
        if count > self.capacity:
            raise ValueError(f"{count} entries exceed the payload capacity {self.capacity}")
        if self.whole and count not in (0, self.capacity):
            raise ValueError(f"this payload carries all {self.capacity} entries or none, "
                             f"not {count}")
        codec = self.index_codec
        order = None
        if codec.ordered and not (ascending or _ascending(indices)):
            indices, order = torch.sort(indices)
            values = values[order]
        out = torch.zeros(self.nbytes, dtype=torch.uint8, device=values.device)
        out[:HEADER_BYTES].view(torch.int32).fill_(count)
        codec.encode(indices, out[HEADER_BYTES: HEADER_BYTES + codec.nbytes])
        if not self.groups:
            sent = self.values.write(values, out[self.value_start:], self.capacity)
        elif not count:  # nothing sent: the areas stay zero
            sent = values.clone()
        else:
            areas = self._areas()
            parts = values.split([size for _, _, size in areas])
            sent = torch.cat([self.values.write(part, out[start:stop], size)
                              for part, (start, stop, size) in zip(parts, areas)])
        if order is not None:  # back in the order given
            sent = torch.empty_like(sent).index_copy_(0, order, sent)
        return out, sent

    def counts(self, buffers: Sequence[torch.Tensor]) -> list[int]:
        """The valid entries of each payload of ``buffers``, read in one transfer."""
        if len(buffers) == 1:
            return [int(buffers[0][:HEADER_BYTES].view(torch.int32)[0])]
        return torch.cat([b[:HEADER_BYTES] for b in buffers]).view(torch.int32).tolist()

    def decode(self, buffer: torch.Tensor,
               count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, values)`` of a payload made by :meth:`encode`: int64 indices, and
        the values as the codec reads them (:meth:`~thinwire.compress.values.ValueCodec.read`).

        Args:
            count: its valid entries, if already read (:meth:`counts`).
        """
        if count is None:
            count = self.counts([buffer])[0]
        indices = self.index_codec.decode(buffer[HEADER_BYTES: HEADER_BYTES + self.index_bytes],
                                          count)
        if not self.groups:
            return indices, self.values.read(buffer[self.value_start:], count, self.capacity,
                                             self.value_dtype)
        if not count:
            return indices, buffer.new_zeros(0, dtype=self.value_dtype)
        return indices, torch.cat([self.values.read(buffer[start:stop], size, size,
                                                    self.value_dtype)
                                   for start, stop, size in self._areas()])

    def segments(self, counts: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """The metered parts of one payload, adding up to its size.

        Each layer is charged its valid entries (values, and indices unless a
        bitmap or a chunk code); the header, the bitmap and a chunk code are charged
        as ``"(header)"``, ``"(bitmap)"`` and ``"(positions)"``, a codec's fixed parts
        as it names them (``"(scales)"``, ``"(tables)"``), the unused capacity (and
        a gap code's block ends) as ``"(padding)"``.

        Args:
            counts: ``(layer, valid entries)`` of the payload.
        """
        index, values, dtype = self.index_entry_bytes, self.values, self.value_dtype
        parts = [(layer, count * index + values.entry_bytes(count, dtype))
                 for layer, count in counts]
        parts.append(("(header)", HEADER_BYTES))
        if self.uses_bitmap:
            parts.append(("(bitmap)", self.index_bytes))
        elif self.index_codec.format in CHUNK_FORMATS:
            parts.append(("(positions)", self.index_bytes))
        fixed: dict[str, int] = {}
        for _, _, size in self._areas():
            for name, nbytes in values.extra_segments(size):
                fixed[name] = fixed.get(name, 0) + nbytes
        parts.extend(fixed.items())
        parts.append(("(padding)", self.nbytes - sum(nbytes for _, nbytes in parts)))
        return parts


Payload = DensePayload | SparsePayload | LowRankPayload


def decode(payload: Payload, info: TensorInfo) -> torch.Tensor:
    """Dense tensor of ``info``'s shape and dtype from a dense or sparse payload."""
    if isinstance(payload, DensePayload):
        return payload.values.to(info.dtype).reshape(info.shape)
    if isinstance(payload, SparsePayload):
        flat = torch.zeros(info.numel, dtype=info.dtype, device=info.device)
        flat[payload.indices] = payload.values.to(info.dtype)
        return flat.reshape(info.shape)
    raise TypeError(f"cannot decode a {type(payload).__name__} without its transport")
