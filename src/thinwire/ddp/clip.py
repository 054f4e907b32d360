"""Local gradient clipping: each worker clips its own gradient before the scheme sees it.

Under a sparse error-feedback scheme ``.grad`` after ``backward`` holds the
step's sparse update, not the gradient, so ``clip_grad_norm_`` there clips
the wrong thing (measured: docs/notes/engine.md). Deep Gradient Compression
clips locally (Lin et al., ICLR 2018, §3.2, "Local gradient clipping"): each
worker scales its gradient before its momentum and error memory. DGC takes
``N^(-1/2)`` of the threshold on the workers' sum; DDP averages, so the same
share of a threshold on the mean is ``max_norm * sqrt(N)`` per worker. A
worker's norm is known only at the step's last bucket, so the buckets are
held until then (:class:`~thinwire.ddp.hold.StepHold`) and scaled by one
factor; below the threshold nothing is scaled (bit-identical to no clipping).
"""

from __future__ import annotations

import math

import torch

from thinwire.comm import world
from thinwire.comm.collectives import Group
from thinwire.ddp.hold import Stage


class LocalClip(Stage):
    """Clip a worker's whole gradient, the buffers of a step's buckets together.

    Args:
        max_norm: the threshold a user would give ``clip_grad_norm_`` for the mean gradient.
        world_size: workers averaged; each clips at ``max_norm * sqrt(world_size)``. None:
            the size of ``group``, read at the first step (a hook state may be built
            before the process group, as Lightning's strategy is).
        group: the process group averaged over (None: the default one).

    Attributes:
        clipped: steps whose gradient was scaled down on this worker (a diagnostic).
        steps: steps seen.

    Raises:
        ValueError: ``max_norm`` not a finite number > 0, or ``world_size`` < 1.
    """

    def __init__(self, max_norm: float, world_size: int | None = None,
                 group: Group = None) -> None:
        if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm={max_norm!r} must be a finite number > 0")
        if world_size is not None and world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be >= 1")
        self.max_norm = float(max_norm)
        self.world_size, self.group = world_size, group
        self.clipped = 0
        self.steps = 0

    @property
    def threshold(self) -> float:
        """Each worker's threshold, ``max_norm * sqrt(world_size)``."""
        n = self.world_size if self.world_size is not None else world(self.group)[1]
        return self.max_norm * math.sqrt(n)

    def prepare(self, buffers: list[torch.Tensor]) -> bool:
        """Scale ``buffers`` by ``min(1, threshold / (norm + 1e-6))`` (``clip_grad_norm_``'s
        factor) when that is below 1 and the norm is finite (a non-finite gradient is
        left to the scheme's ``nonfinite`` policy)."""
        dtype = torch.float32  # half precision summed in float32; float64 kept
        for buffer in buffers:
            dtype = torch.promote_types(dtype, buffer.dtype)
        norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(b, dtype=dtype) for b in buffers])))
        scale = self.threshold / (norm + 1e-6)
        self.steps += 1
        if math.isfinite(norm) and scale < 1.0:
            self.clipped += 1
            torch._foreach_mul_(buffers, scale)
        return True
