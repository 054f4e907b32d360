"""What a push carries: a dense fp32 gradient, or per-tensor compressed payload bytes.

A push travels as one tensor: the flat gradient (scheme ``"dense"``), or each
parameter's ``payload.to_bytes()`` in :class:`~thinwire.ps.layout.Layout`
order, each segment padded to 4 bytes so values can be viewed in place (the
Meter records the padding as layer ``"(padding)"``). The worker keeps the error
memory (DCT Alg. 1 lines 3, 11); hogwild threads of one worker share one codec
and so one error buffer (DCT §3.3, Remark 2), whose races the stochastic drain
(``drain_every``) bounds. A gradient that is not finite is pushed dense, never
compressed (it would poison the threshold and the residual), for the server to
reject and count.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from thinwire import schemes
from thinwire.comm import Meter
from thinwire.compress import (
    FP16,
    Compressor,
    Dense,
    DensePayload,
    Payload,
    SparsePayload,
    Sparsifier,
    TensorInfo,
    decode,
)
from thinwire.feedback import Memory
from thinwire.ps.layout import Layout
from thinwire.schemes import CompressedScheme

_DENSE_VALUE_DTYPES: dict[type, torch.dtype] = {Dense: torch.float32, FP16: torch.float16}


class MalformedPush(ValueError):
    """Push bytes that do not decode to a gradient of the server's model."""


@dataclass(frozen=True)
class Encoded:
    """One push as it goes on the wire."""

    data: torch.Tensor  # the tensor handed to RPC
    dense: bool  # True: ``data`` is the flat gradient; False: payload bytes
    sent: torch.Tensor  # the flat gradient the server will decode from ``data``


def _pad4(nbytes: int) -> int:
    return (-nbytes) % 4


def build_push(scheme: str, **options: Any) -> CompressedScheme:
    """Build push scheme ``scheme``: one the parameter server can decode.

    Raises:
        ValueError: unknown scheme or option, an option out of range, or a scheme
            whose payloads are neither dense nor sparse.
    """
    built = schemes.build(scheme, **options)
    # A subclass keeps per-round state in its launch (local-topk's warm-up), which a push
    # never runs: only the engine itself encodes exactly as the codec below does.
    if type(built) is not CompressedScheme:
        raise ValueError(f"push scheme {scheme!r} does not compress tensor by tensor; "
                         "use one of the sparsifying or dense schemes")
    compressor = built.compressor
    if not isinstance(compressor, Sparsifier) and type(compressor) not in _DENSE_VALUE_DTYPES:
        raise ValueError(f"push scheme {scheme!r} uses {type(compressor).__name__}, whose "
                         "payloads the parameter server cannot decode")
    return built


