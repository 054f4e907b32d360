"""Splitting models into stages in one process: transparency, Algorithm 2's changed
network, the negative-result boundaries, and clear errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from thinwire.comm import Meter
from thinwire.compress import keep_count
from thinwire.models.dlrm import dlrm
from thinwire.models.transformer import encoder
from thinwire.pipeline import Chain, Pipeline, select, split, split_positions, stage_metadata
from thinwire.pipeline.sketch import XGradTopKReceiver, sketch_matrix
from thinwire.pipeline.stages import build_stage


def _tiny_dlrm() -> Chain:
    return dlrm(5, [3, 4, 6], bottom=(16, 12, 8, 4), top=(16, 12, 8, 1), seed=3)


def _dlrm_batch(rows: int = 8) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    dense = torch.randn(rows, 5, generator=generator)
    categorical = torch.stack([torch.randint(0, c, (rows,), generator=generator)
                               for c in (3, 4, 6)], dim=1)
    labels = torch.randint(0, 2, (rows, 1), generator=generator).float()
    return dense, {"categorical": categorical}, labels


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _dlrm_step(net: nn.Module, owner: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients of ``owner``'s parameters (by their names there) after one step of ``net``."""
    dense, side, labels = _dlrm_batch()
    logits = net(dense, **side)
    nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
    return _grads(owner)


def _assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("ratio", [1.0, 0.99])  # 0.99 keeps all 12: the top-k path
@pytest.mark.parametrize("at", [("bottom.3",), ("bottom.3", "top.3"), ("bottom",)])
def test_ratio_one_is_transparent(ratio: float, at: tuple[str, ...]) -> None:
    model = _tiny_dlrm()
    reference = copy.deepcopy(model)
    dense, side, _ = _dlrm_batch()
    stages = split(model, at, dense, side=side, ratio=ratio)
    assert len(stages) == len(at) + 1
    if ratio < 1:
        assert keep_count(12, ratio) == 12
    _assert_identical(_dlrm_step(Pipeline(stages), model), _dlrm_step(reference, reference))


def test_transformer_ffn_split_is_transparent_at_ratio_one() -> None:
    model = encoder(layers=2, seed=1)
    reference = copy.deepcopy(model)
    tokens = torch.rand(6, 8, 8)
    labels = torch.arange(6) % 10
    stages = split(model, ["layer0.ffn_relu", "layer1.ffn_relu"], tokens, ratio=1.0)
    for net in (Pipeline(stages), reference):
        nn.functional.cross_entropy(net(tokens), labels).backward()
    _assert_identical(_grads(model), _grads(reference))


def _masked_reference(model: nn.Module, name: str, ratio: float) -> Any:
    """The unsplit model with Algorithm 2's mask inserted as a layer after ``name``."""
    module = dict(model.named_modules())[name]

    def hook(_: nn.Module, __: Any, out: Any) -> Any:
        acts = out[-1] if isinstance(out, tuple) else out
        mask = torch.zeros_like(acts, dtype=torch.bool).scatter_(-1, select(acts, ratio),
                                                                  True)
        masked = torch.where(mask, acts, 0.0)
        return (*out[:-1], masked) if isinstance(out, tuple) else masked

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("ratio", [0.5, 0.25, 0.1])
def test_split_model_is_sgd_on_the_masked_network(ratio: float) -> None:
    model = _tiny_dlrm()
    reference = copy.deepcopy(model)
    dense, side, _ = _dlrm_batch()
    stages = split(model, ["bottom.3", "top.3"], dense, side=side, ratio=ratio)
    _masked_reference(reference, "bottom.3", ratio)
    _masked_reference(reference, "top.3", ratio)
    _assert_identical(_dlrm_step(Pipeline(stages), model), _dlrm_step(reference, reference))


def test_transformer_split_is_sgd_on_the_masked_network_per_token() -> None:
    model = encoder(layers=2, seed=1)
    reference = copy.deepcopy(model)
    tokens = torch.rand(6, 8, 8)
    labels = torch.arange(6) % 10
    stages = split(model, ["layer1.ffn_relu"], tokens, ratio=0.1)
    _masked_reference(reference, "layer1.ffn_relu", 0.1)
    for net in (Pipeline(stages), reference):
        nn.functional.cross_entropy(net(tokens), labels).backward()
    _assert_identical(_grads(model), _grads(reference))


def test_stage_metadata_marks_values_differentiable_and_indices_not() -> None:
    model = _tiny_dlrm()
    dense, side, _ = _dlrm_batch()
    stages = split(model, ["bottom.3"], dense, side=side, ratio=0.25)
    inputs, outputs = stage_metadata(stages, 0, dense, 2, side)
    k = keep_count(12, 0.25)
    assert [(tuple(t.shape), t.dtype, t.requires_grad) for t in outputs] == [
        ((4, k), torch.float32, True), ((4, k), torch.uint8, False)]
    assert inputs[0].shape == (4, 5)
    received, _ = stage_metadata(stages, 1, dense, 2, side)
    assert [(tuple(t.shape), t.dtype, t.requires_grad) for t in received] == [
        (tuple(t.shape), t.dtype, t.requires_grad) for t in outputs]
    with pytest.raises(ValueError, match="equal microbatches"):
        stage_metadata(stages, 0, dense, 3, side)


