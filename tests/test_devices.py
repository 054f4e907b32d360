"""Every codec, boundary and engine creates its tensors on its input's device.

Without a GPU: ``on_input_device`` makes a factory call that names no device
land on ``meta`` and fails on it; paths whose output sizes do not depend on
values also run wholly on ``meta``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from device_check import on_input_device
from thinwire import schemes
from thinwire.autodiff import MODES, DistributedAutodiff
from thinwire.autodiff.power import dense_power_iterations, structured_power_iterations
from thinwire.compress.cltk import chunk_topk, encode_indices, exact_topk
from thinwire.compress.lowrank import seeded_normal
from thinwire.compress.powersgd import PowerSGD
from thinwire.pipeline.boundary import compact, expand


def test_the_check_catches_a_tensor_made_without_a_device() -> None:
    x = torch.ones(3)
    with pytest.raises(AssertionError, match="aten.zeros.default made a tensor on meta"):
        on_input_device(lambda: torch.zeros(3) + x)
    assert torch.equal(on_input_device(lambda: torch.zeros_like(x) + x), x)


@pytest.mark.parametrize("k", [0, 1, 7, 100])
def test_cltk_selection_and_index_encoding(k: int) -> None:
    magnitudes = torch.rand(100)
    for select in (chunk_topk, exact_topk):
        indices = on_input_device(select, magnitudes, k)
        wire = on_input_device(encode_indices, indices, 100)  # k = 100 takes the bitmap
        assert indices.numel() == k and wire.dtype == torch.uint8


@pytest.mark.parametrize("k", [3, 60])  # index list, bitmap
def test_cltk_index_encoding_runs_on_meta(k: int) -> None:
    indices = chunk_topk(torch.empty(100, device="meta"), k)
    wire = encode_indices(indices, 100)
    assert indices.device.type == wire.device.type == "meta" and indices.shape == (k,)


@pytest.mark.parametrize("name", ["clt-k", "local-topk", "powersgd", "dct-dp", "topk"])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_schemes_reduce_on_the_input_device(name: str, nonfinite: bool) -> None:
    scheme = schemes.build(name, nonfinite="skip")
    grads = {"w": torch.randn(16, 12), "b": torch.randn(16)}
    if nonfinite:
        grads["b"][0] = float("nan")
    for _ in range(2):  # the first step and a warm one
        reduced = on_input_device(scheme.reduce, grads)
        assert {key: value.shape for key, value in reduced.items()} == {
            key: value.shape for key, value in grads.items()}


def test_powersgd_codec_runs_on_meta() -> None:
    codec = PowerSGD(2)
    matrix = torch.empty(16, 12, device="meta")
    p = codec.left("w", matrix)
    assert p.device.type == "meta" and p.shape == (16, 2)
    assert codec.q("w", matrix).device.type == "meta"
    assert seeded_normal("k", (3, 2), device="meta").shape == (3, 2)


@pytest.mark.parametrize("threshold", ["topk", "laplace"])
def test_boundary_forward_and_backward(threshold: str) -> None:
    acts = torch.randn(4, 20, requires_grad=True)

    def through() -> torch.Tensor:
        values, indices = compact(acts, 0.25, threshold=threshold)
        out = expand(values, indices, 20)
        out.backward(torch.ones_like(out))
        return out

    out = on_input_device(through)
    assert out.shape == (4, 20) and acts.grad is not None


def test_topk_boundary_runs_on_meta() -> None:
    acts = torch.empty(4, 20, device="meta", requires_grad=True)
    values, indices = compact(acts, 0.25)
    values.backward(torch.ones_like(values))
    assert values.shape == indices.shape == (4, 5)
    assert acts.grad is not None and acts.grad.device.type == "meta"


def test_rank_dad_factors() -> None:
    acts, deltas = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)

    def start(j: int) -> torch.Tensor:
        return seeded_normal(f"c{j}", (4,), dtype=torch.float64)

    factors = on_input_device(structured_power_iterations, acts, deltas, 3, start, theta=0.0)
    assert factors.rank == 3
    on_input_device(dense_power_iterations, deltas.T @ acts, 3, start, theta=0.0)


@pytest.mark.parametrize("mode", MODES)
def test_autodiff_engine_synchronizes_on_the_input_device(mode: str) -> None:
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    options = {"rank": 2} if mode in ("rank-dad", "powersgd") else {}
    engine = DistributedAutodiff(model, mode, **options)
    F.cross_entropy(model(torch.randn(6, 5)), torch.arange(6) % 3).backward()
    grads = on_input_device(engine.synchronize)
    assert set(grads) == {name for name, _ in model.named_parameters()}
