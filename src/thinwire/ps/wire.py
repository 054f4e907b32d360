"""What a push carries: one row of the scheme's own exchange, or a dense fp32 gradient.

A push is built by the same kernel as a DDP bucket
(:meth:`~thinwire.schemes.Scheme.encode_row`): the whole model as one bucket,
the scheme's selection, value codec, index format and scope, so its bytes are
those the DDP engine hands its collectives for the same tensors and options,
plus a 4-byte step header (``"(step)"``) and the padding of half-precision
tensors sent whole to 4 bytes, both metered. The worker keeps the error
memory (DCT Alg. 1 lines 3, 11); hogwild threads of one worker share one
scheme and so one error buffer (DCT §3.3, Remark 2), whose races the
stochastic drain (``drain_every``) bounds. A gradient that is not finite is
pushed dense, never compressed (it would poison the threshold and the
residual), for the server to reject and count.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from thinwire import schemes
from thinwire.comm import Meter
from thinwire.feedback import Memory
from thinwire.ps.layout import Layout
from thinwire.schemes import Scheme


class MalformedPush(ValueError):
    """Push bytes that do not decode to a gradient of the server's model."""


@dataclass(frozen=True)
class Encoded:
    """One push as it goes on the wire."""

    data: torch.Tensor  # the tensor handed to RPC
    dense: bool  # True: ``data`` is the flat gradient; False: the scheme's row
    sent: torch.Tensor  # the flat gradient the server will decode from ``data``


def build_push(scheme: str, **options: Any) -> Scheme:
    """Build push scheme ``scheme``: one whose payload one process decodes alone.

    Raises:
        ValueError: unknown scheme or option, an option out of range, or a scheme
            whose ranks agree on coordinates in a first round (``clt-k``, ``powersgd``).
    """
    built = schemes.build(scheme, **options)
    if built.traits.rounds > 1:
        raise ValueError(f"push scheme {scheme!r} agrees on its coordinates across ranks in a "
                         "first round, which a push to the server does not have; use a "
                         "scheme of one round (dense, fp16, topk, dct-dp, laplace, local-topk, "
                         "int8/int4/int2/sign, topk+KIND)")
    return built


class PushCodec:
    """Encodes a worker's gradient for the wire, and decodes it on the server.

    Args:
        layout: the model's parameters.
        scheme: a registered scheme of one round (:func:`build_push`).
        **options: that scheme's config (e.g. ``ratio=0.01, life_span=1000,
            drain_every=1_000_000``).

    Raises:
        ValueError: as :func:`build_push`.
    """

    def __init__(self, layout: Layout, scheme: str = "dense", **options: Any) -> None:
        self.scheme = build_push(scheme, **options)
        self.layout = layout
        self.name = scheme
        self.options = dict(options)
        self.infos = layout.infos()
        self.nonfinite = 0
        # A worker's streams share one scheme: error memory and thresholds are
        # read-modify-write state, so encoding is serialised (gradients are not).
        self._lock = threading.Lock()

    @property
    def memory(self) -> Memory | None:
        """The worker's error memory (None: the scheme keeps none)."""
        return self.scheme.error_memory

    # Worker side ------------------------------------------------------------

    def encode(self, grad: torch.Tensor, meter: Meter | None = None) -> Encoded:
        """Compensate, compress and serialise one flat gradient (``grad`` is not modified).

        Records each part's bytes as entity ``"push"``, collective ``"send"``.
        Thread-safe: the streams of one worker may call it concurrently.
        """
        with self._lock:
            if not bool(torch.isfinite(grad).all()):
                self.nonfinite += 1
                self._record(meter, "send", self._dense_parts(grad))
                return Encoded(grad, True, grad)
            row, segments = self.scheme.encode_row(grad.clone(), self.infos)
        self._record(meter, "send", [(layer, nbytes) for _, layer, nbytes in segments])
        return Encoded(row, False, self.scheme.decode_row(row, self.infos))

    def _dense_parts(self, grad: torch.Tensor) -> list[tuple[str, int]]:
        return [(name, numel * grad.element_size())
                for name, numel in zip(self.layout.names, self.layout.numels, strict=True)]

    @staticmethod
    def _record(meter: Meter | None, collective: str,
                segments: list[tuple[str, int]]) -> None:
        if meter is not None:
            for layer, nbytes in segments:
                meter.record("push", layer, collective, nbytes)

    def state_dict(self) -> dict[str, Any]:
        with self._lock:  # a snapshot between two pushes, never inside one
            return {"scheme": self.scheme.state_dict(), "nonfinite": self.nonfinite}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.scheme.load_state_dict(state["scheme"])
            self.nonfinite = state["nonfinite"]

    # Server side ------------------------------------------------------------

    def decode(self, data: torch.Tensor, dense: bool, meter: Meter | None = None) -> torch.Tensor:
        """The flat gradient a push carries; ``meter`` records its bytes as ``"push"``/``"recv"``.

        Raises:
            MalformedPush: wrong dtype or size, a layout the scheme does not make,
                indices out of range.
        """
        if dense:
            if data.dtype != self.layout.dtype or data.shape != (self.layout.numel,):
                raise MalformedPush(f"a dense push must be a flat {self.layout.dtype} tensor of "
                                    f"{self.layout.numel} entries, got {data.dtype} "
                                    f"{tuple(data.shape)}")
            self._record(meter, "recv", self._dense_parts(data))
            return data
        try:
            grad = self.scheme.decode_row(data, self.infos)
        except ValueError as error:
            raise MalformedPush(f"push bytes do not decode: {error}") from error
        self._record(meter, "recv", [("(row)", data.numel())])
        return grad
