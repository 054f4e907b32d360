"""FSDP2's all-reduce hook: each site's gradient shard crosses sites through a scheme.

``fully_shard`` over a 1-D intra-site mesh reduce-scatters each parameter group's
gradients inside the site; ``FSDPModule.set_all_reduce_hook`` then hands the hook
that reduce-scatter output (one flat buffer: the group's parameters' shards back to
back, each padded on dim 0 to ``ceil(rows / shards)`` rows), which the hook
overwrites in place with the mean across sites. The hook runs the scheme engine's
:meth:`~thinwire.schemes.base.Scheme.launch_flat` on that buffer, each parameter's
shard named by its FQN, so every scheme works and its state is per parameter shard.
FSDP divides by the shard count inside the site and the scheme by the site count,
so the result is the mean over all workers, as native HSDP's.

The hook must return with the buffer written: it waits on the scheme's future. On
CUDA it runs on the stream FSDP gives it (``stream=``, or FSDP's all-reduce stream),
where the scheme queues its work, and waiting on a CUDA future orders that stream
after the collectives rather than blocking the default stream.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from thinwire import optim
from thinwire._version import __version__
from thinwire.comm import Meter
from thinwire.comm.collectives import Group, world
from thinwire.comm.fingerprint import (
    DIGEST_BYTES,
    PeerMismatchError,
    check_peers,
    describe,
    digest,
    flatten,
)
from thinwire.compress import TensorInfo
from thinwire.schemes.base import Scheme
from thinwire.schemes.registry import fingerprint

_LOG = logging.getLogger("thinwire.fsdp")


@dataclass(frozen=True)
class Shard:
    """One parameter's gradient shard as the hook's buffer holds it."""

    name: str  # the parameter's FQN in the registered module
    shape: tuple[int, ...]  # the shard in the buffer, padding rows included
    rows: int  # rows of the shard that hold the parameter (the rest is padding)


@dataclass
class FSDPState:
    """What the hooks share: the scheme, the cross-site group and where this rank stands.

    ``optim.couple(optimizer, state)`` couples the optimiser's momentum as for DDP
    (``module`` is None: gradients stay at ``x``, see :func:`register`).
    """

    scheme: Scheme
    group: Group  # the process group across sites (this rank's replicas of its shard)
    site: int  # this rank's index in ``group``
    sites: int  # size of ``group``
    shard: int  # this rank's index inside its site
    shards: int  # ranks per site
    layout: dict[str, Shard] = field(default_factory=dict)  # by parameter name
    names: dict[int, str] = field(default_factory=dict)  # id(parameter) -> name
    module: nn.Module | None = None  # no virtual iterate: see register
    calls: int = 0  # hook calls so far (each a parameter group's exchange)
    coupling: optim.Coupling | None = None  # what register(..., optimizer=) chose, and why

    def state_dict(self) -> dict[str, Any]:
        """The scheme's state and the shard layout it belongs to (this rank's alone)."""
        return {"scheme": self.scheme.state_dict(), "site": self.site, "sites": self.sites,
                "shard": self.shard, "shards": self.shards,
                "layout": {name: [list(s.shape), s.rows] for name, s in self.layout.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict` of the rank at the same site and shard.

        Raises:
            ValueError: the state belongs to another site, shard or shard layout.
        """
        mine = self.state_dict()
        for key in ("site", "sites", "shard", "shards", "layout"):
            if state[key] != mine[key]:
                raise ValueError(f"the checkpoint's {key} is {state[key]!r}, this rank's is "
                                 f"{mine[key]!r}: load each rank's state on the rank at the "
                                 "same site and shard, with the same model and mesh")
        self.scheme.load_state_dict(state["scheme"])

    def checkpoint(self) -> Checkpoint:
        """This state for ``torch.distributed.checkpoint`` (see :class:`Checkpoint`)."""
        return Checkpoint(self)


class Checkpoint:
    """An FSDP hook state as a ``torch.distributed.checkpoint`` Stateful.

    Every rank's scheme state differs (its shard, its site's error), so each is
    saved under a key of its own, ``site{s}.shard{r}``: ``dcp.save`` keeps one copy
    of values whose key repeats across ranks. The state travels serialised, so a
    fresh process can load it before its scheme has built any buffer::

        dcp.save({"model": model.state_dict(), "thinwire": state.checkpoint()}, ...)
        dcp.load({"model": model.state_dict(), "thinwire": state.checkpoint()}, ...)
    """

    def __init__(self, state: FSDPState) -> None:
        self.state = state

    @property
    def key(self) -> str:
        return f"site{self.state.site}.shard{self.state.shard}"

    def state_dict(self) -> dict[str, Any]:
        buffer = io.BytesIO()
        torch.save(self.state.state_dict(), buffer)
        buffer.seek(0)
        return {self.key: buffer}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        value = state[self.key]
        if isinstance(value, io.BytesIO):  # not yet read back (a save's own dict)
            value.seek(0)
            value = torch.load(value, weights_only=False)
        self.state.load_state_dict(value)


