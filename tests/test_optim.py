"""Optimiser coupling: momentum correction keeps the user's SGD and error feedback exact."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from thinwire import optim, schemes
from thinwire.compress import TensorInfo, TopK
from thinwire.feedback import Estimate, LowPass, MomentumCorrection, Residual


def _grads(steps: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn((40, 25), generator=generator, dtype=dtype) for _ in range(steps)]


@pytest.mark.parametrize("nesterov", [False, True])
def test_uncompressed_momentum_correction_is_bit_identical_to_sgd_momentum(
        nesterov: bool) -> None:
    """One worker, everything sent (in fp32, the wire's dtype): exactly SGD's steps."""
    torch.manual_seed(0)
    reference, coupled = nn.Linear(25, 40), nn.Linear(25, 40)
    coupled.load_state_dict(reference.state_dict())
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov)
    scheme = schemes.build("topk", ratio=1.0)
    optimizer = torch.optim.SGD(coupled.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov)
    assert optim.couple(optimizer, scheme).coupled
    assert optimizer.param_groups[0]["momentum"] == 0.0
    memory = scheme.memory  # type: ignore[attr-defined]
    for grad in _grads(6, torch.float32):
        reference.weight.grad = grad.clone()
        plain.step()
        info = TensorInfo.of("w", grad)
        compensated = memory.compensate("w", grad)
        sent = scheme.selection.decompress(  # type: ignore[attr-defined]
            scheme.selection.compress(compensated, info), info)  # type: ignore[attr-defined]
        memory.update("w", compensated, sent)
        coupled.weight.grad = sent
        optimizer.step()
        assert torch.equal(coupled.weight, reference.weight)


def test_coupling_sgds_weight_decay_needs_the_parameters_names() -> None:
    """SGD's decay enters each worker's velocity by parameter, so a bare scheme is refused
    and nothing is moved (the DDP identity tests check the decay through a hook state)."""
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9,
                          weight_decay=5e-4)
    scheme = schemes.build("topk")
    with pytest.raises(ValueError, match="weight_decay enters each worker's velocity"):
        optim.couple(sgd, scheme)
    assert sgd.param_groups[0]["momentum"] == 0.9 and optim.MARK not in sgd.param_groups[0]
    assert not isinstance(scheme.error_memory, MomentumCorrection)


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW])
def test_auto_leaves_adam_as_it_is_and_couples_sgd(make: type) -> None:
    adam = make([nn.Parameter(torch.zeros(3))], lr=1e-3)
    coupling = optim.couple(adam, schemes.build("topk"))
    assert (coupling.rule, coupling.coupled) == ("none", False)
    assert adam.param_groups[0]["betas"] == (0.9, 0.999)
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    assert optim.couple(sgd, schemes.build("topk")).rule == "momentum"


def test_a_state_saved_coupled_couples_again_whatever_the_load_order() -> None:
    """The moved settings travel in the param groups (MARK): an optimiser loaded from a
    coupled state couples the same way, and rule='none' on it is refused."""
    def sgd() -> torch.optim.SGD:
        return torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9,
                               nesterov=True)
    first = sgd()
    optim.couple(first, schemes.build("topk"))
    saved = first.state_dict()
    loaded_before = sgd()
    loaded_before.load_state_dict(saved)
    assert loaded_before.param_groups[0]["momentum"] == 0.0
    coupling = optim.couple(loaded_before, schemes.build("topk"))
    assert coupling.coupled and coupling.momentum == 0.9 and coupling.nesterov
    with pytest.raises(ValueError, match="saved coupled"):
        optim.couple(loaded_before, schemes.build("topk"), rule="none")
    loaded_after = sgd()
    optim.couple(loaded_after, schemes.build("topk"))
    loaded_after.load_state_dict(saved)
    def settings(optimizer: torch.optim.Optimizer) -> list[dict[str, object]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    assert settings(loaded_after) == settings(loaded_before)


@pytest.mark.parametrize("inner", [Residual, lambda: LowPass(1.0)])
@pytest.mark.parametrize("nesterov", [False, True])
def test_error_feedback_invariant_is_exact_on_the_velocity(inner: type, nesterov: bool) -> None:
    """v + e_old == sent + e_new exactly, with v the velocity (or Nesterov's g + mu u)."""
    memory = MomentumCorrection(inner(), 0.9, nesterov=nesterov)
    compressor = TopK(0.05)
    velocity = torch.zeros(40, 25, dtype=torch.float64)
    for grad in _grads(8):
        velocity = 0.9 * velocity + grad if memory.velocity else grad.clone()
        expected = grad.add(velocity, alpha=0.9) if nesterov else velocity
        old_error = memory.buffers.get("w", torch.zeros_like(grad))
        compensated = memory.compensate("w", grad)
        assert torch.equal(compensated, expected + old_error)
        info = TensorInfo.of("w", grad)
        sent = compressor.decompress(compressor.compress(compensated, info), info)
        memory.update("w", compensated, sent)
        assert torch.equal(compensated, sent + memory.buffers["w"])
        assert torch.equal(memory.velocity["w"], velocity)


def test_momentum_correction_resumes_exactly_from_its_state() -> None:
    grads = _grads(6)
    first, second = MomentumCorrection(Residual(), 0.9), MomentumCorrection(Residual(), 0.9)
    compressor = TopK(0.1)
    for index, grad in enumerate(grads):
        if index == 3:
            second.load_state_dict(first.state_dict())
        for memory in ((first,) if index < 3 else (first, second)):
            info = TensorInfo.of("w", grad)
            compensated = memory.compensate("w", grad)
            memory.update("w", compensated,
                          compressor.decompress(compressor.compress(compensated, info), info))
    assert torch.equal(first.buffers["w"], second.buffers["w"])
    assert torch.equal(first.velocity["w"], second.velocity["w"])


def test_couple_leaves_dense_schemes_and_other_optimisers_alone() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for name in ("dense", "fp16", "powersgd"):
        assert not optim.couple(sgd, schemes.build(name)).coupled
    assert sgd.param_groups[0]["momentum"] == 0.9
    topk = schemes.build("topk")
    for plain in (torch.optim.SGD(params, lr=0.1), torch.optim.Adagrad(params),
                  torch.optim.AdamW(params, betas=(0.0, 0.99))):
        assert not optim.couple(plain, topk).coupled
    assert isinstance(topk.memory, Residual)  # type: ignore[attr-defined]


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW])
def test_couple_moves_adams_first_moment_into_the_workers(make: type) -> None:
    adam, scheme = make([nn.Parameter(torch.zeros(3))], lr=1e-3), schemes.build("dct-dp")
    assert optim.couple(adam, scheme, rule="momentum").momentum == 0.9
    assert adam.param_groups[0]["betas"] == (0.0, 0.999)
    memory = scheme.memory  # type: ignore[attr-defined]
    assert isinstance(memory, MomentumCorrection) and memory.dampening == pytest.approx(0.1)


