"""Update rules: ASGD (Eq. 3), DC-ASGD (Eq. 9-10), adaptive lambda, momentum, schedule."""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.ps import DCASGD, build_rule, rule_config_class, rule_names
from thinwire.ps.rules import PAPER_LAMBDA, DCConfig, UpdateRule


def _tensors(n: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    draw = lambda: torch.randn(n, dtype=torch.float64, generator=generator)  # noqa: E731
    return draw(), draw(), draw()


def _trajectory(rule: UpdateRule, steps: int = 6) -> list[torch.Tensor]:
    """Apply ``steps`` pushes with fresh gradients and a backup that lags two updates."""
    weights, _, _ = _tensors(seed=2)
    history = [weights]
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        grad = torch.randn(weights.shape, dtype=torch.float64, generator=generator)
        weights = rule.apply(weights, grad, history[max(0, len(history) - 3)])
        history.append(weights)
    return history


def test_registry_lists_the_rules() -> None:
    assert rule_names()[:2] == ["asgd", "dc-asgd"]
    assert {"lr", "lam", "variant", "momentum", "weight_decay"} <= set(
        rule_config_class("dc-asgd").__dataclass_fields__)
    assert isinstance(build_rule("dc-asgd", lr=0.1, lam=0.04, variant="abs"), DCASGD)


@pytest.mark.parametrize("variant", ["square", "abs"])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 1e-3)])
def test_lambda_zero_is_asgd_exactly(variant: str, adaptive: bool, momentum: float,
                                     weight_decay: float) -> None:
    options = {"lr": 0.05, "momentum": momentum, "weight_decay": weight_decay}
    dc = build_rule("dc-asgd", lam=0.0, variant=variant, adaptive=adaptive, **options)
    for ours, reference in zip(_trajectory(dc), _trajectory(build_rule("asgd", **options)),
                               strict=True):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("variant", ["square", "abs"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_backup_equal_to_weights_is_sgd(variant: str, adaptive: bool) -> None:
    weights, grad, _ = _tensors()
    rule = build_rule("dc-asgd", lr=0.1, lam=5.0, variant=variant, adaptive=adaptive)
    for _ in range(3):
        expected = weights.add(grad, alpha=-0.1)
        weights = rule.apply(weights, grad, weights)
        assert torch.equal(weights, expected)


WEIGHTS = [1.0, -2.0]
BACKUP = [0.5, -1.0]
GRAD = [0.2, -0.4]


def _one_step(**options: object) -> list[float]:
    as64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    rule = build_rule("dc-asgd", lr=0.1, lam=0.5, **options)
    return rule.apply(as64(WEIGHTS), as64(GRAD), as64(BACKUP)).tolist()


def test_hand_computed_square_step() -> None:
    # Eq. 10: g + lam * g*g * (w - w_bak) = [0.2 + 0.5*0.04*0.5, -0.4 + 0.5*0.16*(-1.0)]
    assert _one_step(variant="square") == pytest.approx([1.0 - 0.1 * 0.21, -2.0 + 0.1 * 0.48],
                                                        abs=1e-15)


def test_hand_computed_abs_step() -> None:
    # Eq. 9: g + lam * |g| * (w - w_bak) = [0.2 + 0.5*0.2*0.5, -0.4 + 0.5*0.4*(-1.0)]
    assert _one_step(variant="abs") == pytest.approx([1.0 - 0.1 * 0.25, -2.0 + 0.1 * 0.6],
                                                     abs=1e-15)


def test_hand_computed_adaptive_step() -> None:
    # MeanSquare = (1 - 0.9) g^2 = [0.004, 0.016]; lam_i = 0.5 / sqrt(MeanSquare_i + eps)
    lam = [0.5 / math.sqrt(0.004 + 1e-8), 0.5 / math.sqrt(0.016 + 1e-8)]
    direction = [0.2 + lam[0] * 0.04 * 0.5, -0.4 + lam[1] * 0.16 * -1.0]
    expected = [1.0 - 0.1 * direction[0], -2.0 - 0.1 * direction[1]]
    assert _one_step(variant="square", adaptive=True, ms_decay=0.9, eps=1e-8) == pytest.approx(
        expected, abs=1e-14)


def test_hand_computed_momentum_and_weight_decay() -> None:
    rule = build_rule("dc-asgd", lr=0.1, lam=0.5, momentum=0.9, weight_decay=0.01)
    w = torch.tensor([1.0], dtype=torch.float64)
    g1, g2 = torch.tensor([0.2], dtype=torch.float64), torch.tensor([-0.3], dtype=torch.float64)
    bak = torch.tensor([0.0], dtype=torch.float64)
    w1 = rule.apply(w, g1, bak)
    v1 = 0.2 + 0.5 * 0.04 * 1.0 + 0.01 * 1.0
    assert w1.item() == pytest.approx(1.0 - 0.1 * v1, abs=1e-15)
    w2 = rule.apply(w1, g2, bak)
    w1f = 1.0 - 0.1 * v1
    v2 = 0.9 * v1 + (-0.3 + 0.5 * 0.09 * w1f + 0.01 * w1f)
    assert w2.item() == pytest.approx(w1f - 0.1 * v2, abs=1e-15)


def test_asgd_with_momentum_matches_torch_sgd_exactly() -> None:
    weights, _, _ = _tensors(seed=5)
    parameter = torch.nn.Parameter(weights.clone())
    optimizer = torch.optim.SGD([parameter], lr=0.05, momentum=0.8, weight_decay=1e-2)
    rule = build_rule("asgd", lr=0.05, momentum=0.8, weight_decay=1e-2)
    generator = torch.Generator().manual_seed(6)
    for _ in range(5):
        grad = torch.randn(weights.shape, dtype=torch.float64, generator=generator)
        weights = rule.apply(weights, grad, weights)
        parameter.grad = grad.clone()
        optimizer.step()
        assert torch.equal(weights, parameter.detach())


def test_schedule_drops_lr_and_grows_lambda_at_milestones() -> None:
    rule = build_rule("dc-asgd", lr=0.4, lam=0.04, milestones=(2, 4), lr_decay=0.1)
    seen = []
    weights = torch.zeros(1, dtype=torch.float64)
    for _ in range(5):
        seen.extend((rule.lr, rule.lam))
        weights = rule.apply(weights, torch.ones(1, dtype=torch.float64), weights)
    assert seen == pytest.approx([0.4, 0.04, 0.4, 0.04, 0.04, 0.4, 0.04, 0.4, 0.004, 4.0])
    # The third update used the dropped rate: -0.4 -0.4 -0.04 -0.04 -0.004.
    assert weights.item() == pytest.approx(-0.884)


def test_state_dict_resumes_exactly() -> None:
    options = {"lr": 0.05, "lam": 0.3, "adaptive": True, "momentum": 0.9, "milestones": (4,)}
    whole, interrupted = build_rule("dc-asgd", **options), build_rule("dc-asgd", **options)
    _trajectory(whole, steps=8)
    _trajectory(interrupted, steps=8)
    resumed = build_rule("dc-asgd", **options)
    resumed.load_state_dict(interrupted.state_dict())
    assert resumed.step == 8 and resumed.lr == whole.lr and resumed.lam == whole.lam
    weights, grad, backup = _tensors(seed=9)
    for _ in range(3):
        expected = whole.apply(weights, grad, backup)
        weights = resumed.apply(weights, grad, backup)
        assert torch.equal(weights, expected)


def test_named_tensors_match_flat_application() -> None:
    weights, grad, backup = _tensors(n=10)
    split = lambda t: {"a": t[:4], "b": t[4:]}  # noqa: E731
    options = {"lr": 0.1, "lam": 0.7, "adaptive": True, "momentum": 0.5}
    flat_rule, named_rule = build_rule("dc-asgd", **options), build_rule("dc-asgd", **options)
    for _ in range(3):
        flat = flat_rule.apply(weights, grad, backup)
        named = named_rule.apply(split(weights), split(grad), split(backup))
        assert torch.equal(torch.cat([named["a"], named["b"]]), flat)
        weights = flat
    with pytest.raises(ValueError, match="same tensors"):
        named_rule.apply({"a": weights}, {"b": grad}, {"a": backup})


def test_inputs_are_never_modified() -> None:
    weights, grad, backup = _tensors()
    copies = [t.clone() for t in (weights, grad, backup)]
    rule = build_rule("dc-asgd", lr=0.1, lam=1.0, momentum=0.9, weight_decay=0.1, adaptive=True)
    for _ in range(2):
        out = rule.apply(weights, grad, backup)
    assert out.data_ptr() != weights.data_ptr()
    for original, copy in zip((weights, grad, backup), copies, strict=True):
        assert torch.equal(original, copy)


@pytest.mark.parametrize("name,options,match", [
    ("nope", {}, "unknown update rule 'nope'"),
    ("asgd", {"lam": 0.1}, r"no option\(s\) \['lam'\]"),
    ("asgd", {"lr": 0.0}, "lr=0.0 must be a finite number > 0"),
    ("asgd", {"lr": float("nan")}, "lr=nan"),
    ("asgd", {"momentum": 1.0}, r"momentum=1.0 is outside the allowed range \[0.0, 1.0\)"),
    ("asgd", {"milestones": (5, 3)}, "strictly increasing"),
    ("dc-asgd", {"lam": -1.0}, "lam=-1.0 must be a finite number >= 0"),
    ("dc-asgd", {"variant": "cube"}, "variant='cube' must be one of"),
    ("dc-asgd", {"ms_decay": 1.0}, "ms_decay=1.0"),
])
def test_bad_options_name_the_value(name: str, options: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_rule(name, **options)


def test_shape_mismatch_is_rejected() -> None:
    rule = build_rule("asgd")
    with pytest.raises(ValueError, match="differ"):
        rule.apply(torch.zeros(3), torch.zeros(4), torch.zeros(3))


def test_defaults_are_the_papers_lambdas_and_grow_tenfold_at_each_lr_drop() -> None:
    """§5: λ₁ = 2 (Option I), λ₂ = 0.04 (Option II), "increased by ten times when learning
    rate changes"."""
    assert PAPER_LAMBDA == {"abs": 2.0, "square": 0.04}
    option_1 = build_rule("dc-asgd", variant="abs", milestones=(1, 2))
    option_2 = build_rule("dc-asgd", variant="square", milestones=(1, 2))
    assert option_1.config.lam == 2.0 and option_2.config.lam == 0.04
    assert DCConfig().lam == 0.04 and DCConfig().lam_growth == 10.0
    w = torch.zeros(3, dtype=torch.float64)
    seen = []
    for rule in (option_1, option_2):
        lams = []
        for _ in range(3):
            lams.append(rule.lam)
            rule.apply(w, torch.ones(3, dtype=torch.float64), w)
        seen.append(lams)
    assert seen[0] == pytest.approx([2.0, 20.0, 200.0], rel=1e-15)
    assert seen[1] == pytest.approx([0.04, 0.4, 4.0], rel=1e-15)
    assert build_rule("dc-asgd", variant="abs", lam=0.5).config.lam == 0.5
