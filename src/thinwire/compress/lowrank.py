"""Low-rank maths shared by PowerSGD and rank-dAD: matrices, orthonormal bases, seeds."""

from __future__ import annotations

import zlib

import torch


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """View ``tensor`` as (shape[0], rest): conv kernels become (out, in*kh*kw)."""
    return tensor.reshape(tensor.shape[0], -1)


def compressible(shape: tuple[int, ...], rank: int) -> bool:
    """Whether rank-``rank`` factors of a tensor of ``shape`` save at least half its bytes.

    1-D tensors and those with ``(n + m) * r >= n * m / 2`` are sent dense.
    """
    if len(shape) < 2:
        return False
    n = shape[0]
    m = 1
    for size in shape[1:]:
        m *= size
    return (n + m) * rank < n * m / 2


def orthonormalize(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``matrix``'s (reduced QR, Householder).

    Householder QR never divides by a column norm, so zero or repeated
    columns give a valid orthonormal basis instead of the NaNs of
    Gram-Schmidt with eps = 0.
    """
    q: torch.Tensor = torch.linalg.qr(matrix, mode="reduced")[0]
    return q


def seeded_normal(key: str, shape: tuple[int, ...], seed: int = 0,
                  dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """A standard normal tensor that depends only on (``key``, ``seed``), identical on
    every rank and in every process (``hash()`` is salted per process; crc32 is not).

    Drawn by the CPU's generator and copied to ``device`` (default CPU), as torch's
    ``powerSGD_hook`` draws: CPU and CUDA generators give different numbers, and
    ranks on different kinds of device, or a run replayed on another, must agree.
    The tensors are small (a dimension times a rank). On ``meta`` only the shape exists.
    """
    device = torch.device(device or "cpu")
    if device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    generator = torch.Generator()
    generator.manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(shape, generator=generator, dtype=dtype, device="cpu").to(device)
