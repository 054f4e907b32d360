"""DCT-MP boundary: per-row top-k of an activation crosses a model split as (values, indices).

DCT KDD'21 §2.2, Algorithm 2. Each row of ``X_act`` (a sample, or a token of a
(B, T, d) activation) keeps its ``k = keep_count(d, ratio)`` largest ``|x|``
(``ratio = 1 - eta``; lines 4-9) and crosses as fixed-shape ``values (.., k)``
and ``indices (.., k)`` (line 11); in backward ``X_grad`` crosses at the same indices as values only
(lines 13-14), since the sender kept the mask. Exactly k per row, ties broken by
``torch.topk``, because a pipeline needs fixed shapes. Indices take the smallest
integer dtype that holds the width. ``threshold="laplace"`` (DCT MLSys §2.2,
App. B) reads tau off a Laplace law fitted once per batch and reuses the last
training tau at test; its kept entries are padded into the same k slots (value
0, index d), so it saves selection time, not bytes. ``ratio == 1`` in the
modules sends the activation dense. The choices the papers leave open, and
why: ``docs/dct-mp.md``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from thinwire.comm import Meter
from thinwire.compress.base import check_fraction, keep_count

THRESHOLDS = ("topk", "laplace", "laplace-row")
VALUE_DTYPES: dict[str, torch.dtype | None] = {"native": None, "fp16": torch.float16}
_INDEX_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


def index_dtype(max_index: int) -> torch.dtype:
    """The smallest integer dtype that holds every index in ``[0, max_index]``."""
    for dtype in _INDEX_DTYPES:
        if max_index <= torch.iinfo(dtype).max:
            return dtype
    raise ValueError(f"max_index={max_index!r} does not fit in int64")


def check_activation(acts: torch.Tensor, what: str = "activation") -> None:
    """Raise ``ValueError`` unless ``acts`` is a floating (B, d) or (B, T, d) tensor."""
    if acts.dim() not in (2, 3):
        raise ValueError(f"a DCT-MP boundary needs a (B, d) or (B, T, d) {what}, "
                         f"got shape {tuple(acts.shape)} (rank {acts.dim()})")
    if not acts.is_floating_point():
        raise ValueError(f"a DCT-MP boundary needs a floating {what}, got {acts.dtype}")
    if acts.shape[-1] == 0:
        raise ValueError(f"a DCT-MP boundary needs a non-empty last dimension, got shape "
                         f"{tuple(acts.shape)}")


def check_ratio(ratio: float) -> None:
    check_fraction("ratio", ratio, 0.0, 1.0, closed_low=False, closed_high=True)


def check_threshold(threshold: str) -> None:
    if threshold not in THRESHOLDS:
        raise ValueError(f"threshold={threshold!r} must be one of {THRESHOLDS}")


def value_dtype(values: str) -> torch.dtype | None:
    """The dtype values cross in (``None``: the activation's own)."""
    if values not in VALUE_DTYPES:
        raise ValueError(f"values={values!r} must be one of {sorted(VALUE_DTYPES)}")
    return VALUE_DTYPES[values]


def row_thresholds(acts: torch.Tensor, ratio: float) -> torch.Tensor:
    """``tau_i`` of Algorithm 2 line 6 for every row: the k-th largest ``|x_i|``.

    This is the statistic DCT KDD'21 Fig. 5 averages over the batch.

    Returns:
        A tensor of ``acts.shape[:-1]`` thresholds.
    """
    check_activation(acts)
    check_ratio(ratio)
    k = keep_count(acts.shape[-1], ratio)
    top = torch.topk(acts.detach().abs(), k, dim=-1, sorted=False).values
    return top.amin(dim=-1)


def _laplace_quantile(mean: torch.Tensor, scale: torch.Tensor, ratio: float) -> torch.Tensor:
    """``tau`` with ``P(R >= tau) = 1 - eta`` for ``R ~ Laplace(mean, scale)``."""
    kept = ratio
    if kept <= 0.5:
        return mean - scale * math.log(2 * kept)
    return mean + scale * math.log(2 * (1.0 - ratio)) if ratio < 1 else torch.zeros_like(mean)


def laplace_thresholds(magnitudes: torch.Tensor, ratio: float) -> torch.Tensor:
    """Per-row Laplace estimate of ``tau_i`` (the ``"laplace-row"`` threshold).

    As the paper says, the Laplace law ``R`` is fitted by its mean and
    variance -- location ``mu = mean``, scale ``b = sqrt(var / 2)`` -- and
    ``tau`` is read off its quantile function so that ``P(R >= tau) = 1 - eta``:
    ``tau = mu - b ln(2 (1 - eta))`` when ``1 - eta <= 1/2``, else
    ``mu + b ln(2 eta)``. Here each row's magnitudes get their own law.
    Two passes over the row (mean, variance), no selection: O(d).

    Returns:
        (.., 1) thresholds.
    """
    mean = magnitudes.mean(dim=-1, keepdim=True)
    scale = (magnitudes.var(dim=-1, keepdim=True, correction=0) / 2).sqrt()
    return _laplace_quantile(mean, scale, ratio)


def batch_laplace_threshold(magnitudes: torch.Tensor, ratio: float) -> torch.Tensor:
    """One Laplace estimate of ``tau`` for the whole batch (DCT MLSys §2.2, App. B).

    "We can estimate the threshold tau by finding the mean and variance of the
    Laplace random variable, say R, for that iteration using the activation
    matrix X_act": the law is fitted to every entry's magnitude at once, by
    the same quantile as :func:`laplace_thresholds`. O(B d).

    Returns:
        A 0-dim threshold.
    """
    mean = magnitudes.mean()
    scale = (magnitudes.var(correction=0) / 2).sqrt()
    return _laplace_quantile(mean, scale, ratio)


def _select_topk(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(magnitudes, k, dim=-1, sorted=False).indices


def _select_laplace(magnitudes: torch.Tensor, tau: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the mask ``|x| >= tau``, compacted into k slots; empty slots hold ``d``."""
    width = magnitudes.shape[-1]
    # Zeros are never kept: a row of zeros (tau = 0) keeps nothing, as in compress/.
    mask = torch.where(tau > 0, magnitudes >= tau, magnitudes > 0)
    # Stable compaction by prefix sum: kept entry j goes to slot (#kept before j);
    # everything else (and any overflow) is dumped into an extra slot k, dropped.
    slots = torch.where(mask, mask.cumsum(dim=-1) - 1, k).clamp_(max=k)
    positions = torch.arange(width, device=magnitudes.device).expand_as(magnitudes)
    indices = torch.full((*magnitudes.shape[:-1], k + 1), width, dtype=torch.int64,
                         device=magnitudes.device)
    indices.scatter_(-1, slots, positions)
    indices = indices[..., :k].contiguous()
    overflow = mask.sum(dim=-1) > k
    if bool(overflow.any()):  # the estimate kept too many: exact top-k for those rows
        indices[overflow] = _select_topk(magnitudes[overflow], k)
    return indices


def overflowing_rows(acts: torch.Tensor, ratio: float, tau: torch.Tensor) -> float:
    """Fraction of rows whose Laplace mask keeps more than k entries (they fall back to top-k)."""
    magnitudes = acts.detach().abs()
    k = keep_count(acts.shape[-1], ratio)
    mask = torch.where(tau > 0, magnitudes >= tau, magnitudes > 0)
    return float((mask.sum(dim=-1) > k).float().mean())


def laplace_tau(acts: torch.Tensor, ratio: float, threshold: str) -> torch.Tensor:
    """The fitted ``tau`` of a Laplace threshold: 0-dim (``laplace``) or (.., 1) per row."""
    magnitudes = acts.detach().abs()
    if threshold == "laplace":
        return batch_laplace_threshold(magnitudes, ratio)
    return laplace_thresholds(magnitudes, ratio)


def select(acts: torch.Tensor, ratio: float, threshold: str = "topk",
           tau: torch.Tensor | None = None) -> torch.Tensor:
    """Which entries of each row survive (Alg. 2 lines 4-9), as int64 indices (.., k).

    Under a Laplace threshold an index equal to ``d`` marks an empty slot, and
    ``tau`` (broadcastable to (.., 1)) replaces the fit when given.
    """
    check_activation(acts)
    check_ratio(ratio)
    check_threshold(threshold)
    k = keep_count(acts.shape[-1], ratio)
    magnitudes = acts.detach().abs()
    if threshold == "topk":
        return _select_topk(magnitudes, k)
    if tau is None:
        tau = laplace_tau(acts, ratio, threshold)
    return _select_laplace(magnitudes, tau.to(magnitudes.device, magnitudes.dtype), k)


class _Compact(torch.autograd.Function):
    """(.., d) -> (values (.., k), indices (.., k)); backward scatters X_grad ⊙ M."""

    @staticmethod
    def forward(ctx: Any, acts: torch.Tensor, rows: torch.Tensor,
                sent_dtype: torch.dtype | None, small: torch.dtype,
                padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
        source = F.pad(acts, (0, 1)) if padded else acts
        values = source.gather(-1, rows)
        if sent_dtype is not None:
            values = values.to(sent_dtype)
        indices = rows.to(small)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.shape, ctx.dtype, ctx.padded = acts.shape, acts.dtype, padded
        return values, indices

    @staticmethod
    def backward(ctx: Any, grad_values: torch.Tensor | None,
                 grad_indices: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if grad_values is None:
            return None, None, None, None, None
        (indices,) = ctx.saved_tensors
        width = ctx.shape[-1]
        grad = grad_values.new_zeros((*ctx.shape[:-1], width + int(ctx.padded)), dtype=ctx.dtype)
        grad.scatter_(-1, indices.long(), grad_values.to(ctx.dtype))
        return (grad[..., :width].contiguous() if ctx.padded else grad), None, None, None, None


class _Expand(torch.autograd.Function):
    """(values, indices) -> (.., d); backward gathers X_grad ⊙ M as values only."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, indices: torch.Tensor,
                width: int, dtype: torch.dtype) -> torch.Tensor:
        rows = indices.long()
        padded = rows.numel() > 0 and int(rows.max()) == width
        out = values.new_zeros((*values.shape[:-1], width + int(padded)), dtype=dtype)
        out.scatter_(-1, rows, values.to(dtype))
        ctx.save_for_backward(indices)
        ctx.width, ctx.padded, ctx.sent_dtype = width, padded, values.dtype
        return out[..., :width].contiguous() if padded else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (indices,) = ctx.saved_tensors
        source = F.pad(grad, (0, 1)) if ctx.padded else grad
        return source.gather(-1, indices.long()).to(ctx.sent_dtype), None, None, None


def compact(acts: torch.Tensor, ratio: float, *, threshold: str = "topk",
            values: str = "native",
            tau: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each row's ``ceil(d ratio)`` largest ``|x|`` (Algorithm 2, forward).

    Differentiable in ``acts``: the gradient of ``values`` is scattered back
    through the forward mask (line 13), zero elsewhere.

    Args:
        acts: a (B, d) or (B, T, d) floating activation.
        ratio: ``1 - eta``, the fraction of each row kept, in (0, 1].
        threshold: ``"topk"`` (exact), ``"laplace"`` or ``"laplace-row"`` (estimates,
            padded; see module doc).
        values: ``"native"`` (the activation's dtype) or ``"fp16"``.
        tau: a Laplace threshold to use instead of fitting this batch.

    Returns:
        ``values`` (.., k) and ``indices`` (.., k) in the smallest integer dtype
        holding the largest index.

    Raises:
        ValueError: wrong rank or dtype, ratio outside (0, 1], unknown option.
    """
    sent_dtype = value_dtype(values)
    rows = select(acts, ratio, threshold, tau)
    width = acts.shape[-1]
    padded = threshold != "topk"
    small = index_dtype(width if padded else width - 1)
    out: tuple[torch.Tensor, torch.Tensor] = _Compact.apply(acts, rows, sent_dtype, small, padded)
    return out


def expand(values: torch.Tensor, indices: torch.Tensor, width: int,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """Scatter ``values`` back into a zero (.., width) tensor (the receiving stage).

    Differentiable in ``values``: the gradient is ``X_grad`` gathered at
    ``indices``, the values-only (.., k) tensor that crosses back (line 14).
    An index equal to ``width`` marks an empty slot and is dropped.

    Args:
        values: (.., k) kept values.
        indices: (.., k) integer positions in ``[0, width]``, distinct per row.
        width: d, the activation's last dimension.
        dtype: the dtype of the result (default: that of ``values``).

    Raises:
        ValueError: mismatched shapes, non-integer or out-of-range indices.
    """
    if values.shape != indices.shape:
        raise ValueError(f"values {tuple(values.shape)} and indices {tuple(indices.shape)} "
                         "must have the same shape")
    check_activation(values, "values tensor")
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(f"indices must be an integer tensor, got {indices.dtype}")
    if not isinstance(width, int) or width < values.shape[-1]:
        raise ValueError(f"width={width!r} must be an integer >= k={values.shape[-1]}")
    if indices.numel():
        low, high = (int(v) for v in torch.aminmax(indices))
        if low < 0 or high > width:
            raise ValueError(
                f"indices span [{low}, {high}], outside [0, {width}]: the payload is corrupt "
                "(a pipeline stage built without static metadata receives uninitialised "
                "buffers during shape inference; use thinwire.pipeline.build_stage)")
    out: torch.Tensor = _Expand.apply(values, indices, width, dtype or values.dtype)
    return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Sender(nn.Module):
    """End of a stage: the carry (a tensor, or a tuple whose last tensor is the
    activation of the split module) becomes the tuple of tensors that crosses.

    Tensors before the last one of a tuple (a transformer's residual stream)
    cross dense and are metered as X_act too. Subclasses implement
    :meth:`encode`; ``meter`` records every tensor handed over (``X_act``).
    """

    payload_size = 1  # how many trailing tensors of the crossing encode the activation
    pipelines = True  # whether a pipeline schedule can carry it between processes

    def __init__(self, name: str = "", meter: Meter | None = None) -> None:
        super().__init__()
        self.name = name
        self.meter = meter

    def encode(self, acts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def forward(self, carry: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        *passthrough, acts = carry if isinstance(carry, tuple) else (carry,)
        crossing = (*passthrough, *self.encode(acts))
        if self.meter is not None:
            for tensor in crossing:
                self.meter.record("X_act", self.name, "send", _nbytes(tensor))
        return crossing


class Receiver(nn.Module):
    """Start of the next stage: the crossing tuple becomes the carry again.

    Subclasses implement :meth:`decode`; ``meter`` records the gradient of
    every floating input as it is handed back (``X_grad``).
    """

    payload_size = 1  # how many trailing tensors of the crossing encode the activation
    pipelines = True  # whether a pipeline schedule can carry it between processes
    records_grad = True  # whether the gradients of the inputs are what crosses back

    def __init__(self, name: str = "", meter: Meter | None = None) -> None:
        super().__init__()
        self.name = name
        self.meter = meter

    def decode(self, *payload: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, *crossing: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(crossing) < self.payload_size:
            raise ValueError(f"boundary {self.name!r} expects at least {self.payload_size} "
                             f"tensors, got {len(crossing)}")
        if self.meter is not None and self.records_grad:
            for tensor in crossing:
                if tensor.requires_grad:
                    tensor.register_hook(self._record_grad)
        cut = len(crossing) - self.payload_size
        acts = self.decode(*crossing[cut:])
        return (*crossing[:cut], acts) if cut else acts

    def _record_grad(self, grad: torch.Tensor) -> None:
        assert self.meter is not None  # only registered with a meter
        self.meter.record("X_grad", self.name, "send", _nbytes(grad))


class Compact(Sender):
    """DCT-MP sender (Algorithm 2 forward): crosses as (values, indices), or dense at ratio=1.

    Args:
        ratio: ``1 - eta``, fraction of each row kept, in (0, 1]; 1 sends it dense.
        threshold: ``"topk"``, ``"laplace"`` or ``"laplace-row"`` (module docstring).
        values: ``"native"`` or ``"fp16"``, the dtype values cross in.
        name: the split's name (the meter's layer).
        meter: records the bytes handed over.

    Attributes:
        trace: per training call, (mean row threshold, fraction of entries kept);
            the Laplace estimate's drift from the target shows here (MLSys Fig. 6b).
        overflow: per training call under a Laplace threshold, the fraction of
            rows that kept more than k entries and fell back to exact top-k.
        tau: the last training batch's Laplace threshold (``"laplace"``; NaN
            before the first), reused when not training.
    """

    def __init__(self, ratio: float, threshold: str = "topk", values: str = "native",
                 name: str = "", meter: Meter | None = None) -> None:
        check_ratio(ratio)
        check_threshold(threshold)
        super().__init__(name, meter)
        self.ratio = ratio
        self.threshold = threshold
        self.values = values
        self.sent_dtype = value_dtype(values)
        self.payload_size = 1 if ratio == 1 else 2
        self.trace: list[tuple[float, float]] = []
        self.overflow: list[float] = []
        self.tau: torch.Tensor
        self.register_buffer("tau", torch.tensor(math.nan))

    def encode(self, acts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        check_activation(acts)
        if self.ratio == 1:
            return (acts if self.sent_dtype is None else acts.to(self.sent_dtype),)
        learning = self.training and torch.is_grad_enabled()
        tau: torch.Tensor | None = None
        if self.threshold != "topk":
            stored = self.tau
            if self.threshold == "laplace" and not learning and bool(stored.isfinite()):
                tau = stored  # App. B: the training tau is reused at test
            else:
                tau = laplace_tau(acts, self.ratio, self.threshold)
                if self.threshold == "laplace" and learning:
                    stored.copy_(tau)
        values, indices = compact(acts, self.ratio, threshold=self.threshold,
                                  values=self.values, tau=tau)
        if learning:
            self._trace(values, indices, acts.shape[-1])
            if tau is not None:
                self.overflow.append(overflowing_rows(acts, self.ratio, tau))
        return values, indices

    def _trace(self, values: torch.Tensor, indices: torch.Tensor, width: int) -> None:
        """Record (mean over rows of the smallest kept |x|, fraction of entries kept)."""
        used = indices.long() < width  # Laplace leaves empty slots (index d)
        smallest = values.detach().abs().float().masked_fill(~used, math.inf).amin(dim=-1)
        finite = smallest[smallest.isfinite()]
        tau = float(finite.mean()) if finite.numel() else 0.0
        self.trace.append((tau, float(used.sum()) / (used.numel() // values.shape[-1] * width)))

    def extra_repr(self) -> str:
        return f"ratio={self.ratio}, threshold={self.threshold!r}, values={self.values!r}"


class Expand(Receiver):
    """DCT-MP receiver: (values, indices) back to a (.., width) activation.

    Args:
        width: d of the activation that was compacted.
        ratio: must match the sender's (1 means the activation crossed dense).
        dtype: the activation's dtype before it crossed (values may be fp16).
        name: as for :class:`Compact`.
        meter: as for :class:`Compact`.
    """

    def __init__(self, width: int, ratio: float, dtype: torch.dtype = torch.float32,
                 name: str = "", meter: Meter | None = None) -> None:
        check_ratio(ratio)
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"width={width!r} must be an integer >= 1")
        super().__init__(name, meter)
        self.width = width
        self.ratio = ratio
        self.dtype = dtype
        self.payload_size = 1 if ratio == 1 else 2

    def decode(self, *payload: torch.Tensor) -> torch.Tensor:
        if self.ratio == 1:
            (acts,) = payload
            return acts.to(self.dtype)
        values, indices = payload
        return expand(values, indices, self.width, self.dtype)

    def extra_repr(self) -> str:
        return f"width={self.width}, ratio={self.ratio}"


@dataclasses.dataclass(frozen=True)
class DCTMPConfig:
    """Options of the ``dct-mp`` boundary (DCT KDD'21 Algorithm 2)."""

    ratio: float = 0.1  # 1 - eta, fraction of each row's activations kept, in (0, 1]
    threshold: str = "topk"  # "topk" (Alg. 2), "laplace" (MLSys §2.2) or "laplace-row"
    values: str = "native"  # dtype values cross in: "native" (the activation's) or "fp16"

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        check_threshold(self.threshold)
        value_dtype(self.values)


def dct_mp_pair(config: DCTMPConfig, name: str, width: int, dtype: torch.dtype,
                meter: Meter | None) -> tuple[Sender, Receiver]:
    """The :class:`Compact` / :class:`Expand` pair for one split."""
    return (Compact(config.ratio, config.threshold, config.values, name, meter),
            Expand(width, config.ratio, dtype, name, meter))
