"""Structured power iterations: a low-rank gradient from its AD factors (dAD §3.4.1).

The gradient of a linear layer is ``M = Aᵀ·Δ`` (Eq. 4) with ``A`` (N, h_in)
and ``Δ`` (N, h_out). Its dominant right singular vectors come from iterating
``g ← MᵀM·g`` (Eq. 6); with ``C = A·Aᵀ`` (N, N) and ``B = Δᵀ·C`` (h_out, N)
precomputed this is ``g ← B·(Δ·g)`` (Eq. 7), which never forms the
(h_in, h_out) matrix and costs O(N·h) per iteration.

Components are peeled one at a time (Eq. 8). Choices where the paper is
brief, written down here:

* Deflation subtracts the components found so far from ``M`` itself,
  ``(M − UᵀG)ᵀ(M − UᵀG)·g``, expanded so that it stays linear in h. For
  converged components this equals Eq. 8's deflation of ``MᵀM``; for
  unconverged ones it is the only form under which the next step is a
  least-squares fit of what is left.
* Each component is the least-squares fit ``u = (M − UᵀG)·g`` for its unit
  direction ``g``; the singular value is absorbed in ``u``. So each accepted
  component can only lower ``‖M − UᵀG‖_F`` (by ``‖u‖²``): even one power
  iteration with a rank above the true rank is never worse than sending
  nothing, a failure of the public reference code.
* Stopping (§3.4.1): with ``g_j = UᵀG`` the approximation after j
  components, a new component changes it by ``‖g_{j+1} − g_j‖ = ‖u‖``. It is
  accepted when ``‖u‖ ≥ θ·‖g_j‖`` (the first one when ``‖u‖ > θ·‖M‖_F``) and
  peeling stops at the first rejected one or after ``max_rank``. Every
  accepted component is returned; the reference code dropped its last one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from thinwire.compress.base import check_fraction


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


def check_power_options(max_rank: int, theta: float, iterations: int) -> None:
    """Raise ``ValueError`` naming the first option outside its range."""
    if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
        raise ValueError(f"rank={max_rank!r} must be an integer >= 1")
    check_fraction("theta", theta, 0.0, 1.0, closed_low=True, closed_high=False)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} must be an integer >= 1")


def structured_power_iterations(
    acts: torch.Tensor, deltas: torch.Tensor, max_rank: int, start: Callable[[int], torch.Tensor],
    *, theta: float = 1e-3, iterations: int = 10,
) -> Factors:
    """Peel the leading components of ``actsᵀ·deltas`` without forming it (Eq. 7–8).

    Args:
        acts: (N, h_in) layer inputs (with a ones column when the layer has a bias).
        deltas: (N, h_out) output deltas.
        max_rank: most components to return (r).
        start: ``start(j)`` gives the (h_out,) initial vector of component j;
            the engine seeds it identically on every site.
        theta: relative-change threshold of §3.4.1 (0 peels all ``max_rank``).
        iterations: power iterations per component (§4.2 uses 10).

    Returns:
        The accepted components; ``rank`` is the effective rank (0 for a zero gradient).

    Raises:
        ValueError: bad options or mismatched shapes.
    """
    check_power_options(max_rank, theta, iterations)
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
    return _peel(operator, max_rank, start, theta, iterations, deltas.dtype)


def dense_power_iterations(matrix: torch.Tensor, max_rank: int,
                           start: Callable[[int], torch.Tensor], *, theta: float = 1e-3,
                           iterations: int = 10) -> Factors:
    """The same peeling on an explicit (h_out, h_in) gradient, ``nn.Linear``'s layout.

    For rank-dAD with error feedback, whose compensated gradient ``Δᵀ·A + e``
    has lost the outer-product structure: each iteration costs O(h_in·h_out)
    instead of O(N·h), like PowerSGD's.
    """
    check_power_options(max_rank, theta, iterations)
    m = matrix.T  # paper layout (h_in, h_out)
    operator = _Operator(times=lambda g: m @ g, times_t=lambda u: m.T @ u,
                         gram=lambda g: m.T @ (m @ g), shape=(m.shape[0], m.shape[1]),
                         norm=torch.linalg.matrix_norm(m))
    return _peel(operator, max_rank, start, theta, iterations, matrix.dtype)


@dataclass(frozen=True)
class _Operator:
    """The gradient M (h_in, h_out) seen only through products with it."""

    times: Callable[[torch.Tensor], torch.Tensor]
    times_t: Callable[[torch.Tensor], torch.Tensor]
    gram: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, int]
    norm: torch.Tensor  # ‖M‖_F


def _peel(operator: _Operator, max_rank: int, start: Callable[[int], torch.Tensor],
          theta: float, iterations: int, dtype: torch.dtype) -> Factors:
    """Eq. 8: power iterations on the deflated Gram operator, one component at a time."""
    h_in, h_out = operator.shape
    device = operator.norm.device
    us = torch.zeros(0, h_in, dtype=dtype, device=device)
    gs = torch.zeros(0, h_out, dtype=dtype, device=device)
    cross = torch.zeros(h_out, 0, dtype=dtype, device=device)  # K = Mᵀ·Uᵀ, a column each
    for j in range(max_rank):
        g = start(j).to(dtype=dtype)
        g = g / torch.linalg.vector_norm(g)
        for _ in range(iterations):
            w = _deflated_gram(g, operator, us, gs, cross)
            norm = torch.linalg.vector_norm(w)
            if norm == 0:  # g lies in the deflated operator's null space: nothing left there
                break
            g = w / norm
        u = operator.times(g) - us.T @ (gs @ g)  # least-squares fit of M − UᵀG along g
        size = torch.linalg.vector_norm(u)  # ‖g_{j+1} − g_j‖_F, as ‖g‖ = 1
        done = (us @ us.T * (gs @ gs.T)).sum()  # ‖g_j‖_F²
        reference = operator.norm if j == 0 else torch.sqrt(torch.clamp(done, min=0.0))
        if not size > theta * reference:
            break
        cross = torch.cat([cross, operator.times_t(u).unsqueeze(1)], dim=1)
        us = torch.cat([us, u.unsqueeze(0)])
        gs = torch.cat([gs, g.unsqueeze(0)])
    return Factors(us, gs)


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