def fsdp_modules(module: nn.Module) -> Iterator[FSDPModule]:
    """The modules under ``module`` (itself included) that ``fully_shard`` gave parameters."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule) and sub._get_fsdp_state()._fsdp_param_groups:
            yield sub


def register(module: nn.Module, scheme: Scheme, group: Group, meter: Meter | None = None,
             stream: torch.cuda.Stream | None = None, *,
             optimizer: torch.optim.Optimizer | None = None, coupling: str = "auto",
             warmup: int | None = None, feedback: str = "auto") -> FSDPState:
    """Send every FSDP gradient shard of ``module`` across sites through ``scheme``.

    A collective over all ranks of the sites: it checks that they agree first.

    Args:
        module: a model sharded with ``fully_shard(..., mesh=intra_site_mesh)`` (a 1-D
            mesh over the ranks of one site; :func:`thinwire.fsdp.site_mesh` builds it).
        scheme: from :func:`thinwire.schemes.build`.
        group: the process group across sites: the ranks that hold the same shard.
        meter: records the bytes handed to torch.distributed; attached to the scheme.
        stream: on CUDA, the stream the hooks run on (FSDP's all-reduce stream if None).
        optimizer: the user's optimiser (built on the sharded parameters), coupled in the
            same call with its family's options and warm-up, as
            :func:`thinwire.ddp.register` does (the state's ``coupling`` and one log line
            say what was chosen). None: couple later with :func:`thinwire.optim.couple`
            if at all; no warm-up unless asked for.
        coupling: the rule, one of :data:`thinwire.optim.RULES`.
        warmup: launches of each shard averaged dense before the scheme compresses (the
            scheme's ``warmup_steps``: one with another is rebuilt with this); None: the
            optimiser family's.
        feedback: what a coupled clt-k keeps the velocity in (``couple``'s ``feedback``).

    Returns:
        The state; its ``state_dict`` (or :meth:`FSDPState.checkpoint` for
        ``torch.distributed.checkpoint``) checkpoints the scheme, its ``scheme`` is the
        one registered. The virtual iterate of :func:`thinwire.optim.couple` is not
        installed (its move would act on the gathered parameters FSDP builds in forward):
        coupling moves the momentum only.

    Raises:
        ValueError: no parameter was sharded with ``fully_shard``, a module is sharded
            on a 2-D mesh (native HSDP: shard on the intra-site mesh instead), or
            parameter groups shard over different groups.
        PeerMismatchError: a rank set up another scheme, config, model or thinwire
            version (raised on every rank of the sites alike).
    """
    modules = list(fsdp_modules(module))
    if not modules:
        raise ValueError("no parameter of the module was sharded: call "
                         "torch.distributed.fsdp.fully_shard(..., mesh=intra_site_mesh) first")
    names = {id(p): name for name, p in module.named_parameters()}
    shard_groups = []
    layouts: list[list[Shard]] = []
    for sub in modules:
        for param_group in sub._get_fsdp_state()._fsdp_param_groups:
            if param_group._is_hsdp:
                raise ValueError(
                    "the module is sharded on a 2-D mesh (native HSDP), whose own all-reduce "
                    "crosses sites: shard it on the intra-site mesh, mesh['shard'], and pass "
                    "the cross-site group here")
            shard_groups.append(param_group._reduce_scatter_process_group)
            layouts.append(_layout(param_group, names))
    if any(g is not shard_groups[0] for g in shard_groups):
        raise ValueError("parameter groups shard over different process groups; thinwire's "
                         "hook expects one intra-site mesh for the whole model")
    site, sites = world(group)
    shard, shards = world(shard_groups[0])
    scheme, chosen, warmup = optim.prepare(optimizer, scheme, warmup)
    if meter is not None:
        scheme.meter = meter
    state = FSDPState(scheme, group, site, sites, shard, shards,
                      {s.name: s for layout in layouts for s in layout}, names)
    device = next(module.parameters()).device
    fields = {**fingerprint(scheme), "thinwire": __version__, "shards": shards, "warmup": warmup,
              "sites": sites, "parameters": {name: f"{tuple(p.shape)} {p.dtype}"
                                             for name, p in module.named_parameters()
                                             if p.requires_grad}}
    check_everyone(fields, "the FSDP hook", [group, shard_groups[0]], device)
    check_peers({"layout": {s: str(v) for s, v in state.layout.items()}},
                "the FSDP hook (shard layout)", group, device)
    for sub, layout in zip(modules, layouts):
        sub.set_all_reduce_hook(Exchange(state, layout), stream=stream)
    if optimizer is not None:
        state.coupling = optim.announce(optimizer, state, chosen, warmup, _LOG,
                                        rule=coupling, feedback=feedback)
    optim.watch(scheme, module.parameters())  # warns if SGD momentum is not coupled
    return state


def shards(module: nn.Module) -> list[Shard]:
    """This rank's gradient shards of ``module``, as FSDP's reduce-scatter outputs hold them
    (parameter groups in module order; on a 2-D mesh, the shard of the shard dimension)."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [s for sub in fsdp_modules(module)
            for param_group in sub._get_fsdp_state()._fsdp_param_groups
            for s in _layout(param_group, names)]


def _layout(param_group: Any, names: Mapping[int, str]) -> list[Shard]:
    """A parameter group's shards in the order of its reduce-scatter output."""
    return [_shard(names[id(p.sharded_param)], p) for p in param_group.fsdp_params]


def _shard(name: str, param: Any) -> Shard:
    """Where FSDP puts ``param``'s gradient shard in the reduce-scatter output."""
    if param.fsdp_placement.dim == 0:
        shape = tuple(param.padded_sharded_param_size)
    else:  # Shard(i > 0) requires even sharding: no padding
        shape = tuple(param.sharded_size)
    return Shard(name, shape, int(param.sharded_size[0]) if param.sharded_size else 0)


class Exchange:
    """One parameter group's all-reduce hook: ``hook(reduce_output) -> None``."""

    def __init__(self, state: FSDPState, layout: Sequence[Shard]) -> None:
        self.state = state
        self.layout = list(layout)
        self.numel = sum(math.prod(s.shape) for s in layout)
        self._infos: list[TensorInfo] | None = None

    def __call__(self, buffer: torch.Tensor) -> None:
        """Overwrite ``buffer`` (this site's shard of the group) with its mean across sites.

        Raises:
            RuntimeError: the buffer does not hold every parameter of the group (FSDP
                leaves out parameters without a gradient).
        """
        if buffer.numel() != self.numel:
            raise RuntimeError(
                f"FSDP's reduce-scatter output has {buffer.numel()} elements, the shards of "
                f"{[s.name for s in self.layout]} {self.numel}: a parameter got no gradient "
                "this step; call module.set_reduce_scatter_unused_params(True) so FSDP "
                "sends zeros for it")
        infos = self._infos
        if infos is None or infos[0].dtype != buffer.dtype or infos[0].device != buffer.device:
            infos = self._infos = [TensorInfo(s.name, s.shape, buffer.dtype, "W_grad",
                                              buffer.device) for s in self.layout]
        state = self.state
        state.calls += 1
        # last=True: the hook must return with the result, so no round may wait for a
        # later launch.
        state.scheme.launch_flat(buffer, infos, state.group, last=True).wait()


def check_everyone(fields: Mapping[str, Any], where: str, groups: Sequence[Group],
                   device: torch.device | None = None) -> None:
    """:func:`~thinwire.comm.fingerprint.check_peers` over the product of ``groups``.

    Every rank of a (site x shard) mesh must raise alike, but no one process group
    spans it; gathering the digests over the site group and then gathering those over
    the shard group gives every rank all of them without building a new group.

    Raises:
        PeerMismatchError: a field differs between any two ranks of the mesh.
    """
    if all(world(g)[1] == 1 for g in groups):
        return
    flat = flatten(fields)
    gathered = torch.frombuffer(bytearray(digest(flat)), dtype=torch.uint8).to(device or "cpu")
    for g in groups:
        parts = [torch.empty_like(gathered) for _ in range(world(g)[1])]
        dist.all_gather(parts, gathered, group=g)
        gathered = torch.cat(parts)
    rows = gathered.view(-1, DIGEST_BYTES)
    if all(torch.equal(row, rows[0]) for row in rows[1:]):
        return
    per_rank: list[Any] = [flat]
    for g in groups:
        parts_obj: list[Any] = [None] * world(g)[1]
        dist.all_gather_object(parts_obj, per_rank, group=g)
        per_rank = [item for part in parts_obj for item in part]
    raise PeerMismatchError(describe(per_rank, where))
