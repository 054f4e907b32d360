"""ScaleCom's CLT-k (cyclic local top-k) and the local top-k baseline whose bytes build up.

Both are the kernel with the same k, selection (chunk-wise or exact top-k,
:class:`~thinwire.compress.sparse.Selection`), low-pass error memory
``m <- (1 - beta) m + beta (p - C(p))`` (:class:`thinwire.feedback.LowPass`),
warm-up and exclusions, so a comparison isolates who chooses the indices.
``scope="layer"`` (ScaleCom's) selects k per layer, ``"bucket"`` once over a
launch's sparse tensors (metered as ``first..last``). ``clt-k`` (ScaleCom
App. E): the leader ``step mod n`` broadcasts its top-k indices of ``p = m + g``
and the values there are all-reduced, the same bytes at any world size
(:class:`~thinwire.schemes.agreed.LeaderIndices`). ``local-topk``: each rank's
own top-k by all-gather, so inbound bytes grow with n (App. F's build-up). The
keys launched together share the step of the first, so they share a leader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from thinwire.compress import Cast, value_codec
from thinwire.compress.base import check_fraction
from thinwire.compress.cltk import SELECTIONS
from thinwire.compress.sparse import MIN_NUMEL, Selection
from thinwire.feedback import LowPass
from thinwire.schemes.agreed import LeaderIndices
from thinwire.schemes.base import Scheme
from thinwire.schemes.kernel import CompressedScheme
from thinwire.schemes.registry import (
    register,
    validate_common,
    validate_patterns,
    validate_ratio,
)


@dataclass(frozen=True)
class CLTkConfig:
    """Options of ``clt-k`` (and, unchanged, of ``local-topk``)."""

    ratio: float = 0.01  # fraction of each layer's entries sent, in (0, 1]; ~100x
    k: int | None = None  # entries sent per layer instead of ratio (>= 1, capped at the size)
    selection: str = "exact"  # "exact": top-k; "chunk": top of each of k equal chunks
    beta: float = 1.0  # low-pass factor of the memory, in (0, 1]; 1 is plain error feedback
    warmup_steps: int = 0  # steps all-reduced dense before compression starts
    exclude: tuple[str, ...] = ()  # fnmatch patterns of parameter names always sent dense
    min_numel: int = MIN_NUMEL  # tensors with fewer entries are sent dense (as topk, dct-dp)
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient
    scope: str = "bucket"  # "bucket": one selection over the launch (a DDP bucket); "layer": k each
    values: str = "native"  # the gradient's dtype, fp32, fp16 or bf16 (local-topk: or codes)

    def __post_init__(self) -> None:
        validate_ratio(self.ratio)
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int)
                                   or self.k < 1):
            raise ValueError(f"k={self.k!r} must be None or an integer >= 1")
        if self.scope == "bucket" and self.k is not None:
            raise ValueError(f"k={self.k!r} is per layer: with scope='bucket' give ratio")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r} must be one of {sorted(SELECTIONS)}")
        check_fraction("beta", self.beta, 0.0, 1.0, closed_low=False, closed_high=True)
        validate_patterns(self)
        validate_common(self)


@dataclass(frozen=True)
class LocalTopKConfig(CLTkConfig):
    """Options of ``local-topk``: those of ``clt-k``, so the two compare like for like; its
    values may also be codes, which clt-k's all-reduce cannot sum."""

    codes: ClassVar[bool] = True  # values may be int8/int4/int2/sign (one fp32 scale per 128)


def _selection(config: CLTkConfig) -> Selection:
    """The local choice both schemes share: k per layer or group, exact or chunk top-k."""
    return Selection(config.ratio, k=config.k, selection=config.selection,
                     min_numel=config.min_numel, exclude=config.exclude, scope=config.scope)


@register("clt-k", CLTkConfig)
def _clt_k(config: CLTkConfig) -> Scheme:
    return CompressedScheme(Cast(config.values), LeaderIndices(_selection(config)),
                            LowPass(config.beta), config.nonfinite)


@register("local-topk", LocalTopKConfig)
def _local_topk(config: LocalTopKConfig) -> Scheme:
    # int32 index lists, as ScaleCom's baseline is measured (the 16-bit code is topk's)
    return CompressedScheme(value_codec(config.values), _selection(config), LowPass(config.beta),
                            config.nonfinite, indices="int32")
