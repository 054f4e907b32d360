"""ScaleCom's CLT-k (cyclic local top-k) and the local top-k baseline whose bytes build up.

Both share the k, the selection (chunk-wise or exact top-k), the low-pass
error memory ``m <- (1 - beta) m + beta (p - C(p))``
(:class:`thinwire.feedback.LowPass`), warm-up and exclusions, so a comparison
isolates who chooses the indices. ``scope="layer"`` (ScaleCom's) selects k
per layer, ``"bucket"`` once over a launch's sparse tensors (metered as
``first..last``). ``clt-k`` (ScaleCom App. E): the leader ``step mod n``
broadcasts its top-k indices of ``p = m + g`` and the values there are
all-reduced, the same bytes at any world size. ``local-topk``: each rank's own
top-k by all-gather, so inbound bytes grow with n (App. F's build-up). The
keys launched together share the step of the first, so they share a leader.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from thinwire.comm import done, world
from thinwire.comm.collectives import Future, Group, split_flat
from thinwire.comm.rounds import TwoRounds
from thinwire.comm.shared_index import broadcast_indices
from thinwire.compress import TensorInfo
from thinwire.compress.base import check_fraction
from thinwire.compress.cltk import (
    SELECTIONS,
    captured_energy,
    decode_indices,
    encode_indices,
    index_nbytes,
    layer_k,
    select,
)
from thinwire.compress.grouping import regroup, split_ascending
from thinwire.compress.sparse import MIN_NUMEL, Selection
from thinwire.feedback import LowPass, Memory
from thinwire.schemes.base import CompressedScheme, Scheme, count_step
from thinwire.schemes.registry import (
    register,
    validate_common,
    validate_patterns,
    validate_ratio,
)
from thinwire.schemes.streaming import joined
from thinwire.schemes.traits import ALL_REDUCE, BROADCAST, Traits


@dataclass(frozen=True)
class CLTkConfig:
    """Options of ``clt-k`` (and, unchanged, of ``local-topk``)."""

    ratio: float = 0.01  # fraction of each layer's entries sent, in (0, 1]; ~100x
    k: int | None = None  # entries sent per layer instead of ratio (>= 1, capped at the size)
    selection: str = "exact"  # "exact": top-k; "chunk": top of each of k equal chunks
    beta: float = 1.0  # low-pass factor of the memory, in (0, 1]; 1 is plain error feedback
    warmup_steps: int = 0  # steps all-reduced dense before compression starts
    exclude: tuple[str, ...] = ()  # fnmatch patterns of parameter names always sent dense
    min_numel: int = MIN_NUMEL  # tensors with fewer entries are sent dense (as topk, dct-dp)
    nonfinite: str = "raise"  # "raise" or "skip" on a non-finite gradient
    scope: str = "bucket"  # "bucket": one selection over the launch (a DDP bucket); "layer": k each

    def __post_init__(self) -> None:
        validate_ratio(self.ratio)
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int)
                                   or self.k < 1):
            raise ValueError(f"k={self.k!r} must be None or an integer >= 1")
        if self.scope == "bucket" and self.k is not None:
            raise ValueError(f"k={self.k!r} is per layer: with scope='bucket' give ratio")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection={self.selection!r} must be one of {sorted(SELECTIONS)}")
        check_fraction("beta", self.beta, 0.0, 1.0, closed_low=False, closed_high=True)
        if (isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int)
                or self.warmup_steps < 0):
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be an integer >= 0")
        validate_patterns(self)
        validate_common(self)


@dataclass(frozen=True)
class LocalTopKConfig(CLTkConfig):
    """Options of ``local-topk``: those of ``clt-k``, so the two compare like for like."""


class _SelectedTopK(Scheme):
    """What CLT-k and local top-k share: routing, k per layer, memory, step counters.

    Args:
        config: a :class:`CLTkConfig`.
    """

    def __init__(self, config: CLTkConfig) -> None:
        super().__init__()
        self.config = config
        self.memory: Memory = LowPass(config.beta)  # couple_memory may replace it
        self.steps: dict[str, int] = {}  # key -> launches so far
        self.groups: dict[str, tuple[str, ...]] = {}  # key -> the keys last selected with it

    @property
    def error_memory(self) -> Memory:
        return self.memory

    def couple_memory(self, memory: Memory) -> None:
        self.memory = memory

    def sparse(self, key: str, numel: int, step: int) -> bool:
        """Whether ``key``'s tensor is sparsified at ``step`` (the same on every rank)."""
        config = self.config
        return (step >= config.warmup_steps and numel > 0 and numel >= config.min_numel
                and not any(fnmatchcase(key, pattern) for pattern in config.exclude))

    def k(self, numel: int) -> int:
        """Entries sent of a layer (or a bucket-scope group) of ``numel``."""
        return layer_k(numel, self.config.ratio, self.config.k)

    def _groups(self, keys: Sequence[str]) -> list[list[str]]:
        """The sparse ``keys`` of a launch, in the groups that share one selection: each
        alone (``scope="layer"``) or all together (``"bucket"``, regrouped as last time
        across DDP's re-bucketing: :func:`~thinwire.compress.grouping.regroup`)."""
        if self.config.scope == "layer":
            return [[key] for key in keys]
        return [[keys[i] for i in group] for group in regroup(self.groups, keys)]

    def _split(self, grads: Mapping[str, torch.Tensor],
               step: int) -> tuple[list[str], list[str]]:
        sparse = [key for key, grad in grads.items() if self.sparse(key, grad.numel(), step)]
        sparse_keys = set(sparse)
        dense = [key for key in grads if key not in sparse_keys]
        return sparse, dense

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "memory": self.memory.state_dict(),
                "steps": dict(self.steps), "groups": dict(self.groups)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.memory.load_state_dict(state["memory"])
        self.steps = dict(state["steps"])
        self.groups = dict(state.get("groups", {}))  # a checkpoint without groups: none yet


