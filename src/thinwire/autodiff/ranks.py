"""Effective-rank records: the rank structured power iterations found, per layer per step.

This is rank-dAD's introspection (§4.2.2, Fig. 4–5): how many components
each site's gradient needed before the next one changed it by less than θ.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any


class EffectiveRanks:
    """(step, layer, rank) of this site, appended as training goes."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str, int]] = []

    def record(self, step: int, layer: str, rank: int) -> None:
        self.records.append((step, layer, rank))

    def by_layer(self) -> dict[str, list[tuple[int, int]]]:
        """layer -> [(step, rank), ...] in step order."""
        out: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for step, layer, rank in self.records:
            out[layer].append((step, rank))
        return dict(out)

    def mean_per(self, steps: int) -> dict[str, list[float]]:
        """layer -> mean effective rank over consecutive windows of ``steps`` steps
        (an epoch, as in Fig. 4–5); a partly filled last window is averaged as it is.

        Raises:
            ValueError: ``steps`` < 1.
        """
        if steps < 1:
            raise ValueError(f"steps={steps!r} must be >= 1")
        out: dict[str, list[float]] = {}
        for layer, series in self.by_layer().items():
            windows: dict[int, list[int]] = defaultdict(list)
            for step, rank in series:
                windows[step // steps].append(rank)
            out[layer] = [sum(v) / len(v) for _, v in sorted(windows.items())]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"records": list(self.records)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = [(int(step), str(layer), int(rank))
                        for step, layer, rank in state["records"]]
