"""A progress bar of training steps that appears at the first step, not before."""

from __future__ import annotations

from typing import Any


class StepBar:
    """A progress bar of training steps, drawn by one rank, that starts at the first step.

    Created before training, it draws nothing until :meth:`update` is first
    called, so starting the processes, loading data and the peers' checks do
    not count as a step (nor inflate the estimate of the time left).

    Args:
        total: steps the bar covers.
        show: draw it (typically ``rank == 0``); else every call is a no-op.
        unit: what one step is called.
    """

    def __init__(self, total: int, show: bool, unit: str = "step") -> None:
        self.total, self.show, self.unit = total, show, unit
        self._bar: Any = None

    def update(self, steps: int = 1, description: str | None = None) -> None:
        if not self.show:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, unit=self.unit, dynamic_ncols=True,
                             mininterval=1.0)
        if description is not None:
            self._bar.set_description(description, refresh=False)
        self._bar.update(steps)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
