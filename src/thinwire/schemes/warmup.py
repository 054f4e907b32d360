"""Compression warm-up: a scheme's first steps all-reduced dense, then the scheme itself.

ScaleCom trains its first epochs uncompressed (App. E.4) and Deep Gradient
Compression ramps its sparsity up over the first epochs (§3.3): the early
gradients change fastest, when an error memory lags them most. :class:`Warmup`
wraps any scheme: for its first ``steps`` steps every bucket is averaged by
one all-reduce, bit for bit what ``dense`` sends, and then the wrapped scheme
takes over as if at its own first step. A coupled memory (the optimiser's
momentum moved into the workers) is carried through the dense steps by its
own contract (``compensate``, ``update`` with everything sent, ``settle``),
so the optimiser steps as it would with nothing dropped.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from thinwire.comm import Meter, all_reduce_mean, world
from thinwire.comm._metered import record_segments
from thinwire.comm.collectives import Future, Group, split_flat
from thinwire.compress import TensorInfo
from thinwire.feedback import Memory, check_policy
from thinwire.schemes.base import Scheme
from thinwire.schemes.traits import Traits


class Warmup(Scheme):
    """Average dense for the first ``steps`` steps, then hand over to ``scheme``.

    A step ends at a launch with ``last`` (DDP's last bucket; every
    :meth:`launch` of a dict is a step of its own). The count of steps is in
    :meth:`state_dict`, so a resume on either side of the switch is exact.

    Args:
        scheme: the scheme to warm up (from :func:`thinwire.schemes.build`).
        steps: steps averaged dense, >= 0.
        nonfinite: ``"raise"`` or ``"skip"`` on a non-finite gradient during the
            dense steps; None: the wrapped scheme's own option, else ``"raise"``.

    Raises:
        ValueError: ``steps`` not an integer >= 0, or an unknown ``nonfinite``.
        TypeError: ``scheme`` is not a :class:`Scheme`.
    """

    def __init__(self, scheme: Scheme, steps: int, nonfinite: str | None = None) -> None:
        if not isinstance(scheme, Scheme):
            raise TypeError(f"expected a Scheme to warm up, got {type(scheme).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps={steps!r} must be an integer >= 0 (steps sent dense)")
        self.scheme = scheme  # before Scheme.__init__, which sets these through it
        kept = scheme.meter, scheme.energy, scheme.overhead_s, scheme.skipped
        super().__init__()
        scheme.meter, scheme.energy, scheme.overhead_s, scheme.skipped = kept
        self._overhead_s = 0.0  # the dense steps' own
        self._skipped = 0
        self.steps = steps
        own = getattr(scheme.origin[1], "nonfinite", None) if scheme.origin else None
        self.nonfinite = check_policy(nonfinite or own or "raise")
        self.step = 0  # steps seen so far
        self.origin = scheme.origin

    @property
    def meter(self) -> Meter | None:
        """The wrapped scheme's meter (setting one sets it there)."""
        return self.scheme.meter

    @meter.setter
    def meter(self, meter: Meter | None) -> None:
        self.scheme.meter = meter

    @property
    def energy(self) -> dict[str, list[float]] | None:
        """The wrapped scheme's energy record (set to ``{}`` to record)."""
        return self.scheme.energy

    @energy.setter
    def energy(self, energy: dict[str, list[float]] | None) -> None:
        self.scheme.energy = energy

    @property
    def overhead_s(self) -> float:
        """Seconds of codec and memory work, the dense steps' and the wrapped scheme's."""
        return self._overhead_s + self.scheme.overhead_s

    @overhead_s.setter
    def overhead_s(self, seconds: float) -> None:
        self._overhead_s = seconds - self.scheme.overhead_s

    @property
    def skipped(self) -> int:
        """Rounds dropped as non-finite, in the dense steps and by the wrapped scheme."""
        return self._skipped + self.scheme.skipped

    @skipped.setter
    def skipped(self, count: int) -> None:
        self._skipped = count - self.scheme.skipped

    @property
    def warm(self) -> bool:
        """Whether the wrapped scheme sends (the dense steps are over)."""
        return self.step >= self.steps

    @property
    def traits(self) -> Traits:
        """The wrapped scheme's: what it is once warm."""
        return self.scheme.traits

    @property
    def error_memory(self) -> Memory | None:
        return self.scheme.error_memory

    def couple_memory(self, memory: Memory) -> None:
        self.scheme.couple_memory(memory)

    @property
    def trace(self) -> Mapping[str, Sequence[tuple[int, float, float]]]:
        return self.scheme.trace

    def launch(self, grads: Mapping[str, torch.Tensor], group: Group = None) -> Future[Any]:
        """Average ``grads`` (not modified): one step."""
        if self.warm:
            self.step += 1
            return self.scheme.launch(grads, group)
        return self._via_flat(grads, group)

    def launch_flat(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
                    group: Group = None, *, last: bool = True) -> Future[Any]:
        """Average one bucket in place: dense while warming up, else the wrapped scheme's."""
        warm = self.warm
        if last:
            self.step += 1
        if warm:
            return self.scheme.launch_flat(buffer, infos, group, last=last)
        return self._dense(buffer, infos, group)

    def _dense(self, buffer: torch.Tensor, infos: Sequence[TensorInfo],
               group: Group) -> Future[Any]:
        """One all-reduce of the bucket; a coupled memory compensates, forgets what it sent
        (all of it) and settles the mean, so its state moves as with nothing dropped."""
        start = time.perf_counter()
        views = dict(zip([info.key for info in infos],
                         split_flat(buffer, [info.numel for info in infos])))
        finite = self._finite(views, self.nonfinite, buffer)
        memory = self.scheme.error_memory
        if not finite:
            buffer.zero_()  # contribute nothing; the memory stays as it was
        elif memory is not None:
            memory.advance_(views)
            memory.compensate_all_(views)
            for key, view in views.items():
                if memory.forgets_what_is_sent:
                    memory.buffers.pop(key, None)
                else:
                    memory.update(key, view, view)
        record_segments(self.meter, "W_grad", "all_reduce",
                        [(info.key, info.numel * buffer.element_size()) for info in infos],
                        world(group)[1])
        future = all_reduce_mean(buffer, group)
        self._charge(time.perf_counter() - start)
        if memory is None or not finite:
            return future

        def settle(done: Future[Any]) -> torch.Tensor:
            for key, view in views.items():
                memory.settle_(key, view)
            return buffer

        return future.then(self._charged(settle))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "skipped": self._skipped, "scheme": self.scheme.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises:
            ValueError: ``state`` is not a :class:`Warmup`'s (the wrapped scheme's own)."""
        if "step" not in state or "scheme" not in state:
            raise ValueError("this state was saved from a scheme without a warm-up: load it "
                             "into the wrapped scheme (warmup.scheme.load_state_dict)")
        self.scheme.load_state_dict(state["scheme"])
        self.step = int(state["step"])
        self._skipped = int(state["skipped"])


def warm_up(scheme: Scheme, steps: int) -> Scheme:
    """``scheme`` averaged dense for its first ``steps`` steps (:class:`Warmup`); ``scheme``
    itself when ``steps`` is 0."""
    return Warmup(scheme, steps) if steps else scheme
