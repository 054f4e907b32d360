"""Value codecs: how the entries a selection chose travel.

A codec writes up to ``capacity`` values into a fixed area of a payload and
reads them back; :meth:`ValueCodec.nbytes` depends on the capacity alone, so
every rank's payload has one size. :class:`Cast` sends each value in a float
type (fp32, fp16, bf16, or the tensor's own); its values are summable, so
where every rank sends the same coordinates they are averaged by all-reduce.
:class:`Quantised` sends codes with a scale per chunk
(:class:`~thinwire.compress.quantise.Quantiser`: int8, int4, int2, sign); a
sum of codes at different scales is no code, so they travel by all-gather and
each rank decodes every payload. :class:`Binned` sends 2-bit codes and the mean
of each code's bin (SparseLoCo's values, :mod:`~thinwire.compress.codebook`),
a table per tensor. None keeps state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from thinwire.compress import codebook
from thinwire.compress.quantise import (
    KINDS,
    SCALE_DTYPE,
    QuantisedPayload,
    Quantiser,
    chunks,
    code_bytes,
)

CASTS: dict[str, torch.dtype | None] = {"fp32": torch.float32, "fp16": torch.float16,
                                        "bf16": torch.bfloat16, "native": None}
BINNED = "int2-bins"  # SparseLoCo's 2-bit codes read as their bins' means
CODECS = (*CASTS, *KINDS, BINNED)  # every value codec's name


def align(nbytes: int, size: int) -> int:
    """``nbytes`` rounded up to a multiple of 4 and of ``size`` (a dtype's width)."""
    step = max(4, size)
    return (nbytes + step - 1) // step * step


class ValueCodec(ABC):
    """Values of one payload: written into, and read from, an area of fixed size.

    Attributes:
        name: the codec's name, one of :data:`CODECS`.
        summable: whether the mean over ranks of wire values is the wire value of the
            mean, so the values can be all-reduced (float casts; not codes).
        per_tensor: whether the codec's statistics are each tensor's own, so a payload
            holds one area per tensor (:class:`~thinwire.compress.SparseLayout`'s
            ``groups``).
    """

    name: str
    summable: bool
    per_tensor = False

    @abstractmethod
    def width(self, dtype: torch.dtype) -> int:
        """Alignment of the area in a payload, in bytes (a float's size; codes: 1)."""

    @abstractmethod
    def nbytes(self, capacity: int, dtype: torch.dtype) -> int:
        """Bytes of an area holding up to ``capacity`` values of a ``dtype`` tensor."""

    @abstractmethod
    def entry_bytes(self, count: int, dtype: torch.dtype) -> int:
        """Bytes a meter charges to ``count`` valid values (the rest of the area is charged
        as padding, or as :meth:`extra_segments`)."""

    def extra_segments(self, capacity: int) -> list[tuple[str, int]]:
        """Fixed parts of an area charged on their own (a quantiser's scales)."""
        return []

    @abstractmethod
    def write(self, values: torch.Tensor, area: torch.Tensor, capacity: int) -> torch.Tensor:
        """Encode ``values`` (1-D, at most ``capacity``) into ``area`` (zeroed uint8 of
        :meth:`nbytes`).

        Returns:
            What every receiver decodes of them (for the sender's error memory): a
            cast's wire values, a quantiser's dequantised codes in ``values``' dtype.
        """

    @abstractmethod
    def read(self, area: torch.Tensor, count: int, capacity: int,
             dtype: torch.dtype) -> torch.Tensor:
        """The ``count`` values :meth:`write` put in ``area``, as receivers decode them:
        a float cast's wire values (cast to ``dtype`` by the caller), or codes decoded
        into ``dtype``."""

    def exact(self, dtype: torch.dtype) -> bool:
        """Whether a ``dtype`` tensor's values arrive as they are (nothing left behind)."""
        return False

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a summable codec's values of a ``dtype`` tensor travel in.

        Raises:
            TypeError: codes, which do not travel as floats.
        """
        raise TypeError(f"{self.name} values travel as codes, not as floats")

    def cast(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as a summable codec sends them (all-reduced as they are).

        Raises:
            TypeError: as :meth:`wire_dtype`.
        """
        return values.to(self.wire_dtype(values.dtype))


class Cast(ValueCodec):
    """Each value in a float type: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"native"`` (the
    tensor's own dtype). Summable: a mean of casts is an all-reduce.

    Raises:
        ValueError: an unknown name.
    """

    summable = True

    def __init__(self, name: str = "fp32") -> None:
        if name not in CASTS:
            raise ValueError(f"values={name!r} must be one of {list(CASTS)}")
        self.name = name
        self.dtype = CASTS[name]

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.dtype is None else self.dtype

    def width(self, dtype: torch.dtype) -> int:
        return self.wire_dtype(dtype).itemsize

    def nbytes(self, capacity: int, dtype: torch.dtype) -> int:
        return align(capacity * self.width(dtype), self.width(dtype))

    def entry_bytes(self, count: int, dtype: torch.dtype) -> int:
        return count * self.width(dtype)

    def write(self, values: torch.Tensor, area: torch.Tensor, capacity: int) -> torch.Tensor:
        sent = self.cast(values)
        area[: sent.numel() * sent.element_size()].view(sent.dtype).copy_(sent)
        return sent

    def read(self, area: torch.Tensor, count: int, capacity: int,
             dtype: torch.dtype) -> torch.Tensor:
        wire = self.wire_dtype(dtype)
        return area[: count * wire.itemsize].view(wire)

    def exact(self, dtype: torch.dtype) -> bool:
        return self.wire_dtype(dtype) == dtype


class Quantised(ValueCodec):
    """Codes with one fp32 scale per chunk of values (:class:`Quantiser`): an area holds the
    packed codes of ``capacity`` values (padded to 4), then the scales of their chunks.
    Not summable: each rank's payload is decoded on its own.

    Args:
        kind: one of :data:`~thinwire.compress.quantise.KINDS`.
        chunk: values sharing one scale, >= 1.
    """

    summable = False

    def __init__(self, kind: str, chunk: int) -> None:
        self.quantiser = Quantiser(kind, chunk)
        self.name = kind

    def width(self, dtype: torch.dtype) -> int:
        return 1

    def nbytes(self, capacity: int, dtype: torch.dtype) -> int:
        return self.quantiser.nbytes(capacity)

    def entry_bytes(self, count: int, dtype: torch.dtype) -> int:
        return count * self.quantiser.bits // 8

    def extra_segments(self, capacity: int) -> list[tuple[str, int]]:
        return [("(scales)", SCALE_DTYPE.itemsize * chunks(capacity, self.quantiser.chunk))]

    def write(self, values: torch.Tensor, area: torch.Tensor, capacity: int) -> torch.Tensor:
        payload = self.quantiser.encode(values)
        area[: payload.codes.numel()] = payload.codes
        room = code_bytes(capacity, self.quantiser.bits)
        scales = payload.scales.view(torch.uint8)
        area[room: room + scales.numel()] = scales
        return self.quantiser.decode_flat(payload, values.dtype)

    def read(self, area: torch.Tensor, count: int, capacity: int,
             dtype: torch.dtype) -> torch.Tensor:
        quantiser = self.quantiser
        room = code_bytes(capacity, quantiser.bits)
        # A copy: the scales' bytes may sit at an offset a float view cannot take.
        scales = area[room: room + SCALE_DTYPE.itemsize * chunks(count, quantiser.chunk)]
        codes = area[: (count * quantiser.bits + 7) // 8]
        payload = QuantisedPayload(codes, scales.clone().view(SCALE_DTYPE), count, quantiser.bits)
        return quantiser.decode_flat(payload, dtype)


class Binned(ValueCodec):
    """SparseLoCo's 2-bit values (:mod:`~thinwire.compress.codebook`): an area holds the
    packed codes of ``capacity`` values (padded to 4), then the fp32 mean of each code's
    bin. The table is one tensor's (:attr:`per_tensor`). Not summable.
    """

    name = BINNED
    summable = False
    per_tensor = True

    def width(self, dtype: torch.dtype) -> int:
        return 1

    @staticmethod
    def _room(capacity: int) -> int:
        return align(codebook.code_bytes(capacity), 1)

    def nbytes(self, capacity: int, dtype: torch.dtype) -> int:
        return self._room(capacity) + codebook.TABLE_BYTES

    def entry_bytes(self, count: int, dtype: torch.dtype) -> int:
        return count * codebook.BITS // 8

    def extra_segments(self, capacity: int) -> list[tuple[str, int]]:
        return [("(tables)", codebook.TABLE_BYTES)]

    def write(self, values: torch.Tensor, area: torch.Tensor, capacity: int) -> torch.Tensor:
        book = codebook.encode(values)
        area[: book.codes.numel()] = book.codes
        room = self._room(capacity)
        area[room: room + codebook.TABLE_BYTES] = book.table.view(torch.uint8)
        return codebook.decode(book, values.dtype)

    def read(self, area: torch.Tensor, count: int, capacity: int,
             dtype: torch.dtype) -> torch.Tensor:
        room = self._room(capacity)
        # A copy: the table's bytes may sit at an offset a float view cannot take.
        table = area[room: room + codebook.TABLE_BYTES].clone().view(SCALE_DTYPE)
        return codebook.decode(codebook.Codebook(area[: codebook.code_bytes(count)], table,
                                                 count), dtype)


# Each value in the tensor's own dtype: what a dense all-reduce sends (a warm-up's values).
FULL_WIDTH = Cast("native")


def value_codec(name: str, chunk: int = 128) -> ValueCodec:
    """The codec called ``name`` (:data:`CODECS`); ``chunk`` is a quantiser's.

    Raises:
        ValueError: an unknown name or a chunk below 1.
    """
    if name in CASTS:
        return Cast(name)
    if name in KINDS:
        return Quantised(name, chunk)
    if name == BINNED:
        return Binned()
    raise ValueError(f"values={name!r} must be one of {list(CODECS)}")