@pytest.mark.parametrize("name", ["topk", "dct-dp", "laplace", "local-topk"])
def test_couple_wraps_every_sparse_scheme_once(name: str) -> None:
    scheme = schemes.build(name)
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9, nesterov=True)
    coupling = optim.couple(sgd, scheme)
    assert coupling.coupled and coupling.nesterov and coupling.momentum == 0.9
    memory = scheme.memory  # type: ignore[attr-defined]
    assert isinstance(memory, MomentumCorrection) and memory.nesterov
    assert optim.couple(sgd, scheme).reason == "already coupled"
    assert scheme.memory is memory  # type: ignore[attr-defined]
    # rebuilt (a rollback), it keeps the memory the optimiser's hooks hold
    assert schemes.rebuild(scheme).error_memory is memory is scheme.coupled


def test_couple_gives_clt_k_an_ef21_estimate_of_the_velocity() -> None:
    scheme = schemes.build("clt-k")
    adam = torch.optim.AdamW([nn.Parameter(torch.zeros(3))], lr=1e-3)
    assert optim.couple(adam, scheme, rule="momentum").coupled
    memory = scheme.memory  # type: ignore[attr-defined]
    assert isinstance(memory, MomentumCorrection) and isinstance(memory.inner, Estimate)
    assert optim.couple(adam, scheme).reason == "already coupled"


def test_couple_can_give_clt_k_its_own_error_feedback_instead() -> None:
    scheme = schemes.build("clt-k")
    own = scheme.memory  # type: ignore[attr-defined]
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    assert optim.couple(sgd, scheme, feedback="error").coupled
    memory = scheme.memory  # type: ignore[attr-defined]
    assert isinstance(memory, MomentumCorrection) and memory.inner is own


@pytest.mark.parametrize(("name", "feedback", "message"), [
    ("clt-k", "estimate", "must be one of"),
    ("topk", "ef21", "is for clt-k"),
    ("dense", "ef21", "is for clt-k"),
])
def test_couple_rejects_a_feedback_the_scheme_does_not_take(name: str, feedback: str,
                                                             message: str) -> None:
    scheme = schemes.build(name)
    before = getattr(scheme, "memory", None)
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=message):
        optim.couple(sgd, scheme, feedback=feedback)
    assert getattr(scheme, "memory", None) is before  # nothing changed
    assert sgd.param_groups[0]["momentum"] == 0.9


def test_couple_refuses_a_clt_k_scheme_that_has_already_stepped() -> None:
    scheme = schemes.build("clt-k")
    scheme.reduce({"w": torch.randn(40, 25)})
    with pytest.raises(ValueError, match="before the first step"):
        optim.couple(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9),
                     scheme)


def _clt_k_run(steps: range, optimizer: torch.optim.Optimizer, net: nn.Linear,
               scheme: schemes.Scheme) -> None:
    for grad in _grads(steps.stop)[steps.start:]:
        reduced = scheme.reduce({"weight": grad.to(net.weight.dtype)})
        net.weight.grad = reduced["weight"]
        optimizer.step()


