"""The parameter server's state machine, without any transport (DC-ASGD Algorithm 2).

:class:`ParameterServerCore` is what the RPC server wraps. Every pull and push
runs under one lock, so updates apply one at a time and a pull never sees half
of one; given the order of calls it is exact and deterministic, which is how the
tests drive it (a fake clock, injected delay schedules). A stream is one
pull/compute/push loop (a worker process, or one hogwild thread of it) with its
own backup ``w_bak``, set at each pull and initialised to the initial weights
(Algorithm 2, "Initialize"). Update rules return new tensors and never modify
their inputs, so a weight tensor handed out by a pull is a consistent snapshot
without a copy, and so are the backups.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.ps.rules import UpdateRule
from thinwire.ps.staleness import (
    APPLIED,
    CLOSED,
    MALFORMED,
    NONFINITE,
    PENDING,
    STALE,
    StalenessRecord,
)

# Stream membership: expected -> joined -> left | dead; expected -> refused | dead.
EXPECTED, JOINED, LEFT, DEAD, REFUSED = "expected", "joined", "left", "dead", "refused"
_LIVE = (EXPECTED, JOINED)


@dataclass(frozen=True)
class PushResult:
    """What the server did with one push."""

    outcome: str  # one of staleness.OUTCOMES
    tau: int | None  # updates applied between the stream's pull and this push
    version: int  # updates applied so far, after this push
    round: int | None = None  # synchronous mode: the round whose closing applies it


@dataclass(frozen=True)
class AuditEntry:
    """One push as the server handled it (kept when ``audit=True``)."""

    stream: int
    seq: int  # the stream's own push counter
    tau: int | None
    pulled_version: int  # version of the weights the stream had pulled (its w_bak)
    outcome: str


@dataclass(frozen=True)
class Snapshot:
    """The global model at one version, for learning curves."""

    version: int  # updates applied
    received: int  # pushes received (applied, pending, dropped or rejected)
    seconds: float  # clock time since the core was created
    weights: torch.Tensor


def describe_mismatch(server: Mapping[str, Any], worker: Mapping[str, Any]) -> str:
    """A sentence naming each configuration entry where ``worker`` differs from ``server``."""
    keys = sorted(set(server) | set(worker))
    parts = [f"{key}: worker has {worker.get(key, '(missing)')!r}, server has "
             f"{server.get(key, '(missing)')!r}"
             for key in keys if server.get(key) != worker.get(key)]
    return "; ".join(parts)


class ParameterServerCore:
    """Weights, one backup per stream, an update rule, and the bookkeeping of pushes.

    Args:
        weights: initial weights w_0 (a flat tensor; cloned).
        rule: the update applied for each push (asynchronous) or round (synchronous).
        streams: number of pull/push streams; ids are ``0 .. streams - 1``.
        max_staleness: pushes with tau above this are dropped and counted; None keeps all.
        synchronous: SSGD. A round closes when every live stream has pushed once;
            then the rule is applied once to the mean of the round's finite gradients.
        fingerprint: the configuration workers must match at :meth:`join`.
        audit: keep an :class:`AuditEntry` per push in :attr:`audit`.
        lease_s: :meth:`expire` declares a joined stream dead after this many
            seconds without a pull or push; None never expires.
        snapshot_every: keep a :class:`Snapshot` every this many updates.
        clock: seconds, for leases and snapshot times (inject a fake one in tests).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, weights: torch.Tensor, rule: UpdateRule, streams: int, *,
                 max_staleness: int | None = None, synchronous: bool = False,
                 fingerprint: Mapping[str, Any] | None = None, audit: bool = False,
                 lease_s: float | None = None, snapshot_every: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams={streams!r} must be an integer >= 1")
        if max_staleness is not None and (not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness={max_staleness!r} must be None or an integer >= 0")
        if lease_s is not None and not lease_s > 0:
            raise ValueError(f"lease_s={lease_s!r} must be None or > 0")
        if snapshot_every is not None and (not isinstance(snapshot_every, int)
                                           or snapshot_every < 1):
            raise ValueError(f"snapshot_every={snapshot_every!r} must be None or an integer >= 1")
        if weights.dim() != 1 or not weights.is_floating_point():
            raise ValueError(f"weights must be a flat floating-point tensor, got shape "
                             f"{tuple(weights.shape)} and dtype {weights.dtype}")
        self.rule = rule
        self.streams = streams
        self.max_staleness = max_staleness
        self.synchronous = synchronous
        self.fingerprint = dict(fingerprint) if fingerprint is not None else None
        self.lease_s = lease_s
        self.snapshot_every = snapshot_every
        self.clock = clock
        self.weights = weights.detach().clone()
        self.version = 0
        self.backups = [self.weights] * streams
        self.pulled_at = [0] * streams
        self.status = [EXPECTED] * streams
        self.last_seen = [clock()] * streams
        self.staleness = StalenessRecord()
        self.audit: list[AuditEntry] | None = [] if audit else None
        self.snapshots: list[Snapshot] = []
        self.rounds_closed = 0
        self._round_sum: torch.Tensor | None = None
        self._round_count = 0
        self._round_pushed: set[int] = set()
        self._start = clock()
        self.first_pull_s: float | None = None  # clock time of the first pull, since start
        self.last_update_s: float | None = None  # clock time of the latest update, since start
        self.apply_seconds = 0.0  # wall time spent inside the update rule
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        if snapshot_every is not None:
            self._snapshot()

    # Membership -------------------------------------------------------------

    def join(self, stream: int, fingerprint: Mapping[str, Any] | None = None) -> None:
        """Admit ``stream`` if its configuration matches the server's.

        Raises:
            ValueError: unknown stream, a stream that already joined or ended, or a
                configuration that differs from the server's (the stream is refused).
        """
        with self._lock:
            self._check_stream(stream)
            if self.status[stream] != EXPECTED:
                raise ValueError(f"stream {stream} cannot join: it is {self.status[stream]}")
            if self.fingerprint is not None and dict(fingerprint or {}) != self.fingerprint:
                self.status[stream] = REFUSED
                self._after_membership_change()
                difference = describe_mismatch(self.fingerprint, fingerprint or {})
                raise ValueError(f"stream {stream} was refused: it was started with a different "
                                 f"model or configuration than the server ({difference})")
            self.status[stream] = JOINED
            self.last_seen[stream] = self.clock()

    def leave(self, stream: int) -> None:
        """Mark ``stream`` as finished (idempotent for ended streams)."""
        self._end([stream], LEFT)

    def mark_dead(self, streams: Iterable[int]) -> None:
        """Declare ``streams`` dead: their later pushes are ignored; barriers stop waiting."""
        self._end(streams, DEAD)

    def expire(self) -> list[int]:
        """Declare dead every joined stream silent for longer than ``lease_s``.

        Returns:
            The streams declared dead by this call.
        """
        if self.lease_s is None:
            return []
        now = self.clock()
        with self._lock:
            silent = [s for s in range(self.streams)
                      if self.status[s] == JOINED and now - self.last_seen[s] > self.lease_s]
        self.mark_dead(silent)
        return silent

    def _end(self, streams: Iterable[int], status: str) -> None:
        with self._lock:
            for stream in streams:
                self._check_stream(stream)
                if self.status[stream] in _LIVE:
                    self.status[stream] = status
            self._after_membership_change()

    @property
    def finished(self) -> bool:
        """Whether every stream has left, died or been refused."""
        with self._lock:
            return not any(s in _LIVE for s in self.status)

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Block until :attr:`finished` or ``timeout`` seconds; returns :attr:`finished`."""
        with self._changed:
            return self._changed.wait_for(
                lambda: not any(s in _LIVE for s in self.status), timeout)

    # Pull and push ----------------------------------------------------------

    def pull(self, stream: int) -> tuple[int, torch.Tensor]:
        """Algorithm 2 lines 4-6: set ``w_bak(stream) = w_t`` and return ``(t, w_t)``.

        The returned tensor is never modified by the server (treat it as read-only).

        Raises:
            ValueError: unknown stream, or one that has not joined or has ended.
        """
        with self._lock:
            self._check_joined(stream)
            self.backups[stream] = self.weights
            self.pulled_at[stream] = self.version
            self.last_seen[stream] = self.clock()
            if self.first_pull_s is None:
                self.first_pull_s = self.last_seen[stream] - self._start
            return self.version, self.weights

    def push(self, stream: int, grad: torch.Tensor, seq: int = -1) -> PushResult:
        """Algorithm 2 lines 2-3: apply one stream's gradient (or add it to the round).

        Non-finite gradients are rejected and counted, never applied; gradients
        older than ``max_staleness`` are dropped and counted; pushes of streams
        that ended are ignored.

        Args:
            stream: the pushing stream.
            grad: its gradient, computed at the weights it last pulled.
            seq: the stream's push counter, kept in the audit log.

        Raises:
            ValueError: unknown stream or one that never joined.
        """
        well_formed = grad.shape == self.weights.shape and grad.dtype == self.weights.dtype
        finite = well_formed and bool(torch.isfinite(grad).all())
        with self._lock:
            self._check_stream(stream)
            if self.status[stream] == EXPECTED:
                raise ValueError(f"stream {stream} must join before pushing")
            if not well_formed:
                outcome = MALFORMED
            elif not finite:
                outcome = NONFINITE
            elif (self.max_staleness is not None
                  and self.version - self.pulled_at[stream] > self.max_staleness):
                outcome = STALE
            else:
                outcome = PENDING if self.synchronous else APPLIED
            return self._handle(stream, seq, outcome, grad)

    def reject(self, stream: int, outcome: str = MALFORMED, seq: int = -1) -> PushResult:
        """Count a push the transport could not decode, without applying anything.

        Raises:
            ValueError: unknown stream, one that never joined, or an outcome
                other than ``MALFORMED`` / ``NONFINITE``.
        """
        if outcome not in (MALFORMED, NONFINITE):
            raise ValueError(f"outcome={outcome!r} must be {MALFORMED!r} or {NONFINITE!r}")
        with self._lock:
            self._check_stream(stream)
            if self.status[stream] == EXPECTED:
                raise ValueError(f"stream {stream} must join before pushing")
            return self._handle(stream, seq, outcome, None)

    # Internals (called with the lock held) ---------------------------------

    def _handle(self, stream: int, seq: int, outcome: str,
                grad: torch.Tensor | None) -> PushResult:
        if self.status[stream] != JOINED:
            return self._count(stream, seq, CLOSED, None)
        self.last_seen[stream] = self.clock()
        tau = self.version - self.pulled_at[stream]
        round_ = None
        if self.synchronous and outcome != STALE:
            if stream in self._round_pushed:
                raise ValueError(f"stream {stream} pushed twice in synchronous round "
                                 f"{self.rounds_closed}")
            round_ = self.rounds_closed
            self._round_pushed.add(stream)  # a rejected push still answers the barrier
            if outcome == PENDING and grad is not None:
                self._round_sum = grad if self._round_sum is None else self._round_sum + grad
                self._round_count += 1
        result = self._count(stream, seq, outcome, tau, round_)
        if outcome == APPLIED and grad is not None:
            self._update(grad, self.backups[stream])
            result = PushResult(APPLIED, tau, self.version)
        self._maybe_close_round()
        return result

    def _update(self, grad: torch.Tensor, backup: torch.Tensor) -> None:
        begin = time.perf_counter()
        new = self.rule.apply(self.weights, grad, backup)
        self.apply_seconds += time.perf_counter() - begin
        if new.data_ptr() == self.weights.data_ptr():
            raise RuntimeError(f"update rule {self.rule.name!r} modified the weights in place; "
                               "rules must return new tensors")
        self.weights = new
        self.version += 1
        self.last_update_s = self.clock() - self._start
        if self.snapshot_every is not None and self.version % self.snapshot_every == 0:
            self._snapshot()

    def updates_per_second(self) -> float:
        """Updates applied per clock second between the first pull and the latest update."""
        with self._lock:
            if self.first_pull_s is None or self.last_update_s is None:
                return 0.0
            span = self.last_update_s - self.first_pull_s
            return self.version / span if span > 0 else 0.0

    def _snapshot(self) -> None:
        received = sum(n for k, n in self.staleness.outcomes.items() if k != CLOSED)
        self.snapshots.append(Snapshot(self.version, received, self.clock() - self._start,
                                       self.weights))

    def _maybe_close_round(self) -> None:
        if not self.synchronous or not self._round_pushed:
            return
        live = {s for s in range(self.streams) if self.status[s] in _LIVE}
        if not live <= self._round_pushed:
            return
        if self._round_sum is not None:
            # Every stream pulled at the round's start, so w_bak = w_t: plain SGD on the mean.
            self._update(self._round_sum / self._round_count, self.weights)
        self._round_sum, self._round_count, self._round_pushed = None, 0, set()
        self.rounds_closed += 1
        self._changed.notify_all()

    def _after_membership_change(self) -> None:
        self._maybe_close_round()
        self._changed.notify_all()

    def _count(self, stream: int, seq: int, outcome: str, tau: int | None,
               round_: int | None = None) -> PushResult:
        self.staleness.count(outcome, tau)
        if self.audit is not None:
            self.audit.append(AuditEntry(stream, seq, tau, self.pulled_at[stream], outcome))
        return PushResult(outcome, tau, self.version, round_)

    def _check_stream(self, stream: int) -> None:
        if not isinstance(stream, int) or not 0 <= stream < self.streams:
            raise ValueError(f"stream={stream!r} must be an integer in [0, {self.streams})")

    def _check_joined(self, stream: int) -> None:
        self._check_stream(stream)
        if self.status[stream] != JOINED:
            raise ValueError(f"stream {stream} cannot pull: it is {self.status[stream]}")

    # Checkpoint -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: weights, every w_bak, rule state, counters.

        Taken under the lock, so it is one consistent version. Membership is
        not saved: a restarted server expects its streams to join again.
        """
        with self._lock:
            return {
                "weights": self.weights,
                "version": self.version,
                "backups": list(self.backups),
                "pulled_at": list(self.pulled_at),
                "rule": self.rule.state_dict(),
                "rule_name": self.rule.name,
                "staleness": self.staleness.state_dict(),
                "rounds_closed": self.rounds_closed,
                "round_sum": self._round_sum,
                "round_count": self._round_count,
                "round_pushed": sorted(self._round_pushed),
                "audit": None if self.audit is None else [
                    (e.stream, e.seq, e.tau, e.pulled_version, e.outcome) for e in self.audit],
                "snapshots": [(s.version, s.received, s.seconds, s.weights)
                              for s in self.snapshots],
                "first_pull": self.first_pull_s,
                "last_update": self.last_update_s,
                "elapsed": self.clock() - self._start,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` (streams start again as expected).

        Raises:
            ValueError: the state is for another rule, model size or stream count.
        """
        if state["rule_name"] != self.rule.name:
            raise ValueError(f"checkpoint was written by rule {state['rule_name']!r}, "
                             f"this server runs {self.rule.name!r}")
        if state["weights"].shape != self.weights.shape or len(state["backups"]) != self.streams:
            raise ValueError(f"checkpoint holds {state['weights'].numel()} weights and "
                             f"{len(state['backups'])} streams; this server has "
                             f"{self.weights.numel()} and {self.streams}")
        with self._lock:
            self.weights = state["weights"].clone()
            self.version = int(state["version"])
            # Keep shared versions shared: backups equal to the weights stay one tensor.
            clones: dict[int, torch.Tensor] = {id(state["weights"]): self.weights}
            self.backups = [clones.setdefault(id(b), b.clone()) for b in state["backups"]]
            self.pulled_at = [int(v) for v in state["pulled_at"]]
            self.rule.load_state_dict(state["rule"])
            self.staleness.load_state_dict(state["staleness"])
            self.rounds_closed = int(state["rounds_closed"])
            self._round_sum = None if state["round_sum"] is None else state["round_sum"].clone()
            self._round_count = int(state["round_count"])
            self._round_pushed = set(state["round_pushed"])
            self.audit = (None if state["audit"] is None
                          else [AuditEntry(*entry) for entry in state["audit"]])
            self.snapshots = [Snapshot(*entry) for entry in state["snapshots"]]
            self.first_pull_s = state["first_pull"]
            self.last_update_s = state["last_update"]
            self.status = [EXPECTED] * self.streams
            self.last_seen = [self.clock()] * self.streams
            self._start = self.clock() - float(state["elapsed"])
