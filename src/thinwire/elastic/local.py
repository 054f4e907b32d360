"""Local updates (DiLoCo, Streaming DiLoCo) whose workers fail and join, on torchft's Manager."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torchft.manager import Manager

from thinwire.comm import done
from thinwire.comm.collectives import Future
from thinwire.elastic.job import JobRecord
from thinwire.elastic.membership import Membership
from thinwire.elastic.state import Rollback, load_shared, shared_state
from thinwire.local import LocalUpdates

JOINING = -1  # the fragment a worker names in the roll call when it is not launching one


class ElasticLocalUpdates:
    """:class:`~thinwire.local.LocalUpdates` under torchft: a quorum at each sync, a commit
    vote before each outer step.

    Call :meth:`step` where ``LocalUpdates.step`` was called::

        manager = thinwire.elastic.connect("http://lighthouse:29510", min_workers=2)
        updates = ElasticLocalUpdates(LocalUpdates(model, inner, build("int4"), every=50),
                                      manager)
        while updates.steps < total:
            loss(model(batch)).backward(); inner.step(); inner.zero_grad()
            updates.step()

    Each fragment's launch starts with a quorum of the live workers. A worker
    behind the others (one just started or relaunched, or one whose last sync
    did not commit) is healed in it from a live peer through torchft's
    checkpoint transport: global weights, outer optimiser state, step count
    and the scheme's shared state; its replica restarts from the global
    weights and it contributes nothing to that sync, so the mean divides by
    the workers that did. The first :meth:`step` joins (:meth:`join`). At
    landing, torchft's commit vote decides: a sync that failed anywhere (a
    worker lost mid-exchange) or lacks ``min_workers`` applies nothing, the
    scheme's state is rolled back (:class:`~thinwire.elastic.state.Rollback`)
    and each replica keeps training from its own weights, so the fragment's
    next sync carries the lost one's progress.

    Args:
        updates: built with ``group=None`` before the first quorum; plain (not
            DTensor) parameters.
        manager: from :func:`~thinwire.elastic.connect`.
        job: the job's record of its latest commit (:class:`~thinwire.elastic.JobRecord`,
            steps counted in inner steps), written after each committed sync; a worker
            behind it with no live peer to heal it stops with
            :class:`~thinwire.elastic.StaleWorker` rather than train committed steps
            again. None: no record, no such check.

    Attributes:
        record: counts of ``commits``, ``failures`` (syncs that did not commit),
            ``heals``, and seconds spent in ``quorum_s`` and ``heal_s``.

    Raises:
        ValueError: ``updates`` has a group of its own, DTensor parameters, or
            ``overlap``, ``eager`` or ``lookahead`` (an exchange landing a sync late would
            span two quorums).
    """

    def __init__(self, updates: LocalUpdates, manager: Manager, *,
                 job: JobRecord | None = None) -> None:
        if updates.group is not None:
            raise ValueError("build the LocalUpdates with group=None: each quorum forms "
                             "torch.distributed's default group of the live workers")
        sharded = [name for name, p in updates.params.items()
                   if getattr(p, "device_mesh", None) is not None]
        if sharded:
            raise ValueError(f"parameters {sharded[:3]} are DTensors: fault-tolerant local "
                             "updates take a model that is not sharded")
        for name in ("overlap", "eager", "lookahead"):
            if getattr(updates.config, name):
                raise ValueError(f"{name}=True lands each exchange a sync late, across the next "
                                 f"sync's quorum; fault-tolerant local updates take {name}=False")
        self.updates = updates
        self.membership = Membership(manager, updates.fields, "fault-tolerant local updates",
                                     updates.device, updates.scheme.meter, job)
        self.launching: int | None = None  # the fragment whose quorum is under way
        self.joined = False
        self._peer_launch: tuple[int, int] | None = None  # (fragment, steps) found when healed
        self._rollback: Rollback | None = None
        updates.exchange = self
        manager.register_state_dict_fn("thinwire local updates", self._heal, self._shared)

    @property
    def manager(self) -> Manager:
        return self.membership.manager

    @property
    def record(self) -> dict[str, float]:
        return self.membership.record

    @property
    def steps(self) -> int:
        """Inner steps taken (a healed worker's are its peer's)."""
        return self.updates.steps

    def step(self) -> list[int]:
        """:meth:`join` if not yet joined, then ``LocalUpdates.step``: the fragments that
        landed (committed or not).

        Raises:
            StaleWorker: behind the job's record with no one to heal it (see ``job``).
        """
        commits = self.record["commits"]
        self.join()  # may land the others' sync, at their step count
        self._recorded(commits)
        commits = self.record["commits"]
        landed = self.updates.step()
        self._recorded(commits)
        return landed

    def _recorded(self, commits: float) -> None:
        """The job's record of this worker's latest commit, if any since ``commits``."""
        if self.record["commits"] > commits:
            self.membership.committed(self.updates.steps,
                                      list(self.updates.global_state().values()))

    def join(self) -> None:
        """The first quorum. Where the others train already it waits for their next
        sync; behind them, this worker is healed and takes part in that sync with a
        zero pseudo-gradient, its step count theirs."""
        if self.joined:
            return
        self.joined = True
        rows = self.membership.meet(lambda: self._roll(JOINING, contributing=False))
        if rows is None:
            return
        launched = {(int(fragment), int(steps)) for fragment, steps, _ in rows.tolist()
                    if fragment != JOINING}
        if not launched:  # every worker joins (a start): commit it, or torchft heals them again
            self.manager.should_commit()
            return
        if len(launched) > 1:
            self.membership.fail(f"workers launch different syncs: {sorted(launched)}")
            return
        (fragment, steps), = launched
        healed, self._peer_launch = (fragment, steps) == self._peer_launch, None
        updates = self.updates
        updates.steps = steps
        zeros = {name: torch.zeros_like(updates.globals[name])
                 for name in updates.fragments[fragment]}
        updates.pending[fragment] = (steps + updates.config.delay,
                                     self._exchange(zeros, rows))
        if not healed:  # without the others' state it takes part, but must not commit
            self.membership.fail("joined a sync without the others' state")
        if updates.config.delay == 0:  # the others land it at the step that launched it
            updates.finish()

    # The exchange LocalUpdates delegates to (thinwire.local.diloco.Exchange)

    def launch(self, updates: LocalUpdates, fragment: int,
               deltas: dict[str, torch.Tensor]) -> Future[Any]:
        """The sync's quorum, the roll call of who contributes, then the scheme's exchange;
        the future holds the mean over the contributors, or None where it failed."""
        self._rollback = None
        self.launching = fragment
        heals = self.membership.heals
        try:  # a worker healed in this quorum restarted from the global weights: sends nothing
            rows = self.membership.meet(
                lambda: self._roll(fragment, contributing=self.membership.heals == heals))
        finally:
            self.launching = None
        if rows is None:
            return done(None)
        if self.membership.heals > heals:
            deltas = {name: torch.zeros_like(delta) for name, delta in deltas.items()}
        launched = {(int(f), int(s)) for f, s, _ in rows.tolist() if f != JOINING}
        if launched != {(fragment, updates.steps)}:
            self.membership.fail(f"workers launch different syncs: {sorted(launched)}")
            return done(None)
        return self._exchange(deltas, rows)

    def land(self, updates: LocalUpdates, fragment: int,
             future: Future[Any]) -> Mapping[str, torch.Tensor] | None:
        """The mean if every worker's exchange went through and torchft commits; else None,
        with the scheme's state rolled back."""
        result = future.wait()
        if self.membership.commit() and result is not None:
            return result  # type: ignore[no-any-return]
        if self._rollback is not None:
            updates.scheme = self._rollback.restore(updates.scheme)
        return None

    def _exchange(self, deltas: dict[str, torch.Tensor], rows: torch.Tensor) -> Future[Any]:
        """Average ``deltas`` with the scheme; the mean over the contributors of ``rows``."""
        updates = self.updates
        workers, contributors = rows.shape[0], int(rows[:, 2].sum())
        if contributors == 0:
            self.membership.fail("no worker of the quorum contributes to this sync")
            return done(None)
        self._rollback = Rollback(updates.scheme)

        def over_contributors(mean: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if contributors == workers:  # the scheme's own mean, to the bit
                return mean
            return {name: value * (workers / contributors) for name, value in mean.items()}

        return self.membership.guard(lambda: updates.scheme.launch(deltas, None), None,
                                     over_contributors)

    def _roll(self, fragment: int, contributing: bool) -> list[int]:
        """This worker's row of the roll call: the sync it launches, its step count, and
        whether it contributes a pseudo-gradient."""
        return [fragment, self.updates.steps, int(contributing)]

    # torchft's state transfer to a worker that heals

    def _shared(self) -> dict[str, Any]:
        updates = self.updates
        return {"globals": {name: value.clone() for name, value in updates.globals.items()},
                "outer": copy.deepcopy(updates.outer.state_dict()), "steps": updates.steps,
                "scheme": shared_state(updates.scheme), "launching": self.launching}

    def _heal(self, state: dict[str, Any]) -> None:
        updates = self.updates
        with torch.no_grad():
            for name, value in state["globals"].items():
                updates.globals[name].copy_(value)
                updates.params[name].copy_(value)  # the replica restarts from the global weights
        updates.outer.load_state_dict(state["outer"])
        updates.steps = state["steps"]
        updates.pending = {}  # exchanges of syncs the others have finished
        load_shared(updates.scheme, state["scheme"])
        launching = state["launching"]
        self._peer_launch = None if launching is None else (launching, state["steps"])
        self.membership.healed()

    # checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The local updates' and the Manager's state (torchft needs its step count back)."""
        return {"updates": self.updates.state_dict(), "manager": self.manager.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state, before the first :meth:`step`.

        Raises:
            ValueError: this worker has joined already.
        """
        if self.joined:
            raise ValueError("load the state before the first step: a joined worker takes "
                             "the others' state when it falls behind")
        self.updates.load_state_dict(state["updates"])  # alone: nothing is broadcast
        self.updates.pending = {}
        self.manager.load_state_dict(state["manager"])

    def finish(self) -> None:
        """Land the exchanges in flight (each all workers' commit vote, at the end)."""
        commits = self.record["commits"]
        self.updates.finish()
        self._recorded(commits)

