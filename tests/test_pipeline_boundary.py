"""The DCT-MP boundary: exact per-row top-k forward, X_grad ⊙ M backward, exact bytes."""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.comm import Meter
from thinwire.compress import keep_count
from thinwire.pipeline import (
    Compact,
    Expand,
    batch_laplace_threshold,
    compact,
    expand,
    index_dtype,
    laplace_thresholds,
    row_thresholds,
    select,
)
from thinwire.pipeline.boundary import overflowing_rows

SHAPES = [(6, 40), (3, 5, 24), (4, 300), (1, 1)]
RATIOS = [1.0, 0.5, 0.25, 0.1, 0.02]


def _mask(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Boolean (.., width) mask of the slots that hold an index < width."""
    rows = indices.long()
    mask = torch.zeros((*rows.shape[:-1], width + 1), dtype=torch.bool)
    mask.scatter_(-1, rows, True)
    return mask[..., :width]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_forward_keeps_exactly_the_top_k_of_every_row(shape: tuple[int, ...],
                                                      ratio: float) -> None:
    acts = torch.randn(shape, dtype=torch.float64)
    values, indices = compact(acts, ratio)
    width = shape[-1]
    k = keep_count(width, ratio)
    assert values.shape == indices.shape == (*shape[:-1], k)
    assert indices.dtype == index_dtype(width - 1)
    assert torch.equal(values, acts.gather(-1, indices.long()))
    mask = _mask(indices, width)
    assert torch.equal(mask.sum(-1), torch.full(shape[:-1], k))  # k distinct per row
    kept_min = acts.abs().masked_fill(~mask, math.inf).amin(-1)
    dropped_max = acts.abs().masked_fill(mask, -math.inf).amax(-1)
    assert bool((kept_min >= dropped_max).all())  # nothing dropped beats anything kept


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ratio", [0.5, 0.1])
@pytest.mark.parametrize("threshold", ["topk", "laplace", "laplace-row"])
def test_round_trip_and_backward_are_exactly_the_mask(shape: tuple[int, ...], ratio: float,
                                                      threshold: str) -> None:
    acts = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    values, indices = compact(acts, ratio, threshold=threshold)
    rebuilt = expand(values, indices, shape[-1])
    mask = _mask(indices, shape[-1])
    assert torch.equal(rebuilt, torch.where(mask, acts, 0.0))  # X_act ⊙ M (Alg. 2 line 10)
    grad = torch.randn(shape, dtype=torch.float64)
    sent_back: list[torch.Tensor] = []
    values.register_hook(sent_back.append)
    rebuilt.backward(grad)
    assert acts.grad is not None
    assert torch.equal(acts.grad, torch.where(mask, grad, 0.0))  # X_grad ⊙ M (line 13)
    # What crosses back is values only: (.., k), X_grad at the forward's indices.
    (crossing,) = sent_back
    assert crossing.shape == values.shape
    padded = torch.nn.functional.pad(grad, (0, 1))
    assert torch.equal(crossing, padded.gather(-1, indices.long()))


def test_index_dtype_is_as_small_as_the_width_allows() -> None:
    assert index_dtype(255) == torch.uint8
    assert index_dtype(256) == torch.int16
    assert index_dtype(32767) == torch.int16
    assert index_dtype(32768) == torch.int32
    for width, dtype in [(256, torch.uint8), (257, torch.int16), (32768, torch.int16),
                         (32769, torch.int32)]:
        _, indices = compact(torch.randn(2, width), 0.99)
        assert indices.dtype == dtype, width
    # Laplace pads with index d, which must fit too.
    _, indices = compact(torch.randn(2, 256), 0.9, threshold="laplace")
    assert indices.dtype == torch.int16


def test_fp16_values_cross_both_ways_in_fp16() -> None:
    acts = torch.randn(8, 64, requires_grad=True)
    values, indices = compact(acts, 0.25, values="fp16")
    assert values.dtype == torch.float16
    rebuilt = expand(values, indices, 64, torch.float32)
    assert rebuilt.dtype == torch.float32
    sent_back: list[torch.Tensor] = []
    values.register_hook(sent_back.append)
    rebuilt.sum().backward()
    assert sent_back[0].dtype == torch.float16
    mask = _mask(indices, 64)
    assert acts.grad is not None and torch.equal(acts.grad, mask.float())
    torch.testing.assert_close(rebuilt, torch.where(mask, acts, 0.0), rtol=1e-3, atol=1e-3)


def test_laplace_row_keeps_the_estimated_mask_pads_with_width_and_falls_back_to_top_k() -> None:
    torch.manual_seed(1)
    # Laplace-distributed rows: the estimate is close, most rows fit the budget.
    acts = torch.distributions.Laplace(0.0, 1.0).sample((64, 200)).double()
    acts[0] = 0.0  # an all-zero row keeps nothing
    acts[1] = 0.0
    acts[1, ::4] = 1.0  # 50 equal spikes: the estimate keeps all 50 > k
    ratio = 0.1
    k = keep_count(200, ratio)
    indices = select(acts, ratio, "laplace-row")
    tau = laplace_thresholds(acts.abs(), ratio)
    for row in range(64):
        used = indices[row][indices[row] < 200]
        expected = (acts[row].abs() >= tau[row]).nonzero().squeeze(1)
        if row == 0:
            assert used.numel() == 0
        elif expected.numel() > k:  # overflow: exact top-k of the row
            assert torch.equal(used.sort().values,
                               acts[row].abs().topk(k).indices.sort().values)
        else:  # the Laplace mask itself, compacted in index order, padded with d
            assert torch.equal(used, expected)
            assert bool((indices[row][used.numel():] == 200).all())
    assert int((indices[1] < 200).sum()) == k  # row 1 overflowed
    values, small = compact(acts, ratio, threshold="laplace-row")
    assert bool((values[small.long() == 200] == 0).all())


def test_laplace_fits_one_law_to_the_whole_batch() -> None:
    """MLSys §2.2: mean and variance of X_act's entries give one tau per iteration."""
    torch.manual_seed(2)
    acts = torch.relu(torch.distributions.Laplace(0.3, 1.0).sample((32, 100)).double())
    acts[:4] *= 6.0  # four loud rows: the one batch tau keeps more than k there
    ratio = 0.1
    k = keep_count(100, ratio)
    magnitudes = acts.abs()
    mean, b = magnitudes.mean(), (magnitudes.var(correction=0) / 2).sqrt()
    tau = batch_laplace_threshold(magnitudes, ratio)
    assert tau.dim() == 0
    assert torch.allclose(tau, mean - b * math.log(2 * ratio))  # P(R >= tau) = 0.1
    indices = select(acts, ratio, "laplace")
    overflowed = 0
    for row in range(32):
        used = indices[row][indices[row] < 100]
        expected = (magnitudes[row] >= tau).nonzero().squeeze(1)
        if expected.numel() > k:
            overflowed += 1
            assert torch.equal(used.sort().values, magnitudes[row].topk(k).indices.sort().values)
        else:
            assert torch.equal(used, expected)
    assert overflowed >= 4
    assert overflowing_rows(acts, ratio, tau) == overflowed / 32


def test_laplace_sender_reuses_the_training_tau_at_test_and_checkpoints_it() -> None:
    """App. B: "during testing, the estimated tau from the training process can be used"."""
    sender = Compact(0.25, threshold="laplace")
    assert bool(sender.tau.isnan())
    train = torch.relu(torch.randn(16, 40))
    sender(train.clone().requires_grad_())
    fitted = batch_laplace_threshold(train.abs(), 0.25)
    assert torch.equal(sender.tau, fitted)
    assert len(sender.overflow) == 1
    sender.eval()
    test = 0.5 * torch.relu(torch.randn(16, 40))  # quieter: a refit would lower tau
    values, indices = sender(test)
    assert torch.equal(indices.long(), select(test, 0.25, "laplace", tau=fitted))
    assert not torch.equal(indices.long(), select(test, 0.25, "laplace"))
    assert torch.equal(sender.tau, fitted)  # evaluation never moves it
    restored = Compact(0.25, threshold="laplace")
    restored.load_state_dict(sender.state_dict())
    restored.eval()
    assert torch.equal(restored(test)[1], indices)


@pytest.mark.parametrize("shape", [(5, 30), (2, 3, 17)])
def test_row_thresholds_are_the_k_th_largest_magnitude(shape: tuple[int, ...]) -> None:
    acts = torch.randn(shape)
    for ratio in (1.0, 0.5, 0.1):
        k = keep_count(shape[-1], ratio)
        expected = acts.abs().sort(dim=-1, descending=True).values[..., k - 1]
        assert torch.equal(row_thresholds(acts, ratio), expected)


@pytest.mark.parametrize("ratio", [1.0, 0.1])
@pytest.mark.parametrize("values_dtype", ["native", "fp16"])
def test_modules_meter_exactly_the_payload_bytes(ratio: float, values_dtype: str) -> None:
    meter = Meter()
    batch, width = 16, 256
    sender = Compact(ratio, values=values_dtype, name="cut", meter=meter)
    receiver = Expand(width, ratio, torch.float32, name="cut", meter=meter)
    acts = torch.randn(batch, width, requires_grad=True)
    crossing = sender(acts)
    rebuilt = receiver(*crossing)
    rebuilt.sum().backward()
    value_size = 2 if values_dtype == "fp16" else 4
    k = keep_count(width, ratio)
    records = [(r.entity, r.layer, r.collective, r.nbytes) for r in meter.records]
    if ratio == 1:  # dense: the activation itself, no indices
        assert len(crossing) == 1
        assert records == [("X_act", "cut", "send", batch * width * value_size),
                           ("X_grad", "cut", "send", batch * width * value_size)]
    else:  # values + uint8 indices forward, values only backward
        assert len(crossing) == 2 and crossing[1].dtype == torch.uint8
        assert records == [("X_act", "cut", "send", batch * k * value_size),
                           ("X_act", "cut", "send", batch * k * 1),
                           ("X_grad", "cut", "send", batch * k * value_size)]
        assert records[0][3] + records[1][3] == sum(t.numel() * t.element_size()
                                                    for t in crossing)


def test_a_residual_stream_crosses_dense_beside_the_payload() -> None:
    meter = Meter()
    residual = torch.randn(2, 3, 8, requires_grad=True)
    hidden = torch.randn(2, 3, 32, requires_grad=True)
    crossing = Compact(0.25, name="ffn", meter=meter)((residual, hidden))
    assert len(crossing) == 3 and crossing[0] is residual
    out = Expand(32, 0.25, name="ffn", meter=meter)(*crossing)
    assert isinstance(out, tuple) and out[0] is residual and out[1].shape == (2, 3, 32)
    assert [r.nbytes for r in meter.records] == [2 * 3 * 8 * 4, 2 * 3 * 8 * 4, 2 * 3 * 8]


def test_ratio_one_compact_still_returns_a_full_permutation() -> None:
    acts = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    values, indices = compact(acts, 1.0)
    assert values.shape == (4, 9)
    assert torch.equal(expand(values, indices, 9), acts)


@pytest.mark.parametrize("ratio", [-0.1, 0.0, 1.5, float("nan")])
def test_ratio_outside_zero_one_is_rejected(ratio: float) -> None:
    with pytest.raises(ValueError, match="ratio="):
        compact(torch.randn(2, 8), ratio)
    with pytest.raises(ValueError, match="ratio="):
        Compact(ratio)
    with pytest.raises(ValueError, match="ratio="):
        Expand(8, ratio)


@pytest.mark.parametrize("shape", [(8,), (2, 3, 4, 5), ()])
def test_a_tensor_of_the_wrong_rank_is_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"\(B, d\) or \(B, T, d\)"):
        compact(torch.randn(shape), 0.5)
    with pytest.raises(ValueError, match=r"\(B, d\) or \(B, T, d\)"):
        Compact(0.5)(torch.randn(shape))


