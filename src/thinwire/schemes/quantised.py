"""Quantised schemes with error feedback: int8, int4, int2, sign, and top-k chained before them.

The kernel with a quantising value codec (:class:`~thinwire.compress.Quantised`):
every rank's codes travel by one all-gather of fixed-size packed payloads and
each rank decodes every row, ranks summed in rank order so every rank gets the
same bits. An all-reduce cannot carry them: a sum of codes at different scales
is not a code, and summing dequantised values in fp32 sends 32 bits an entry
again. All-gather moves (n-1) payloads into each rank, which beats a dense ring
all-reduce's 2(n-1)/n x 32 bits while n * bits < 64.

``topk+KIND`` selects by :class:`~thinwire.compress.TopK` as the topk scheme
does (its ``ratio``, ``scope``, index format), then quantises the selected
values in chunks. Error feedback: ``p = g + e``, then ``e <- p - sent`` with
``sent`` what every receiver decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from thinwire.compress import Quantised, TopK
from thinwire.compress.quantise import CHUNK, KINDS
from thinwire.compress.sparse import MIN_NUMEL
from thinwire.feedback import Residual
from thinwire.schemes.base import Scheme
from thinwire.schemes.kernel import CompressedScheme
from thinwire.schemes.registry import register, validate_common, validate_ratio


@dataclass(frozen=True)
class QuantConfig:
    chunk: int = CHUNK  # entries sharing one fp32 scale, >= 1
    error_feedback: bool = True  # keep what quantisation left out for the next round
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient
    warmup_steps: int = 0  # launches of each tensor sent dense (full width) first, >= 0

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk={self.chunk!r} must be an integer >= 1")
        validate_common(self)


@dataclass(frozen=True)
class TopKQuantConfig:
    ratio: float = 0.01  # fraction of each tensor's entries sent, in (0, 1]
    chunk: int = CHUNK  # selected values sharing one fp32 scale, >= 1
    min_numel: int = MIN_NUMEL  # tensors smaller than this are quantised whole (0: none)
    indices: str = "delta16"  # index list on the wire: "delta16", "delta8" (bits an index), "int32"
    scope: str = "bucket"  # "bucket": ratio of all tensors, one selection; "layer": of each
    error_feedback: bool = True  # keep what was not sent, or sent coarsely, for the next round
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient
    warmup_steps: int = 0  # launches of each tensor sent dense (full width) first, >= 0

    def __post_init__(self) -> None:
        validate_ratio(self.ratio)
        QuantConfig(self.chunk, self.error_feedback, self.nonfinite)
        validate_common(self)


def _plain(kind: str) -> Any:
    def build(config: QuantConfig) -> Scheme:
        return CompressedScheme(Quantised(kind, config.chunk), None,
                                Residual() if config.error_feedback else None,
                                config.nonfinite)
    return build


def _after_topk(kind: str) -> Any:
    def build(config: TopKQuantConfig) -> Scheme:
        selection = TopK(config.ratio, min_numel=config.min_numel, scope=config.scope)
        return CompressedScheme(Quantised(kind, config.chunk), selection,
                                Residual() if config.error_feedback else None,
                                config.nonfinite, indices=config.indices)
    return build


for _kind in KINDS:
    register(_kind, QuantConfig)(_plain(_kind))
for _kind in KINDS:
    register(f"topk+{_kind}", TopKQuantConfig)(_after_topk(_kind))