class CyclicLocalTopK(_SelectedTopK):
    """ScaleCom's CLT-k: a rotating leader's indices, shared by every rank, all-reduced.

    Attributes:
        leader: the leader of the last launch (``step mod n``).
        indices: key -> the index set used by the last launch (int64, ascending).
        energy: None, or (set it to ``{}`` to record) key -> per launch, the share
            of this rank's own top-k energy that the leader's indices captured
            (:func:`~thinwire.compress.cltk.captured_energy`; 1.0 on the leader).
            A diagnostic: it costs a top-k per layer and launch.
    """

    def __init__(self, config: CLTkConfig) -> None:
        super().__init__(config)
        self.leader = 0
        self.indices: dict[str, torch.Tensor] = {}
        self.rounds = TwoRounds()  # at most one bucket whose values wait for their indices

    @property
    def traits(self) -> Traits:
        return Traits(self.config.ratio, self.memory.rule, shared_indices=True, energy=True,
                      collectives=(BROADCAST, ALL_REDUCE))

    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Average ``grads`` (not modified) with CLT-k; the future holds a dict of results.

        The same path as a DDP bucket (:meth:`launch_flat`), on a copy of ``grads``
        flat, one buffer per dtype and device.
        """
        return self._via_flat(grads, group) if grads else done({})

    def launch_flat(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                    group: Group = None, *, last: bool = True) -> Future[Any]:
        """CLT-k on a flat ``buffer`` (a DDP bucket, or :meth:`launch`'s copy), in place.

        ``p = m + g`` is formed in the bucket itself; the leader selects on
        its per-layer views (or, with ``scope="bucket"``, once over them all),
        round 1 broadcasts the index sets, every rank gathers its values there and
        round 2's all-reduce averages them with the dense tensors; the memory is
        updated in place where it can be
        (:meth:`~thinwire.feedback.LowPass.update_selected_`), the mean is
        decoded straight into ``buffer`` and settled there
        (:meth:`~thinwire.feedback.Memory.settle_`, an EF21 estimate when coupled).
        Without ``last`` the broadcast is waited for at the next launch (see
        :class:`~thinwire.comm.rounds.TwoRounds`), so the backward pass runs meanwhile.

        Returns:
            A future holding ``buffer``, overwritten with the mean over ranks.
        """
        if not infos:
            return done(buffer)
        start = time.perf_counter()
        rank, n = world(group)
        views = dict(zip([info.key for info in infos],
                         split_flat(buffer, [info.numel for info in infos])))
        finite = self._finite(views, self.config.nonfinite, buffer)
        step = count_step(self.steps, views)
        leader = self.leader = step % n
        sparse = [info for info in infos if self.sparse(info.key, info.numel, step)]
        sparse_keys = {info.key for info in sparse}
        dense = [info for info in infos if info.key not in sparse_keys]
        shapes = {info.key: info.shape for info in sparse}
        for info in sparse:  # p = m + g in the bucket (a skipped round counts g as 0)
            view = views[info.key]
            if not finite:
                view.zero_()
            self.memory.compensate_(info.key, view)
        groups = self._groups([info.key for info in sparse])
        plan = _Plan(self, groups, {info.key: info.numel for info in sparse},
                     [_span(buffer, infos, keys, views) for keys in groups])
        encoded = plan.encoded(rank == leader, buffer.device)
        self._charge(time.perf_counter() - start)

        def gather(received: torch.Tensor) -> torch.Tensor:
            parts = []
            for keys, p, chosen in plan.decode(received):
                if finite:
                    self._record_energy(keys, p, chosen)
                    parts.append(p.index_select(0, chosen))
                    for key in keys:
                        self.memory.update_selected_(key, views[key].view(shapes[key]),
                                                     plan.chosen[key])
                else:  # contribute nothing, leave the memory as it was
                    parts.append(torch.zeros(chosen.numel(), dtype=buffer.dtype,
                                             device=buffer.device))
            self.indices.update(plan.chosen)
            for info in dense:  # through the memory, as in launch (_whole)
                view = views[info.key]
                if finite:
                    self.memory.compensate_(info.key, view)
                    self.memory.update(info.key, view, view)
                    parts.append(view)  # cat copies
                else:
                    parts.append(torch.zeros_like(view))
            return joined(parts) if not dense else torch.cat(parts)  # a lone part is fresh

        size = buffer.element_size()
        future = self.rounds.launch(
            lambda: broadcast_indices(encoded, leader, group, self.meter, plan.index_segments()),
            self._charged(gather), device=buffer.device, last=last, group=group,
            meter=self.meter,
            segments=plan.value_segments(size) + [(info.key, info.numel * size)
                                                  for info in dense])

        def scatter(fut: Future[Any]) -> torch.Tensor:
            mean = fut.value()
            for key, values in plan.values(mean):
                views[key].zero_().index_copy_(0, plan.chosen[key], values)
            offset = plan.total_k
            for info in dense:
                views[info.key].copy_(mean[offset: offset + info.numel])
                offset += info.numel
            for info in infos:  # what the optimiser steps with (EF21 keeps an estimate)
                self.memory.settle_(info.key, views[info.key])
            return buffer

        return future.then(self._charged(scatter))

    def _record_energy(self, keys: Sequence[str], p: torch.Tensor, chosen: torch.Tensor) -> None:
        """The energy diagnostic of one selection, recorded for each of its tensors."""
        if self.energy is not None:
            energy = captured_energy(p, chosen)
            for key in keys:
                self.energy.setdefault(key, []).append(energy)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "leader": self.leader}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.leader = state["leader"]


class _Plan:
    """One launch's selections: the groups of sparse keys that share one leader
    selection (a key alone per layer), each group's k, encoded index set and result.

    Args:
        scheme: gives k, the selection rule and room for ``|p|``.
        groups: the sparse keys, grouped (:meth:`_SelectedTopK._groups`).
        numels: entries of each sparse key.
        joined: per group, its tensors' ``p`` flat and back to back.
    """

    def __init__(self, scheme: _SelectedTopK, groups: list[list[str]],
                 numels: Mapping[str, int], joined: list[torch.Tensor]) -> None:
        self.groups, self.numels, self.joined = groups, numels, joined
        self.selection = scheme.config.selection
        self.magnitudes = scheme._magnitudes  # room for |p|, kept by the scheme
        self.sizes = [sum(numels[key] for key in keys) for keys in groups]
        self.ks = [scheme.k(size) for size in self.sizes]
        self.nbytes = [index_nbytes(k, size) for k, size in zip(self.ks, self.sizes)]
        self.total_k = sum(self.ks)
        self.chosen: dict[str, torch.Tensor] = {}  # key -> indices into its own tensor
        self.own: list[torch.Tensor] | None = None  # the leader's selection, per group

    def encoded(self, leading: bool, device: torch.device) -> torch.Tensor:
        """The index sets the leader broadcasts (its own selection), or room for them."""
        if leading and self.groups:
            self.own = [select(p, k, self.selection, self.magnitudes(p))
                        for p, k in zip(self.joined, self.ks)]
            return joined([encode_indices(chosen, size)
                           for chosen, size in zip(self.own, self.sizes)])
        return torch.empty(sum(self.nbytes), dtype=torch.uint8, device=device)

    def decode(self, received: torch.Tensor) -> Iterator[tuple[list[str], torch.Tensor,
                                                               torch.Tensor]]:
        """Per group: its keys, its joined ``p`` and the leader's indices into it;
        fills :attr:`chosen` with each key's share. The leader keeps its own
        selection rather than decode it (the code is lossless: the same indices)."""
        offset = 0
        for group, (keys, p, k, size, nbytes) in enumerate(zip(
                self.groups, self.joined, self.ks, self.sizes, self.nbytes)):
            chosen = (decode_indices(received[offset: offset + nbytes], k, size)
                      if self.own is None else self.own[group])
            offset += nbytes
            self.chosen.update(zip(keys, split_ascending(chosen, [self.numels[key]
                                                                   for key in keys])))
            yield keys, p, chosen

    def values(self, mean: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Each sparse key's part of the all-reduced values (its share of its group's k)."""
        offset = 0
        for keys in self.groups:
            for key in keys:
                count = self.chosen[key].numel()
                yield key, mean[offset: offset + count]
                offset += count

    def index_segments(self) -> list[tuple[str, int]]:
        return [(_name(keys), nbytes) for keys, nbytes in zip(self.groups, self.nbytes)]

    def value_segments(self, itemsize: int) -> list[tuple[str, int]]:
        return [(_name(keys), k * itemsize) for keys, k in zip(self.groups, self.ks)]


def _name(keys: Sequence[str]) -> str:
    """A group's name for the meter: its key, or ``first..last``."""
    return keys[0] if len(keys) == 1 else f"{keys[0]}..{keys[-1]}"


def _span(buffer: torch.Tensor, infos: Sequence[TensorInfo], keys: Sequence[str],
          views: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``keys``' parts of a flat ``buffer`` back to back: a view when they lie so in it."""
    order = [info.key for info in infos]
    first = order.index(keys[0])
    if order[first: first + len(keys)] == list(keys):
        start = sum(info.numel for info in infos[:first])
        return buffer[start: start + sum(views[key].numel() for key in keys)]
    return torch.cat([views[key] for key in keys])


class LocalTopK(CompressedScheme):
    """Local top-k with low-pass error feedback: each rank's own indices, by sparse all-gather.

    The engine (:class:`~thinwire.schemes.base.CompressedScheme`) with ScaleCom's
    selection (:class:`~thinwire.compress.sparse.Selection`, values in the
    gradient's own dtype) and the low-pass memory (:class:`~thinwire.feedback.LowPass`):
    every rank receives all n payloads and sums them in rank order.

    Args:
        config: a :class:`LocalTopKConfig` (those of ``clt-k``).
    """

    def __init__(self, config: CLTkConfig) -> None:
        self.selection = Selection(config.ratio, k=config.k, selection=config.selection,
                                   min_numel=config.min_numel, exclude=config.exclude,
                                   scope=config.scope, values="native")
        super().__init__(self.selection, LowPass(config.beta), config.nonfinite)
        self.config = config
        self.steps: dict[str, int] = {}  # key -> launches so far

    def launch_flat(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                    group: Group = None, *, last: bool = True) -> Future[Any]:
        """The engine's launch, dense for the first ``warmup_steps`` of its tensors."""
        step = count_step(self.steps, [info.key for info in infos])
        self.selection.warming = step < self.config.warmup_steps
        return super().launch_flat(buffer, infos, group, last=last)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps = dict(state["steps"])


@register("clt-k", CLTkConfig)
def _clt_k(config: CLTkConfig) -> Scheme:
    return CyclicLocalTopK(config)


@register("local-topk", LocalTopKConfig)
def _local_topk(config: LocalTopKConfig) -> Scheme:
    return LocalTopK(config)
