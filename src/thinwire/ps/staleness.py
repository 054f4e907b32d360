"""What happened to each push: its delay tau, and the counts of pushes not applied."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Outcomes of a push, as reported to the worker and counted by the server.
APPLIED = "applied"  # applied to the weights (asynchronous rules)
PENDING = "pending"  # accepted into the open synchronous round (SSGD)
STALE = "stale"  # older than max_staleness: dropped
NONFINITE = "nonfinite"  # contained NaN or infinity: rejected
MALFORMED = "malformed"  # bytes that do not decode to a gradient of the model: rejected
CLOSED = "closed"  # the stream has left or was declared dead: ignored
OUTCOMES = (APPLIED, PENDING, STALE, NONFINITE, MALFORMED, CLOSED)


@dataclass
class StalenessRecord:
    """Histograms of tau = updates applied between a stream's pull and its push.

    Attributes:
        applied: tau -> pushes applied (or accepted into a synchronous round).
        dropped: tau -> pushes dropped for exceeding ``max_staleness``.
        outcomes: outcome -> count, over every push received.
    """

    applied: Counter[int] = field(default_factory=Counter)
    dropped: Counter[int] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)

    def count(self, outcome: str, tau: int | None = None) -> None:
        """Count one push with ``outcome`` and, where it has one, its delay ``tau``."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome={outcome!r} must be one of {OUTCOMES}")
        self.outcomes[outcome] += 1
        if tau is not None and outcome in (APPLIED, PENDING):
            self.applied[tau] += 1
        elif tau is not None and outcome == STALE:
            self.dropped[tau] += 1

    def mean(self) -> float:
        """Mean tau of the applied pushes (0 when there are none)."""
        total = sum(self.applied.values())
        return sum(t * n for t, n in self.applied.items()) / total if total else 0.0

    def summary(self) -> dict[str, Any]:
        return {"histogram": dict(sorted(self.applied.items())),
                "dropped_histogram": dict(sorted(self.dropped.items())),
                "mean": self.mean(),
                "max": max(self.applied, default=0),
                "outcomes": {k: self.outcomes.get(k, 0) for k in OUTCOMES}}

    def state_dict(self) -> dict[str, Any]:
        return {"applied": dict(self.applied), "dropped": dict(self.dropped),
                "outcomes": dict(self.outcomes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.applied = Counter(state["applied"])
        self.dropped = Counter(state["dropped"])
        self.outcomes = Counter(state["outcomes"])
