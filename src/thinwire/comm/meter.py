"""The byte Meter: what each rank hands to torch.distributed, and what the wire carries.

Two numbers per record:

* ``nbytes``: the bytes of the tensors this rank handed to the collective
  (values, indices or bitmap, headers, sizes, padding): measured, not modelled.
* ``sent`` / ``received``: the per-rank traffic of that collective under the
  ring algorithm -- all-reduce moves 2(n-1)/n of the payload each way,
  all-gather (n-1) times each rank's (padded) contribution, a pipelined
  broadcast the payload once into and out of every rank but the chain's ends.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

ENTITIES = ("W_grad", "X_act", "X_grad", "activation", "delta", "factor", "index", "size",
            "pull", "push")


def _all_reduce(nbytes: int, n: int, rank: int, root: int) -> tuple[float, float]:
    moved = 2.0 * (n - 1) / n * nbytes
    return moved, moved


def _all_gather(nbytes: int, n: int, rank: int, root: int) -> tuple[float, float]:
    moved = float((n - 1) * nbytes)
    return moved, moved


def _broadcast(nbytes: int, n: int, rank: int, root: int) -> tuple[float, float]:
    position = (rank - root) % n
    return float(nbytes if position < n - 1 else 0), float(nbytes if position > 0 else 0)


def _send(nbytes: int, n: int, rank: int, root: int) -> tuple[float, float]:
    return float(nbytes), 0.0


def _recv(nbytes: int, n: int, rank: int, root: int) -> tuple[float, float]:
    return 0.0, float(nbytes)


TRAFFIC: dict[str, Callable[[int, int, int, int], tuple[float, float]]] = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "broadcast": _broadcast,
    "send": _send,
    "recv": _recv,
}


@dataclass(frozen=True)
class Record:
    step: int
    entity: str
    layer: str
    collective: str
    nbytes: int  # handed to torch.distributed by this rank
    sent: float  # ring-model traffic out of this rank
    received: float  # ring-model traffic into this rank


class Meter:
    """Records bytes per rank, step, entity and layer. Thread-safe.

    Args:
        rank: this process's rank in the group being metered.
        world_size: that group's size (for the traffic model).
    """

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self.records: list[Record] = []
        self._lock = threading.Lock()

    def record(self, entity: str, layer: str, collective: str, nbytes: int, *,
               world_size: int | None = None, root: int = 0) -> None:
        """Record ``nbytes`` handed to ``collective`` for ``layer``'s ``entity``."""
        if entity not in ENTITIES:
            raise ValueError(f"entity={entity!r} must be one of {ENTITIES}")
        if collective not in TRAFFIC:
            raise ValueError(f"collective={collective!r} must be one of {sorted(TRAFFIC)}")
        n = self.world_size if world_size is None else world_size
        sent, received = TRAFFIC[collective](nbytes, n, self.rank, root)
        with self._lock:
            self.records.append(Record(self.step, entity, layer, collective, nbytes, sent,
                                       received))

    def next_step(self) -> None:
        """Close the current training step."""
        with self._lock:
            self.step += 1

    def _per_step(self, field: str, by: str | None = None) -> dict[str, float]:
        steps = max(1, self.step)
        totals: dict[str, float] = defaultdict(float)
        for record in self.records:
            totals["total" if by is None else getattr(record, by)] += getattr(record, field)
        return {key: value / steps for key, value in totals.items()}

    def bytes_per_step(self, by: str | None = None) -> dict[str, float]:
        """Mean bytes handed per closed step, in total or grouped ``by`` a Record field."""
        return self._per_step("nbytes", by)

    def traffic_per_step(self) -> tuple[float, float]:
        """Mean (sent, received) ring-model bytes per closed step."""
        return (self._per_step("sent").get("total", 0.0),
                self._per_step("received").get("total", 0.0))

    def summary(self) -> dict[str, object]:
        sent, received = self.traffic_per_step()
        return {
            "steps": self.step,
            "bytes_sent_per_step": self.bytes_per_step().get("total", 0.0),
            "wire_sent_per_step": sent,
            "bytes_received_per_step": received,
            "bytes_per_entity": self.bytes_per_step("entity"),
            "bytes_per_layer": self.bytes_per_step("layer"),
        }
