"""Sparsifiers: exact top-k, the DCT reused threshold (Alg. 1) and the Laplace estimate.

Choices every sparsifier here shares (the papers leave them open):

* Zeros are never sent, and ties at the threshold are all kept (the mask is
  Algorithm 1 line 9's ``|x| >= tau``, no sort); the achieved density is traced.
* Every tensor is sparsified by default (:data:`MIN_NUMEL` = 0; Laplace:
  1024, its fit passes nothing on a few entries); ``exclude`` patterns,
  smaller tensors and ``ratio == 1`` travel dense (DCT KDD'21 §3.3 compresses
  only the fully connected layers).
* ``scope="layer"`` (the papers') selects per tensor; ``scope="bucket"`` once
  over all the tensors of a call, so the same total goes where ``|p|`` is
  largest. A group's state is keyed by its first and last keys.
* Payloads have a fixed capacity (:meth:`Sparsifier.capacity`), so a sparse
  exchange is one all-gather; what a threshold passes beyond it waits in the
  error memory. Measured reasons for the defaults: docs/notes/engine.md.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch

from thinwire.compress._select import (
    SAMPLE,
    kth_largest,
    largest_in_order,
    sparse_nonzero,
)
from thinwire.compress.base import TensorInfo, check_fraction, keep_count
from thinwire.compress.cltk import SELECTIONS, layer_k
from thinwire.compress.grouping import regroup, split_ascending
from thinwire.compress.payload import DensePayload, Payload, SparsePayload, decode
from thinwire.compress.pieces import STREAM_RULES

SCOPES = ("layer", "bucket")
MIN_NUMEL = 0  # default: tensors smaller than this travel dense (0: none do)
LAPLACE_MIN_NUMEL = 1024  # the Laplace fit's: it passes nothing on a tensor of a few entries
# Default payload room, in multiples of k. The wire carries the whole capacity every
# step, so it sits just above the target; what a threshold passes beyond it waits in
# the error memory (a tighter room costs a top-k among the few passing entries).
CAPACITY = 1.25
TRACE_LENGTH = 4096  # threshold-trace points kept per key (the most recent)


class Sparsifier(ABC):
    """A selection: which entries of each tensor a step sends, and which travel whole.

    Common machinery: routing small and excluded tensors whole, a payload's room
    (capacity), selection over one tensor or a group of them, a threshold trace.
    How the chosen values and their indices travel is the scheme's (a value
    codec, :mod:`thinwire.compress.values`; an index codec,
    :class:`~thinwire.compress.payload.IndexCodec`).

    Contract of :meth:`_select`: distinct indices; :meth:`_pick` sorts them
    when they do not ascend (the 16-bit index code and the bitmap need them so),
    so a selection of any order is exact on the wire.

    Args:
        min_numel: tensors smaller than this travel whole (default :data:`MIN_NUMEL`).
        capacity: payload room in multiples of the target count k, >= 1
            (default :data:`CAPACITY`; :class:`TopK` never needs more than k).
        exclude: fnmatch patterns of the keys always sent whole; empty: none.
        scope: ``"layer"`` (each tensor at the target density) or ``"bucket"``
            (one selection over all the tensors of a call; :meth:`select_all`).
    """

    def __init__(self, *, min_numel: int = MIN_NUMEL, capacity: float = CAPACITY,
                 exclude: tuple[str, ...] = (), scope: str = "layer") -> None:
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel={min_numel!r} must be an integer >= 0")
        if not (isinstance(capacity, (int, float)) and math.isfinite(capacity)
                and capacity >= 1.0):
            raise ValueError(f"capacity={capacity!r} must be a number >= 1")
        if scope not in SCOPES:
            raise ValueError(f"scope={scope!r} must be one of {SCOPES}")
        self.scope = scope
        self.min_numel = min_numel
        self.exclude = tuple(exclude)
        self.capacity_factor = float(capacity)
        # key -> the last TRACE_LENGTH (call index, threshold, achieved density), for
        # plots (DCT Fig. 2); bounded so long runs do not grow it without end.
        self.trace: dict[str, deque[tuple[int, float, float]]] = {}
        self._calls: dict[str, int] = {}
        self.groups: dict[str, tuple[str, ...]] = {}  # key -> the keys last selected with it

    @property
    @abstractmethod
    def density(self) -> float:
        """Target fraction of entries kept."""

    def is_dense(self, info: TensorInfo) -> bool:
        """Whether ``info``'s tensor travels whole (same answer on every rank)."""
        if any(fnmatchcase(info.key, p) for p in self.exclude):
            return True
        return self.density >= 1.0 or info.numel < self.min_numel

    def capacity(self, numel: int) -> int:
        """Most entries one payload of a ``numel``-entry tensor carries (same on every rank)."""
        return min(numel, math.ceil(self.capacity_factor * keep_count(numel, self.density)
                                    - 1e-9))

    def diagnostics(self) -> dict[str, Any]:
        """What the selection counts about itself, for reports; here nothing."""
        return {}

    def plan(self, infos: Sequence[TensorInfo]) -> tuple[tuple[int, int], ...] | None:
        """``(entries, positions sent)`` of each chunk of ``infos``' tensors laid back to
        back, where every call sends exactly that many of each (the payload then
        carries a chunk code, :data:`~thinwire.compress.payload.CHUNK_FORMATS`); None:
        the count varies (here)."""
        return None

    def compress(self, tensor: torch.Tensor, info: TensorInfo) -> Payload:
        """``tensor``'s selected entries (in its own dtype), or all of it if it travels whole."""
        flat = tensor.reshape(-1)
        if self.is_dense(info):
            return DensePayload(flat)
        indices = self.indices(flat.abs(), info)
        return SparsePayload(flat.index_select(0, indices), indices, flat.numel())

    def decompress(self, payload: Payload, info: TensorInfo) -> torch.Tensor:
        """The dense tensor ``payload`` stands for."""
        return decode(payload, info)

    def indices(self, magnitudes: torch.Tensor, info: TensorInfo) -> torch.Tensor:
        """Indices to send of a sparsified tensor, at most :meth:`capacity` of them.

        Advances ``info.key``'s call count and threshold state and records the trace.

        Args:
            magnitudes: ``|x|``, 1-D (a view of a flat bucket is fine); not modified.
        """
        indices, call, tau = self._pick(magnitudes, info)
        if magnitudes.numel():
            self._trace(info.key, call, tau, indices.numel() / magnitudes.numel())
        return indices

    def select_all(self, magnitudes: torch.Tensor,
                   infos: Sequence[TensorInfo]) -> list[torch.Tensor]:
        """Indices to send of each tensor of ``infos``, whose ``|x|`` lie back to back.

        ``scope="layer"``: :meth:`indices` on each tensor's part. ``scope="bucket"``:
        one selection at the target density over a group of tensors, keyed by the
        group; each tensor's trace records the group's threshold and its own share.
        The group is the call's tensors, except that tensors whose last groups
        are all present are selected in those groups again: DDP builds its
        buckets anew once after its first step, and a resumed run's first
        step, in DDP's first-step buckets, then selects as the uninterrupted
        run did.

        Returns:
            Per tensor, ascending indices into its own part.
        """
        if self.scope == "layer" or not infos:
            parts = magnitudes.split([info.numel for info in infos])
            return [self.indices(part, info) for part, info in zip(parts, infos)]
        return self._select_groups(magnitudes, infos, self.groups_of(infos))

    def select_joined(self, magnitudes: torch.Tensor,
                      infos: Sequence[TensorInfo]) -> tuple[torch.Tensor, list[int]]:
        """:meth:`select_all`'s indices as one ascending list into the tensors laid back
        to back, with each tensor's count. One selection over all of them
        (``scope="bucket"``, one group: the usual case) is neither split nor joined."""
        numels = [info.numel for info in infos]
        if self.scope == "bucket" and len(infos) > 1:
            groups = self.groups_of(infos)
            if groups == [list(range(len(infos)))]:
                picked, call, tau = self._pick_group(magnitudes, infos)
                cuts = torch.searchsorted(picked, torch.tensor(
                    list(itertools.accumulate(numels)), device=picked.device)).tolist()
                counts = [high - low for low, high in zip([0, *cuts], cuts)]
                self._trace_group(infos, counts, call, tau)
                return picked, counts
            local = self._select_groups(magnitudes, infos, groups)
        else:
            local = self.select_all(magnitudes, infos)
        starts = itertools.accumulate(numels[:-1], initial=0)
        shifted = [part + start if start else part for part, start in zip(local, starts)]
        indices = (shifted[0] if len(shifted) == 1 else torch.cat(shifted) if shifted
                   else magnitudes.new_zeros(0, dtype=torch.int64))
        return indices, [part.numel() for part in local]

    def _select_groups(self, magnitudes: torch.Tensor, infos: Sequence[TensorInfo],
                       groups: list[list[int]]) -> list[torch.Tensor]:
        """:meth:`select_all` under ``scope="bucket"``, given the groups."""
        parts = magnitudes.split([info.numel for info in infos])
        out = list(parts)  # each replaced by its tensor's indices below
        for group in groups:
            members = [infos[i] for i in group]
            if len(members) == 1:
                out[group[0]] = self.indices(parts[group[0]], members[0])
                continue
            whole = group == list(range(len(infos)))  # the usual case: no copy
            together = magnitudes if whole else torch.cat([parts[i] for i in group])
            picked, call, tau = self._pick_group(together, members)
            local = split_ascending(picked, [info.numel for info in members])
            for i, chosen in zip(group, local):
                out[i] = chosen
            self._trace_group(members, [chosen.numel() for chosen in local], call, tau)
        return out

    def _pick_group(self, together: torch.Tensor, members: Sequence[TensorInfo]
                    ) -> tuple[torch.Tensor, int, float]:
        """One selection over ``members`` laid back to back, its state keyed by the first
        and last keys: ascending indices, the call index and the threshold."""
        first = members[0]
        return self._pick(together, TensorInfo(f"{first.key}..{members[-1].key}",
                                               (together.numel(),), first.dtype, first.role,
                                               first.device))

    def _trace_group(self, members: Sequence[TensorInfo], counts: Sequence[int], call: int,
                     tau: float) -> None:
        """Each member's trace point: the group's threshold, its own achieved density."""
        for info, count in zip(members, counts):
            if info.numel:
                self._trace(info.key, call, tau, count / info.numel)

    def room(self, infos: Sequence[TensorInfo], *, record: bool = True) -> int:
        """Most entries one payload of ``infos``' tensors carries (same on every rank).

        ``scope="layer"``: each tensor's :meth:`capacity`. ``scope="bucket"``: the
        capacity of each group selected together, so a bucket of many small
        tensors carries no room that its one selection could not fill. It
        records the grouping as :meth:`select_all` does, so a rank that skips a
        non-finite step keeps the same groups, and the same room, as the others;
        without ``record``, a question about ``infos`` as one call records nothing.
        """
        return sum(self.capacity(sum(infos[i].numel for i in group))
                   for group in self.groups_of(infos, record=record))

    @property
    def piece(self) -> int:
        """Entries per piece a large bucket travels in (:mod:`thinwire.compress.pieces`); 0: whole.

        Only a per-tensor threshold that keeps each entry on its own
        (:class:`DCTThreshold`) cuts; a selection over a whole tensor or
        bucket (top-k, a Laplace fit) must see all of it first.
        """
        return 0

    def groups_of(self, infos: Sequence[TensorInfo], *,
                  record: bool = True) -> list[list[int]]:
        """Positions in ``infos`` of each group selected together: each tensor alone
        (``scope="layer"``), or the call's tensors (``"bucket"``), regrouped as they were
        last selected (:func:`~thinwire.compress.grouping.regroup`; recorded unless not
        ``record``)."""
        if self.scope == "layer":
            return [[i] for i in range(len(infos))]
        return regroup(self.groups if record else dict(self.groups),
                       [info.key for info in infos])

    def _pick(self, magnitudes: torch.Tensor,
              info: TensorInfo) -> tuple[torch.Tensor, int, float]:
        """Indices (at most the room), the call index and the threshold; advances the count."""
        if magnitudes.numel() == 0:
            return torch.zeros(0, dtype=torch.int64, device=magnitudes.device), 0, 0.0
        call = self._calls.get(info.key, 0)
        self._calls[info.key] = call + 1
        indices, tau = self._select(magnitudes, info, call)
        if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
            indices = indices.sort().values  # the contract, kept where it is made
            if bool((indices[1:] == indices[:-1]).any()):
                raise ValueError(f"{type(self).__name__} selected an index of {info.key!r} "
                                 "twice; a selection's indices must be distinct")
        room = self.capacity(magnitudes.numel())
        if indices.numel() > room:  # the largest go now, the rest stay in the error memory
            indices = indices.index_select(
                0, largest_in_order(magnitudes.index_select(0, indices), room))
        return indices, call, tau

    def _trace(self, key: str, call: int, tau: float, density: float) -> None:
        self.trace.setdefault(key, deque(maxlen=TRACE_LENGTH)).append((call, tau, density))

    @abstractmethod
    def _select(
        self, magnitudes: torch.Tensor, info: TensorInfo, call: int
    ) -> tuple[torch.Tensor, float]:
        """Indices to send and the threshold they passed."""

    def state_dict(self) -> dict[str, Any]:
        return {"calls": dict(self._calls), "groups": dict(self.groups)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._calls = dict(state["calls"])
        self.groups = dict(state.get("groups", {}))  # a checkpoint without groups: none yet


def _above(magnitudes: torch.Tensor, tau: float, density: float | None = None) -> torch.Tensor:
    """Ascending indices of the entries at or above ``tau`` (above 0 when ``tau`` is 0);
    ``density``: the fraction expected to pass (:func:`sparse_nonzero`)."""
    return sparse_nonzero(magnitudes >= tau if tau > 0 else magnitudes > 0, density)


class TopK(Sparsifier):
    """Exact top-k of ``|x|`` on every call: the copy-and-sort baseline of DCT Fig. 7a.

    Args:
        ratio: fraction of entries kept, in (0, 1].
    """

    def __init__(self, ratio: float, **kwargs: Any) -> None:
        check_fraction("ratio", ratio, 0.0, 1.0, closed_low=False, closed_high=True)
        super().__init__(**kwargs)
        self.ratio = ratio

    @property
    def density(self) -> float:
        return self.ratio

    def capacity(self, numel: int) -> int:
        """Exactly k: top-k never selects more."""
        return keep_count(numel, self.ratio)

    def _select(
        self, magnitudes: torch.Tensor, info: TensorInfo, call: int
    ) -> tuple[torch.Tensor, float]:
        k = keep_count(magnitudes.numel(), self.ratio)
        indices = largest_in_order(magnitudes, k)  # ascending: the 16-bit code needs no sort
        top = magnitudes.index_select(0, indices)
        tau = float(top.min())  # one read in the usual case: no zero among the k largest
        if tau > 0:
            return indices, tau
        keep = top > 0  # fewer than k nonzero entries (or a NaN): zeros are not sent
        top = top[keep]
        return indices[keep], float(top.min()) if top.numel() else 0.0


class DCTThreshold(Sparsifier):
    """DCT-DP's reused top-K threshold, per tensor (DCT KDD'21 Algorithm 1).

    Every ``life_span`` calls for a key (lines 4-6) tau is recomputed as the
    k-th largest ``|x|``, ``k = ceil(N ratio)``, by exact candidate selection
    (:func:`~thinwire.compress._select.kth_largest`); between refreshes it is
    reused (line 8) and the mask is ``|x| >= tau`` (line 9). Algorithm 1 indexes
    the sort at ``floor(N eta)``, one entry more than the target; we keep
    exactly k, so ``life_span=1`` is :class:`TopK`. ``refresh_above=f``
    recomputes a reused tau that passes more than ``f k`` entries. ``gain=g``
    nudges the reused tau each call, ``tau *= exp(g (sent / k - 1))`` (sent/k
    capped at 16): an integral controller on the mean of sent that needs no
    selection, because under error feedback the memory piles up just below a
    reused tau and a refresh barely moves it (docs/notes/engine.md). When zeros
    leave fewer than k entries, the target is what can be sent; a reused tau of
    0 that passes more than k entries is recomputed at once.

    Args:
        ratio: fraction ``1 - eta`` of entries kept, in (0, 1]; 1 sends dense.
        life_span: L, calls between threshold refreshes, >= 1.
        refresh_above: recompute a reused tau that keeps more than this many
            times the target count; None (default) never does. Must be > 1.
        gain: the density control's gain g, in (0, 1]; None (default)
            keeps tau fixed between refreshes.
        piece: entries per piece in which the engine sends a bucket of at
            least two pieces' worth of sparse entries on the CPU
            (:mod:`thinwire.compress.pieces`); 0 (default here; the dct-dp
            scheme's default is :data:`~thinwire.compress.pieces.PIECE_ENTRIES`)
            sends each bucket as one payload.
        stream: when the engine sends in pieces: ``"always"`` (default here),
            or ``"auto"`` (the dct-dp scheme's default), once a bucket's timed
            rounds of one payload show that pieces pay on this link
            (:func:`thinwire.compress.pieces.pay`).
    """

    def __init__(self, ratio: float, life_span: int = 1000,
                 refresh_above: float | None = None, gain: float | None = None,
                 piece: int = 0, stream: str = "always", **kwargs: Any) -> None:
        check_fraction("ratio", ratio, 0.0, 1.0, closed_low=False, closed_high=True)
        if not isinstance(life_span, int) or life_span < 1:
            raise ValueError(f"life_span={life_span!r} must be an integer >= 1")
        if refresh_above is not None and not refresh_above > 1.0:
            raise ValueError(f"refresh_above={refresh_above!r} must be None or > 1")
        if gain is not None:
            check_fraction("gain", gain, 0.0, 1.0, closed_low=False, closed_high=True)
        if isinstance(piece, bool) or not isinstance(piece, int) or piece < 0:
            raise ValueError(f"piece={piece!r} must be an integer >= 0 (0: one payload)")
        if stream not in STREAM_RULES:
            raise ValueError(f"stream={stream!r} must be one of {STREAM_RULES}")
        super().__init__(**kwargs)
        self._piece = piece
        self.stream = stream
        self.ratio = ratio
        self.life_span = life_span
        self.refresh_above = refresh_above
        self.gain = gain
        self.tau: dict[str, float] = {}
        self.refreshes: dict[str, int] = {}

    @property
    def density(self) -> float:
        return self.ratio

    def _select(
        self, magnitudes: torch.Tensor, info: TensorInfo, call: int
    ) -> tuple[torch.Tensor, float]:
        k = keep_count(magnitudes.numel(), self.density)
        key = info.key
        fresh = call % self.life_span == 0 or key not in self.tau
        if fresh:
            self._refresh(magnitudes, key, k)
        indices = _above(magnitudes, self.tau[key], self.density)
        if not fresh and self._stale(self.tau[key], indices.numel(), k):
            self._refresh(magnitudes, key, k)
            indices = _above(magnitudes, self.tau[key], self.density)
        tau = self.tau[key]
        if self.gain is not None and tau > 0:
            room = self.capacity(magnitudes.numel())
            self.tau[key] = tau * correction(self.gain, magnitudes, indices.numel(), k, room)
        return indices, tau

    def diagnostics(self) -> dict[str, Any]:
        """The threshold recomputations (Alg. 1 lines 4-6) per tensor."""
        return {"threshold_refreshes": dict(self.refreshes)}

    @property
    def piece(self) -> int:
        """The ``piece`` option, per tensor (``scope="layer"``) and without the budget
        guard (whose refresh re-selects a whole tensor at once); else 0."""
        return self._piece if self.scope == "layer" and self.refresh_above is None else 0

    def reused(self, info: TensorInfo) -> bool:
        """Whether this call reuses ``info``'s tau (Alg. 1 line 8): known before its magnitudes."""
        return info.key in self.tau and self._calls.get(info.key, 0) % self.life_span != 0

    def open_call(self, magnitudes: torch.Tensor | None, info: TensorInfo) -> float:
        """Begin a call on ``info``'s tensor in pieces; its threshold for this call.

        A refresh (lines 4-6) needs the whole tensor's ``magnitudes``; a reused
        tau does not (None is fine). Finish with :meth:`close_call`.
        """
        if not self.reused(info):
            if magnitudes is None:
                raise ValueError(f"{info.key!r}: a refresh call needs the tensor's magnitudes")
            self._refresh(magnitudes, info.key, keep_count(info.numel, self.density))
        return self.tau[info.key]

    def pick(self, magnitudes: torch.Tensor, tau: float,
             room: int) -> tuple[torch.Tensor, int]:
        """Ascending indices of a part's entries at or above ``tau`` (line 9), at most
        ``room`` of them (the largest); and how many passed before that cut."""
        indices = _above(magnitudes, tau, self.density)
        passed = indices.numel()
        if passed > room:
            indices = indices.index_select(
                0, largest_in_order(magnitudes.index_select(0, indices), room))
        return indices, passed

    def close_call(self, magnitudes: torch.Tensor, info: TensorInfo, passed: int,
                   sent: int) -> None:
        """End a call begun by :meth:`open_call`: count it, trace it, move tau for the next.

        As :meth:`_select` does, except that a stale tau (0, passing more than
        k) is refreshed for the next call instead of this one: the pieces
        sent with it are on the wire already.

        Args:
            magnitudes: the whole tensor's ``|p|`` of this call.
            passed: entries at or above tau over all the parts.
            sent: entries sent (``passed`` less what the parts' rooms cut).
        """
        key, numel = info.key, info.numel
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        k = keep_count(numel, self.density)
        tau = self.tau[key]
        if self._stale(tau, passed, k):
            self._refresh(magnitudes, key, k)
        elif self.gain is not None and tau > 0:
            room = self.capacity(numel)
            self.tau[key] = tau * correction(self.gain, magnitudes, passed, k, room)
        self._trace(key, call, tau, sent / numel)

    def _stale(self, tau: float, count: int, k: int) -> bool:
        """Whether a reused tau passing ``count`` entries is recomputed at once."""
        if count <= k:
            return False
        return tau == 0.0 or (self.refresh_above is not None and count > self.refresh_above * k)

    def _refresh(self, magnitudes: torch.Tensor, key: str, k: int) -> None:
        """tau = the k-th largest magnitude (Alg. 1 lines 5-6), by selection."""
        self.tau[key] = float(kth_largest(magnitudes, k))
        self.refreshes[key] = self.refreshes.get(key, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "tau": dict(self.tau), "refreshes": dict(self.refreshes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.tau = dict(state["tau"])
        self.refreshes = dict(state["refreshes"])


_CLAMP = 16.0  # most count / target one density correction acts on


def correction(gain: float, magnitudes: torch.Tensor, count: int, k: int, room: int) -> float:
    """The factor ``exp(gain * (sent / target - 1))`` a threshold takes for the next call:
    an integral controller that holds the mean of what is sent at the target k.

    ``sent`` is what goes out of ``count`` passing entries with room for
    ``room``, so the mean of what is sent, not of what passes, is held at k;
    a count beyond twice the room counts in full, so tau does not stay so low
    that selecting the room's largest among the passing entries grows costly.
    """
    target = k if count >= k else min(k, _nonzero_at_least(magnitudes, k))
    sent = count if count > 2 * room else min(count, room)
    if sent == target:
        return 1.0
    return math.exp(gain * (min(sent / target, _CLAMP) - 1.0))


def _nonzero_at_least(magnitudes: torch.Tensor, k: int) -> int:
    """The count of non-zero entries, or ``k`` when a strided sample shows plainly more.

    An exact count costs a pass over the tensor; the density control only
    needs it when zeros may leave fewer than ``k`` entries to send (an
    embedding's untouched rows). When at least twice the fraction ``k / N``
    of a strided sample of :data:`~thinwire.compress._select.SAMPLE` entries
    is non-zero, the answer is taken to be ``k`` without counting. (Non-zeros
    striped in step with the sample can pass for more than they are; the
    control then aims at k, as it does on a dense layer.)
    """
    numel = magnitudes.numel()
    if numel > 4 * SAMPLE:
        sample = magnitudes[:: numel // SAMPLE]
        if int(torch.count_nonzero(sample)) * numel >= 2 * k * sample.numel():
            return k
    return int(torch.count_nonzero(magnitudes))


class Selection(Sparsifier):
    """ScaleCom's local selection: ``k`` entries of each tensor (or group), exact top-k or
    the largest of each of ``k`` chunks (:data:`~thinwire.compress.cltk.SELECTIONS`).

    Exactly ``k = layer_k(N, ratio, k)`` entries go, zeros included, so the
    payload's room is k.

    Args:
        ratio: fraction of entries kept, in (0, 1].
        k: entries kept per tensor instead of ``ratio`` (capped at its size).
        selection: ``"exact"`` or ``"chunk"``.
    """

    def __init__(self, ratio: float, *, k: int | None = None, selection: str = "exact",
                 **kwargs: Any) -> None:
        check_fraction("ratio", ratio, 0.0, 1.0, closed_low=False, closed_high=True)
        if selection not in SELECTIONS:
            raise ValueError(f"selection={selection!r} must be one of {sorted(SELECTIONS)}")
        super().__init__(**kwargs)
        self.ratio, self.k, self.selection = ratio, k, selection

    @property
    def density(self) -> float:
        return self.ratio

    def is_dense(self, info: TensorInfo) -> bool:
        """Whole when empty, small or excluded; ``ratio=1`` still selects."""
        return (info.numel == 0 or info.numel < self.min_numel
                or any(fnmatchcase(info.key, p) for p in self.exclude))

    def capacity(self, numel: int) -> int:
        """Exactly k."""
        return layer_k(numel, self.ratio, self.k)

    def _select(
        self, magnitudes: torch.Tensor, info: TensorInfo, call: int
    ) -> tuple[torch.Tensor, float]:
        indices = SELECTIONS[self.selection](magnitudes, self.capacity(magnitudes.numel()))
        return indices, float(magnitudes.index_select(0, indices).min()) if indices.numel() \
            else 0.0


class LaplaceThreshold(Sparsifier):
    """O(N) threshold from a Laplace fit of the entries (DCT MLSys §2.2, App. B).

    The paper fits a Laplace law to the entries and reads tau off its quantile
    function. We threshold magnitudes, so we fit the zero-centred Laplace whose
    magnitude is exponential with maximum-likelihood scale ``b = mean(|x|)``;
    then ``P(|X| >= tau) = ratio`` gives ``tau = b * ln(1 / ratio)``.
    One pass over the tensor, no selection. The achieved density drifts from
    the target as the fit does (the paper's Fig. 6b, which leaves it as a caveat
    "beyond the scope of this paper"); it is in :attr:`trace`. Gradients have
    heavier tails than the fit, so ``mean(|x|)`` overstates the scale and fewer
    entries pass than asked: on text-lm at 7 % about 3 %, in a payload with room
    for 7 %. ``gain=g`` corrects the estimate with the integral controller of
    :class:`DCTThreshold` (:func:`correction`): each key's factor on tau is
    multiplied by ``exp(g (sent / k - 1))`` after each call, so the mean of what
    is sent is held at the target while the fit still sets the threshold's scale.

    Args:
        ratio: target fraction ``1 - eta`` of entries kept, in (0, 1].
        gain: the controller's gain g, in (0, 1]; None (default): the paper's
            estimate as it is.
    """

    def __init__(self, ratio: float, gain: float | None = None, **kwargs: Any) -> None:
        check_fraction("ratio", ratio, 0.0, 1.0, closed_low=False, closed_high=True)
        if gain is not None:
            check_fraction("gain", gain, 0.0, 1.0, closed_low=False, closed_high=True)
        kwargs.setdefault("min_numel", LAPLACE_MIN_NUMEL)
        super().__init__(**kwargs)
        self.ratio = ratio
        self.gain = gain
        self.scale: dict[str, float] = {}  # key -> the controller's factor on the estimate

    @property
    def density(self) -> float:
        return self.ratio

    def threshold(self, magnitudes: torch.Tensor) -> float:
        """The Laplace estimate of tau for these magnitudes."""
        return float(magnitudes.mean()) * -math.log(self.ratio)

    def _select(
        self, magnitudes: torch.Tensor, info: TensorInfo, call: int
    ) -> tuple[torch.Tensor, float]:
        scale = self.scale.get(info.key, 1.0)
        tau = self.threshold(magnitudes) * scale
        indices = _above(magnitudes, tau, self.density)
        if self.gain is not None and tau > 0:
            k = keep_count(magnitudes.numel(), self.density)
            room = self.capacity(magnitudes.numel())
            self.scale[info.key] = scale * correction(self.gain, magnitudes, indices.numel(),
                                                      k, room)
        return indices, tau

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "scale": dict(self.scale)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.scale = dict(state.get("scale", {}))  # saved before the controller: none
