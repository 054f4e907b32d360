"""One-step-delayed update: step t applies the mean of step t-1, whose exchange ran under step t.

Each bucket's gradient leaves on a copy of its own; DDP is handed, for the
same parameters, the mean of the step before, which has had a whole forward
and backward pass to arrive. The first step applies zeros. The same mean is
applied one step later, so the model moves as SGD with a gradient one step
stale (DC-ASGD's delay 1, synchronously), and the link time hides behind the
compute up to one step's worth. DDP builds its buckets anew after its first
step, so means are matched to parameters by name, not by bucket.

Use: ``state = thinwire.ddp.register(net, scheme, delay=True)``; ``state.state_dict()``
holds the means in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from thinwire.comm.collectives import Future, collect, done, split_flat
from thinwire.compress import TensorInfo


class OneStepDelay:
    """The means in flight, by the step that sent them (module docstring)."""

    def __init__(self) -> None:
        # (the bucket's tensors, the future of their mean): last step's, and this step's
        self._previous: list[tuple[list[TensorInfo], Future[Any]]] = []
        self._current: list[tuple[list[TensorInfo], Future[Any]]] = []

    def swap(self, buffer: torch.Tensor, infos: Sequence[TensorInfo], launched: Future[Any],
             last: bool) -> Future[Any]:
        """Keep ``launched`` (the mean of this step's bucket, computed on a copy) for the next
        step; return a future of ``buffer`` holding last step's mean of the same tensors
        (zeros at the first step).

        Args:
            buffer: DDP's bucket, the tensors of ``infos`` back to back; overwritten.
            last: whether this is the step's last bucket (the step then ends).
        """
        self._current.append((list(infos), launched))
        wanted = {info.key for info in infos}
        sources = [(held, future) for held, future in self._previous
                   if wanted & {info.key for info in held}]
        if last:
            self._previous, self._current = self._current, []
        if not sources:  # the first step: nothing has arrived yet
            return done(buffer.zero_())
        views = dict(zip([info.key for info in infos],
                         split_flat(buffer, [info.numel for info in infos])))

        def fill(arrived: Future[Any]) -> torch.Tensor:
            buffer.zero_()  # a tensor no earlier step sent (unused then) applies nothing
            for (held, _), future in zip(sources, arrived.value()):
                for info, mean in zip(held, split_flat(future.value(),
                                                       [i.numel for i in held])):
                    if info.key in views:
                        views[info.key].copy_(mean)
            return buffer

        return collect([future for _, future in sources], [buffer.device]).then(fill)

    def state_dict(self) -> dict[str, Any]:
        """The means not yet applied, by parameter name (waits for them: take it between
        steps, at the same step on every rank)."""
        means = {}
        for held, future in self._previous:
            for info, mean in zip(held, split_flat(future.wait(), [i.numel for i in held])):
                means[info.key] = mean.clone()
        return {"means": means}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the next step applies these means."""
        self._previous = [([TensorInfo(key, (mean.numel(),), mean.dtype, "W_grad",
                                       mean.device)], done(mean.clone()))
                          for key, mean in state["means"].items()]
        self._current = []
