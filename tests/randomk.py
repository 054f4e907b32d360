"""A new selection in one small class, registered as a scheme for the tests that use it.

Random-k (Stich et al., 2018): each call keeps ``k`` entries drawn at random,
in the order drawn (not ascending), seeded by the call, so every rank draws
alike. It exists to show that a selection plugs into the exchange kernel by
its ``_select`` alone and reaches every front door through the registry.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from thinwire import schemes
from thinwire.compress import Cast, Sparsifier, TensorInfo, keep_count
from thinwire.feedback import Residual
from thinwire.schemes import CompressedScheme, registry

NAME = "test-random-k"


class RandomK(Sparsifier):
    """``k = ceil(ratio N)`` entries of each tensor, drawn at random and left unordered."""

    def __init__(self, ratio: float) -> None:
        super().__init__(capacity=1.0)
        self.ratio = ratio

    @property
    def density(self) -> float:
        return self.ratio

    def _select(self, magnitudes: torch.Tensor, info: TensorInfo,
                call: int) -> tuple[torch.Tensor, float]:
        numel = magnitudes.numel()
        generator = torch.Generator().manual_seed(zlib.crc32(f"{info.key}/{call}".encode()))
        drawn = torch.randperm(numel, generator=generator)[:keep_count(numel, self.ratio)]
        return drawn.to(magnitudes.device), 0.0


@dataclass(frozen=True)
class RandomKConfig:
    ratio: float = 0.1  # fraction of each tensor's entries sent
    indices: str = "delta16"  # index list on the wire
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient
    warmup_steps: int = 0  # launches of each tensor sent dense first, >= 0

    def __post_init__(self) -> None:
        registry.validate_warmup(self.warmup_steps)


def build(config: RandomKConfig) -> schemes.Scheme:
    return CompressedScheme(Cast("native"), RandomK(config.ratio), Residual(),
                            config.nonfinite, indices=config.indices)


def register() -> None:
    """Register :data:`NAME` in this process (once)."""
    if NAME not in schemes.names():
        schemes.register(NAME, RandomKConfig)(build)


@contextmanager
def registered() -> Iterator[None]:
    """:data:`NAME` registered for the body only (the suite's other tests list schemes)."""
    known = NAME in schemes.names()
    register()
    try:
        yield
    finally:
        if not known:
            del registry._REGISTRY[NAME]
