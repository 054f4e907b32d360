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
from collections import defaultdict, deque
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


# Positions in the totals' keys and sums.
_GROUPS = {"entity": 0, "layer": 1, "collective": 2}
_FIELDS = {"nbytes": 0, "sent": 1, "received": 2}


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
    """Records bytes per rank, step, entity and layer, in bounded memory. Thread-safe.

    Totals are kept per (entity, layer, collective), so a run of any length
    holds a fixed number of sums; :attr:`records` keeps only the latest
    ``window`` records, for inspection.

    Args:
        rank: this process's rank in the group being metered.
        world_size: that group's size (for the traffic model).
        window: how many of the latest records :attr:`records` keeps; None keeps
            every record (memory grows with the run: for short runs only).

    Raises:
        ValueError: ``window`` < 0.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, window: int | None = 1024) -> None:
        if window is not None and window < 0:
            raise ValueError(f"window={window!r} must be None or >= 0")
        self.rank = rank
        self.world_size = world_size
        self.step = 0
        self.records: deque[Record] = deque(maxlen=window)
        # (entity, layer, collective) -> [nbytes, sent, received] summed over the run
        self._totals: dict[tuple[str, str, str], list[float]] = {}
        self.calls = 0  # collectives recorded over the run (a buffer's segments: one)
        self._lock = threading.Lock()

    def record(self, entity: str, layer: str, collective: str, nbytes: int, *,
               world_size: int | None = None, root: int = 0, joined: bool = False) -> None:
        """Record ``nbytes`` handed to ``collective`` for ``layer``'s ``entity``.

        Args:
            joined: these bytes travel in the same call as the previous record's (one
                segment of a buffer): they count no new collective (a latency).
        """
        if entity not in ENTITIES:
            raise ValueError(f"entity={entity!r} must be one of {ENTITIES}")
        if collective not in TRAFFIC:
            raise ValueError(f"collective={collective!r} must be one of {sorted(TRAFFIC)}")
        n = self.world_size if world_size is None else world_size
        sent, received = TRAFFIC[collective](nbytes, n, self.rank, root)
        with self._lock:
            self.records.append(Record(self.step, entity, layer, collective, nbytes, sent,
                                       received))
            self.calls += 0 if joined else 1
            sums = self._totals.setdefault((entity, layer, collective), [0.0, 0.0, 0.0])
            sums[0] += nbytes
            sums[1] += sent
            sums[2] += received

    def collectives_per_step(self) -> float:
        """Mean collectives per closed step: each is one latency on the link."""
        return self.calls / self.step if self.step else 0.0

    def next_step(self) -> None:
        """Close the current training step."""
        with self._lock:
            self.step += 1

    def totals(self, field: str = "nbytes", by: str | None = None) -> dict[str, float]:
        """``field`` (nbytes, sent or received) summed over the run, in total or grouped
        ``by`` entity, layer or collective."""
        if field not in _FIELDS:
            raise ValueError(f"field={field!r} must be one of {sorted(_FIELDS)}")
        if by is not None and by not in _GROUPS:
            raise ValueError(f"by={by!r} must be None or one of {sorted(_GROUPS)}")
        summed: dict[str, float] = defaultdict(float)
        with self._lock:
            for key, sums in self._totals.items():
                summed["total" if by is None else key[_GROUPS[by]]] += sums[_FIELDS[field]]
        return dict(summed)

    def _per_step(self, field: str, by: str | None = None) -> dict[str, float]:
        steps = max(1, self.step)
        return {key: value / steps for key, value in self.totals(field, by).items()}

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