@pytest.mark.parametrize(("exclude", "feedback"), [((), "auto"), (("weight",), "auto"),
                                                   ((), "error")])
def test_coupled_clt_k_sending_everything_is_sgd_momentum_up_to_rounding(
        exclude: tuple[str, ...], feedback: str) -> None:
    """k = N (or the tensor sent dense): the EF21 estimate is the velocity, and plain error
    feedback keeps nothing back, so SGD's steps either way."""
    torch.manual_seed(0)
    reference, coupled = nn.Linear(25, 40).double(), nn.Linear(25, 40).double()
    coupled.load_state_dict(reference.state_dict())
    plain = torch.optim.SGD([reference.weight], lr=0.1, momentum=0.9)
    for grad in _grads(6):
        reference.weight.grad = grad.clone()
        plain.step()
    scheme = schemes.build("clt-k", ratio=1.0, exclude=exclude)
    optimizer = torch.optim.SGD([coupled.weight], lr=0.1, momentum=0.9)
    optim.couple(optimizer, scheme, feedback=feedback)
    _clt_k_run(range(6), optimizer, coupled, scheme)
    torch.testing.assert_close(coupled.weight, reference.weight, rtol=1e-12, atol=1e-12)


def test_coupled_clt_k_resumes_exactly_from_its_state() -> None:
    nets = [nn.Linear(25, 40).double() for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    runs = []
    for net in nets:
        scheme = schemes.build("clt-k", ratio=0.05)
        optimizer = torch.optim.SGD([net.weight], lr=0.1, momentum=0.9)
        optim.couple(optimizer, scheme)
        runs.append((scheme, optimizer))
    _clt_k_run(range(8), runs[0][1], nets[0], runs[0][0])
    _clt_k_run(range(4), runs[1][1], nets[1], runs[1][0])
    fresh = schemes.build("clt-k", ratio=0.05)
    optimizer = torch.optim.SGD([nets[1].weight], lr=0.1, momentum=0.9)
    optim.couple(optimizer, fresh)
    fresh.load_state_dict(runs[1][0].state_dict())
    _clt_k_run(range(4, 8), optimizer, nets[1], fresh)
    assert torch.equal(nets[0].weight, nets[1].weight)


def test_couple_rejects_mixed_momentum_and_bad_targets() -> None:
    groups = [{"params": [nn.Parameter(torch.zeros(2))], "momentum": 0.9},
              {"params": [nn.Parameter(torch.zeros(2))], "momentum": 0.5}]
    with pytest.raises(ValueError, match="different"):
        optim.couple(torch.optim.SGD(groups, lr=0.1), schemes.build("topk"))
    with pytest.raises(TypeError, match="Scheme"):
        optim.couple(torch.optim.SGD(groups, lr=0.1), object())
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="momentum"):
            MomentumCorrection(Residual(), bad)
    with pytest.raises(ValueError, match="dampening"):
        MomentumCorrection(Residual(), 0.9, dampening=1.5)


def test_couple_leaves_optimisers_it_does_not_know_alone_and_says_so() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    rmsprop = torch.optim.RMSprop(params, lr=0.1, momentum=0.9)
    topk = schemes.build("topk")
    coupling = optim.couple(rmsprop, topk)
    assert not coupling.coupled and "RMSprop" in coupling.reason
    assert rmsprop.param_groups[0]["momentum"] == 0.9
    assert isinstance(topk.memory, Residual)  # type: ignore[attr-defined]


@pytest.mark.parametrize("scheduled", ["one-cycle", "old-state"])
def test_momentum_set_back_after_coupling_raises_before_the_step(scheduled: str) -> None:
    net = nn.Linear(4, 2)
    scheme = schemes.build("topk")
    optim.watch(scheme, net.parameters())  # what thinwire.ddp.register does
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    saved = optimizer.state_dict()
    assert optim.couple(optimizer, scheme).coupled
    optimizer.step()  # momentum 0 in the optimiser: fine
    if scheduled == "one-cycle":  # cycles momentum by default: sets it back at construction
        torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    else:
        optimizer.load_state_dict(saved)
    before = [p.detach().clone() for p in net.parameters()]
    net(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="applied twice"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))  # nothing stepped


def test_coupling_an_optimiser_with_a_momentum_of_its_own_says_it_restarts() -> None:
    """A state saved by plain training, loaded before couple: its buffer is not used,
    and couple says so (a state saved coupled carries no buffer, and couples silently)."""
    net = nn.Linear(4, 2)
    plain = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.ones(1, 4)).sum().backward()
    plain.step()
    loaded = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loaded.load_state_dict(plain.state_dict())
    with pytest.warns(UserWarning, match="momentum_buffer"):
        assert optim.couple(loaded, schemes.build("topk")).coupled
    again = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    again.load_state_dict(loaded.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert optim.couple(again, schemes.build("topk")).coupled
