"""DiLoCo and Streaming DiLoCo around any module: inner steps apart, a compressed outer step.

Each worker trains its replica with its own inner optimiser; every ``every`` =
H steps the pseudo-gradient ``delta = x_global - x_local`` (DiLoCo, Douillard
et al. 2023, Alg. 1) is averaged through a thinwire scheme over the group, the
outer optimiser steps the global weights with it, and the replica restarts
from them. Streaming DiLoCo (Douillard et al. 2025) cuts the parameters into
``fragments`` synced at staggered steps; a fragment's exchange is launched as
a future and lands ``delay`` (tau) inner steps later, its local weights then
``mix * local + (1 - mix) * global``. With ``overlap`` (DiLoCoX's one-step
delay; Qi et al. 2025) every exchange lands one sync late: the workers train on
through it, and when it lands each replica becomes the new global weights plus
its own progress since the exchange left. With ``eager`` (Kale et al. 2025) it
lands as late, and each worker steps at once with its own fresh pseudo-gradient
in the place of its share of the average, the others' shares arriving a sync late.
With ``lookahead`` it lands as late, only whole averages step the global weights,
and each replica starts from the step its own fresh pseudo-gradient would take.

Parameters only: buffers (batch-norm statistics) stay each worker's own. A
DTensor parameter (FSDP2 inside a site) is worked on through its local shard,
exchanged over ``group`` (the cross-site group, ``site_mesh(S)["site"]``);
fragments are cut by whole-parameter size, so a site's shards agree on them.
The schedule depends on the step count alone, so every rank launches the same
exchanges in the same order. Every rank starts from rank 0's weights, as under DDP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from thinwire._version import __version__
from thinwire.comm import Meter
from thinwire.comm.broadcast import broadcast_object, broadcast_tensors, digest_tensors
from thinwire.comm.collectives import Future, Group, done, world
from thinwire.comm.fingerprint import check_peers
from thinwire.feedback import Decayed
from thinwire.schemes import Scheme, build, fingerprint

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def nesterov(lr: float = 0.7, momentum: float = 0.9) -> OuterFactory:
    """DiLoCo's outer optimiser: SGD with Nesterov momentum (the paper's lr 0.7, momentum 0.9)."""
    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)
    return make


def default_every(scheme: Scheme) -> int:
    """The H a scheme calls for: 10 where its error memory decays (SparseLoCo: its memory
    is the outer momentum; on text-lm H = 10 reached the target where 50 did not:
    docs/record/sparseloco.md), else DiLoCo's 50."""
    return 10 if scheme.traits.memory == Decayed.rule else 50


def outer_defaults(scheme: Scheme) -> tuple[float, float]:
    """The outer ``(lr, momentum)`` a scheme calls for: plain SGD at lr 1 where its error
    memory decays (SparseLoCo, whose memory is the outer momentum: Alg. 1, alpha = 1 in
    the reference code), else DiLoCo's 0.7 and Nesterov 0.9."""
    return (1.0, 0.0) if scheme.traits.memory == Decayed.rule else (0.7, 0.9)


