"""Gradients at the virtual iterate x - lr * e: where they are taken, and that x comes back
bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from thinwire import ddp, optim, schemes
from thinwire.feedback import Residual
from thinwire.optim.virtual import VirtualIterate


def _setup(lr: float = 0.1) -> tuple[nn.Linear, torch.optim.SGD, Residual, VirtualIterate]:
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    sgd = torch.optim.SGD(net.parameters(), lr=lr)
    memory = Residual()
    memory.buffers["weight"] = torch.randn(3, 5) * 1e-3  # the bias has no pending error
    names = {id(p): name for name, p in net.named_parameters()}
    return net, sgd, memory, VirtualIterate(sgd, net, names, memory)


def test_the_gradient_is_taken_at_x_minus_lr_e_and_x_comes_back_bit_for_bit() -> None:
    net, sgd, memory, _ = _setup()
    x = {name: p.detach().clone() for name, p in net.named_parameters()}
    inputs = torch.randn(4, 5)
    (0.5 * net(inputs).pow(2).sum()).backward()
    moved = x["weight"] - 0.1 * memory.buffers["weight"]
    expected = nn.Linear(5, 3)
    with torch.no_grad():
        expected.weight.copy_(moved)
        expected.bias.copy_(x["bias"])
    (0.5 * expected(inputs).pow(2).sum()).backward()
    assert torch.equal(net.weight.grad, expected.weight.grad)
    assert torch.equal(net.weight.detach(), moved)  # still there until the step
    seen = {}
    sgd.register_step_pre_hook(lambda *_: seen.update(w=net.weight.detach().clone()))
    sgd.step()
    assert torch.equal(seen["w"], x["weight"])  # back at x, exactly, before the step
    for name, p in net.named_parameters():  # SGD's own step from x
        assert torch.equal(p.detach(), torch.add(x[name], p.grad, alpha=-0.1))


def test_each_parameter_has_its_own_storage_back_for_the_step() -> None:
    net, sgd, memory, _ = _setup()
    before = {name: p.data_ptr() for name, p in net.named_parameters()}
    view = net.weight.detach()  # shares x's storage, as an optimiser's flat bucket would
    x = view.clone()
    for _ in range(3):
        net(torch.randn(4, 5)).sum().backward()
        assert net.weight.data_ptr() != before["weight"]  # moved, in the spare storage
        assert net.bias.data_ptr() == before["bias"]  # nothing pending: not moved
        assert torch.equal(view, x)  # x itself is never written while moved
        sgd.step()
        sgd.zero_grad()
        assert {name: p.data_ptr() for name, p in net.named_parameters()} == before
        assert torch.equal(view, net.weight.detach())  # the step wrote into x's storage
        x = view.clone()


def test_evaluation_and_accumulation_do_not_move_the_weights_again() -> None:
    net, sgd, memory, ahead = _setup()
    x = net.weight.detach().clone()
    with torch.no_grad():
        net(torch.randn(2, 5))
    net.eval()
    net(torch.randn(2, 5))
    assert torch.equal(net.weight.detach(), x)  # no gradient or eval(): x
    net.train()
    net(torch.randn(2, 5)).sum().backward()
    once = net.weight.detach().clone()
    net(torch.randn(2, 5)).sum().backward()  # accumulation: the same point
    assert torch.equal(net.weight.detach(), once) and not torch.equal(once, x)
    ahead.remove()
    assert torch.equal(net.weight.detach(), x)
    net(torch.randn(2, 5)).sum().backward()
    assert torch.equal(net.weight.detach(), x)  # removed: no hook left


def test_the_step_size_is_read_at_each_forward_and_state_loads_are_followed() -> None:
    net, sgd, memory, _ = _setup(lr=0.1)
    x = net.weight.detach().clone()
    for group in sgd.param_groups:
        group["lr"] = 0.5  # a scheduler's change
    state = memory.state_dict()
    state["buffers"] = {"weight": torch.full((3, 5), 2e-3)}
    memory.load_state_dict(state)  # a resume replaces the buffers' dict
    net(torch.randn(2, 5)).sum().backward()
    assert torch.equal(net.weight.detach(), x - 0.5 * torch.full((3, 5), 2e-3))


def _hook_state(name: str, **config: object) -> ddp.HookState:
    net = nn.Linear(40, 25)
    return ddp.hook_state(net, schemes.build(name, **config))


@pytest.mark.parametrize(("name", "feedback", "optimizer", "virtual", "installed"), [
    ("topk", "auto", "sgd", True, True),
    ("dct-dp", "auto", "sgd", True, True),
    ("topk", "auto", "sgd", False, False),
    ("topk", "auto", "adamw", True, True),  # with Adam's own scale (thinwire.optim.adam)
    ("topk", "auto", "adam-amsgrad", True, False),  # a step AgedAdam does not reproduce
    ("clt-k", "error", "sgd", True, True),
    ("clt-k", "ef21", "sgd", True, False),  # EF21 steps with its estimate: nothing pends
])
def test_couple_installs_it_into_plain_error_feedback_through_a_hook_state(
        name: str, feedback: str, optimizer: str, virtual: bool, installed: bool) -> None:
    state = _hook_state(name)
    assert state.module is not None
    params = list(state.module.parameters())
    built = (torch.optim.SGD(params, lr=0.1, momentum=0.9) if optimizer == "sgd"
             else torch.optim.AdamW(params, lr=1e-3, amsgrad=optimizer == "adam-amsgrad"))
    coupling = optim.couple(built, state, rule="momentum", feedback=feedback, virtual=virtual)
    assert coupling.coupled and (coupling.virtual is not None) is installed
    assert (coupling.adam is not None) is (installed and optimizer == "adamw")
    if optimizer == "adam-amsgrad":
        assert "amsgrad" in coupling.reason


def test_couple_on_a_bare_scheme_has_no_model_to_move() -> None:
    scheme = schemes.build("topk")
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    coupling = optim.couple(sgd, scheme)
    assert coupling.virtual is None and "thinwire.ddp.register" in coupling.reason
