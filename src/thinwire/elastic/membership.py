"""One worker's part in torchft's quorums: meeting, the peer check, guarded exchanges, the vote."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torchft.manager import Manager

from thinwire.comm import Meter, done
from thinwire.comm.collectives import Future, all_gather_single
from thinwire.comm.fingerprint import PeerMismatchError, check_peers
from thinwire.elastic.job import JobRecord, StaleWorker, weights_hash
from thinwire.elastic.manager import QuorumLost, quorum
from thinwire.launch import end_process_group


class Membership:
    """Meets each quorum, compares peers in each new group, reports failures to torchft
    instead of raising them, and keeps the count of commits, failures and heals.

    Args:
        manager: the worker's torchft Manager.
        fields: what every worker must share (:func:`thinwire.comm.fingerprint.check_peers`).
        where: names the front door in a peer-check message.
        device: where the small tensors of the roll call live (the worker's device).
        meter: records the roll call's bytes (entity ``size``).
        job: the job's record of its latest commit: checked at each quorum, written at
            each commit (:mod:`thinwire.elastic.job`); None: no check.
    """

    def __init__(self, manager: Manager, fields: Mapping[str, Any], where: str,
                 device: torch.device | None, meter: Meter | None = None,
                 job: JobRecord | None = None) -> None:
        self.manager = manager
        self.job = job
        self.meter = meter
        self.fields = fields
        self.where = where
        self.device = device or torch.device("cpu")
        self.rank = 0  # in the last quorum's group
        # quorum_s: waiting for quorums; heal_s: for those in which this worker was healed
        self.record: dict[str, float] = {"commits": 0, "failures": 0, "heals": 0,
                                         "quorum_s": 0.0, "heal_s": 0.0}
        self._checked: weakref.ref[dist.ProcessGroup] | None = None  # the group last compared
        # the group in which a collective of this step failed: left at the vote
        self._broken: weakref.ref[dist.ProcessGroup] | None = None

    @property
    def heals(self) -> int:
        return int(self.record["heals"])

    def healed(self) -> None:
        """Count one heal (torchft loaded a peer's state here, during :meth:`meet`)."""
        self.record["heals"] += 1

    def meet(self, row: Callable[[], list[int]] | None = None) -> torch.Tensor | None:
        """The quorum (a worker behind is healed in it), the peer check where its group is
        new, then a roll call: every worker's ``row()`` (called after the quorum), gathered.

        Returns:
            The rows in the group's rank order (CPU, int64), an empty tensor without
            ``row``; None if the quorum or the roll call failed (reported: no commit).

        Raises:
            QuorumLost: no quorum in time.
            PeerMismatchError: the quorum's workers were set up differently.
            StaleWorker: this worker is behind the job's recorded commit, and the job is
                over or the quorum (healed to its most advanced worker) is behind it too:
                the step is reported failed first, so no worker of the quorum commits it.
        """
        job = self.job
        if job is not None:
            job.check(self.manager.current_step(), in_quorum=False)
        start, heals = time.perf_counter(), self.heals
        try:
            formed = quorum(self.manager)
        except QuorumLost:
            if job is not None:  # the job may have ended while this worker waited
                job.check(self.manager.current_step(), in_quorum=False)
            raise
        waited = time.perf_counter() - start
        self.record["heal_s" if self.heals > heals else "quorum_s"] += waited
        if not formed:
            self.fail("no process group formed for this quorum")
            return None
        rows = self._roll_call(row)
        if job is not None and rows is not None:
            # after the peer check and the roll call, which a worker healed in this quorum
            # reaches once its state has arrived: a stale source never leaves it half-healed
            try:
                job.check(self.manager.current_step(), in_quorum=True)
            except StaleWorker as error:
                self.fail(error)
                raise
        return rows

    def _roll_call(self, row: Callable[[], list[int]] | None) -> torch.Tensor | None:
        """The peer check where the quorum's group is new, then every worker's ``row()``,
        gathered (:meth:`meet`'s returns)."""
        try:
            group = dist.group.WORLD
            if self._checked is None or self._checked() is not group:
                check_peers(self.fields, self.where, None, self.device)
                assert group is not None
                self._checked = weakref.ref(group)
            self.rank = dist.get_rank()
            if row is None:
                return torch.empty(0, dtype=torch.int64)
            mine = torch.tensor(row(), dtype=torch.int64, device=self.device)
            rows = torch.empty(dist.get_world_size() * mine.numel(), dtype=torch.int64,
                               device=self.device)
            all_gather_single(rows, mine)
            if self.meter is not None:
                self.meter.record("size", "(roll call)", "all_gather",
                                  mine.numel() * mine.element_size(),
                                  world_size=dist.get_world_size())
            return rows.view(-1, mine.numel()).cpu()
        except PeerMismatchError:
            raise
        except Exception as error:  # a peer lost while meeting: this step does not commit
            self.broke(error, dist.group.WORLD)
            return None

    def guard(self, launch: Callable[[], Future[Any]], fallback: Any,
              finish: Callable[[Any], Any] = lambda value: value) -> Future[Any]:
        """``launch()``'s future with ``finish`` applied to its value; where the launch or the
        exchange fails, or an earlier one of this step did, ``fallback`` instead, the error
        reported to torchft (the step will not commit) rather than raised."""
        if self.manager.errored() is not None:
            return done(fallback)
        group = dist.group.WORLD
        try:
            future = launch()
        except Exception as error:
            self.broke(error, group)
            return done(fallback)

        def settle(arrived: Future[Any]) -> Any:
            try:
                return finish(arrived.value())
            except Exception as error:  # noqa: BLE001  (reported: the step does not commit)
                self.broke(error, group)
                return fallback

        return future.then(settle)

    def committed(self, step: int, weights: list[torch.Tensor]) -> None:
        """Record a commit in the job's record (where there is one): ``step`` is the
        training step it ends, ``weights`` the global weights after it.

        Raises:
            StaleWorker: the record holds this commit with other weights.
        """
        if self.job is not None:
            self.job.write(self.manager.current_step(), step, weights_hash(weights))

    def fail(self, error: Exception | str) -> None:
        """Report ``error`` to torchft: this step or sync does not commit on this worker."""
        self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(error))

    def broke(self, error: Exception, group: dist.ProcessGroup | None) -> None:
        """A collective in ``group`` failed (a peer lost): :meth:`fail`, and leave ``group``
        at the vote."""
        if group is not None:
            self._broken = weakref.ref(group)
        self.fail(error)

    def commit(self) -> bool:
        """torchft's commit vote (False on any reported error or too few workers).

        After a failed collective this worker first leaves the quorum's group, so that a
        peer still waiting on its part (a ring's next hop) can fail without waiting out
        the group's timeout (where nothing else holds the group alive). The Lighthouse
        forms a new quorum after a failed commit, and with it a new group (one formed
        since the failure is kept)."""
        broken, self._broken = self._broken, None
        if broken is not None and dist.is_initialized() and broken() is dist.group.WORLD:
            end_process_group()
        committed = bool(self.manager.should_commit())
        self.record["commits" if committed else "failures"] += 1
        return committed