@dataclass(frozen=True)
class LocalConfig:
    every: int = 50  # H, inner steps between a fragment's syncs, >= fragments
    fragments: int = 1  # F, parts of the parameters synced at staggered steps, >= 1
    delay: int = 0  # tau, inner steps an exchange overlaps before it lands, < every // fragments
    mix: float = 0.0  # weight of the local weights when a fragment lands, in [0, 1)
    overlap: bool = False  # each exchange lands at the fragment's next sync (delay, mix 0)
    # each exchange lands a sync late; meanwhile the outer step takes the worker's own fresh
    # pseudo-gradient in place of its share (Kale et al. 2025; overlap False)
    eager: bool = False
    # each exchange lands a sync late; meanwhile the replica starts from the outer step the
    # worker's own fresh pseudo-gradient would take, on a copy (overlap and eager False)
    lookahead: bool = False

    def __post_init__(self) -> None:
        for name, low in (("every", 1), ("fragments", 1), ("delay", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if self.fragments > self.every:
            raise ValueError(f"fragments={self.fragments!r} must be <= every={self.every!r} "
                             "(each fragment syncs at its own step of the cycle)")
        if self.delay >= self.every // self.fragments:
            raise ValueError(f"delay={self.delay!r} must be < every // fragments = "
                             f"{self.every // self.fragments} (Streaming DiLoCo's tau < H / F: "
                             "each fragment's first exchange starts after step 0)")
        if not (isinstance(self.mix, (int, float)) and 0.0 <= self.mix < 1.0):
            raise ValueError(f"mix={self.mix!r} is outside the allowed range [0, 1)")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap={self.overlap!r} must be True or False")
        for name in ("eager", "lookahead"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.overlap and (self.delay or self.mix):
            raise ValueError(f"overlap=True lands each exchange a whole sync late; it takes "
                             f"delay=0 and mix=0, not delay={self.delay!r}, mix={self.mix!r}")
        if self.eager and (self.overlap or self.delay or self.mix):
            raise ValueError(f"eager=True lands each exchange a whole sync late, as overlap does "
                             f"(it implies overlap's schedule); it takes overlap=False, delay=0 "
                             f"and mix=0, not overlap={self.overlap!r}, delay={self.delay!r}, "
                             f"mix={self.mix!r}")
        if self.lookahead and (self.overlap or self.eager or self.delay or self.mix):
            raise ValueError(f"lookahead=True lands each exchange a whole sync late (it implies "
                             f"overlap's schedule); it takes overlap=False, eager=False, delay=0 "
                             f"and mix=0, not overlap={self.overlap!r}, eager={self.eager!r}, "
                             f"delay={self.delay!r}, mix={self.mix!r}")

    @property
    def late(self) -> bool:
        """Whether each exchange lands at the fragment's next sync (``overlap``, ``eager``
        or ``lookahead``)."""
        return self.overlap or self.eager or self.lookahead

    def offset(self, fragment: int) -> int:
        """The step of the cycle, in [1, every], at which ``fragment`` lands."""
        return (fragment + 1) * self.every // self.fragments


def split(sizes: list[int], fragments: int) -> list[list[int]]:
    """Positions of ``sizes`` (parameter numels, in order) in ``fragments`` contiguous runs of
    about equal total size, none empty.

    Raises:
        ValueError: fewer parameters than fragments.
    """
    if len(sizes) < fragments:
        raise ValueError(f"fragments={fragments} exceeds the {len(sizes)} trained parameters")
    total = max(sum(sizes), 1)
    runs: list[list[int]] = [[] for _ in range(fragments)]
    passed, last = 0, 0
    for position, size in enumerate(sizes):
        left = len(sizes) - position  # parameters still to place, this one included
        # the run this parameter's middle falls in, neither skipping a run nor leaving
        # too few parameters for the runs after it
        wanted = min(int((passed + size / 2) * fragments / total), fragments - 1)
        last = min(max(wanted, fragments - left, last), last + 1 if runs[last] else last)
        runs[last].append(position)
        passed += size
    return runs


class Exchange(Protocol):
    """How a fragment's pseudo-gradients are averaged, and whether the average is applied."""

    def launch(self, updates: LocalUpdates, fragment: int,
               deltas: dict[str, torch.Tensor]) -> Future[Any]:
        """Start averaging ``deltas`` (the fragment's ``x_global - x_local`` by name).

        It may move ``updates.steps`` (a fault-tolerant worker healed in the sync's
        quorum takes its peers' count); the exchange then lands that much later too."""

    def land(self, updates: LocalUpdates, fragment: int,
             future: Future[Any]) -> Mapping[str, torch.Tensor] | None:
        """The average to apply, or None: the exchange did not commit (nothing is applied)."""


class _Direct:
    """The scheme over the group, every average applied (no failure to recover from)."""

    def launch(self, updates: LocalUpdates, fragment: int,
               deltas: dict[str, torch.Tensor]) -> Future[Any]:
        return updates.scheme.launch(deltas, updates.group)

    def land(self, updates: LocalUpdates, fragment: int,
             future: Future[Any]) -> Mapping[str, torch.Tensor] | None:
        result: Mapping[str, torch.Tensor] = future.wait()
        return result


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (in place edits reach the DTensor); any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class LocalUpdates:
    """Local-update data parallelism (DiLoCo, Streaming DiLoCo) for any ``nn.Module``.

    Call :meth:`step` after each ``inner.step()``::

        updates = LocalUpdates(model, inner, thinwire.schemes.build("int4"), every=50)
        for batch in data:
            loss(model(batch)).backward(); inner.step(); inner.zero_grad()
            updates.step()

    Construction is a collective over ``group``: the peer check, then rank 0's
    trained parameters are broadcast to every rank, as DDP does when it wraps a
    model (ranks seeded differently then start alike).

    Eager updates (``eager=True``; Kale et al. 2025, "eager updates"): at a
    fragment's sync the exchange of this round's pseudo-gradient ``delta_t``
    leaves, last round's average ``mean_{t-1}`` lands, and the outer step takes,
    without waiting, ``delta_t / M + (mean_{t-1} - delta_{t-1} / M)``: the
    worker's own fresh share and the others' shares from a sync ago (M the
    group's size). The replica restarts from the result, as under blocking
    DiLoCo. Each worker keeps its own global weights and outer state, which
    differ by the fresh shares; every share enters the outer steps once in all.
    Where the paper is silent: a first round has no average yet, so its step is
    ``delta_1 / M``; a compressing scheme sends what it sends without eager, and
    the fresh share is the worker's own uncompressed ``delta`` (the fresh local
    information the paper steps with), subtracted from the average when that
    lands, so what its codec held back is not counted twice; :meth:`finish`
    takes one more outer step with the rest of the last average. With one
    worker and a lossless scheme the step is ``delta_t``: blocking DiLoCo.

    Lookahead (``lookahead=True``): the exchange of ``delta_t`` lands at the next
    sync as under ``overlap``; at a sync the average that lands steps the global
    weights and the outer state (shared by every worker, as under blocking DiLoCo),
    then the replica starts from the outer step this worker's own ``delta_t`` would
    take from them, taken on copies of the weights and the outer state: its stand-in
    for the average in flight, which never enters the outer momentum. The next
    ``delta`` is measured from that start. :meth:`finish` lands the last averages and
    moves each replica by what they changed of where it started. With one worker
    and a lossless scheme, or every worker's ``delta`` the same, it is blocking
    DiLoCo to the bit, a sync's exchange hidden behind the next H steps.

    Args:
        module: the replica; its trained parameters are synchronised.
        inner: the user's optimiser of ``module``'s parameters (never reset).
        scheme: averages the pseudo-gradients; default ``build("dense")``.
        every, fragments, delay, mix, overlap, eager, lookahead: see
            :class:`LocalConfig`; ``every`` None: the scheme's (:func:`default_every`).
        outer: builds the outer optimiser from the global weights; default
            :func:`nesterov` ``(*``:func:`outer_defaults` ``(scheme))``.
        group: the process group the workers exchange over; None: the default. For a
            model sharded with FSDP2 inside each site, the cross-site group.
        meter: records the bytes handed to torch.distributed; attached to the scheme.
        broadcast: True: rank 0's weights at construction, and its global weights,
            outer optimiser state and step count at :meth:`load_state_dict`, go to
            every rank. False: each rank keeps its own, which must then be equal.

    Raises:
        ValueError: a bad option, more fragments than trained parameters, or a
            parameter sharded on a mesh of more than one dimension (native HSDP).
        PeerMismatchError: another rank differs in H, fragments, delay, mix, overlap,
            eager, lookahead, the outer optimiser, the scheme or the parameters, or
            (``broadcast=False``) in its weights (on every rank alike).
    """

    def __init__(self, module: nn.Module, inner: torch.optim.Optimizer,
                 scheme: Scheme | None = None, *, every: int | None = None, fragments: int = 1,
                 delay: int = 0, mix: float = 0.0, overlap: bool = False, eager: bool = False,
                 lookahead: bool = False, outer: OuterFactory | None = None,
                 group: Group = None, meter: Meter | None = None,
                 broadcast: bool = True) -> None:
        self.scheme = scheme if scheme is not None else build("dense")
        every = default_every(self.scheme) if every is None else every
        self.config = LocalConfig(every, fragments, delay, mix, overlap, eager, lookahead)
        self.module = module
        self.inner = inner
        if meter is not None:
            self.scheme.meter = meter
        self.group = group
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        for name, p in named:
            mesh = getattr(p, "device_mesh", None)
            if mesh is not None and mesh.ndim != 1:
                raise ValueError(
                    f"parameter {name!r} is sharded on a {mesh.ndim}-D mesh, so FSDP would "
                    "all-reduce its gradient across sites at every inner step; shard on the "
                    "intra-site mesh (fully_shard(..., mesh=site_mesh(S)['shard'])) and pass "
                    "the cross-site group (site_mesh(S)['site'].get_group()) as group")
        self.names = [name for name, _ in named]
        self.params = dict(named)
        with torch.no_grad():
            self.globals = {name: _local(p).detach().clone() for name, p in named}
        self.make_outer = outer or nesterov(*outer_defaults(self.scheme))
        self.outer = self.make_outer(list(self.globals.values()))
        # split by the whole parameter's size (a DTensor's numel is global), so the
        # ranks of a site, whose shards differ in size, agree on every fragment
        self.fragments = [[self.names[i] for i in run] for run in
                          split([p.numel() for _, p in named], fragments)]
        self.steps = 0  # inner steps taken
        self.pending: dict[int, tuple[int, Future[Any]]] = {}  # fragment -> (lands at, result)
        self.exchange: Exchange = _Direct()  # thinwire.elastic's adds a quorum and a commit
        self.broadcast = broadcast
        self.device = _local(named[0][1]).device if named else None
        # what every rank must share (thinwire.elastic compares it again in each quorum)
        self.fields = {**fingerprint(self.scheme), "local": dataclasses.asdict(self.config),
                       "outer": _describe(self.outer),
                       "parameters": {name: f"{tuple(_local(p).shape)} {p.dtype}"
                                      for name, p in named},
                       "thinwire": __version__}
        self._agree()
        with torch.no_grad():  # every replica starts from the (now shared) global weights
            for name in self.names:
                _local(self.params[name]).copy_(self.globals[name])
        # overlap: each replica's weights when its last exchange left, its progress' origin;
        # lookahead: where the replica started (the predicted global weights)
        self.anchors = ({name: g.clone() for name, g in self.globals.items()}
                        if self.config.overlap or self.config.lookahead else None)
        # eager: each fragment's last pseudo-gradient, whose share stepped before its average
        self.fresh: dict[int, dict[str, torch.Tensor]] = {}

    def _agree(self, own: bool = False) -> None:
        """Every rank's global weights, outer optimiser state and step count become rank 0's
        (broadcast), or are compared (``broadcast=False``), after the peer check; ``own``
        (eager, resumed): each rank keeps its own, the step counts are compared. A
        collective over ``group``; a no-op alone.

        Raises:
            PeerMismatchError: ``broadcast=False`` (or ``own``) and the ranks' states differ.
        """
        if own:
            check_peers({**self.fields, "steps": self.steps}, "eager local updates",
                        self.group, self.device)
            return
        shared = [self.globals[name] for name in self.names]
        if not self.broadcast:
            outer = [value for state in self.outer.state.values() for value in state.values()
                     if isinstance(value, torch.Tensor)]
            check_peers({**self.fields, "steps": self.steps, "weights": digest_tensors(shared),
                         "outer state": digest_tensors(outer)},
                        "local updates, each rank keeping its own weights (broadcast=False),",
                        self.group, self.device)
            return
        check_peers(self.fields, "local updates", self.group, self.device)
        broadcast_tensors(shared, self.group)
        outer, self.steps = broadcast_object((self.outer.state_dict(), self.steps), self.group,
                                             device=self.device)
        self.outer.load_state_dict(outer)

    def step(self) -> list[int]:
        """Count one inner step; launch and land the fragments the schedule names.

        Returns:
            The fragments that landed at this step (their weights are the global ones,
            mixed with the local when ``mix`` > 0; under ``overlap``, plus this replica's
            progress since the exchange left; under ``eager``, after the eager step).
        """
        self.steps += 1
        config = self.config
        landed = []
        for fragment in range(config.fragments):
            phase = (self.steps - config.offset(fragment) + config.delay) % config.every
            if phase == 0 and config.late:  # the last exchange lands as the next leaves
                previous = self.pending.pop(fragment, None)
                deltas = self._launch(fragment, self.steps + config.every)
                if config.eager:
                    self._eager(fragment, deltas, None if previous is None else previous[1])
                elif config.lookahead:
                    self._look_ahead(fragment, deltas, None if previous is None else previous[1])
                elif previous is not None:
                    self._land(fragment, previous[1])
                else:
                    self._rebase(fragment, moved=False)
                if previous is not None:
                    landed.append(fragment)
                continue
            if phase == 0:
                self._launch(fragment, self.steps + config.delay)
            pending = self.pending.get(fragment)
            if pending is not None and pending[0] == self.steps:
                self._land(fragment, self.pending.pop(fragment)[1])
                landed.append(fragment)
        return landed

    def _launch(self, fragment: int, lands: int) -> dict[str, torch.Tensor]:
        """Start averaging the fragment's pseudo-gradients (``x_global - x_local``; under
        ``overlap`` and ``lookahead`` ``x_anchor - x_local``, this replica's progress since
        its last launch, or since it started), and return them."""
        origin = self.globals if self.anchors is None else self.anchors
        with torch.no_grad():
            deltas = {name: origin[name] - _local(self.params[name])
                      for name in self.fragments[fragment]}
        steps = self.steps
        future = self.exchange.launch(self, fragment, deltas)
        # an exchange may move the step count (a fault-tolerant worker healed in the sync's
        # quorum takes its peers'): the sync lands where theirs does
        self.pending[fragment] = (lands + self.steps - steps, future)
        return deltas

    def _eager(self, fragment: int, deltas: dict[str, torch.Tensor] | None,
               future: Future[Any] | None) -> None:
        """Under ``eager``: the outer step with this worker's fresh share ``deltas / M`` and,
        from the average in ``future``, the shares it has not yet stepped with
        (``mean - last / M``; Kale et al. 2025's eager update); the replica restarts from
        the result. ``deltas`` None: no new round (:meth:`finish`)."""
        size = world(self.group)[1]
        last = self.fresh.pop(fragment, None)
        averaged = None if future is None else self.exchange.land(self, fragment, future)
        names = self.fragments[fragment]
        shares = {}
        for name in names:
            share = torch.zeros_like(self.globals[name]) if deltas is None else deltas[name] / size
            if averaged is not None and last is not None:
                share = share + (averaged[name] - last[name] / size)
            shares[name] = share
        if deltas is not None:
            self.fresh[fragment] = deltas
        self._outer_step(self.outer, {name: self.globals[name] for name in names}, shares)
        with torch.no_grad():
            for name in names:
                _local(self.params[name]).copy_(self.globals[name])

    def _look_ahead(self, fragment: int, deltas: dict[str, torch.Tensor] | None,
                    future: Future[Any] | None) -> None:
        """Under ``lookahead``: the average in ``future`` (last sync's) steps the global
        weights, as under blocking DiLoCo; then the replica starts from the outer step that
        this worker's fresh ``deltas`` would take from them, taken on a copy of the weights
        and the outer state (the stand-in for this sync's average, in flight). ``deltas``
        None (:meth:`finish`): the replica moves by what the average changed of where it
        started, keeping its progress since (``x <- x + (g - start)``: alone, no move)."""
        names = self.fragments[fragment]
        averaged = None if future is None else self.exchange.land(self, fragment, future)
        if averaged is not None:
            self._outer_step(self.outer, {name: self.globals[name] for name in names}, averaged)
        assert self.anchors is not None
        if deltas is None:
            with torch.no_grad():
                for name in names:
                    _local(self.params[name]).add_(self.globals[name] - self.anchors[name])
            return
        start = {name: self.globals[name].clone() for name in names}
        ahead = self.make_outer(list(start.values()))
        for name, tensor in start.items():  # the outer state, copied
            ahead.state[tensor] = {key: value.clone() if isinstance(value, torch.Tensor)
                                   else value for key, value in
                                   self.outer.state.get(self.globals[name], {}).items()}
        self._outer_step(ahead, start, deltas)
        with torch.no_grad():
            for name in names:
                _local(self.params[name]).copy_(start[name])
                self.anchors[name].copy_(start[name])

    @staticmethod
    def _outer_step(outer: torch.optim.Optimizer, weights: Mapping[str, torch.Tensor],
                    grads: Mapping[str, torch.Tensor]) -> None:
        """One step of ``outer`` on ``weights`` (some of its parameters) with ``grads``."""
        for name, tensor in weights.items():  # the optimiser skips parameters without one
            tensor.grad = grads[name].to(tensor.dtype)
        outer.step()
        for tensor in weights.values():
            tensor.grad = None

    def _land(self, fragment: int, future: Future[Any]) -> None:
        """The outer step on the fragment's global weights, then the local weights (unless
        the exchange did not commit: then both stay as they are)."""
        averaged = self.exchange.land(self, fragment, future)
        if averaged is None:
            if self.anchors is not None:
                self._rebase(fragment, moved=False)
            return
        names = self.fragments[fragment]
        self._outer_step(self.outer, {name: self.globals[name] for name in names}, averaged)
        with torch.no_grad():
            for name in names:
                local = _local(self.params[name])
                if self.anchors is not None:
                    continue  # below: the global weights plus this replica's progress
                if self.config.mix == 0.0:
                    local.copy_(self.globals[name])
                else:
                    local.lerp_(self.globals[name], 1.0 - self.config.mix)
        if self.anchors is not None:
            self._rebase(fragment, moved=True)

    def _rebase(self, fragment: int, moved: bool) -> None:
        """Under ``overlap``: where the global weights ``moved``, the local
        weights become them plus this replica's progress since its anchor
        (``x <- g + (x - a)``); the anchor becomes the local weights."""
        assert self.anchors is not None
        with torch.no_grad():
            for name in self.fragments[fragment]:
                local, anchor = _local(self.params[name]), self.anchors[name]
                if moved:
                    local.sub_(anchor).add_(self.globals[name])
                anchor.copy_(local)

    def finish(self) -> None:
        """Land every exchange in flight now (at the end of training)."""
        for fragment in sorted(self.pending):
            future = self.pending.pop(fragment)[1]
            if self.config.eager:
                self._eager(fragment, None, future)
            elif self.config.lookahead:
                self._look_ahead(fragment, None, future)
            else:
                self._land(fragment, future)

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global weights by parameter name (local shards of DTensors): what every worker
        shares after a sync, for evaluation (under ``eager``, this worker's own)."""
        return dict(self.globals)

    def state_dict(self) -> dict[str, Any]:
        """Module, inner, outer and scheme state together, with the exchanges in flight.

        Waits for the exchanges in flight (no new collective), so it is taken at
        the same step on every rank; a run resumed from it is bit-identical. An
        exchange that did not go through is kept as None.
        """
        return {"steps": self.steps, "config": dataclasses.asdict(self.config),
                "module": {k: v.clone() for k, v in self.module.state_dict().items()},
                "inner": self.inner.state_dict(), "outer": self.outer.state_dict(),
                "globals": {name: g.clone() for name, g in self.globals.items()},
                "anchors": None if self.anchors is None else {
                    name: a.clone() for name, a in self.anchors.items()},
                "fresh": {fragment: {name: d.clone() for name, d in deltas.items()}
                          for fragment, deltas in self.fresh.items()},
                "scheme": self.scheme.state_dict(),
                "pending": {fragment: (lands, _cloned(future.wait()))
                            for fragment, (lands, future) in self.pending.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (the options must match).

        A collective over ``group``, as construction is: rank 0's global weights, outer
        optimiser state and step count go to every rank (``broadcast``), or every rank's
        must be equal; the replica (module, inner optimiser) stays each rank's own. Under
        ``eager`` the global weights and outer state are each rank's own too (they differ
        by design); only the step count and options are compared.

        Raises:
            ValueError: the state was saved under other options.
            PeerMismatchError: ``broadcast=False`` and the ranks' states differ.
        """
        if {**dataclasses.asdict(LocalConfig()), **state["config"]} != dataclasses.asdict(
                self.config):  # a state from before overlap existed has no such key
            raise ValueError(f"the state was saved with {state['config']}, these local updates "
                             f"run with {dataclasses.asdict(self.config)}")
        self.module.load_state_dict(state["module"])
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for name, tensor in state["globals"].items():
                self.globals[name].copy_(tensor)
            for name, tensor in (state.get("anchors") or {}).items():
                assert self.anchors is not None  # the configs match
                self.anchors[name].copy_(tensor)
        self.outer.load_state_dict(state["outer"])
        self.scheme.load_state_dict(state["scheme"])
        self.steps = state["steps"]
        self.pending = {fragment: (lands, done(result))
                        for fragment, (lands, result) in state["pending"].items()}
        self.fresh = {fragment: dict(deltas) for fragment, deltas in state.get("fresh", {}).items()}
        self._agree(own=self.config.eager)


def _cloned(result: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if result is None else {key: value.clone() for key, value in result.items()}


def _describe(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimiser's class and hyperparameters, for the peer check."""
    groups = [{key: value for key, value in group.items() if key != "params"}
              for group in optimizer.param_groups]
    return {"class": type(optimizer).__name__,
            "groups": [{k: v if isinstance(v, (int, float, bool, str, type(None))) else str(v)
                        for k, v in group.items()} for group in groups]}