class PushCodec:
    """Encodes a worker's gradient for the wire, and decodes it on the server.

    Args:
        layout: the model's parameters.
        scheme: a registered scheme built from a compressor and an optional
            memory (``"dense"``, ``"fp16"``, ``"topk"``, ``"dct-dp"``, ``"laplace"``).
        **options: that scheme's config (e.g. ``ratio=0.01, life_span=1000,
            drain_every=1_000_000``).

    Raises:
        ValueError: unknown scheme or option, or a scheme whose payloads are
            neither dense nor sparse (low-rank schemes need their own transport).
    """

    def __init__(self, layout: Layout, scheme: str = "dense", **options: Any) -> None:
        built = build_push(scheme, **options)
        compressor = built.compressor
        self.layout = layout
        self.scheme = scheme
        self.options = dict(options)
        self.compressor: Compressor = compressor
        self.memory: Memory | None = built.memory
        self.raw = type(compressor) is Dense and self.memory is None
        self.infos = layout.infos()
        self.nonfinite = 0
        # A worker's streams share one codec: error memory and thresholds are
        # read-modify-write state, so encoding is serialised (gradients are not).
        self._lock = threading.Lock()

    # Worker side ------------------------------------------------------------

    def encode(self, grad: torch.Tensor, meter: Meter | None = None) -> Encoded:
        """Compensate, compress and serialise one flat gradient (``grad`` is not modified).

        Records each segment's bytes as entity ``"push"``, collective ``"send"``.
        Thread-safe: the streams of one worker may call it concurrently.
        """
        with self._lock:
            return self._encode(grad, meter)

    def _encode(self, grad: torch.Tensor, meter: Meter | None) -> Encoded:
        if self.raw or not bool(torch.isfinite(grad).all()):
            if not self.raw:
                self.nonfinite += 1
            if meter is not None:
                parts = torch.split(grad, list(self.layout.numels))
                for info, part in zip(self.infos, parts, strict=True):
                    meter.record("push", info.key, "send", part.numel() * part.element_size())
            return Encoded(grad, True, grad)
        segments: list[torch.Tensor] = []
        sent: list[torch.Tensor] = []
        padding = 0
        for info, part in zip(self.infos, self.layout.split(grad).values(), strict=True):
            payload = self._compress(info, part)
            wire = payload.to_bytes()
            pad = _pad4(wire.numel())
            segments.append(torch.nn.functional.pad(wire, (0, pad)) if pad else wire)
            sent.append(decode(payload, info).reshape(-1))
            padding += pad
            if meter is not None:
                meter.record("push", info.key, "send", payload.nbytes)
        if meter is not None and padding:
            meter.record("push", "(padding)", "send", padding)
        return Encoded(torch.cat(segments), False, torch.cat(sent))

    def _compress(self, info: TensorInfo, grad: torch.Tensor) -> Payload:
        if self.memory is None:
            return self.compressor.compress(grad, info)
        compensated = self.memory.compensate(info.key, grad)
        payload = self.compressor.compress(compensated, info)
        self.memory.update(info.key, compensated, self.compressor.decompress(payload, info))
        return payload

    def state_dict(self) -> dict[str, Any]:
        with self._lock:  # a snapshot between two pushes, never inside one
            return {"compressor": self.compressor.state_dict(), "nonfinite": self.nonfinite,
                    "memory": None if self.memory is None else self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.compressor.load_state_dict(state["compressor"])
            self.nonfinite = state["nonfinite"]
            if self.memory is not None:
                self.memory.load_state_dict(state["memory"])

    # Server side ------------------------------------------------------------

    def decode(self, data: torch.Tensor, dense: bool, meter: Meter | None = None) -> torch.Tensor:
        """The flat gradient a push carries; ``meter`` records its bytes as ``"push"``/``"recv"``.

        Raises:
            MalformedPush: wrong dtype or size, truncated or trailing bytes,
                indices out of range.
        """
        if dense:
            if data.dtype != self.layout.dtype or data.shape != (self.layout.numel,):
                raise MalformedPush(f"a dense push must be a flat {self.layout.dtype} tensor of "
                                    f"{self.layout.numel} entries, got {data.dtype} "
                                    f"{tuple(data.shape)}")
            if meter is not None:
                for name, numel in zip(self.layout.names, self.layout.numels, strict=True):
                    meter.record("push", name, "recv", numel * data.element_size())
            return data
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise MalformedPush(f"a compressed push must be flat uint8 bytes, got {data.dtype} "
                                f"{tuple(data.shape)}")
        parts: list[torch.Tensor] = []
        sizes: list[tuple[str, int]] = []
        offset = 0
        try:
            for info in self.infos:
                payload, used = self._read(data, offset, info)
                parts.append(decode(payload, info).reshape(-1))
                sizes.append((info.key, used))
                if _pad4(used):
                    sizes.append(("(padding)", _pad4(used)))
                offset += used + _pad4(used)
        except (RuntimeError, IndexError, ValueError) as error:
            raise MalformedPush(f"push bytes do not decode at byte {offset}: {error}") from error
        if offset != data.numel():
            raise MalformedPush(f"push has {data.numel()} bytes, the model's payloads "
                                f"use {offset}")
        if meter is not None:
            for name, nbytes in sizes:
                meter.record("push", name, "recv", nbytes)
        return torch.cat(parts)

    def _read(self, data: torch.Tensor, offset: int, info: TensorInfo) -> tuple[Payload, int]:
        compressor = self.compressor
        if isinstance(compressor, Sparsifier) and not compressor.is_dense(info):
            header = int(data[offset:offset + 4].view(torch.int32)[0])
            if header != -1 and not 0 <= header <= info.numel:
                raise MalformedPush(f"tensor {info.key!r}: header {header} is neither a count "
                                    f"in [0, {info.numel}] nor the bitmap marker -1")
            payload, used = SparsePayload.from_bytes(data[offset:], info.numel,
                                                     compressor.value_dtype)
            if payload.count and (int(payload.indices.min()) < 0
                                  or int(payload.indices.max()) >= info.numel):
                raise MalformedPush(f"tensor {info.key!r}: index out of [0, {info.numel})")
            if payload.values.numel() != payload.count:
                raise MalformedPush(f"tensor {info.key!r}: truncated values")
            return payload, used
        value_dtype = (compressor.value_dtype if isinstance(compressor, Sparsifier)
                       else _DENSE_VALUE_DTYPES[type(compressor)])
        used = info.numel * value_dtype.itemsize
        if offset + used > data.numel():
            raise MalformedPush(f"tensor {info.key!r}: truncated dense segment")
        return DensePayload(data[offset:offset + used].view(value_dtype)), used
