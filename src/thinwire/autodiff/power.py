"""Structured power iterations: a low-rank gradient from its AD factors (dAD §3.4.1).

For ``M = Aᵀ·Δ`` (Eq. 4) the dominant right singular vectors come from
``g ← B·(Δ·g)`` with ``B = Δᵀ·A·Aᵀ`` (Eq. 7): O(N·h) per iteration, and the
(h_in, h_out) matrix is never formed. Components are peeled one at a time
(Eq. 8), deflating ``M`` itself so that each component ``u = (M − UᵀG)·g`` is the
least-squares fit of what is left: an accepted component never makes the
approximation worse, even at a rank above the true one (where the reference
code is). Stopping (:data:`STOPPING`): ``"paper"`` stops when consecutive
directions repeat, ``‖g^j − g^{j+1}‖ / ‖g^j‖ < θ`` up to sign, and drops the
repeat; ``"residual"`` accepts a component while ``‖u‖ ≥ θ·‖UᵀG‖``. Every
accepted component is returned (the reference code drops its last). Why these
readings of the paper: ``docs/dad.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from thinwire.compress.base import check_fraction

STOPPING = ("paper", "residual")  # rules that end the peeling, see the module docstring


@dataclass(frozen=True)
class Factors:
    """A rank-``rank`` approximation ``actsᵀ·deltas`` of ``Aᵀ·Δ``, shaped like dAD's rows.

    ``acts`` rows are ``u_j`` (singular value absorbed), ``deltas`` rows are
    unit right singular vectors ``g_j``; they travel exactly like dAD's ``A``
    and ``Δ`` with ``rank`` rows instead of N.
    """

    acts: torch.Tensor  # (rank, h_in)
    deltas: torch.Tensor  # (rank, h_out)

    @property
    def rank(self) -> int:
        return int(self.acts.shape[0])


def check_power_options(max_rank: int, theta: float, iterations: int,
                        stopping: str = "paper") -> None:
    """Raise ``ValueError`` naming the first option outside its range."""
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
        raise ValueError(f"rank={max_rank!r} must be an integer >= 1")
    check_fraction("theta", theta, 0.0, 1.0, closed_low=True, closed_high=False)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} must be an integer >= 1")
    if stopping not in STOPPING:
        raise ValueError(f"stopping={stopping!r} must be one of {STOPPING}")


def structured_power_iterations(
    acts: torch.Tensor, deltas: torch.Tensor, max_rank: int, start: Callable[[int], torch.Tensor],
    *, theta: float = 1e-3, iterations: int = 10, stopping: str = "paper",
) -> Factors:
    """Peel the leading components of ``actsᵀ·deltas`` without forming it (Eq. 7–8).

    Args:
        acts: (N, h_in) layer inputs (with a ones column when the layer has a bias).
        deltas: (N, h_out) output deltas.
        max_rank: most components to return (r).
        start: ``start(j)`` gives the (h_out,) initial vector of component j;
            the engine seeds it identically on every site.
        theta: threshold θ of §3.4.1 (0 peels all ``max_rank``).
        iterations: power iterations per component (§4.2 uses 10).
        stopping: ``"paper"`` or ``"residual"`` (module docstring).

    Returns:
        The accepted components; ``rank`` is the effective rank (0 for a zero gradient).

    Raises:
        ValueError: bad options or mismatched shapes.
    """
    check_power_options(max_rank, theta, iterations, stopping)
    if acts.dim() != 2 or deltas.dim() != 2 or acts.shape[0] != deltas.shape[0]:
        raise ValueError(f"acts {tuple(acts.shape)} and deltas {tuple(deltas.shape)} must be "
                         "(N, h_in) and (N, h_out) with the same N")
    gram = acts @ acts.T  # C (N, N)
    back = deltas.T @ gram  # B (h_out, N)
    total = torch.sqrt(torch.clamp((gram * (deltas @ deltas.T)).sum(), min=0.0))  # ‖M‖_F
    operator = _Operator(
        times=lambda g: acts.T @ (deltas @ g),  # M·g
        times_t=lambda u: deltas.T @ (acts @ u),  # Mᵀ·u
        gram=lambda g: back @ (deltas @ g),  # MᵀM·g = B·(Δ·g), Eq. 7
        shape=(acts.shape[1], deltas.shape[1]), norm=total)
    return _peel(operator, max_rank, start, theta, iterations, stopping)


def dense_power_iterations(matrix: torch.Tensor, max_rank: int,
                           start: Callable[[int], torch.Tensor], *, theta: float = 1e-3,
                           iterations: int = 10, stopping: str = "paper") -> Factors:
    """The same peeling on an explicit (h_out, h_in) gradient, ``nn.Linear``'s layout.

    For rank-dAD with error feedback, whose compensated gradient ``Δᵀ·A + e``
    has lost the outer-product structure: each iteration costs O(h_in·h_out)
    instead of O(N·h), like PowerSGD's.
    """
    check_power_options(max_rank, theta, iterations, stopping)
    m = matrix.T  # paper layout (h_in, h_out)
    operator = _Operator(times=lambda g: m @ g, times_t=lambda u: m.T @ u,
                         gram=lambda g: m.T @ (m @ g), shape=(m.shape[0], m.shape[1]),
                         norm=torch.linalg.matrix_norm(m))
    return _peel(operator, max_rank, start, theta, iterations, stopping)


@dataclass(frozen=True)
class _Operator:
    """The gradient M (h_in, h_out) seen only through products with it."""

    times: Callable[[torch.Tensor], torch.Tensor]
    times_t: Callable[[torch.Tensor], torch.Tensor]
    gram: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, int]
    norm: torch.Tensor  # ‖M‖_F


def _peel(operator: _Operator, max_rank: int, start: Callable[[int], torch.Tensor],
          theta: float, iterations: int, stopping: str) -> Factors:
    """Eq. 8: power iterations on the deflated Gram operator, one component at a time."""
    h_in, h_out = operator.shape
    like = operator.norm
    us = like.new_zeros(0, h_in)
    gs = like.new_zeros(0, h_out)
    cross = like.new_zeros(h_out, 0)  # K = Mᵀ·Uᵀ, one column per component ("residual")
    powers = like.new_zeros(0)  # σ_j² = ‖M·g_j‖², Eq. 8's Q = G·diag(σ²) ("paper")
    for j in range(max_rank):
        g = start(j).to(device=like.device, dtype=like.dtype)
        g = g / torch.linalg.vector_norm(g)
        for _ in range(iterations):
            if stopping == "paper":
                w = operator.gram(g) - gs.T @ (powers * (gs @ g))
            else:
                w = _deflated_gram(g, operator, us, gs, cross)
            norm = torch.linalg.vector_norm(w)
            if norm == 0:  # g lies in the deflated operator's null space: nothing left there
                break
            g = w / norm
        u = operator.times(g) - us.T @ (gs @ g)  # least-squares fit of M − UᵀG along g
        size = torch.linalg.vector_norm(u)
        if stopping == "paper":
            if not size > 0 or (j > 0 and repeat(gs[-1], g) < theta):
                break
            powers = torch.cat([powers, torch.linalg.vector_norm(operator.times(g)).square()
                                .reshape(1)])
        else:  # ‖g_{j+1} − g_j‖_F = ‖u‖ as ‖g‖ = 1, against ‖g_j‖_F (‖M‖_F for the first)
            done = (us @ us.T * (gs @ gs.T)).sum()
            reference = operator.norm if j == 0 else torch.sqrt(torch.clamp(done, min=0.0))
            if not size > theta * reference:
                break
            cross = torch.cat([cross, operator.times_t(u).unsqueeze(1)], dim=1)
        us = torch.cat([us, u.unsqueeze(0)])
        gs = torch.cat([gs, g.unsqueeze(0)])
    return Factors(us, gs)


def repeat(previous: torch.Tensor, g: torch.Tensor) -> float:
    """§3.4.1's ``‖g^j − g^{j+1}‖₂ / ‖g^j‖₂``, up to the sign of ``g^{j+1}``."""
    previous, g = previous.detach(), g.detach()
    scale = torch.linalg.vector_norm(previous)
    return float(torch.minimum(torch.linalg.vector_norm(previous - g),
                               torch.linalg.vector_norm(previous + g)) / scale)


def _deflated_gram(g: torch.Tensor, operator: _Operator, us: torch.Tensor, gs: torch.Tensor,
                   cross: torch.Tensor) -> torch.Tensor:
    """``(M − UᵀG)ᵀ(M − UᵀG)·g`` from MᵀM·g and O(j·h) more (the peeling of Eq. 8)."""
    out = operator.gram(g)
    if us.shape[0] == 0:
        return out
    gg = gs @ g
    return out - cross @ gg - gs.T @ (cross.T @ g) + gs.T @ ((us @ us.T) @ gg)


def reconstruct(acts: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """The (h_out, h_in) gradient in ``nn.Linear``'s layout from rows: ``Δᵀ·A`` (Eq. 4)."""
    return deltas.T @ acts