def test_other_bad_input_is_rejected_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="floating"):
        compact(torch.ones(2, 8, dtype=torch.int64), 0.5)
    with pytest.raises(ValueError, match="threshold="):
        compact(torch.randn(2, 8), 0.5, threshold="median")
    with pytest.raises(ValueError, match="values="):
        compact(torch.randn(2, 8), 0.5, values="int8")
    values, indices = compact(torch.randn(2, 8), 0.5)
    with pytest.raises(ValueError, match="outside"):
        expand(values, indices.long() + 5, 8)
    with pytest.raises(ValueError, match="integer"):
        expand(values, indices.float(), 8)
    with pytest.raises(ValueError, match="same shape"):
        expand(values, indices[:, :2], 8)
    with pytest.raises(ValueError, match="width="):
        expand(values, indices, 3)


def test_compact_traces_threshold_and_occupancy_only_while_training() -> None:
    sender = Compact(0.1, threshold="laplace-row")
    acts = torch.zeros(4, 200)
    acts[:, ::20] = torch.arange(1.0, 11.0)  # 10 spikes per row, fewer than k = 20
    kept = acts >= laplace_thresholds(acts, 0.1)
    assert 0 < int(kept[0].sum()) < 10  # the estimate keeps the larger spikes only
    sender(acts.clone().requires_grad_())
    (tau, density), = sender.trace
    assert tau == float(acts[kept].min())
    assert density == float(kept.sum()) / acts.numel()
    with torch.no_grad():
        sender(acts)
    sender.eval()
    sender(acts)
    assert len(sender.trace) == 1
