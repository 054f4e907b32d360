"""edAD's delta recomputation (Eq. 5): activation derivatives and the chain it needs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.autodiff import DistributedAutodiff
from thinwire.autodiff.edad import DERIVATIVES, derivative
from thinwire.models.gru import GRUClassifier

ACTIVATIONS = [nn.ReLU(), nn.ReLU(inplace=True), nn.LeakyReLU(0.1), nn.LeakyReLU(0.0), nn.Tanh(),
               nn.Sigmoid(), nn.Identity()]


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: repr(a))
def test_derivative_from_the_output_matches_autograd(activation: nn.Module) -> None:
    z = torch.randn(50, 7, dtype=torch.float64)
    z[0, :3] = 0.0  # the kink: both sides must agree on the derivative at 0
    leaf = z.clone().requires_grad_()
    grad_out = torch.randn_like(z)
    torch.autograd.backward(activation(leaf.clone()), grad_out)
    out = activation(z.clone())
    assert torch.allclose(grad_out * derivative(activation, "act", out), leaf.grad, atol=1e-15)


def test_registry_is_a_dict_of_the_supported_activations() -> None:
    assert set(DERIVATIVES) == {nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Identity}


def _step(model: nn.Module, engine: DistributedAutodiff, x: torch.Tensor) -> None:
    F.cross_entropy(model(x), torch.randint(0, 3, (x.shape[0],))).backward()
    engine.synchronize()


@pytest.mark.parametrize("activation", [nn.GELU(), nn.ELU(), nn.Softplus(), nn.Dropout(0.1)],
                         ids=lambda a: type(a).__name__)
def test_unsupported_activation_raises_naming_the_module(activation: nn.Module) -> None:
    model = nn.Sequential(nn.Linear(4, 5), activation, nn.Linear(5, 3))
    engine = DistributedAutodiff(model, "edad")
    with pytest.raises(ValueError, match=rf"{type(activation).__name__} '1'"):
        _step(model, engine, torch.randn(6, 4))


def test_negative_leaky_slope_raises() -> None:
    model = nn.Sequential(nn.Linear(4, 5), nn.LeakyReLU(-0.5), nn.Linear(5, 3))
    engine = DistributedAutodiff(model, "edad")
    with pytest.raises(ValueError, match="negative_slope"):
        _step(model, engine, torch.randn(6, 4))


class _Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


class _Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.act = nn.ReLU()
        self.b = nn.Linear(5, 5)
        self.c = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        return self.c(self.b(h) + h)  # c's input is not b's output: the chain check sees it


class _HiddenPath(nn.Module):
    """A chain to the hooks, but the output also depends on ``h`` through a side path."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.act = nn.Tanh()
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        return self.b(h) + h[:, :3] ** 2


def test_functional_activation_breaks_the_chain_with_a_clear_error() -> None:
    model = _Functional()
    engine = DistributedAutodiff(model, "edad")
    with pytest.raises(ValueError, match="functional activation"):
        _step(model, engine, torch.randn(6, 4))


def test_skip_connection_is_refused() -> None:
    model = _Skip()
    engine = DistributedAutodiff(model, "edad")
    with pytest.raises(ValueError, match="'c' is not the output"):
        _step(model, engine, torch.randn(6, 4))


def test_hidden_path_is_caught_by_the_own_rows_check() -> None:
    model = _HiddenPath()
    engine = DistributedAutodiff(model, "edad")
    with pytest.raises(ValueError, match="recomputed deltas differ"):
        _step(model, engine, torch.randn(6, 4))


def test_edad_on_the_gru_keeps_autograds_gradient_on_one_site() -> None:
    model = GRUClassifier(3, 2, hidden=4, widths=(5,)).double()
    engine = DistributedAutodiff(model, "edad")
    F.cross_entropy(model(torch.randn(2, 4, 3, dtype=torch.float64)),
                    torch.tensor([0, 1])).backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    got = engine.synchronize()
    assert max(float((got[name] - want[name]).abs().max()) for name in want) < 1e-12


def test_edad_on_a_recurrent_model_refuses_a_private_input() -> None:
    model = GRUClassifier(3, 2, hidden=4, widths=(5,))
    engine = DistributedAutodiff(model, "edad", private_input=True)
    F.cross_entropy(model(torch.randn(2, 4, 3)), torch.tensor([0, 1])).backward()
    with pytest.raises(ValueError, match="private_input=True works for feed-forward"):
        engine.synchronize()


class _RecurrentDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rec = nn.Linear(3, 3)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(3):
            h = self.drop(torch.tanh(self.rec(h)))
        return self.out(h)


def test_edad_replay_catches_randomness_it_cannot_replay() -> None:
    model = _RecurrentDropout()
    engine = DistributedAutodiff(model, "edad")
    with pytest.raises(ValueError, match="recomputed deltas differ"):
        _step(model, engine, torch.randn(6, 3))


class _OneLayerRecurrence(nn.Module):
    """Only the output layer, called at every step on its own previous output."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(3):
            h = torch.tanh(self.out(h))
        return h


def test_edad_replay_with_only_the_output_layer_keeps_autograds_gradient() -> None:
    model = _OneLayerRecurrence().double()
    engine = DistributedAutodiff(model, "edad")
    F.cross_entropy(model(torch.randn(4, 3, dtype=torch.float64)),
                    torch.tensor([0, 1, 2, 0])).backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    got = engine.synchronize()
    assert max(float((got[name] - want[name]).abs().max()) for name in want) < 1e-12
