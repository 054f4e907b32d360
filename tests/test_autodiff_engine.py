"""The engine in one process: each mode against autograd, errors, state, non-finite input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.autodiff import MODES, DistributedAutodiff
from thinwire.comm import Meter
from thinwire.models.gru import GRUClassifier


def _mlp(*sizes: int, bias: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b, bias=bias))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).double()


def _backward(model: nn.Module, x: torch.Tensor, classes: int = 3) -> dict[str, torch.Tensor]:
    y = torch.arange(x.shape[0]) % classes
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["dad", "edad", "dsgd"])
@pytest.mark.parametrize("bias", [True, False])
def test_exact_modes_in_one_process_equal_autograd(mode: str, bias: bool) -> None:
    model = _mlp(5, 9, 7, 3, bias=bias)
    engine = DistributedAutodiff(model, mode)
    local = _backward(model, torch.randn(6, 5, dtype=torch.float64))
    grads = engine.synchronize()
    assert set(grads) == set(local)
    for name, grad in local.items():
        assert torch.allclose(grads[name], grad, atol=1e-14, rtol=0)
        assert torch.equal(dict(model.named_parameters())[name].grad, grads[name])


def test_sum_reduction_is_pooled_sum() -> None:
    model = _mlp(4, 6, 3)
    engine = DistributedAutodiff(model, "dad", reduction="sum")
    x = torch.randn(5, 4, dtype=torch.float64)
    F.cross_entropy(model(x), torch.arange(5) % 3, reduction="sum").backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads = engine.synchronize()
    for name, grad in local.items():
        assert torch.allclose(grads[name], grad, atol=1e-13)


def test_rank_dad_with_rank_at_least_the_batch_is_exact() -> None:
    model = _mlp(10, 16, 12, 4)
    engine = DistributedAutodiff(model, "rank-dad", rank=6, theta=0.0, iterations=80)
    local = _backward(model, torch.randn(5, 10, dtype=torch.float64), classes=4)
    grads = engine.synchronize()
    for name, grad in local.items():
        assert torch.allclose(grads[name], grad, atol=1e-9), name
    assert [rank for _, _, rank in engine.ranks.records] == [6, 6, 6]


@pytest.mark.parametrize("stopping", ["paper", "residual"])
def test_rank_dad_records_the_effective_rank_per_layer(stopping: str) -> None:
    model = _mlp(10, 16, 12, 3)
    engine = DistributedAutodiff(model, "rank-dad", rank=8, iterations=40, stopping=stopping)
    _backward(model, torch.randn(5, 10, dtype=torch.float64))
    engine.synchronize()
    ranks = {layer: rank for _, layer, rank in engine.ranks.records}
    # batch 5 bounds every layer; softmax deltas sum to zero over 3 classes: rank <= 2.
    # The paper's rule sees the rank run out when the next direction repeats, which can
    # take one more component than the residual rule.
    extra = 1 if stopping == "paper" else 0
    assert 1 <= ranks["0"] <= 5 + extra and 1 <= ranks["2"] <= 5 + extra
    assert 2 <= ranks["4"] <= 2 + extra


def test_powersgd_keeps_the_error_feedback_invariant() -> None:
    model = _mlp(30, 40, 3)
    engine = DistributedAutodiff(model, "powersgd", rank=2)
    local = _backward(model, torch.randn(8, 30, dtype=torch.float64))
    grads = engine.synchronize()
    # orig == sent + error, exactly in float64 (one site: sent is what every site applies)
    error = engine.powersgd.state_dict()["memory"]["buffers"]["0.weight"]
    assert torch.allclose(local["0.weight"], grads["0.weight"] + error.view(40, 30), atol=1e-14)
    assert torch.linalg.matrix_rank(grads["0.weight"]) == 2
    assert torch.equal(grads["0.bias"], local["0.bias"])  # 1-D: dense


def test_rank_dad_error_feedback_keeps_what_the_factors_left_out() -> None:
    model = _mlp(30, 40, 3)
    engine = DistributedAutodiff(model, "rank-dad", rank=2, error_feedback=True)
    previous = torch.zeros(40, 31, dtype=torch.float64)
    for _ in range(3):
        model.zero_grad()
        local = _backward(model, torch.randn(8, 30, dtype=torch.float64))
        grads = engine.synchronize()
        sent = torch.cat([grads["0.weight"], grads["0.bias"][:, None]], 1)
        compensated = torch.cat([local["0.weight"], local["0.bias"][:, None]], 1) + previous
        # orig + e_old == sent + e_new, exactly in float64
        assert torch.allclose(compensated, sent + engine.errors["0"], atol=1e-14)
        assert torch.linalg.matrix_rank(sent) == 2
        previous = engine.errors["0"].clone()


def _run(engine: DistributedAutodiff, model: nn.Module, xs: list[torch.Tensor],
         state_at: int | None = None) -> tuple[list[dict[str, torch.Tensor]], object]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    used, saved = [], None
    for i, x in enumerate(xs):
        optimizer.zero_grad()
        _backward(model, x)
        used.append({k: v.clone() for k, v in engine.synchronize().items()})
        optimizer.step()
        if i == state_at:
            saved = (copy.deepcopy(engine.state_dict()), copy.deepcopy(model.state_dict()))
    return used, saved


@pytest.mark.parametrize("mode,feedback", [("powersgd", False), ("rank-dad", False),
                                           ("rank-dad", True)])
def test_state_dict_resumes_exactly(mode: str, feedback: bool) -> None:
    xs = [torch.randn(6, 30, dtype=torch.float64) for _ in range(4)]
    model = _mlp(30, 40, 3)
    options = {"rank": 2, "error_feedback": feedback}
    straight, saved = _run(DistributedAutodiff(model, mode, **options), model, xs, state_at=1)
    engine_state, model_state = saved  # type: ignore[misc]
    resumed_model = _mlp(30, 40, 3)
    resumed_model.load_state_dict(model_state)
    resumed = DistributedAutodiff(resumed_model, mode, **options)
    resumed.load_state_dict(engine_state)
    assert resumed.step == 2
    after, _ = _run(resumed, resumed_model, xs[2:])
    for a, b in zip(straight[2:], after, strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    if mode == "rank-dad":
        assert len(resumed.ranks.records) == 4 * 2


def test_state_of_another_mode_is_refused() -> None:
    model = _mlp(3, 4, 2)
    state = DistributedAutodiff(model, "powersgd", rank=2).state_dict()
    with pytest.raises(ValueError, match="mode"):
        DistributedAutodiff(_mlp(3, 4, 2), "dad").load_state_dict(state)


def test_gru_classifier_is_torchs_gru() -> None:
    model = GRUClassifier(3, 2, hidden=4, widths=(5,)).double()
    reference = nn.GRU(3, 4, batch_first=True).double()
    with torch.no_grad():
        reference.weight_ih_l0.copy_(model.x2h.weight)
        reference.bias_ih_l0.copy_(model.x2h.bias)
        reference.weight_hh_l0.copy_(model.h2h.weight)
        reference.bias_hh_l0.copy_(model.h2h.bias)
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    _, last = reference(x)
    assert torch.allclose(model.head(last[0]), model(x), atol=1e-14)


def test_dad_on_the_gru_stacks_time_into_rows() -> None:
    model = GRUClassifier(3, 2, hidden=4, widths=(5,)).double()
    meter = Meter()
    engine = DistributedAutodiff(model, "dad", meter=meter)
    local = _backward(model, torch.randn(2, 6, 3, dtype=torch.float64), classes=2)
    grads = engine.synchronize()
    for name, grad in local.items():
        assert torch.allclose(grads[name], grad, atol=1e-14), name
    x2h = [r for r in meter.records if r.layer == "x2h" and r.entity == "activation"]
    assert x2h[0].nbytes == 2 * 6 * 3 * 8  # batch x time rows of 3 features


def test_meter_counts_one_step_per_synchronize() -> None:
    model = _mlp(4, 5, 3)
    meter = Meter()
    engine = DistributedAutodiff(model, "edad", meter=meter)
    for _ in range(3):
        model.zero_grad()
        _backward(model, torch.randn(2, 4, dtype=torch.float64))
        engine.synchronize()
    assert meter.step == 3
    per_entity = meter.bytes_per_step("entity")
    assert per_entity["activation"] == 2 * (4 + 5) * 8 and per_entity["delta"] == 2 * 3 * 8


# ----------------------------------------------------------------- errors

@pytest.mark.parametrize("module", [nn.Conv1d(1, 1, 2), nn.LayerNorm(4), nn.Embedding(3, 4)],
                         ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("mode", ["dad", "edad", "rank-dad"])
def test_modules_other_than_linear_are_refused(module: nn.Module, mode: str) -> None:
    model = nn.Sequential(module, nn.Linear(4, 2))
    with pytest.raises(ValueError, match=type(module).__name__):
        DistributedAutodiff(model, mode)


@pytest.mark.parametrize("mode", ["dsgd", "powersgd"])
def test_gradient_modes_take_any_module(mode: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    engine = DistributedAutodiff(model, mode)
    local = _backward(model, torch.randn(3, 4, dtype=torch.float64), classes=2)
    grads = engine.synchronize()
    for name, grad in local.items():
        assert torch.allclose(grads[name], grad, atol=1e-14)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) + F.linear(x, self.a.weight))


class _Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.linear(x, self.a.weight, self.a.bias))


@pytest.mark.parametrize("model", [_Tied(), _Functional()], ids=["tied", "functional"])
def test_parameters_used_outside_their_module_are_caught(model: nn.Module) -> None:
    engine = DistributedAutodiff(model.double(), "dad")
    with pytest.raises(ValueError, match="'a'"):
        _backward(model, torch.randn(3, 4, dtype=torch.float64))
        engine.synchronize()


def test_two_forwards_before_synchronize_raise() -> None:
    model = _mlp(3, 4, 2)
    engine = DistributedAutodiff(model, "dad")
    model(torch.randn(2, 3, dtype=torch.float64))
    _backward(model, torch.randn(2, 3, dtype=torch.float64), classes=2)
    with pytest.raises(RuntimeError, match="2 forward passes"):
        engine.synchronize()


def test_evaluation_under_no_grad_is_ignored() -> None:
    model = _mlp(3, 4, 2)
    engine = DistributedAutodiff(model, "dad")
    local = _backward(model, torch.randn(2, 3, dtype=torch.float64), classes=2)
    with torch.no_grad():
        model(torch.randn(7, 3, dtype=torch.float64))
    grads = engine.synchronize()
    assert torch.allclose(grads["0.weight"], local["0.weight"], atol=1e-15)


def test_synchronize_without_backward_raises() -> None:
    model = _mlp(3, 4, 2)
    engine = DistributedAutodiff(model, "dad")
    with pytest.raises(RuntimeError, match="no forward"):
        engine.synchronize()
    model(torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="no backward"):
        engine.synchronize()


@pytest.mark.parametrize("options", [
    {"mode": "sgd"}, {"rank": 0}, {"theta": 2.0}, {"iterations": 0}, {"reduction": "max"},
    {"private_fallback": "drop"}, {"nonfinite": "ignore"}, {"seed": -1}, {"private_input": 1},
])
def test_bad_options_raise_naming_the_value(options: dict[str, object]) -> None:
    key = next(iter(options))
    kwargs = {"mode": "dad", **options}
    with pytest.raises(ValueError, match=key):
        DistributedAutodiff(_mlp(3, 4, 2), **kwargs)  # type: ignore[arg-type]


def test_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        DistributedAutodiff(_mlp(3, 4, 2), "dad", ranks=3)


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_statistics_raise_or_skip(mode: str) -> None:
    model = _mlp(3, 4, 2)
    engine = DistributedAutodiff(model, mode, rank=1)
    x = torch.randn(2, 3, dtype=torch.float64)
    x[0, 0] = float("nan")
    _backward(model, x, classes=2)
    with pytest.raises(FloatingPointError):
        engine.synchronize()

    model = _mlp(30, 40, 2)
    engine = DistributedAutodiff(model, mode, rank=1, nonfinite="skip")
    _backward(model, torch.randn(2, 30, dtype=torch.float64), classes=2)
    engine.synchronize()
    state = copy.deepcopy(engine.state_dict())
    model.zero_grad()
    x = torch.randn(2, 30, dtype=torch.float64)
    x[1, 3] = float("inf")
    _backward(model, x, classes=2)
    grads = engine.synchronize()
    assert engine.skipped == 1
    assert all(bool((g == 0).all()) for g in grads.values())  # the only site skipped
    errors = engine.powersgd.state_dict()["memory"]["buffers"]
    for key, value in state["powersgd"]["memory"]["buffers"].items():
        assert torch.equal(errors[key], value)  # memory untouched
