"""The scheme contract every front door talks to: launch, reduce, traits, state."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from thinwire.comm import Meter
from thinwire.comm.collectives import Future, Group, collect, split_flat
from thinwire.compress import TensorInfo
from thinwire.feedback import Memory, all_finite
from thinwire.schemes.traits import Traits

T = TypeVar("T")


class Scheme(ABC):
    """Averages named gradients across a group, compressed.

    ``launch`` returns a future of the averaged gradients; ``reduce`` waits
    for it (for loops without DDP). Per-tensor state is keyed by name, never
    by position, so it survives DDP re-bucketing.

    Attributes:
        meter: records the bytes handed to torch.distributed (set by the caller).
        overhead_s: seconds spent compressing, decompressing and in memory.
        skipped: rounds whose gradients were non-finite and dropped (``skip``).
        origin: (registered name, config) when built by ``schemes.build``.
        given: the options ``schemes.build`` was given (the rest are the config's
            defaults, which :func:`thinwire.ddp.register` may choose per optimiser).
        warmup_steps: launches of each tensor averaged dense before the scheme
            compresses it (the config's ``warmup_steps``, set by ``schemes.build``).
        coupled: the memory :meth:`couple_memory` put in place of the scheme's own
            (:func:`thinwire.optim.couple`), else None.
    """

    origin: tuple[str, Any] | None = None
    given: frozenset[str] = frozenset()
    warmup_steps = 0
    coupled: Memory | None = None

    def __init__(self) -> None:
        self.meter: Meter | None = None
        self.overhead_s = 0.0
        self.skipped = 0
        # Set to {} to record, where traits.energy: key -> per launch, the share of this
        # rank's own top-k energy that the shared indices captured.
        self.energy: dict[str, list[float]] | None = None
        self._lock = threading.Lock()
        self._scratch: torch.Tensor | None = None  # |p|, reused across launches

    def _magnitudes(self, buffer: torch.Tensor) -> torch.Tensor:
        """Room for ``|p|`` of ``buffer`` (1-D): a scratch tensor kept between launches (a
        fresh one of a large bucket costs its page faults on every launch on CPU)."""
        scratch = self._scratch
        if (scratch is None or scratch.numel() < buffer.numel() or scratch.dtype != buffer.dtype
                or scratch.device != buffer.device):
            scratch = self._scratch = torch.empty_like(buffer)
        return scratch[: buffer.numel()]

    @abstractmethod
    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Start averaging ``grads`` (not modified); the future holds a dict of results."""

    def reduce(self, grads: Mapping[str, torch.Tensor],
               group: Group = None) -> dict[str, torch.Tensor]:
        """Average ``grads`` across ``group`` and wait for the result."""
        result: dict[str, torch.Tensor] = self.launch(grads, group).wait()
        return result

    def launch_flat(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                    group: Group = None, *, last: bool = True) -> Future[Any]:
        """Average the tensors laid out back to back in the 1-D ``buffer`` (a DDP bucket).

        This default splits ``buffer`` into views, runs :meth:`launch` on them
        and copies the results back; schemes with a flat engine override it.

        Args:
            last: whether this is the step's last launch (DDP's last bucket). A
                scheme with dependent rounds may leave a launch that is not the
                last waiting for its first round until the next launch; its future
                then completes once a launch with ``last`` has run.

        Returns:
            A future holding ``buffer``, overwritten with the mean over ranks.
        """
        views = split_flat(buffer, [info.numel for info in infos])
        grads = {info.key: view.view(info.shape) for info, view in zip(infos, views)}

        def write(fut: Future[Any]) -> torch.Tensor:
            reduced = fut.value()
            for info, view in zip(infos, views):
                view.copy_(reduced[info.key].reshape(-1))
            return buffer

        return self.launch(grads, group).then(write)

    @property
    def started(self) -> bool:
        """Whether the scheme has launched or loaded state, which a rebuild
        (:func:`thinwire.schemes.rebuild`) would not keep. Here: a skipped round."""
        return self.skipped > 0

    @property
    def traits(self) -> Traits:
        """What this scheme is (:class:`~thinwire.schemes.traits.Traits`): the layers
        above read this, never the scheme's class. Here: a dense all-reduce."""
        return Traits()

    def diagnostics(self) -> dict[str, Any]:
        """What the scheme counts about itself, for reports (DCT-DP's threshold refreshes
        per tensor, the buckets it chose to stream); here nothing."""
        return {}

    @property
    def trace(self) -> Mapping[str, Sequence[tuple[int, float, float]]]:
        """Per tensor, its threshold's recent (call, threshold, achieved density); empty
        where nothing is thresholded."""
        return {}

    @property
    def error_memory(self) -> Memory | None:
        """The error feedback of a sparsifier, into which :func:`thinwire.optim.couple`
        moves the optimiser's momentum; None: nothing to couple."""
        return None

    def payload_bytes(self, infos: Sequence[TensorInfo],
                      step: int | None = None) -> dict[str, int]:
        """The bytes one launch of ``infos`` hands each collective, by collective (here:
        one all-reduce of the tensors as they are)."""
        return {"all_reduce": sum(info.numel * info.dtype.itemsize for info in infos)}

    def encode_row(self, buffer: torch.Tensor,
                   infos: Sequence[TensorInfo]) -> tuple[torch.Tensor, list[tuple[str, str, int]]]:
        """This rank's payload as one row another process decodes alone (a push).

        Raises:
            TypeError: the scheme's exchange is not one rank's payload (here: always).
        """
        raise TypeError(f"{type(self).__name__} does not encode one rank's payload alone")

    def decode_rows(self, rows: Sequence[torch.Tensor],
                    infos: Sequence[TensorInfo]) -> torch.Tensor:
        """The mean of several ranks' :meth:`encode_row` rows, as an exchange averages them.

        Raises:
            TypeError: as :meth:`encode_row`.
        """
        raise TypeError(f"{type(self).__name__} does not decode one rank's payload alone")

    def decode_row(self, row: torch.Tensor, infos: Sequence[TensorInfo]) -> torch.Tensor:
        """The flat tensor one :meth:`encode_row` row stands for."""
        return self.decode_rows([row], infos)

    def couple_memory(self, memory: Memory) -> None:
        """Put ``memory`` (a coupling that wraps :attr:`error_memory`) in its place.

        Raises:
            TypeError: the scheme has no error memory to couple.
        """
        raise TypeError(f"{type(self).__name__} has no error memory to couple")

    def _via_flat(self, grads: Mapping[str, torch.Tensor], group: Group) -> Future[Any]:
        """:meth:`launch` through :meth:`launch_flat`: ``grads`` (not modified) copied into
        one flat buffer per dtype and device, so a dict and a DDP bucket take one path."""
        groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
        for key, grad in grads.items():
            groups.setdefault((grad.dtype, grad.device), []).append(key)
        futures = []
        for keys in groups.values():
            buffer = torch.cat([grads[key].reshape(-1) for key in keys])
            futures.append(self.launch_flat(buffer, [TensorInfo.of(key, grads[key])
                                                     for key in keys], group))

        def split(fut: Future[Any]) -> dict[str, torch.Tensor]:
            out: dict[str, torch.Tensor] = {}
            for keys, done_future in zip(groups.values(), fut.value()):
                views = split_flat(done_future.value(), [grads[key].numel() for key in keys])
                out.update({key: view.view(grads[key].shape) for key, view in zip(keys, views)})
            return {key: out[key] for key in grads}

        both = collect(futures, [device for _, device in groups])
        return both.then(split)

    def _charge(self, seconds: float) -> None:
        with self._lock:
            self.overhead_s += seconds

    def _charged(self, callback: Callable[[Any], T]) -> Callable[[Any], T]:
        """``callback`` (of a future, or of a round's result), its seconds charged to
        :attr:`overhead_s`: the codec's time after the exchange, not the wait for it."""
        def timed(arrived: Any) -> T:
            begin = time.perf_counter()
            try:
                return callback(arrived)
            finally:
                self._charge(time.perf_counter() - begin)

        return timed

    def _finite(self, grads: Mapping[str, torch.Tensor], policy: str,
                flat: torch.Tensor | None = None) -> bool:
        """Whether this round's gradients are finite on every rank (one reduction); a
        skipped round is counted (see :func:`thinwire.feedback.all_finite`)."""
        finite = all_finite(grads, policy, flat=flat)
        if not finite:
            self.skipped += 1
        return finite

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = state["skipped"]


def count_step(steps: dict[str, int], keys: Iterable[str]) -> int:
    """A launch's step, that of its first key, so the tensors launched together (a DDP
    bucket) share it; advances every key's count in ``steps``."""
    keys = list(keys)
    step = steps.get(keys[0], 0) if keys else 0
    for key in keys:
        steps[key] = steps.get(key, 0) + 1
    return step
