"""Error feedback: the exact invariant, the non-finite policy, the drain, checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from thinwire.compress import DCTThreshold, TensorInfo, TopK
from thinwire.feedback import (
    Decayed,
    Estimate,
    LowPass,
    Memory,
    MomentumCorrection,
    Residual,
    all_finite,
)
from thinwire.schemes import build


@pytest.mark.parametrize("compressor", [TopK(0.1), DCTThreshold(0.95, life_span=3),
                                        TopK(0.2, min_numel=20)])
def test_invariant_grad_plus_old_error_equals_sent_plus_new_error(compressor: TopK) -> None:
    memory = Residual()
    shapes = {"fc1.weight": (16, 8), "fc1.bias": (16,), "fc2.weight": (4, 16)}
    for _ in range(6):
        for key, shape in shapes.items():
            grad = torch.randn(shape, dtype=torch.float64)
            old = memory.buffers.get(key, torch.zeros(shape, dtype=torch.float64)).clone()
            info = TensorInfo.of(key, grad)
            compensated = memory.compensate(key, grad)
            sent = compressor.decompress(compressor.compress(compensated, info), info)
            memory.update(key, compensated, sent)
            assert torch.equal(grad + old, sent + memory.buffers[key])


def test_memory_never_aliases_the_gradient() -> None:
    memory = Residual()
    grad = torch.ones(4)
    compensated = memory.compensate("w", grad)
    compensated.mul_(3)
    assert torch.equal(grad, torch.ones(4))


def test_nonfinite_policy() -> None:
    grads = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")])}
    with pytest.raises(FloatingPointError, match="'b'"):
        all_finite(grads, "raise")
    assert all_finite(grads, "skip") is False
    assert all_finite({"a": torch.ones(3)}, "raise") is True


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nan_gradient_leaves_error_memory_finite(policy: str) -> None:
    scheme = build("dct-dp", ratio=0.1, life_span=2, nonfinite=policy, min_numel=0)
    scheme.reduce({"w": torch.randn(100)})
    before = scheme.state_dict()
    bad = torch.randn(100)
    bad[7] = float("inf")
    if policy == "raise":
        with pytest.raises(FloatingPointError):
            scheme.reduce({"w": bad})
    else:
        out = scheme.reduce({"w": bad})
        assert torch.equal(out["w"], torch.zeros(100))  # this rank contributes nothing
        assert scheme.skipped == 1
    after = scheme.state_dict()
    assert torch.isfinite(after["memory"]["buffers"]["w"]).all()
    assert torch.equal(after["memory"]["buffers"]["w"], before["memory"]["buffers"]["w"])
    assert after["selection"]["tau"] == before["selection"]["tau"]


def test_stochastic_drain_empties_buffers_at_the_expected_rate() -> None:
    memory = Residual(drain_every=4, seed=1)
    for _ in range(400):
        memory.update("w", torch.ones(3), torch.zeros(3))
    assert 60 < memory.drains < 140  # binomial(400, 1/4): mean 100, sd 8.7
    with pytest.raises(ValueError, match="drain_every=0"):
        Residual(drain_every=0)


def test_residual_state_dict_round_trip_includes_the_drain_state() -> None:
    memory = Residual(drain_every=2, seed=3)
    memory.update("w", torch.ones(3), torch.zeros(3))
    copy = Residual(drain_every=2)
    copy.load_state_dict(memory.state_dict())
    for _ in range(20):
        memory.update("w", torch.ones(3), torch.zeros(3))
        copy.update("w", torch.ones(3), torch.zeros(3))
    assert memory.drains == copy.drains


def test_drain_draws_do_not_depend_on_the_order_keys_are_updated_in() -> None:
    forward, backward = Residual(drain_every=3, seed=5), Residual(drain_every=3, seed=5)
    keys = [f"layer{i}" for i in range(6)]
    for _ in range(10):
        for memory, order in ((forward, keys), (backward, keys[::-1])):
            for key in order:
                memory.update(key, torch.ones(2), torch.zeros(2))
    assert forward.drains == backward.drains > 0
    for key in keys:
        assert torch.equal(forward.buffers[key], backward.buffers[key])


def test_sparse_update_equals_the_dense_update() -> None:
    compensated = torch.randn(50)
    indices = torch.tensor([3, 17, 40])
    for sent in (compensated[indices], compensated[indices].half()):
        sparse, dense = Residual(), Residual()
        sparse.update_sparse("w", compensated, indices, sent)
        decoded = torch.zeros(50)
        decoded[indices] = sent.float()
        dense.update("w", compensated, decoded)
        assert torch.equal(sparse.buffers["w"], dense.buffers["w"])
        assert torch.equal(sparse.buffers["w"] + decoded, compensated)


@pytest.mark.parametrize("memory", [Residual, lambda: Residual(drain_every=2, seed=1), Estimate,
                                    lambda: LowPass(0.5)])  # Estimate: the generic form
def test_an_exactly_sent_selection_updates_as_the_dense_update(
        memory: Callable[[], Memory]) -> None:
    selected, dense = memory(), memory()
    generator = torch.Generator().manual_seed(2)
    for step in range(6):
        grad = torch.randn(50, generator=generator)
        grad[7] = -0.0  # a signed zero kept or sent stays what update() makes of it
        indices = torch.randperm(50, generator=generator)[:5]
        for memory_ in (selected, dense):
            p = memory_.absorb_("w", grad)
            if memory_ is selected:
                memory_.update_selected_("w", p, indices)
            else:
                sent = torch.zeros_like(p)
                sent[indices] = p[indices]
                memory_.update("w", p, sent)
        assert torch.equal(selected.buffers["w"], dense.buffers["w"]), step
        assert torch.equal(torch.signbit(selected.buffers["w"]),
                           torch.signbit(dense.buffers["w"])), step


def test_ef21_estimate_adds_exactly_what_was_sent() -> None:
    """EF21: p == v - g_old, g_new == g_old + sent and G_new == G_old + mean, exactly."""
    memory, compressor = Estimate(), TopK(0.05)
    generator = torch.Generator().manual_seed(3)
    for _ in range(6):
        grad = torch.randn(40, 25, generator=generator, dtype=torch.float64)
        old = memory.buffers.get("w", torch.zeros_like(grad)).clone()
        compensated = memory.compensate("w", grad)
        assert torch.equal(compensated, grad - old)
        info = TensorInfo.of("w", grad)
        sent = compressor.decompress(compressor.compress(compensated, info), info)
        memory.update("w", compensated, sent)
        assert torch.equal(memory.buffers["w"], old + sent)
        before = memory.estimates.get("w", torch.zeros_like(grad)).clone()
        assert torch.equal(memory.settle("w", sent), before + sent)


def test_ef21_sparse_update_and_state_round_trip() -> None:
    dense, sparse = Estimate(), Estimate()
    generator = torch.Generator().manual_seed(4)
    for _ in range(3):
        grad = torch.randn(100, generator=generator, dtype=torch.float64)
        indices = torch.randperm(100, generator=generator)[:7]
        for memory in (dense, sparse):
            p = memory.compensate("w", grad)
            if memory is dense:
                sent = torch.zeros_like(p)
                sent[indices] = p[indices]
                memory.update("w", p, sent)
            else:
                memory.update_sparse("w", p, indices, p[indices])
            memory.settle("w", p)
    assert torch.equal(dense.buffers["w"], sparse.buffers["w"])
    copy = Estimate()
    copy.load_state_dict(dense.state_dict())
    assert torch.equal(copy.buffers["w"], dense.buffers["w"])
    assert torch.equal(copy.estimates["w"], dense.estimates["w"])
    assert copy.estimates["w"] is not dense.estimates["w"]


def test_estimate_settles_in_place_bit_for_bit_as_it_settles_a_copy() -> None:
    kept, in_place = Estimate(), Estimate()
    for step in range(3):
        mean = torch.randn(6, 5)
        expected = kept.settle("w", mean)
        bucket = mean.reshape(-1).clone()  # a flat view, as in a DDP bucket
        in_place.settle_("w", bucket)
        assert torch.equal(bucket.view(6, 5), expected), step
        assert torch.equal(in_place.estimates["w"].view(-1), kept.estimates["w"].view(-1))
    expected.add_(1.0)  # the copy settle returns is the caller's: the estimate is untouched
    assert torch.equal(in_place.estimates["w"].view(-1), kept.estimates["w"].view(-1))


@pytest.mark.parametrize("options", [{}, {"nesterov": True}, {"dampening": 0.1}])
def test_batched_velocity_advance_gives_the_bits_of_one_key_at_a_time(
        options: dict[str, Any]) -> None:
    one = MomentumCorrection(Residual(), 0.9, **options)
    batched = MomentumCorrection(Residual(), 0.9, **options)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        grads = {"w": torch.randn(5, 3, generator=generator),
                 "b": torch.randn(7, generator=generator)}
        expected = {key: one.absorb_(key, grad).clone() for key, grad in grads.items()}
        batched.advance_(grads)
        for key, grad in grads.items():  # advanced once, not again by absorb_
            assert torch.equal(batched.absorb_(key, grad), expected[key])
            assert torch.equal(batched.velocity[key], one.velocity[key])
        for key, p in expected.items():  # send half, as a scheme would
            one.update(key, p, p / 2)
            batched.update(key, p, p / 2)


@pytest.mark.parametrize("options", [{}, {"nesterov": True}, {"dampening": 0.1}])
def test_batched_compensation_gives_the_bits_of_one_key_at_a_time(
        options: dict[str, Any]) -> None:
    one = MomentumCorrection(Residual(), 0.9, **options)
    batched = MomentumCorrection(Residual(), 0.9, **options)
    generator = torch.Generator().manual_seed(0)
    for step in range(4):
        grads = {"w": torch.randn(15, generator=generator),
                 "b": torch.randn(7, generator=generator)}
        expected = {key: one.compensate_(key, grad.clone()) for key, grad in grads.items()}
        targets = {key: grad.clone() for key, grad in grads.items()}
        if step % 2:  # moved by advance_ first, or left to compensate_all_
            batched.advance_(targets)
        batched.compensate_all_(targets)
        for key, target in targets.items():
            assert torch.equal(target, expected[key]), (step, key)
            assert torch.equal(batched.velocity[key], one.velocity[key]), (step, key)
            one.update(key, target, target / 2)  # leave an error behind for the next round
            batched.update(key, target, target / 2)


def _same_bits(first: Any, second: Any) -> bool:
    """Whether two states (nested dicts of tensors and numbers) are equal, tensors to the
    bit (the sign of zero included)."""
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(
            _same_bits(first[key], second[key]) for key in first)
    if isinstance(first, torch.Tensor):
        return (first.shape == second.shape and first.dtype == second.dtype
                and torch.equal(first.view(torch.uint8), second.view(torch.uint8)))
    return bool(first == second)


@pytest.mark.parametrize("make", [Residual, lambda: Decayed(0.9),
                                  lambda: MomentumCorrection(Residual(), 0.9),
                                  lambda: MomentumCorrection(Residual(), 0.9, nesterov=True)],
                         ids=["residual", "decayed", "momentum", "nesterov"])
def test_a_region_absorbs_and_remembers_bit_for_bit_as_its_keys_one_by_one(
        make: Callable[[], Memory]) -> None:
    numels = {"a": 7, "b": 1, "c": 20, "d": 5}
    together, alone = make(), make()
    generator = torch.Generator().manual_seed(0)
    # the same keys again, one of them dropped, a re-bucketing (b..d, then a..d again),
    # an exact round
    for round_, keys in enumerate([["a", "b", "c", "d"], ["a", "b", "c", "d"],
                                   ["a", "b", "c", "d"], ["b", "c", "d"],
                                   ["a", "b", "c", "d"], ["a", "b", "c", "d"]]):
        sizes = [numels[key] for key in keys]
        if round_ == 2:  # sent whole and exactly (the kernel then drops its error)
            together.buffers.pop("c")
            alone.buffers.pop("c")
        grads = torch.randn(sum(sizes), generator=generator)
        indices = torch.randperm(grads.numel(), generator=generator)[:9].sort().values
        p = together.absorb_region_(keys, sizes, grads)
        exact = round_ == 5
        sent = None if exact else p.index_select(0, indices).to(torch.float16)
        together.update_region_(keys, p, indices, sent)
        start = 0
        for key, part in zip(keys, grads.split(sizes)):
            mine = indices[(indices >= start) & (indices < start + part.numel())] - start
            compensated = alone.absorb_(key, part)
            if exact:
                alone.update_selected_(key, compensated, mine)
            else:
                alone.update_sparse(key, compensated, mine,
                                    compensated.index_select(0, mine).to(torch.float16))
            start += part.numel()
        assert _same_bits(together.state_dict(), alone.state_dict()), round_
    resumed = make()
    resumed.load_state_dict(together.state_dict())
    grads = torch.randn(33, generator=generator)
    again = resumed.absorb_region_(["a", "b", "c", "d"], [7, 1, 20, 5], grads)
    assert torch.equal(
        again, together.absorb_region_(["a", "b", "c", "d"], [7, 1, 20, 5], grads))


def test_a_draining_memory_absorbs_no_region() -> None:
    assert Residual().absorbs_regions and not Residual(drain_every=10).absorbs_regions
    assert MomentumCorrection(Residual(), 0.9).absorbs_regions
    assert not MomentumCorrection(Residual(drain_every=10), 0.9).absorbs_regions
