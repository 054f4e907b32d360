"""Front door 1: a DDP communication hook that applies a scheme layer-wise."""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire import optim
from thinwire._version import __version__
from thinwire.comm import Meter, world
from thinwire.comm.collectives import Future, Group
from thinwire.comm.fingerprint import check_peers
from thinwire.compress import TensorInfo
from thinwire.ddp.amp import LossScale
from thinwire.ddp.clip import LocalClip
from thinwire.ddp.delayed import OneStepDelay
from thinwire.ddp.guard import GradGuard
from thinwire.ddp.hold import Stage, StepHold
from thinwire.schemes.base import Scheme
from thinwire.schemes.registry import fingerprint

_LOG = logging.getLogger("thinwire.ddp")


@dataclass(slots=True)
class HookState:
    """What the hook needs: the scheme (tunable + state) and parameter names."""

    scheme: Scheme
    names: dict[int, str]  # id(parameter) -> name, so state is keyed by parameter
    group: Group = None
    fields: dict[str, Any] = field(default_factory=dict)  # what every rank must share
    agreed: bool = False  # peers compared (at register, else at the hook's first call)
    module: torch.nn.Module | None = None  # the model whose parameters ``names`` names
    clip: LocalClip | None = None  # each worker's gradient clipped before the scheme
    loss_scale: LossScale | None = None  # a GradScaler's scale kept out of the scheme
    hold: StepHold | None = None  # holds a step's buckets for the two above
    guard: GradGuard | None = None  # warns if the sparse update is rewritten before the step
    coupling: optim.Coupling | None = None  # what couple did, when given the optimiser
    delay: OneStepDelay | None = None  # hands DDP last step's mean (thinwire.ddp.delayed)

    @property
    def clips_in_hook(self) -> bool:
        """Whether gradient clipping belongs in the hook (``register``'s ``max_norm``)
        instead of ``clip_grad_norm_`` after ``backward``
        (:attr:`thinwire.schemes.Traits.clips_in_hook`: a sparse scheme's)."""
        return self.scheme.traits.clips_in_hook

    def state_dict(self) -> dict[str, Any]:
        """This rank's scheme state (error memory, velocity, thresholds, counters), with the
        rank and world size it belongs to, the error memory's rule and, under ``delay``, the
        means not yet applied: save one per rank."""
        rank, world_size = world(self.group)
        return {"rank": rank, "world_size": world_size,
                "memory": self.scheme.traits.memory, "scheme": self.scheme.state_dict(),
                "delay": self.delay.state_dict() if self.delay is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` saved on this rank.

        Raises:
            ValueError: ``state`` belongs to another rank or world size, to a scheme
                whose error memory was coupled otherwise (register with the same
                ``optimizer`` and ``coupling`` before loading), or to a run with another
                ``delay``.
        """
        rank, world_size = world(self.group)
        if (state.get("rank"), state.get("world_size")) != (rank, world_size):
            raise ValueError(f"this scheme state was saved by rank {state.get('rank')} of "
                             f"{state.get('world_size')}; this is rank {rank} of {world_size}. "
                             "Each rank's error memory is its own: save and load one file "
                             "per rank")
        memory = self.scheme.traits.memory
        if state.get("memory") != memory:
            raise ValueError(f"this scheme state keeps an error memory of rule "
                             f"{state.get('memory')!r}, the registered scheme {memory!r}: "
                             "register with the same scheme, optimizer and coupling as the "
                             "run that saved it, then load")
        if (state.get("delay") is None) != (self.delay is None):
            raise ValueError(f"this scheme state was saved with delay="
                             f"{state.get('delay') is not None}, this hook has delay="
                             f"{self.delay is not None}: register with the same delay")
        self.scheme.load_state_dict(state["scheme"])
        if self.delay is not None:
            self.delay.load_state_dict(state["delay"])


def agree(state: HookState, device: torch.device | None) -> None:
    """Compare ``state.fields`` across the group once (see :func:`check_peers`).

    Raises:
        PeerMismatchError: on every rank alike, naming the fields that differ.
    """
    if not state.agreed:
        check_peers(state.fields, "the DDP hook", state.group, device)
        state.agreed = True


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """Reduce ``bucket``'s flat buffer in place with the scheme, tensor by tensor
    (named by parameter); the future holds the buffer, averaged."""
    buffer = bucket.buffer()
    agree(state, buffer.device)  # a no-op after register; here for hook_state's users
    infos = [TensorInfo(state.names[id(p)], tuple(p.shape), p.dtype, "W_grad", p.device)
             for p in bucket.parameters()]
    sent = buffer if state.delay is None else buffer.clone()  # delayed: DDP keeps buffer

    def start(last: bool) -> Future[Any]:
        return state.scheme.launch_flat(sent, infos, state.group, last=last)

    future = (start(bucket.is_last()) if state.hold is None
              else state.hold.launch(sent, start, bucket.is_last()))
    if state.delay is not None:
        future = state.delay.swap(buffer, infos, future, bucket.is_last())
    if state.guard is not None:
        state.guard.arm()
    return future


def register(ddp_model: DistributedDataParallel, scheme: Scheme, group: Group = None,
             meter: Meter | None = None, max_norm: float | None = None,
             scaler: torch.amp.GradScaler | None = None,
             optimizer: torch.optim.Optimizer | None = None, coupling: str = "auto",
             warmup: int | None = None, feedback: str = "auto",
             delay: bool = False) -> HookState:
    """Install ``scheme`` as ``ddp_model``'s communication hook.

    Under a sparse error-feedback scheme, ``.grad`` after ``backward`` holds the
    step's sparse update: a step after code wrote it (``clip_grad_norm_``) warns
    once (:mod:`thinwire.ddp.guard`).

    Args:
        ddp_model: a DistributedDataParallel model (gloo or NCCL).
        scheme: from :func:`thinwire.schemes.build`.
        group: the process group the hook reduces over (DDP's own by default).
        meter: records the bytes handed to torch.distributed; attached to the scheme.
        max_norm: clip gradients as ``clip_grad_norm_(params, max_norm)`` would the
            mean's, but on each worker before the scheme (:mod:`thinwire.ddp.clip`,
            DGC's local clipping): under a sparse scheme, ``.grad`` after
            ``backward`` holds the sparse update, which ``clip_grad_norm_`` must
            not clip. None: no clipping.
        scaler: the ``torch.amp.GradScaler`` of fp16 autocast, if any: its loss scale
            is divided out before the scheme and put back after, and a step that
            overflowed on any rank is skipped on every rank (:mod:`thinwire.ddp.amp`).
        optimizer: the user's optimiser, coupled to the scheme in the same call by the
            rule its family takes (:func:`thinwire.optim.couple`; SGD with momentum:
            ``"momentum"``; Adam, AdamW: ``"none"``), with its family's warm-up
            (:func:`thinwire.optim.default_warmup`). What was chosen, and why, is in
            the state's ``coupling`` and in one ``logging`` line (logger
            ``thinwire.ddp``). Build it, load its state if resuming, then register.
            None: nothing is coupled and there is no warm-up unless asked for.
        coupling: the rule, one of :data:`thinwire.optim.RULES` (``"auto"``: the
            optimiser family's).
        warmup: steps averaged dense before the scheme compresses (the scheme's
            ``warmup_steps``: one with another is rebuilt with this); None: the
            optimiser family's
            (:func:`thinwire.optim.default_warmup`), or the scheme's own without an
            optimiser.
        feedback: what a coupled clt-k keeps the velocity in (``couple``'s ``feedback``).
        delay: apply each step's mean one step later, its exchange overlapping the next
            step (:mod:`thinwire.ddp.delayed`; the state's ``state_dict`` holds the mean
            in flight).

    Returns:
        The hook state; its ``state_dict`` checkpoints this rank's scheme (one file per
        rank), its ``scheme`` is the one registered (yours, or rebuilt with the
        optimiser family's options: :func:`thinwire.optim.follow`).

    Raises:
        TypeError: ``ddp_model`` is not DistributedDataParallel.
        ValueError: ``max_norm`` is not a finite number > 0, the model has sparse
            gradients (see :func:`hook_state`), or a ``coupling`` or ``warmup`` out of range
            (:func:`thinwire.optim.couple`).
        PeerMismatchError: another rank registered a different scheme, config, value
            format, parameter set or thinwire version (raised on every rank alike;
            ``register`` is a collective over the hook's group).
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"expected DistributedDataParallel, got {type(ddp_model).__name__}")
    state = hook_state(ddp_model.module, scheme,
                       group if group is not None else ddp_model.process_group, meter,
                       max_norm=max_norm, scaler=scaler, optimizer=optimizer,
                       coupling=coupling, warmup=warmup, feedback=feedback, delay=delay)
    parameter = next(ddp_model.module.parameters(), None)
    agree(state, parameter.device if parameter is not None else None)
    ddp_model.register_comm_hook(state, comm_hook)
    optim.watch(state.scheme, ddp_model.module.parameters())  # warns if SGD is not coupled
    return state


def hook_state(module: torch.nn.Module, scheme: Scheme, group: Group = None,
               meter: Meter | None = None, max_norm: float | None = None,
               scaler: torch.amp.GradScaler | None = None,
               optimizer: torch.optim.Optimizer | None = None, coupling: str = "auto",
               warmup: int | None = None, feedback: str = "auto",
               delay: bool = False) -> HookState:
    """The state for :func:`comm_hook`, for frameworks that register the hook themselves.

    PyTorch Lightning takes it as ``DDPStrategy(ddp_comm_state=hook_state(model, scheme),
    ddp_comm_hook=comm_hook)``.

    Args:
        module: the model DDP wraps (its parameter names key the scheme's state).
        scheme: from :func:`thinwire.schemes.build`.
        group: the process group to reduce over; None: the default group.
        meter: records the bytes handed to torch.distributed; attached to the scheme.
        max_norm, scaler, optimizer, coupling, warmup, feedback, delay: as for
            :func:`register`.

    Raises:
        ValueError: an ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` (sparse
            gradients), named; ``max_norm`` not a finite number > 0.
    """
    sparse = [name for name, m in module.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ValueError(f"modules {sparse} have sparse=True: thinwire's hook works on dense "
                         "gradient buckets; build them with sparse=False (a sparse scheme "
                         "sends only the largest entries of the rows a batch touched anyway)")
    scheme, chosen, warmup = optim.prepare(optimizer, scheme, warmup)
    if meter is not None:
        scheme.meter = meter
    named = list(module.named_parameters())
    parameters = {name: f"{tuple(p.shape)} {p.dtype}" for name, p in named if p.requires_grad}
    if scaler is not None and not scaler.is_enabled():
        scaler = None  # a disabled scaler (float32) scales nothing: no overflow vote to take
    clip = None if max_norm is None else LocalClip(max_norm, group=group)
    loss_scale = None if scaler is None else LossScale(scaler, group, meter)
    stages: list[Stage] = [s for s in (loss_scale, clip) if s is not None]  # unscale first
    trained = [p for _, p in named if p.requires_grad]
    guard = (GradGuard(max(trained, key=lambda p: p.numel()))
             if trained and scheme.traits.sparse else None)
    state = HookState(scheme, {id(p): name for name, p in named}, group,
                      {**fingerprint(scheme), "parameters": parameters, "thinwire": __version__,
                       "max_norm": max_norm, "scaler": scaler is not None, "warmup": warmup,
                       "delay": delay},
                      module=module, clip=clip, loss_scale=loss_scale,
                      hold=StepHold(stages) if stages else None, guard=guard,
                      delay=OneStepDelay() if delay else None)
    if optimizer is not None:
        state.coupling = optim.announce(optimizer, state, chosen, warmup, _LOG,
                                        rule=coupling, feedback=feedback)
    return state