def test_bad_split_points_are_rejected_with_the_valid_ones_listed() -> None:
    model = _tiny_dlrm()
    dense, side, _ = _dlrm_batch()
    with pytest.raises(ValueError, match=r"no module named 'bottom\.99'.*split points are"):
        split(model, ["bottom.99"], dense, side=side)
    with pytest.raises(ValueError, match=r"cannot split inside 'interact'"):
        split(model, ["interact.table"], dense, side=side)
    with pytest.raises(ValueError, match="last module"):
        split(model, ["top.6"], dense, side=side)
    with pytest.raises(ValueError, match="same position"):
        split(model, ["bottom.7", "bottom"], dense, side=side)
    with pytest.raises(TypeError, match="nn.Sequential"):
        split_positions(nn.Linear(2, 2), ["weight"])
    assert split_positions(model, ["top.3", "bottom.3"]) == [3, 12]


def test_a_split_on_an_activation_of_the_wrong_rank_is_rejected() -> None:
    model = Chain(nn.Linear(4, 6), nn.Flatten(0), nn.Linear(12, 1))
    with pytest.raises(ValueError, match=r"\(B, d\) or \(B, T, d\).*after '1'"):
        split(model, ["1"], torch.randn(2, 4))
    conv = Chain(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 36, 1))
    with pytest.raises(ValueError, match=r"rank 4"):
        split(conv, ["1"], torch.randn(2, 1, 8, 8))


def test_bad_boundary_options_are_rejected() -> None:
    model = _tiny_dlrm()
    dense, side, _ = _dlrm_batch()
    with pytest.raises(ValueError, match="unknown boundary kind"):
        split(model, ["bottom.3"], dense, side=side, boundary="zip")
    with pytest.raises(ValueError, match="no option"):
        split(model, ["bottom.3"], dense, side=side, rato=0.1)
    with pytest.raises(ValueError, match="sparsity was renamed: pass ratio=1-x"):
        split(model, ["bottom.3"], dense, side=side, sparsity=0.9)
    with pytest.raises(ValueError, match="ratio="):
        split(model, ["bottom.3"], dense, side=side, ratio=0.0)
    with pytest.raises(ValueError, match="side input"):
        split(model, ["top.3"], dense)


def test_gaussian_sketch_sends_x_s_and_returns_the_exact_sketched_gradient() -> None:
    model = _tiny_dlrm()
    dense, side, _ = _dlrm_batch()
    meter = Meter()
    stages = split(model, ["bottom.3"], dense, side=side, boundary="sketch",
                   compression=0.75, seed=5, meter=meter)
    sender, receiver = stages[0].sender, stages[1].receiver
    for call in (1, 2):  # a fresh S per training call, the same on both sides
        matrix = sketch_matrix("bottom.3", 12, 0.75, seed=5, draw=call).double()
        assert matrix.shape == (12, 3)
        acts = torch.randn(8, 12, dtype=torch.float64, requires_grad=True)
        (sketched,) = sender(acts)
        assert torch.equal(sketched, acts @ matrix)
        rebuilt = receiver(sketched)
        assert torch.equal(rebuilt.detach(), sketched.detach() @ matrix.T)
        grad = torch.randn(8, 12, dtype=torch.float64)
        rebuilt.backward(grad)
        torch.testing.assert_close(acts.grad, grad @ matrix @ matrix.T)
    assert [(r.entity, r.nbytes) for r in meter.records] == [("X_act", 8 * 3 * 8),
                                                             ("X_grad", 8 * 3 * 8)] * 2
    # The call count is checkpointed; evaluation uses draw 0 and counts nothing.
    clone = split(_tiny_dlrm(), ["bottom.3"], dense, side=side, boundary="sketch",
                  compression=0.75, seed=5)
    clone[0].load_state_dict(stages[0].state_dict())
    assert clone[0].sender.sketch.calls == 2
    sender.eval()
    with torch.no_grad():
        fixed = sketch_matrix("bottom.3", 12, 0.75, seed=5)
        assert torch.equal(sender(torch.eye(12))[0], fixed)
    assert sender.sketch.calls == 2
    # E[S S^T] = I over draws.
    average = sum(sketch_matrix("x", 64, 0.0, seed=1, draw=d) @
                  sketch_matrix("x", 64, 0.0, seed=1, draw=d).T for d in range(50)) / 50
    torch.testing.assert_close(average, torch.eye(64), atol=0.2, rtol=0.0)


def test_xgrad_topk_keeps_the_error_feedback_invariant_and_resumes() -> None:
    receiver = XGradTopKReceiver(0.25, name="cut", meter=Meter())
    first = torch.randn(4, 16, dtype=torch.float64)
    sent = receiver.compress_grad(first)
    assert torch.equal((sent != 0).sum(-1), torch.full((4,), 4))
    key = "cut(4, 16)"
    torch.testing.assert_close(first, sent + receiver.memory.buffers[key], rtol=0, atol=0)
    second = torch.randn(4, 16, dtype=torch.float64)
    compensated = second + receiver.memory.buffers[key]
    sent2 = receiver.compress_grad(second)
    assert torch.equal(compensated, sent2 + receiver.memory.buffers[key])
    assert [r.nbytes for r in receiver.meter.records] == [4 * 4 * (8 + 1)] * 2
    # The residual is in the module's state_dict and resumes exactly.
    clone = XGradTopKReceiver(0.25, name="cut")
    clone.load_state_dict(receiver.state_dict())
    third = torch.randn(4, 16, dtype=torch.float64)
    assert torch.equal(clone.compress_grad(third), receiver.compress_grad(third))


def test_xgrad_topk_trains_in_one_process_but_no_pipeline_can_carry_it() -> None:
    model = _tiny_dlrm()
    dense, side, _ = _dlrm_batch()
    stages = split(model, ["bottom.3"], dense, side=side, boundary="xgrad-topk", ratio=0.5)
    grads = _dlrm_step(Pipeline(stages), model)
    assert all(torch.isfinite(g).all() for g in grads.values())
    with pytest.raises(ValueError, match="runs only in one process"):
        build_stage(stages, 0, dense, 2, side=side)
