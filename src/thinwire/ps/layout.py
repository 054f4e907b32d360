"""A model's parameters as one flat vector: names, shapes, and views into it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from thinwire.compress import TensorInfo


@dataclass(frozen=True)
class Layout:
    """Where each named parameter lives in the flat weight vector the server holds.

    Pulls carry the flat vector; pushes are encoded tensor by tensor in this
    order, so per-tensor compressor state is keyed by parameter name.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype = torch.float32

    @staticmethod
    def of(tensors: Mapping[str, torch.Tensor]) -> Layout:
        """The layout of ``tensors`` in their iteration order (all of one dtype).

        Raises:
            ValueError: no tensors, or tensors of different dtypes.
        """
        dtypes = {t.dtype for t in tensors.values()}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
        return Layout(tuple(tensors), tuple(tuple(t.shape) for t in tensors.values()),
                      dtypes.pop())

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def infos(self) -> list[TensorInfo]:
        """A :class:`TensorInfo` per parameter, for compressors."""
        return [TensorInfo(name, shape, self.dtype, "W_grad")
                for name, shape in zip(self.names, self.shapes, strict=True)]

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped like each parameter (no copy; autograd flows through)."""
        if flat.shape != (self.numel,):
            raise ValueError(f"expected a flat tensor of {self.numel} entries, got shape "
                             f"{tuple(flat.shape)}")
        parts = torch.split(flat, list(self.numels))
        return {name: part.view(shape)
                for name, part, shape in zip(self.names, parts, self.shapes, strict=True)}

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One flat tensor of ``tensors`` in layout order."""
        return torch.cat([tensors[name].detach().reshape(-1).to(self.dtype) for name in self.names])

    def describe(self) -> list[str]:
        """Human-readable entries (``"conv1.weight (16, 1, 3, 3)"``) for fingerprints."""
        return [f"{name} {shape}" for name, shape in zip(self.names, self.shapes, strict=True)] + [
            f"dtype {self.dtype}"]
