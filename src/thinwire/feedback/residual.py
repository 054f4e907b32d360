"""Plain error feedback (DCT Alg. 1 lines 3 and 11): e <- g + e - g_hat."""

from __future__ import annotations

from typing import Any

import torch

from thinwire.feedback.base import Memory


class Residual(Memory):
    """Keeps what compression left out and adds it back next round.

    Args:
        drain_every: if set, each update empties the key's buffer with
            probability ``1 / drain_every`` -- the stochastic drain of DCT §3.3
            Remark 2, which stops a buffer shared by hogwild threads from
            growing stale ("every 1 million iterations" in the paper, read here
            as an expected period so threads need no shared counter).
        seed: seeds the drain's generator (identical runs drain identically).
    """

    def __init__(self, drain_every: int | None = None, seed: int = 0) -> None:
        super().__init__()
        if drain_every is not None and drain_every < 1:
            raise ValueError(f"drain_every={drain_every!r} must be None or an integer >= 1")
        self.drain_every = drain_every
        self.drains = 0
        self._generator = torch.Generator().manual_seed(seed)

    def update(self, key: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        residual = compensated - sent
        if self.drain_every is not None:
            draw = torch.rand((), generator=self._generator)
            if float(draw) < 1.0 / self.drain_every:
                residual.zero_()
                self.drains += 1
        self.buffers[key] = residual

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "drains": self.drains,
                "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.drains = state["drains"]
        self._generator.set_state(state["generator"])
