"""The data-parallel schemes of the foundation: dense, fp16, topk, dct-dp, laplace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from thinwire.compress import Cast, DCTThreshold, LaplaceThreshold, TopK, value_codec
from thinwire.compress.pieces import PIECE_ENTRIES, STREAM_RULES
from thinwire.compress.sparse import CAPACITY, LAPLACE_MIN_NUMEL, MIN_NUMEL
from thinwire.feedback import Residual
from thinwire.schemes.base import Scheme
from thinwire.schemes.kernel import CompressedScheme
from thinwire.schemes.registry import (
    register,
    validate_capacity,
    validate_common,
    validate_gain,
    validate_patterns,
    validate_ratio,
)


@dataclass(frozen=True)
class DenseConfig:
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient
    warmup_steps: int = 0  # launches of each tensor sent at full width first (dense: no change)

    def __post_init__(self) -> None:
        validate_common(self)


@dataclass(frozen=True)
class TopKConfig:
    ratio: float = 0.01  # fraction of each tensor's entries sent, in (0, 1]
    min_numel: int = MIN_NUMEL  # tensors smaller than this travel dense (0: none)
    values: str = "native"  # the gradient's dtype, fp32, fp16, bf16, or int8/int4/int2/sign codes
    codes: ClassVar[bool] = True  # values may be codes (one fp32 scale per 128 values)
    indices: str = "delta16"  # index list on the wire: "delta16", "delta8" (bits an index), "int32"
    error_feedback: bool = True  # keep what was not sent for the next step
    scope: str = "bucket"  # "bucket": ratio of all tensors, one selection; "layer": of each
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient
    exclude: tuple[str, ...] = ()  # fnmatch patterns of parameter names always sent dense
    warmup_steps: int = 0  # launches of each tensor sent dense (full width) first, >= 0

    def __post_init__(self) -> None:
        validate_ratio(self.ratio)
        validate_patterns(self)
        validate_common(self)


@dataclass(frozen=True)
class DCTConfig:
    ratio: float = 0.01  # 1 - eta, fraction of each tensor's entries kept, in (0, 1]
    life_span: int = 1000  # L, steps between threshold refreshes, >= 1
    refresh_above: float | None = None  # recompute a stale tau passing > this x target; None: never
    gain: float | None = 0.05  # in (0, 1]: tau *= exp(gain (sent / k - 1)) per step; None: off
    min_numel: int = MIN_NUMEL  # tensors smaller than this travel dense (0: none)
    values: str = "native"  # the gradient's dtype, fp32, fp16, bf16, or int8/int4/int2/sign codes
    codes: ClassVar[bool] = True  # values may be codes (one fp32 scale per 128 values)
    indices: str = "delta16"  # index list on the wire: "delta16", "delta8" (bits an index), "int32"
    drain_every: int | None = None  # stochastic drain period of the error buffer
    capacity: float = 1.0  # payload room, multiples of k (>= 1); the excess waits in memory
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient
    exclude: tuple[str, ...] = ()  # fnmatch patterns of parameter names always sent dense
    scope: str = "layer"  # "layer": tau per tensor (Alg. 1); "bucket": one tau over the bucket
    piece: int = PIECE_ENTRIES  # entries per piece sent while the next is compressed; 0: whole
    stream: str = "auto"  # pieces "auto" (once timed rounds show they pay) or "always"
    warmup_steps: int = 0  # launches of each tensor sent dense (full width) first, >= 0

    def __post_init__(self) -> None:
        validate_ratio(self.ratio)
        validate_patterns(self)
        if not isinstance(self.life_span, int) or self.life_span < 1:
            raise ValueError(f"life_span={self.life_span!r} must be an integer >= 1")
        if self.refresh_above is not None and not self.refresh_above > 1.0:
            raise ValueError(f"refresh_above={self.refresh_above!r} must be None or > 1")
        validate_gain(self.gain)
        if isinstance(self.piece, bool) or not isinstance(self.piece, int) or self.piece < 0:
            raise ValueError(f"piece={self.piece!r} must be an integer >= 0 (0: one payload)")
        if self.stream not in STREAM_RULES:
            raise ValueError(f"stream={self.stream!r} must be one of {STREAM_RULES}")
        if self.drain_every is not None and self.drain_every < 1:
            raise ValueError(f"drain_every={self.drain_every!r} must be None or >= 1")
        validate_capacity(self.capacity)
        validate_common(self)


@dataclass(frozen=True)
class LaplaceConfig:
    ratio: float = 0.01  # target fraction of entries kept, in (0, 1]
    min_numel: int = LAPLACE_MIN_NUMEL  # tensors smaller than this travel dense (1024)
    values: str = "native"  # the gradient's dtype, fp32, fp16, bf16, or int8/int4/int2/sign codes
    codes: ClassVar[bool] = True  # values may be codes (one fp32 scale per 128 values)
    indices: str = "delta16"  # index list on the wire: "delta16", "delta8" (bits an index), "int32"
    capacity: float = CAPACITY  # payload room, multiples of k (>= 1); the excess waits in memory
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient
    exclude: tuple[str, ...] = ()  # fnmatch patterns of parameter names always sent dense
    scope: str = "layer"  # "layer": a fit per tensor (App. B); "bucket": one over the bucket
    gain: float | None = None  # in (0, 1]: the fit's tau *= exp(gain (sent / k - 1)); None: off
    warmup_steps: int = 0  # launches of each tensor sent dense (full width) first, >= 0

    def __post_init__(self) -> None:
        validate_ratio(self.ratio)
        validate_gain(self.gain)
        validate_patterns(self)
        validate_capacity(self.capacity)
        validate_common(self)


@register("dense", DenseConfig)
def _dense(config: DenseConfig) -> Scheme:
    return CompressedScheme(Cast("native"), nonfinite=config.nonfinite)


@register("fp16", DenseConfig)
def _fp16(config: DenseConfig) -> Scheme:
    return CompressedScheme(Cast("fp16"), nonfinite=config.nonfinite)


@register("topk", TopKConfig)
def _topk(config: TopKConfig) -> Scheme:
    selection = TopK(config.ratio, min_numel=config.min_numel, scope=config.scope,
                     exclude=config.exclude)
    return CompressedScheme(value_codec(config.values), selection,
                            Residual() if config.error_feedback else None, config.nonfinite,
                            indices=config.indices)


@register("dct-dp", DCTConfig)
def _dct_dp(config: DCTConfig) -> Scheme:
    selection = DCTThreshold(config.ratio, config.life_span, config.refresh_above, config.gain,
                             min_numel=config.min_numel, capacity=config.capacity,
                             exclude=config.exclude, scope=config.scope, piece=config.piece,
                             stream=config.stream)
    return CompressedScheme(value_codec(config.values), selection, Residual(config.drain_every),
                            config.nonfinite, indices=config.indices)


@register("laplace", LaplaceConfig)
def _laplace(config: LaplaceConfig) -> Scheme:
    selection = LaplaceThreshold(config.ratio, config.gain, min_numel=config.min_numel,
                                 capacity=config.capacity, exclude=config.exclude,
                                 scope=config.scope)
    return CompressedScheme(value_codec(config.values), selection, Residual(), config.nonfinite,
                            indices=config.indices)
