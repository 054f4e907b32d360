"""Selections every rank agrees on in a first round: a leader's indices, a low-rank basis.

The kernel (:mod:`thinwire.schemes.kernel`) issues round 1 as the selection
describes it (:class:`Proposal`: a broadcast from the leader, or an
all-reduce), hands the result back (:meth:`Agreed.agree`), then all-reduces
the values at the agreed coordinates with the tensors sent whole, and places
the mean (:meth:`Agreed.place`). Because every rank ends round 1 with the
same coordinates, the values are summable and the mean is the mean of what
was projected.

* :class:`LeaderIndices`: ScaleCom's CLT-k (App. E): rank ``step mod n`` picks
  its own top-k indices of ``p = m + g`` by its :class:`~thinwire.compress.Sparsifier`
  and broadcasts them (int32, the 16-bit code or a bitmap, the smallest);
  every rank sends its ``p`` there. Remembers per rank ``p`` less its own values
  there, as the other selections do.
* :class:`LowRankBasis`: PowerSGD (Vogels et al. 2019, Alg. 1): round 1
  all-reduces ``P = M Q`` (line 3), the basis is ``P_hat = orth(P)`` (line 4), the
  values ``Q = M^T P_hat`` (line 5) and the mean ``P_hat Q^T`` (line 7). Its error
  is ``M - P_hat mean(Q)^T``, the mean's approximation, as torch's
  ``powerSGD_hook`` keeps it (:attr:`Agreed.errors_from_mean`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from thinwire.compress import Sparsifier, TensorInfo
from thinwire.compress.cltk import captured_energy, decode_indices, encode_indices, index_nbytes
from thinwire.compress.grouping import split_ascending
from thinwire.compress.powersgd import PowerSGD, as_matrix, orthonormalize, right
from thinwire.schemes.traits import ALL_REDUCE, BROADCAST


@dataclass
class Proposal:
    """Round 1 as a selection describes it, for the kernel to issue."""

    buffer: torch.Tensor  # sent (and received into, in place)
    collective: str  # BROADCAST (from ``root``) or ALL_REDUCE (the mean)
    segments: list[tuple[str, int]]  # its metered parts
    values: list[tuple[str, int]]  # round 2's values, in order: (name, count)
    root: int = 0
    launch: Any = None  # the selection's own record of this launch, between its rounds


class Agreed(ABC):
    """A selection whose coordinates a first round makes the same on every rank.

    The kernel calls, per launch: :meth:`propose` (on every rank), :meth:`agree`
    with round 1's result, :meth:`project` for the values sent in round 2,
    :meth:`place` with their mean. Each call takes the launch's :class:`Proposal`,
    which carries what the selection needs between them (a launch's round 2 may
    wait until after the next launch's round 1).
    """

    errors_from_mean = False  # the error memory keeps p less the mean's approximation
    shares_indices = False  # the coordinates are indices (traits.shared_indices)
    # None, or (the scheme's, set to {} to record) key -> per launch, the share of this
    # rank's own top-k energy the agreed coordinates captured
    energy: dict[str, list[float]] | None = None

    @property
    def trace(self) -> Mapping[str, Sequence[tuple[int, float, float]]]:
        """A threshold trace, where the selection keeps one."""
        return {}

    def diagnostics(self) -> dict[str, Any]:
        """What the selection counts about itself, for reports; here nothing."""
        return {}

    @property
    @abstractmethod
    def density(self) -> float | None:
        """Target fraction of the entries sent; None: not a sparsifier."""

    @abstractmethod
    def is_dense(self, info: TensorInfo) -> bool:
        """Whether ``info``'s tensor travels whole."""

    @abstractmethod
    def sizes(self, infos: Sequence[TensorInfo]) -> tuple[str, int, list[int]]:
        """Round 1's collective and bytes, and round 2's value counts, for ``infos``
        selected (fixed by shapes and options; nothing recorded)."""

    @abstractmethod
    def propose(self, ps: Mapping[str, torch.Tensor], infos: Sequence[TensorInfo], step: int,
                rank: int, n: int, finite: bool) -> Proposal:
        """Round 1 for the ``p`` (flat) of the selected ``infos``."""

    @abstractmethod
    def agree(self, proposal: Proposal, received: torch.Tensor) -> None:
        """Take round 1's result: the coordinates every rank now shares."""

    @abstractmethod
    def project(self, proposal: Proposal) -> list[torch.Tensor]:
        """This rank's values at the agreed coordinates, flat, in round 2's order."""

    @abstractmethod
    def remember(self, proposal: Proposal, memory: Any,
                 sent: Sequence[torch.Tensor] | None) -> None:
        """Tell ``memory`` what this rank sent (not called where :attr:`errors_from_mean`):
        :meth:`project`'s values as they are (``sent`` None), or ``sent``, those values as
        the wire carries them (cast to fewer bits)."""

    @abstractmethod
    def place(self, proposal: Proposal, mean: torch.Tensor,
              views: Mapping[str, torch.Tensor], memory: Any, remember: bool) -> None:
        """Write the mean of round 2's values (flat, in :meth:`project`'s order) into each
        selected tensor's view; where :attr:`errors_from_mean`, ``memory`` (when
        ``remember``) keeps ``p`` less it."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class LeaderIndices(Agreed):
    """CLT-k's shared indices: the leader ``step mod n`` selects with ``selection``.

    Args:
        selection: the leader's choice of indices (ScaleCom's exact or chunk top-k,
            :class:`~thinwire.compress.sparse.Selection`); its scope groups tensors.

    Attributes:
        leader: the leader of the last launch.
        indices: key -> the index set the last launch used (int64, ascending).
    The energy diagnostic (:attr:`Agreed.energy`) is
    :func:`~thinwire.compress.cltk.captured_energy` (1.0 on the leader).
    """

    shares_indices = True

    def __init__(self, selection: Sparsifier) -> None:
        self.selection = selection
        self.leader = 0
        self.indices: dict[str, torch.Tensor] = {}

    @property
    def trace(self) -> Mapping[str, Sequence[tuple[int, float, float]]]:
        return self.selection.trace

    @property
    def density(self) -> float:
        return self.selection.density

    def is_dense(self, info: TensorInfo) -> bool:
        return self.selection.is_dense(info)

    def sizes(self, infos: Sequence[TensorInfo]) -> tuple[str, int, list[int]]:
        groups = self.selection.groups_of(infos, record=False)
        numels = [sum(infos[i].numel for i in group) for group in groups]
        ks = [self.selection.capacity(numel) for numel in numels]
        return BROADCAST, sum(index_nbytes(k, numel) for k, numel in zip(ks, numels)), ks

    def propose(self, ps: Mapping[str, torch.Tensor], infos: Sequence[TensorInfo], step: int,
                rank: int, n: int, finite: bool) -> Proposal:
        """The leader's encoded index set per group; room for them on the other ranks."""
        self.leader = leader = step % n
        groups = [[infos[i] for i in group] for group in self.selection.groups_of(infos)]
        joined = [ps[group[0].key] if len(group) == 1
                  else torch.cat([ps[info.key] for info in group]) for group in groups]
        sizes = [sum(info.numel for info in group) for group in groups]
        ks = [self.selection.capacity(size) for size in sizes]
        nbytes = [index_nbytes(k, size) for k, size in zip(ks, sizes)]
        own = None
        device = next(iter(ps.values())).device
        if rank == leader:
            own = [self.selection.indices(p.abs(), _group_info(group))
                   for p, group in zip(joined, groups)]
            buffer = torch.cat([encode_indices(chosen, size) for chosen, size in zip(own, sizes)])
        else:
            buffer = torch.empty(sum(nbytes), dtype=torch.uint8, device=device)
        return Proposal(buffer, BROADCAST, [(_name(group), size) for group, size
                                            in zip(groups, nbytes)],
                        [(_name(group), k) for group, k in zip(groups, ks)], leader,
                        _Leading(groups, joined, ks, sizes, own, finite))

    def agree(self, proposal: Proposal, received: torch.Tensor) -> None:
        launch: _Leading = proposal.launch
        offset, launch.chosen = 0, []
        for index, (group, k, size) in enumerate(zip(launch.groups, launch.ks, launch.sizes)):
            nbytes = index_nbytes(k, size)
            # The leader keeps its own selection (the code is lossless: the same indices).
            chosen = (decode_indices(received[offset: offset + nbytes], k, size)
                      if launch.own is None else launch.own[index])
            offset += nbytes
            launch.chosen.append(chosen)
            launch.keyed.update(zip([info.key for info in group],
                                    split_ascending(chosen, [info.numel for info in group])))
        self.indices.update(launch.keyed)

    def project(self, proposal: Proposal) -> list[torch.Tensor]:
        launch: _Leading = proposal.launch
        out = []
        for group, p, chosen in zip(launch.groups, launch.joined, launch.chosen):
            if launch.finite and self.energy is not None:
                energy = captured_energy(p, chosen)
                for info in group:
                    self.energy.setdefault(info.key, []).append(energy)
            values = (p.index_select(0, chosen) if launch.finite
                      else torch.zeros(chosen.numel(), dtype=p.dtype, device=p.device))
            out.append(values)
        return out

    def remember(self, proposal: Proposal, memory: Any,
                 sent: Sequence[torch.Tensor] | None) -> None:
        launch: _Leading = proposal.launch
        for number, (group, p) in enumerate(zip(launch.groups, launch.joined)):
            parts = p.split([info.numel for info in group]) if len(group) > 1 else [p]
            counts = [launch.keyed[info.key].numel() for info in group]  # place's order
            wire = [None] * len(group) if sent is None else sent[number].split(counts)
            for info, part, values in zip(group, parts, wire):
                chosen = launch.keyed[info.key]
                if values is None:
                    memory.update_selected_(info.key, part, chosen)
                else:
                    memory.update_sparse(info.key, part, chosen, values)

    def place(self, proposal: Proposal, mean: torch.Tensor,
              views: Mapping[str, torch.Tensor], memory: Any, remember: bool) -> None:
        launch: _Leading = proposal.launch
        offset = 0
        for group in launch.groups:
            for info in group:
                chosen = launch.keyed[info.key]
                views[info.key].zero_().index_copy_(0, chosen,
                                                    mean[offset: offset + chosen.numel()])
                offset += chosen.numel()

    def state_dict(self) -> dict[str, Any]:
        return {"leader": self.leader, "selection": self.selection.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.leader = state["leader"]
        self.selection.load_state_dict(state["selection"])


@dataclass
class _Leading:
    """One CLT-k launch between its rounds."""

    groups: list[list[TensorInfo]]
    joined: list[torch.Tensor]  # each group's p, flat and back to back
    ks: list[int]
    sizes: list[int]
    own: list[torch.Tensor] | None  # the leader's own selection
    finite: bool
    chosen: list[torch.Tensor] = field(default_factory=list)  # per group, into its joined p
    keyed: dict[str, torch.Tensor] = field(default_factory=dict)  # per tensor, into its own


def _group_info(group: Sequence[TensorInfo]) -> TensorInfo:
    """A group's name and size for its selection's state: its tensor, or ``first..last``."""
    first = group[0]
    if len(group) == 1:
        return first
    return TensorInfo(_name(group), (sum(info.numel for info in group),), first.dtype,
                      first.role, first.device)


def _name(group: Sequence[TensorInfo]) -> str:
    """A group's name for the meter: its key, or ``first..last``."""
    return group[0].key if len(group) == 1 else f"{group[0].key}..{group[-1].key}"


class LowRankBasis(Agreed):
    """PowerSGD's shared basis ``P_hat`` per matrix (Alg. 1 lines 2-7), warm-started Q.

    Args:
        codec: the per-key Q state (:class:`~thinwire.compress.powersgd.PowerSGD`).
    """

    errors_from_mean = True
    entity = "W_grad"

    def __init__(self, codec: PowerSGD) -> None:
        self.codec = codec

    @property
    def density(self) -> float | None:
        return None

    def is_dense(self, info: TensorInfo) -> bool:
        return not self.codec.compresses(info.shape)

    def sizes(self, infos: Sequence[TensorInfo]) -> tuple[str, int, list[int]]:
        rank_r = self.codec.rank
        shapes = [as_matrix(torch.empty(info.shape, device="meta")).shape for info in infos]
        itemsize = infos[0].dtype.itemsize if infos else 0
        return (ALL_REDUCE, sum(rows * rank_r for rows, _ in shapes) * itemsize,
                [cols * rank_r for _, cols in shapes])

    def propose(self, ps: Mapping[str, torch.Tensor], infos: Sequence[TensorInfo], step: int,
                rank: int, n: int, finite: bool) -> Proposal:
        """``P = M Q`` per matrix (zeros where the gradient was not finite), flat."""
        matrices = {}
        for info in infos:  # a rank whose gradient was not finite contributes zeros
            matrix = as_matrix(ps[info.key].view(info.shape))
            matrices[info.key] = matrix if finite else torch.zeros_like(matrix)
        parts = [self.codec.left(info.key, matrices[info.key]).reshape(-1) for info in infos]
        rank_r = self.codec.rank
        buffer = parts[0] if len(parts) == 1 else torch.cat(parts)
        size = buffer.element_size()
        return Proposal(buffer, ALL_REDUCE, [(info.key, matrices[info.key].shape[0] * rank_r
                                              * size) for info in infos],
                        [(info.key, matrices[info.key].shape[1] * rank_r) for info in infos],
                        launch={"infos": list(infos), "matrices": matrices, "p_hats": {}})

    def agree(self, proposal: Proposal, received: torch.Tensor) -> None:
        launch, rank_r, offset = proposal.launch, self.codec.rank, 0
        for info in launch["infos"]:
            rows = launch["matrices"][info.key].shape[0]
            launch["p_hats"][info.key] = orthonormalize(
                received[offset: offset + rows * rank_r].view(rows, rank_r))
            offset += rows * rank_r

    def project(self, proposal: Proposal) -> list[torch.Tensor]:
        """``Q = M^T P_hat`` per matrix, as Q^T flat (column-major Q, as ``finish`` reads it)."""
        launch = proposal.launch
        return [right(launch["matrices"][info.key], launch["p_hats"][info.key]).t().reshape(-1)
                for info in launch["infos"]]

    def remember(self, proposal: Proposal, memory: Any,
                 sent: Sequence[torch.Tensor] | None) -> None:
        raise NotImplementedError("PowerSGD's error is the mean's (errors_from_mean)")

    def place(self, proposal: Proposal, mean: torch.Tensor,
              views: Mapping[str, torch.Tensor], memory: Any, remember: bool) -> None:
        """``G_hat = P_hat mean(Q)^T`` into each view; ``e <- M - G_hat`` (Alg. 2, torch's rule).

        Elementwise maths only (:func:`~thinwire.compress.powersgd.reconstruct`):
        identical bits on every rank whichever thread runs it.
        """
        launch, rank_r, offset = proposal.launch, self.codec.rank, 0
        for info in launch["infos"]:
            rows, cols = launch["matrices"][info.key].shape
            q_mean = mean[offset: offset + cols * rank_r].view(rank_r, cols).t()
            offset += cols * rank_r
            approx = self.codec.finish(info.key, launch["p_hats"][info.key], q_mean,
                                       out=views[info.key].view(rows, cols))
            if remember and memory is not None:
                memory.subtract_(info.key, approx)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.codec.load_state_dict(state["codec"])
