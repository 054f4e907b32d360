"""Structured power iterations (dAD §3.4.1) against SVD and the unstructured iteration."""

from __future__ import annotations

import pytest
import torch

from thinwire.autodiff.power import (
    STOPPING,
    dense_power_iterations,
    reconstruct,
    repeat,
    structured_power_iterations,
)
from thinwire.autodiff.ranks import EffectiveRanks
from thinwire.compress.lowrank import seeded_normal


def _start(width: int, key: str = "layer"):  # type: ignore[no-untyped-def]
    return lambda j: seeded_normal(f"{key}/{j}", (width,), 0, dtype=torch.float64)


def _factors_with_spectrum(n: int, h_in: int, h_out: int, singular: list[float]):
    """(A, Δ) whose product AᵀΔ has exactly the given singular values."""
    k = len(singular)
    left = torch.linalg.qr(torch.randn(h_in, k, dtype=torch.float64))[0]
    right = torch.linalg.qr(torch.randn(h_out, k, dtype=torch.float64))[0]
    mix = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64))[0]  # orthonormal columns
    acts = mix @ left.T  # (n, h_in)
    deltas = mix @ torch.diag(torch.tensor(singular, dtype=torch.float64)) @ right.T
    return acts, deltas


def _truncated(matrix: torch.Tensor, r: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u[:, :r] @ torch.diag(s[:r]) @ vh[:r]


def test_converged_iterations_give_the_truncated_svd() -> None:
    acts, deltas = _factors_with_spectrum(12, 30, 20, [9.0, 5.0, 3.0, 1.0, 0.5, 0.2])
    gradient = deltas.T @ acts  # nn.Linear layout (h_out, h_in)
    for r in (1, 2, 3, 4):
        factors = structured_power_iterations(acts, deltas, r, _start(20), theta=0.0,
                                              iterations=300)
        assert factors.rank == r
        best = _truncated(gradient, r)
        assert torch.allclose(reconstruct(factors.acts, factors.deltas), best, atol=1e-9)


def test_residual_rule_stops_at_a_known_rank_and_is_exact() -> None:
    for q in (1, 2, 3):
        acts = torch.randn(10, 40, dtype=torch.float64)
        deltas = torch.randn(10, q, dtype=torch.float64) @ torch.randn(q, 25, dtype=torch.float64)
        factors = structured_power_iterations(acts, deltas, 8, _start(25), iterations=30,
                                              stopping="residual")
        assert factors.rank == q
        assert torch.allclose(reconstruct(factors.acts, factors.deltas), deltas.T @ acts,
                              atol=1e-9)


def test_last_component_is_kept_when_the_rank_limit_stops_peeling() -> None:
    acts = torch.randn(16, 20, dtype=torch.float64)
    deltas = torch.randn(16, 12, dtype=torch.float64)  # full rank 12
    factors = structured_power_iterations(acts, deltas, 5, _start(12), theta=1e-3,
                                          iterations=200)
    assert factors.rank == 5
    best = _truncated(deltas.T @ acts, 5)
    assert torch.allclose(reconstruct(factors.acts, factors.deltas), best, atol=1e-7)


def test_residual_rule_matches_the_unstructured_iteration_on_the_explicit_gradient() -> None:
    """Eq. 7 with B, C precomputed equals Eq. 6 on the formed (h_in, h_out) matrix, deflated."""
    acts = torch.randn(6, 15, dtype=torch.float64)
    deltas = torch.randn(6, 9, dtype=torch.float64)
    factors = structured_power_iterations(acts, deltas, 3, _start(9), theta=0.0, iterations=4,
                                          stopping="residual")
    m = acts.T @ deltas  # paper layout: ∇W = Aᵀ·Δ
    us, gs = [], []
    for j in range(3):
        g = _start(9)(j)
        g = g / g.norm()
        residual = m - sum((torch.outer(u, v) for u, v in zip(us, gs, strict=True)),
                           torch.zeros_like(m))
        for _ in range(4):
            g = residual.T @ residual @ g
            g = g / g.norm()
        us.append(residual @ g)
        gs.append(g)
    assert torch.allclose(factors.acts, torch.stack(us), atol=1e-10)
    assert torch.allclose(factors.deltas, torch.stack(gs), atol=1e-10)


@pytest.mark.parametrize("stopping", STOPPING)
def test_dense_peeling_of_the_formed_gradient_matches_the_structured_one(stopping: str) -> None:
    acts = torch.randn(7, 18, dtype=torch.float64)
    deltas = torch.randn(7, 11, dtype=torch.float64)
    structured = structured_power_iterations(acts, deltas, 4, _start(11), iterations=6,
                                             stopping=stopping)
    dense = dense_power_iterations(deltas.T @ acts, 4, _start(11), iterations=6,
                                   stopping=stopping)
    assert dense.rank == structured.rank == 4
    assert torch.allclose(dense.acts, structured.acts, atol=1e-10)
    assert torch.allclose(dense.deltas, structured.deltas, atol=1e-10)


def test_paper_rule_deflates_the_gram_operator_as_eq_8() -> None:
    """g ← (MᵀM − Σ σ_j²·g_j·g_jᵀ)·g on the formed matrix; u the least-squares fit of the rest."""
    acts = torch.randn(6, 15, dtype=torch.float64)
    deltas = torch.randn(6, 9, dtype=torch.float64)
    factors = structured_power_iterations(acts, deltas, 3, _start(9), theta=0.0, iterations=4)
    m = acts.T @ deltas
    us: list[torch.Tensor] = []
    gs: list[torch.Tensor] = []
    for j in range(3):
        g = _start(9)(j)
        g = g / g.norm()
        for _ in range(4):
            g = m.T @ (m @ g) - sum(((m @ q).square().sum() * q * (q @ g) for q in gs),
                                    torch.zeros_like(g))
            g = g / g.norm()
        residual = m - sum((torch.outer(u, q) for u, q in zip(us, gs, strict=True)),
                           torch.zeros_like(m))
        us.append(residual @ g)
        gs.append(g)
    assert torch.allclose(factors.acts, torch.stack(us), atol=1e-10)
    assert torch.allclose(factors.deltas, torch.stack(gs), atol=1e-10)


@pytest.mark.parametrize("spectrum", [[9.0, 5.0, 3.0], [4.0, 1.0], [7.0]])
def test_paper_rule_stops_exactly_when_its_criterion_first_holds(spectrum: list[float]) -> None:
    """§3.4.1: stop when ‖g^j − g^{j+1}‖ / ‖g^j‖ < θ; g^{j+1} is dropped, g^1..g^j kept."""
    acts, deltas = _factors_with_spectrum(12, 30, 20, spectrum)
    every = structured_power_iterations(acts, deltas, 8, _start(20), theta=0.0, iterations=10)
    assert every.rank == 8  # θ = 0: the criterion never holds
    changes = [repeat(every.deltas[j], every.deltas[j + 1]) for j in range(7)]
    # the deflation error leaves only the components found: past the true rank, g repeats
    assert min(changes[len(spectrum) - 1:len(spectrum) + 1]) < 1e-3
    assert all(c > 1e-3 for c in changes[:len(spectrum) - 1])
    for theta in sorted({*(c for c in changes if c < 0.9), 1e-3, 0.5}):
        for at in (theta, theta * (1 + 1e-9)):
            factors = structured_power_iterations(acts, deltas, 8, _start(20), theta=at,
                                                  iterations=10)
            first = next((j + 1 for j, c in enumerate(changes) if c < at), 8)
            assert factors.rank == first
            assert torch.equal(factors.deltas, every.deltas[:first])
    kept = structured_power_iterations(acts, deltas, 8, _start(20), iterations=10)
    assert len(spectrum) <= kept.rank <= len(spectrum) + 1
    gradient = deltas.T @ acts
    error = (reconstruct(kept.acts, kept.deltas) - gradient).norm() / gradient.norm()
    assert error < 1e-3  # 10 iterations converge to (σ₂/σ₁)²⁰ at worst


def test_bad_stopping_rule_raises() -> None:
    with pytest.raises(ValueError, match="stopping='svd' must be one of"):
        structured_power_iterations(torch.ones(2, 3), torch.ones(2, 4), 2, _start(4),
                                    stopping="svd")


def test_one_iteration_above_the_true_rank_is_never_worse_than_nothing() -> None:
    acts = torch.randn(8, 50, dtype=torch.float64)
    deltas = torch.randn(8, 2, dtype=torch.float64) @ torch.randn(2, 30, dtype=torch.float64)
    gradient = deltas.T @ acts
    errors = []
    for r in range(1, 9):
        factors = structured_power_iterations(acts, deltas, r, _start(30), theta=0.0,
                                              iterations=1)
        errors.append(float((gradient - reconstruct(factors.acts, factors.deltas)).norm()))
    assert errors[0] < float(gradient.norm())
    assert all(later <= earlier + 1e-12 for earlier, later in zip(errors, errors[1:],
                                                                   strict=False))


def test_zero_gradient_has_effective_rank_zero() -> None:
    acts = torch.randn(5, 7, dtype=torch.float64)
    factors = structured_power_iterations(acts, torch.zeros(5, 4, dtype=torch.float64), 3,
                                          _start(4))
    assert factors.rank == 0
    assert factors.acts.shape == (0, 7) and factors.deltas.shape == (0, 4)


def test_residual_rule_in_float32_stops_at_the_true_rank() -> None:
    acts = torch.randn(32, 100)
    deltas = torch.randn(32, 3) @ torch.randn(3, 60)
    start = lambda j: seeded_normal(f"f/{j}", (60,), 0)  # noqa: E731
    factors = structured_power_iterations(acts, deltas, 10, start, stopping="residual")
    assert factors.rank == 3
    gradient = deltas.T @ acts
    error = (reconstruct(factors.acts, factors.deltas) - gradient).norm() / gradient.norm()
    assert error < 1e-4


@pytest.mark.parametrize("options", [{"max_rank": 0}, {"theta": -0.1}, {"theta": 1.0},
                                     {"iterations": 0}, {"max_rank": 2.5}])
def test_bad_options_raise(options: dict[str, float]) -> None:
    kwargs = {"max_rank": 2, "theta": 1e-3, "iterations": 3, **options}
    with pytest.raises(ValueError, match=next(iter(options)).replace("max_", "")):
        structured_power_iterations(torch.ones(2, 3), torch.ones(2, 4),
                                    kwargs.pop("max_rank"), _start(4), **kwargs)


def test_mismatched_rows_raise() -> None:
    with pytest.raises(ValueError, match="same N"):
        structured_power_iterations(torch.ones(2, 3), torch.ones(3, 4), 2, _start(4))


def test_effective_rank_records_average_per_window_and_resume() -> None:
    ranks = EffectiveRanks()
    for step, (a, b) in enumerate([(3, 1), (5, 1), (4, 2)]):
        ranks.record(step, "fc1", a)
        ranks.record(step, "out", b)
    assert ranks.mean_per(2) == {"fc1": [4.0, 4.0], "out": [1.0, 2.0]}
    copy = EffectiveRanks()
    copy.load_state_dict(ranks.state_dict())
    assert copy.by_layer() == ranks.by_layer()
    with pytest.raises(ValueError, match="steps"):
        ranks.mean_per(0)
