"""Adam's step for entries that arrive in bursts (thinwire.optim.adam): its rule checked
against torch's AdamW and by hand, its state resumed exactly, and the look-ahead's scale."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from thinwire import ddp, optim, schemes
from thinwire.feedback import MomentumCorrection, Residual
from thinwire.optim.adam import STATE_KEYS, AgedAdam, look_ahead, refuses
from thinwire.optim.virtual import VirtualIterate


def _param(values: list[float]) -> nn.Parameter:
    return nn.Parameter(torch.tensor(values, dtype=torch.float64))


def _memory() -> MomentumCorrection:
    return MomentumCorrection(Residual(), 0.9, 0.1, beta2=0.999)


def test_entries_arriving_every_step_move_as_adamw_without_first_moment() -> None:
    # two groups (one without weight decay), tensors of several shapes, and a step on
    # which one tensor has no gradient (the group's flat state is rebuilt around it)
    torch.manual_seed(0)
    shapes = [(3,), (2, 4), (5,)]
    ours = [nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]

    def groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
        return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:]}]

    settings = {"lr": 0.01, "betas": (0.0, 0.99), "eps": 1e-8, "weight_decay": 0.0}
    mine = torch.optim.AdamW(groups(ours), **settings)
    AgedAdam(mine, {id(p): f"p{i}" for i, p in enumerate(ours)}, _memory())
    reference = torch.optim.AdamW(groups(theirs), **settings)
    for step in range(20):
        for a, b in zip(ours, theirs):
            if step == 7 and a is ours[1]:
                a.grad = b.grad = None
                continue
            grad = torch.randn(a.shape, dtype=torch.float64)
            a.grad, b.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    # sqrt(v / c) against torch's sqrt(v) / sqrt(c): equal up to rounding
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-13, atol=1e-15)
        assert a.grad is not None and torch.equal(a.grad, b.grad)  # given back


def test_a_burst_of_a_steps_moves_the_entry_a_learning_rates() -> None:
    # entry 0 arrives every step with 1.0; entry 1 waits 4 steps, then arrives with 4.0
    weights = _param([0.0, 0.0])
    adam = torch.optim.AdamW([weights], lr=0.1, betas=(0.0, 0.999), eps=1e-300,
                             weight_decay=0.0)
    memory = _memory()
    AgedAdam(adam, {id(weights): "w"}, memory)
    for step in range(4):
        weights.grad = torch.tensor([1.0, 4.0 if step == 3 else 0.0], dtype=torch.float64)
        adam.step()
    assert torch.equal(memory.arrivals["w"]["age"], torch.zeros(2, dtype=torch.float64))
    assert not adam.state[weights]  # the optimiser's own state stays empty
    # both entries stood for 4 steps of gradient 1: each moved 4 learning rates
    torch.testing.assert_close(weights.detach(), torch.tensor([-0.4, -0.4], dtype=torch.float64),
                               rtol=1e-12, atol=0)
    # AdamW fed the same burst moves entry 1 by sqrt(4) = 2 learning rates, not four
    plain = _param([0.0])
    reference = torch.optim.AdamW([plain], lr=0.1, betas=(0.0, 0.999), eps=1e-300,
                                  weight_decay=0.0)
    for step in range(4):
        plain.grad = torch.tensor([4.0 if step == 3 else 0.0], dtype=torch.float64)
        reference.step()
    torch.testing.assert_close(plain.detach(), torch.tensor([-0.2], dtype=torch.float64),
                               rtol=1e-3, atol=0)


def test_a_burst_is_credited_with_at_most_the_horizons_steps() -> None:
    # one entry waits 6 steps and arrives with 6.0; with a horizon of 3 it counts as 3
    # steps of 2.0, so it moves 6 / 2 = 3 learning rates, not 6
    weights = _param([0.0])
    adam = torch.optim.AdamW([weights], lr=0.1, betas=(0.0, 0.999), eps=1e-300,
                             weight_decay=0.0)
    AgedAdam(adam, {id(weights): "w"}, _memory(), horizon=3)
    for step in range(6):
        weights.grad = torch.tensor([6.0 if step == 5 else 0.0], dtype=torch.float64)
        adam.step()
    torch.testing.assert_close(weights.detach(), torch.tensor([-0.3], dtype=torch.float64),
                               rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="horizon=0"):
        AgedAdam(adam, {}, _memory(), horizon=0)


def test_its_state_rides_in_the_memorys_state_dict_and_resumes_exactly() -> None:
    torch.manual_seed(1)
    grads = [torch.randn(4) * (torch.rand(4) < 0.4) for _ in range(12)]

    def run(resume_at: int | None) -> torch.Tensor:
        weights, memory = nn.Parameter(torch.ones(4)), _memory()
        adam = torch.optim.AdamW([weights], lr=0.05)
        AgedAdam(adam, {id(weights): "w"}, memory)
        for i, grad in enumerate(grads):
            if i == resume_at:
                saved = memory.state_dict()
                weights, memory = nn.Parameter(weights.detach().clone()), _memory()
                adam = torch.optim.AdamW([weights], lr=0.05)
                AgedAdam(adam, {id(weights): "w"}, memory)
                memory.load_state_dict(saved)
                assert set(memory.arrivals["w"]) == set(STATE_KEYS)
            weights.grad = grad.clone()
            adam.step()
        return weights.detach()

    assert torch.equal(run(None), run(6))


def test_parameters_it_was_not_given_are_stepped_by_the_optimiser() -> None:
    ours, other = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    adam = torch.optim.AdamW([ours, other], lr=0.1)
    memory = _memory()
    stepped = AgedAdam(adam, {id(ours): "ours"}, memory)
    ours.grad, other.grad = torch.ones(2), torch.ones(2)
    adam.step()
    assert set(adam.state[other]) == {"step", "exp_avg", "exp_avg_sq"}
    assert not adam.state[ours] and set(memory.arrivals) == {"ours"}
    stepped.remove()
    adam.step()  # the optimiser's own step again
    assert set(adam.state[ours]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(("build", "word"), [
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.Adam(p, maximize=True), "maximize"),
    (lambda p: torch.optim.Adam(p, weight_decay=0.01), "AdamW"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "not Adam"),
])
def test_settings_it_does_not_reproduce_are_refused_by_name(build, word) -> None:  # type: ignore[no-untyped-def]
    optimizer = build([nn.Parameter(torch.ones(2))])
    assert word in refuses(optimizer)
    with pytest.raises(ValueError, match=word):
        AgedAdam(optimizer, {}, _memory())
    decoupled = torch.optim.Adam([nn.Parameter(torch.ones(2))], weight_decay=0.01,
                                 decoupled_weight_decay=True)
    assert refuses(decoupled) == ""  # Adam with decoupled decay is AdamW


def test_the_local_second_moment_is_adams_of_the_workers_own_gradient() -> None:
    torch.manual_seed(2)
    whole = MomentumCorrection(Residual(), 0.9, 0.1, beta2=0.99)
    batched = MomentumCorrection(Residual(), 0.9, 0.1, beta2=0.99)
    parts = MomentumCorrection(Residual(), 0.9, 0.1, beta2=0.99)
    square = torch.zeros(6)
    for step in range(1, 6):
        grad = torch.randn(6)
        square = 0.99 * square + 0.01 * grad * grad
        whole.compensate("w", grad)
        if step == 1:  # advance_ moves only keys with a velocity
            batched.compensate("w", grad)
        else:
            batched.advance_({"w": grad})
            batched.compensate_all_({"w": grad.clone()})
        if step == 1:  # a key's first round goes whole (the flat path checks holds())
            parts.absorb_("w", grad)
        else:
            for start in (0, 4):  # one key split over two buckets
                parts.absorb_part_("w", grad[start: start + 4], start)
        expected = square / (1 - 0.99 ** step)
        for memory in (whole, batched, parts):
            torch.testing.assert_close(memory.second_moment("w"), expected)
    restored = MomentumCorrection(Residual(), 0.9, 0.1, beta2=0.99)
    restored.load_state_dict(whole.state_dict())
    assert torch.equal(restored.second_moment("w"), whole.second_moment("w"))
    assert MomentumCorrection(Residual(), 0.9).second_moment("w") is None


def test_under_adam_the_look_ahead_is_scaled_by_the_local_second_moment() -> None:
    torch.manual_seed(3)
    net = nn.Linear(5, 3, bias=False)
    adam = torch.optim.AdamW(net.parameters(), lr=0.1, eps=1e-3)
    memory = MomentumCorrection(Residual(), 0.9, 0.1, beta2=0.999)
    memory.compensate("weight", torch.randn(3, 5))
    memory.inner.buffers["weight"] = torch.randn(3, 5) * 1e-2
    VirtualIterate(adam, net, {id(net.weight): "weight"}, memory, look_ahead(memory))
    x = net.weight.detach().clone()
    net(torch.randn(2, 5)).sum().backward()
    scale = memory.second_moment("weight").sqrt() + 1e-3  # type: ignore[union-attr]
    assert torch.equal(net.weight.detach(), x - 0.1 * (memory.buffers["weight"] / scale))


def test_couple_installs_both_for_adamw_through_a_hook_state() -> None:
    net = nn.Linear(40, 25)
    state = ddp.hook_state(net, schemes.build("topk", min_numel=0))
    adam = torch.optim.AdamW(net.parameters(), lr=1e-3, betas=(0.9, 0.98))
    coupling = optim.couple(adam, state, rule="momentum")
    memory = state.scheme.memory  # type: ignore[attr-defined]
    assert coupling.virtual is not None and coupling.adam is not None
    assert coupling.adam.horizon == 100  # 1 / density at topk's default 1 %
    assert isinstance(memory, MomentumCorrection) and memory.beta2 == 0.98
    assert adam.param_groups[0]["betas"] == (0.0, 0.98)
    bare = optim.couple(torch.optim.AdamW([nn.Parameter(torch.ones(2))]),
                        schemes.build("topk"), rule="momentum")
    assert bare.coupled and bare.adam is None  # no model: Adam steps as before


@pytest.mark.parametrize(("name", "ratio"), [("clt-k", 0.05), ("local-topk", 0.05),
                                             ("topk", 0.05), ("dct-dp", 0.02),
                                             ("laplace", 0.25)])
def test_the_ratio_a_user_sets_reaches_the_coupling(name: str, ratio: float) -> None:
    """AgedAdam's horizon is the mean wait at the scheme's own density, ``1 / ratio``."""
    net = nn.Linear(40, 25)
    scheme = schemes.build(name, ratio=ratio)
    assert scheme.traits.density == ratio
    adam = torch.optim.AdamW(net.parameters(), lr=1e-3)
    state = ddp.hook_state(net, scheme, optimizer=adam, coupling="momentum", warmup=0)
    assert state.coupling is not None and state.coupling.adam is not None
    assert state.coupling.adam.horizon == round(1 / ratio)
    assert state.scheme.error_memory is state.coupling.adam.memory


def test_the_scheme_contract_states_what_coupling_needs() -> None:
    for name in ("dense", "fp16", "powersgd"):
        scheme = schemes.build(name)
        assert scheme.traits.density is None and scheme.error_memory is None
        with pytest.raises(TypeError, match="no error memory"):
            scheme.couple_memory(Residual())
    assert schemes.build("clt-k").traits.shared_indices
    assert not any(schemes.build(name).traits.shared_indices
                   for name in ("topk", "dct-dp", "laplace", "local-topk"))
    assert schemes.build("topk", error_feedback=False).error_memory is None
