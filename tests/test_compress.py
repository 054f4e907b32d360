"""Sparsifiers: exact selection, DCT threshold reuse (Alg. 1), the documented edge cases."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch

from thinwire import schemes
from thinwire.compress import (
    Cast,
    DCTThreshold,
    DensePayload,
    LaplaceThreshold,
    SparseLayout,
    SparsePayload,
    TensorInfo,
    TopK,
    decode,
    value_codec,
)
from thinwire.compress._select import (
    kth_by_topk,
    kth_largest,
    largest_in_order,
    sparse_nonzero,
)
from thinwire.compress.chunked import ChunkTopK
from thinwire.compress.sparse import TRACE_LENGTH, Sparsifier, _nonzero_at_least
from thinwire.feedback import Residual


def info_of(tensor: torch.Tensor, key: str = "w") -> TensorInfo:
    return TensorInfo.of(key, tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_native_values_are_bit_exact_and_fp16_rounds(dtype: torch.dtype) -> None:
    values = torch.randn(35, dtype=dtype)
    native, half = Cast("native"), Cast("fp16")
    sent = {}
    for codec in (native, half):
        area = torch.zeros(codec.nbytes(35, dtype), dtype=torch.uint8)
        sent[codec.name] = codec.write(values, area, 35)
        assert torch.equal(codec.read(area, 35, 35, dtype), sent[codec.name])
    assert native.exact(dtype) and torch.equal(sent["native"], values)
    assert not half.exact(dtype) and torch.equal(sent["fp16"], values.half())
    assert half.nbytes(35, dtype) == 72  # 35 fp16 values, padded to 4 bytes


def test_topk_keeps_exactly_the_largest_magnitudes() -> None:
    grad = torch.randn(1000)
    payload = TopK(0.05, min_numel=0).compress(grad, info_of(grad))
    assert isinstance(payload, SparsePayload) and payload.count == 50
    expected = set(torch.topk(grad.abs(), 50).indices.tolist())
    assert set(payload.indices.tolist()) == expected
    assert torch.equal(payload.values, grad[payload.indices])


def test_dct_with_life_span_one_equals_topk_with_error_feedback() -> None:
    dct, topk = DCTThreshold(0.1, life_span=1, min_numel=0), TopK(1 - 0.9, min_numel=0)
    memory_dct, memory_topk = Residual(), Residual()
    for _ in range(20):
        grad = torch.randn(257)  # continuous values: no ties
        sent = []
        for compressor, memory in ((dct, memory_dct), (topk, memory_topk)):
            info = info_of(grad)
            compensated = memory.compensate("w", grad)
            payload = compressor.compress(compensated, info)
            decoded = compressor.decompress(payload, info)
            memory.update("w", compensated, decoded)
            sent.append(decoded)
        assert torch.equal(sent[0], sent[1])
        assert torch.equal(memory_dct.buffers["w"], memory_topk.buffers["w"])


@pytest.mark.parametrize("steps,life_span", [(10, 3), (9, 3), (1, 5), (12, 1)])
def test_dct_recomputes_threshold_ceil_steps_over_l_times(steps: int, life_span: int) -> None:
    dct = DCTThreshold(0.1, life_span=life_span, min_numel=0)
    taus = []
    for _ in range(steps):
        grad = torch.randn(100)
        dct.compress(grad, info_of(grad))
        taus.append(dct.tau["w"])
    assert dct.refreshes["w"] == math.ceil(steps / life_span)
    for step in range(steps):  # reused in between refreshes
        if step % life_span:
            assert taus[step] == taus[step - 1]


def test_dct_reused_threshold_masks_by_magnitude() -> None:
    dct = DCTThreshold(0.5, life_span=100, min_numel=0, capacity=10.0)
    first = torch.arange(1.0, 11.0)
    dct.compress(first, info_of(first))
    assert dct.tau["w"] == 6.0  # the 5th largest of 1..10
    later = torch.tensor([0.5, -7.0, 6.0, 5.9, 0.0, 100.0])
    payload = dct.compress(later, info_of(later))
    assert sorted(payload.indices.tolist()) == [1, 2, 5]  # |x| >= 6, ties kept


def test_ties_at_threshold_are_all_kept() -> None:
    grad = torch.tensor([1.0, 2.0, 2.0, 2.0, 0.5])
    payload = DCTThreshold(0.2, life_span=1, min_numel=0,
                           capacity=3.0).compress(grad, info_of(grad))  # k = 1
    assert sorted(payload.indices.tolist()) == [1, 2, 3]


@pytest.mark.parametrize("compressor", [DCTThreshold(0.1, 1, min_numel=0), TopK(0.1, min_numel=0),
                                        LaplaceThreshold(0.1, min_numel=0)])
def test_all_zero_tensor_sends_nothing(compressor: TopK) -> None:
    grad = torch.zeros(300)
    payload = compressor.compress(grad, info_of(grad))
    assert isinstance(payload, SparsePayload) and payload.count == 0
    assert payload.nbytes == 4


def test_topk_sends_only_the_nonzero_entries_among_its_k_largest() -> None:
    grad = torch.zeros(1000)
    grad[[3, 500, 999]] = torch.tensor([-2.0, 0.5, 1.0])  # k = 10, three nonzero
    topk = TopK(0.01, min_numel=0)
    payload = topk.compress(grad, info_of(grad))
    assert isinstance(payload, SparsePayload)
    assert payload.indices.tolist() == [3, 500, 999] and topk.trace["w"][-1][1] == 0.5
    grad[:] = torch.arange(1000.0)  # all ten of the largest are nonzero: tau is the 10th
    assert topk.compress(grad, info_of(grad)).count == 10 and topk.trace["w"][-1][1] == 990.0


def test_small_tensors_ratio_one_and_empty_tensors() -> None:
    small = torch.randn(10)
    assert isinstance(DCTThreshold(0.1, 1, min_numel=11).compress(small, info_of(small)),
                      DensePayload)
    dense = DCTThreshold(1.0, 1).compress(small, info_of(small))
    assert isinstance(dense, DensePayload) and torch.equal(dense.values, small)
    empty = torch.zeros(0)
    for compressor in (TopK(0.5, min_numel=0), DCTThreshold(0.1, 1, min_numel=0),
                       LaplaceThreshold(0.1, min_numel=0)):
        payload = compressor.compress(empty, info_of(empty))  # header only
        assert payload.nbytes == 4 and decode(payload, info_of(empty)).numel() == 0
    assert TopK(0.5, min_numel=1).compress(empty, info_of(empty)).nbytes == 0  # dense
    # By default every tensor is sparse and keeps at least one entry; the Laplace fit,
    # which passes nothing on a few entries, sends tensors under 1024 entries dense.
    one = TopK(0.01).compress(small, info_of(small))
    assert isinstance(one, SparsePayload) and one.count == 1
    assert one.indices.tolist() == [int(small.abs().argmax())]
    assert isinstance(LaplaceThreshold(0.01).compress(small, info_of(small)), DensePayload)


def test_laplace_records_achieved_density() -> None:
    laplace = LaplaceThreshold(0.01)
    grad = torch.distributions.Laplace(0.0, 1.0).sample((100_000,))
    payload = laplace.compress(grad, info_of(grad))
    _, tau, density = laplace.trace["w"][0]
    assert density == payload.count / grad.numel()
    assert tau == pytest.approx(math.log(100), rel=0.02)  # b = 1, eta = 0.99
    assert density == pytest.approx(0.01, rel=0.1)  # the fit is right for Laplace data


def test_laplace_over_a_bucket_fits_one_law_to_its_tensors() -> None:
    """scope="bucket": one tau, b = mean |p| over every tensor of the launch, so a tensor
    of small entries sends none of them while per layer it sends its share."""
    torch.manual_seed(0)
    grads = {"large": torch.randn(4000), "small": torch.randn(4000) * 1e-3}
    tau = float(torch.cat(list(grads.values())).abs().mean()) * math.log(10)
    bucket = schemes.build("laplace", ratio=0.1, scope="bucket", capacity=4.0).reduce(grads)
    layer = schemes.build("laplace", ratio=0.1).reduce(grads)
    assert torch.equal(bucket["large"], torch.where(grads["large"].abs() > tau,
                                                    grads["large"], 0.0))
    assert not bucket["small"].any() and layer["small"].any()


def _heavy_tailed(step: int) -> torch.Tensor:
    """Entries with heavier tails than a Laplace law (Student's t, 2 degrees of freedom):
    mean |x| overstates the fit's scale, so fewer pass the fit's tau than asked."""
    generator = torch.Generator().manual_seed(step)
    normal = torch.randn(50_000, generator=generator)
    chi = torch.randn(2, 50_000, generator=generator).pow(2).sum(0)
    return normal / (chi / 2).sqrt()


def test_laplace_gain_holds_the_mean_sent_at_the_target() -> None:
    """The paper's fit misses the target on heavy tails (its Fig. 6b); the controller
    brings the mean of what is sent to it."""
    sent = {}
    for gain in (None, 0.1):
        laplace = LaplaceThreshold(0.07, gain)
        counts = [laplace.indices(_heavy_tailed(step).abs(), info_of(torch.zeros(50_000)))
                  .numel() for step in range(150)]
        sent[gain] = sum(counts[-50:]) / 50 / 50_000
    assert abs(sent[None] - 0.07) > 0.004  # the fit alone is off here
    assert sent[0.1] == pytest.approx(0.07, rel=0.03)


def test_laplace_gain_resumes_exactly() -> None:
    laplace = LaplaceThreshold(0.05, 0.1)
    grads = [_heavy_tailed(step) for step in range(8)]
    for grad in grads[:3]:
        laplace.compress(grad, info_of(grad))
    resumed = LaplaceThreshold(0.05, 0.1)
    resumed.load_state_dict(laplace.state_dict())
    for grad in grads[3:]:
        a, b = laplace.compress(grad, info_of(grad)), resumed.compress(grad, info_of(grad))
        assert torch.equal(a.indices, b.indices)
    assert laplace.scale == resumed.scale and laplace.scale["w"] != 1.0


def test_fp16_values_halve_value_bytes() -> None:
    full = SparseLayout(10_000, 100, torch.float32, "delta16", Cast("fp32"))
    half = SparseLayout(10_000, 100, torch.float32, "delta16", Cast("fp16"))
    assert full.nbytes - half.nbytes == 100 * 2


def test_dct_state_dict_resumes_threshold() -> None:
    dct = DCTThreshold(0.1, life_span=4, min_numel=0)
    grads = [torch.randn(50) for _ in range(8)]
    for grad in grads[:3]:
        dct.compress(grad, info_of(grad))
    resumed = DCTThreshold(0.1, life_span=4, min_numel=0)
    resumed.load_state_dict(dct.state_dict())
    for grad in grads[3:]:
        a, b = dct.compress(grad, info_of(grad)), resumed.compress(grad, info_of(grad))
        assert torch.equal(a.indices, b.indices)
    assert dct.tau == resumed.tau and dct.refreshes == resumed.refreshes


@pytest.mark.parametrize("make", [lambda: TopK(0.0), lambda: TopK(1.5), lambda: TopK(float("nan")),
                                  lambda: DCTThreshold(0.0), lambda: DCTThreshold(-0.1),
                                  lambda: DCTThreshold(0.5, life_span=0),
                                  lambda: LaplaceThreshold(1.2),
                                  lambda: LaplaceThreshold(0.1, gain=0.0),
                                  lambda: value_codec("int9"), lambda: Cast("int8")])
def test_bad_config_raises_value_error(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]


def _adversarial() -> list[torch.Tensor]:
    n = 50_000  # above the size where the sampled bound is used
    spike = torch.zeros(n)
    spike[123] = 1e30
    stripes = torch.zeros(n)
    stripes[::12] = 1.0  # every sampled entry large: the bound overshoots
    return [torch.ones(n), torch.zeros(n), spike, stripes, torch.randint(0, 4, (n,)).float(),
            torch.randn(n).abs(), torch.rand(n).sort().values, torch.rand(n) ** 8]


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("k", [1, 7, 500, 4999, 20_000])
def test_candidate_kth_largest_matches_torch_kthvalue(case: int, k: int) -> None:
    magnitudes = _adversarial()[case]
    assert torch.equal(kth_largest(magnitudes, k),
                       torch.kthvalue(magnitudes, magnitudes.numel() - k + 1).values)


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("k", [1, 7, 4999, 25_000, 25_001, 45_000, 50_000])
def test_kth_by_topk_matches_torch_kthvalue(case: int, k: int) -> None:
    magnitudes = _adversarial()[case]  # the GPU's path, checked here on the CPU
    assert torch.equal(kth_by_topk(magnitudes, k),
                       torch.kthvalue(magnitudes, magnitudes.numel() - k + 1).values)


@pytest.mark.parametrize("case", range(8))
@pytest.mark.parametrize("k", [0, 1, 7, 500, 4999, 50_000])
def test_largest_in_order_keeps_the_top_k_values_ascending_with_lowest_ties(
        case: int, k: int) -> None:
    magnitudes = _adversarial()[case]
    positions = largest_in_order(magnitudes, k)
    assert positions.numel() == k and bool((positions[1:] > positions[:-1]).all())
    expected = torch.topk(magnitudes, k).values
    assert torch.equal(magnitudes[positions].sort(descending=True).values, expected)
    if 0 < k < magnitudes.numel():  # of the entries tied at the k-th value, the first ones
        kth = expected[-1]
        tied = (magnitudes == kth).nonzero().squeeze(1)
        assert torch.equal(positions[magnitudes[positions] == kth],
                           tied[: int((magnitudes[positions] == kth).sum())])


@pytest.mark.parametrize("numel", [0, 7, 16_384, 65_536, 65_541, 200_003])
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.01, 0.2, 0.9, 1.0])
def test_sparse_nonzero_equals_nonzero(numel: int, density: float) -> None:
    mask = torch.rand(numel) < density
    assert torch.equal(sparse_nonzero(mask), mask.nonzero().squeeze(1))
    for expected in (0.001, 0.5):  # a caller's expected density picks the pass, not the result
        assert torch.equal(sparse_nonzero(mask, expected), mask.nonzero().squeeze(1))
    if numel > 16:  # a view that starts off the 8-byte grid, and one that is not contiguous
        assert torch.equal(sparse_nonzero(mask[3:]), mask[3:].nonzero().squeeze(1))
        assert torch.equal(sparse_nonzero(mask[::2]), mask[::2].nonzero().squeeze(1))


def test_sparse_nonzero_finds_the_last_and_first_entries() -> None:
    mask = torch.zeros(100_005, dtype=torch.bool)
    mask[[0, 7, 8, 99_999, 100_000, 100_004]] = True
    assert sparse_nonzero(mask).tolist() == [0, 7, 8, 99_999, 100_000, 100_004]


def test_nonzero_at_least_counts_exactly_when_the_sample_is_not_plain() -> None:
    dense = torch.randn(100_000)
    assert _nonzero_at_least(dense, 1000) == 1000  # plainly more than k non-zeros
    sparse = torch.zeros(100_000)
    sparse[5_000:5_250] = 1.0  # 250 non-zeros against k = 1000 (an embedding's touched rows)
    assert _nonzero_at_least(sparse, 1000) == 250
    assert _nonzero_at_least(torch.zeros(100), 10) == 0


def test_candidate_selection_refuses_k_out_of_range() -> None:
    with pytest.raises(ValueError, match="k=11"):
        largest_in_order(torch.ones(10), 11)
    with pytest.raises(ValueError, match="k=0"):
        kth_largest(torch.ones(10), 0)
    with pytest.raises(ValueError, match="k=-1"):
        largest_in_order(torch.ones(10), -1)


def test_threshold_trace_keeps_a_bounded_window() -> None:
    dct = DCTThreshold(0.1, life_span=1, min_numel=0)
    grad = torch.randn(20)
    for _ in range(TRACE_LENGTH + 5):
        dct.compress(grad, info_of(grad))
    assert len(dct.trace["w"]) == TRACE_LENGTH and dct.trace["w"][-1][0] == TRACE_LENGTH + 4
def _drifting_grads(steps: int, numel: int = 4000) -> list[torch.Tensor]:
    """A gradient whose scale swings by 10x and whose large entries move: a stale tau both
    over- and under-sends on such a sequence."""
    generator = torch.Generator().manual_seed(0)
    grads = []
    for step in range(steps):
        scale = 10.0 ** math.sin(step / 15.0)
        heavy = torch.zeros(numel)
        heavy[(step * 37) % numel:(step * 37) % numel + 40] = 5.0
        grads.append(scale * (torch.randn(numel, generator=generator) + heavy))
    return grads


def _run(compressor: DCTThreshold, grads: list[torch.Tensor]) -> float:
    """Feed ``grads`` through ``compressor`` with error feedback; the mean achieved density."""
    memory = Residual()
    for grad in grads:
        compensated = memory.compensate("w", grad)
        payload = compressor.compress(compensated, info_of(grad))
        memory.update("w", compensated, compressor.decompress(payload, info_of(grad)))
    return sum(d for _, _, d in compressor.trace["w"]) / len(grads)


@pytest.mark.parametrize("capacity", [100.0, 1.0])  # room for everything; room for k
def test_dct_density_control_holds_the_target_with_one_selection_per_life_span(
        capacity: float) -> None:
    grads = _drifting_grads(600)
    controlled = DCTThreshold(0.01, life_span=1000, gain=0.05, capacity=capacity)
    stale = DCTThreshold(0.01, life_span=1000, capacity=100.0)
    assert abs(_run(controlled, grads) / 0.01 - 1) <= 0.25
    assert abs(_run(stale, grads) / 0.01 - 1) > 0.25  # the sequence defeats a fixed tau
    assert controlled.refreshes["w"] == 1  # no selection beyond the life-span's first
    resumed = DCTThreshold(0.01, life_span=1000, gain=0.05, capacity=capacity)
    resumed.load_state_dict(controlled.state_dict())
    grad = grads[0]
    assert torch.equal(resumed.compress(grad, info_of(grad)).indices,
                       controlled.compress(grad, info_of(grad)).indices)
    assert resumed.tau == controlled.tau


def test_dct_density_control_targets_what_a_sparse_gradient_can_send() -> None:
    dct = DCTThreshold(0.1, life_span=1000, gain=0.05, min_numel=0)
    grad = torch.zeros(1000)
    grad[:20] = torch.arange(1.0, 21.0)  # 20 non-zeros against k = 100
    for _ in range(5):
        assert dct.compress(grad, info_of(grad)).count == 20
    assert dct.refreshes["w"] == 1


def test_dct_reused_zero_threshold_is_recomputed() -> None:
    dct = DCTThreshold(0.1, life_span=1000, min_numel=0)
    dct.compress(torch.zeros(1000), info_of(torch.zeros(1000)))  # tau = 0
    grad = torch.randn(1000)
    assert dct.compress(grad, info_of(grad)).count == 100
    assert dct.refreshes["w"] == 2


def test_dct_density_control_rejects_a_bad_gain() -> None:
    for bad in (0.0, 1.5, -0.5, float("nan")):
        with pytest.raises(ValueError, match="gain"):
            DCTThreshold(0.1, gain=bad)


def _picks(compressor: DCTThreshold, parts: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """``select_all`` on ``parts`` as one call (one DDP bucket), per key."""
    infos = [TensorInfo.of(key, part) for key, part in parts.items()]
    chosen = compressor.select_all(torch.cat(list(parts.values())), infos)
    return {info.key: local.tolist() for info, local in zip(infos, chosen)}


@pytest.mark.parametrize("make, sizes", [
    (lambda: DCTThreshold(0.02, life_span=2, min_numel=0, scope="bucket"), (500, 1500, 700)),
    (lambda: DCTThreshold(0.02, life_span=2, min_numel=0, scope="layer"), (500, 1500, 700)),
    (lambda: ChunkTopK(64, 3), (128, 192, 100)),  # whole chunks, then a partial one
    (lambda: ChunkTopK(64, 3), (100, 192, 128))], ids=["bucket", "layer", "chunks", "ragged"])
def test_joined_selection_is_every_tensors_selection_back_to_back(
        make: Callable[[], Sparsifier], sizes: tuple[int, ...]) -> None:
    """select_joined, the kernel's, against select_all's per-tensor indices: the same
    entries and counts, traces and state, through one group, a split group and a
    re-grouping."""
    generator = torch.Generator().manual_seed(0)
    apart, joined = make(), make()
    for keys in (["a", "b", "c"], ["a", "b", "c"], ["a", "b"], ["c"], ["c", "b", "a"],
                 ["a", "c"]):
        parts = {key: torch.rand(n, generator=generator) for key, n in zip(keys, sizes)}
        expected = _picks(apart, parts)
        infos = [TensorInfo.of(key, part) for key, part in parts.items()]
        indices, counts = joined.select_joined(torch.cat(list(parts.values())), infos)
        starts = [0, *itertools.accumulate(info.numel for info in infos)]
        assert counts == [len(expected[key]) for key in keys]
        assert indices.tolist() == [start + i for key, start in zip(keys, starts)
                                    for i in expected[key]]
        assert joined.state_dict() == apart.state_dict()
        assert getattr(joined, "tau", None) == getattr(apart, "tau", None)
        assert {k: list(v) for k, v in joined.trace.items()} == {
            k: list(v) for k, v in apart.trace.items()}


def test_bucket_scope_selects_again_in_the_groups_it_last_used() -> None:
    """DDP's first step after a resume puts every tensor in one bucket, in another order:
    each tensor is still selected with the tensors it was last selected with."""
    def step(seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return {key: torch.rand(n, generator=generator) * scale
                for key, n, scale in (("a", 1000, 1.0), ("b", 3000, 2.0), ("c", 2000, 1.0))}

    straight = DCTThreshold(0.01, life_span=3, min_numel=0, scope="bucket")
    for seed in range(2):  # DDP's rebuilt buckets: (a, b) and (c)
        magnitudes = step(seed)
        _picks(straight, {"a": magnitudes["a"], "b": magnitudes["b"]})
        _picks(straight, {"c": magnitudes["c"]})
    resumed = DCTThreshold(0.01, life_span=3, min_numel=0, scope="bucket")
    resumed.load_state_dict(straight.state_dict())
    magnitudes = step(2)
    expected = {**_picks(straight, {"a": magnitudes["a"], "b": magnitudes["b"]}),
                **_picks(straight, {"c": magnitudes["c"]})}
    got = _picks(resumed, {key: magnitudes[key] for key in ("c", "b", "a")})
    assert got == expected and len(got["a"]) < len(got["b"])  # b's entries are larger
    assert resumed.tau == straight.tau and set(resumed.tau) == {"a..b", "c"}
    # A bucket that splits a group is a new group, remembered from then on.
    _picks(resumed, {"a": magnitudes["a"], "c": magnitudes["c"]})
    assert resumed.groups == {"a": ("a", "c"), "b": ("a", "b"), "c": ("a", "c")}
    assert "a..c" in resumed.tau
