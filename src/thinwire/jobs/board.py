"""A run's Meter on TensorBoard: bytes, compression ratio and per-layer density per step.

Written with ``torch.utils.tensorboard`` (the ``tensorboard`` package, the
optional extra ``thinwire[tensorboard]``), one run folder per scheme, so
TensorBoard draws the schemes of a ``thinwire compare`` side by side. Scalars
are per step, not the Meter's running means, so a change of regime (a warm-up
that ends, a threshold that is recomputed) shows where it happens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from thinwire.comm import Meter

# The scalars' tags, for readers and tests.
HANDED = "bytes/handed_per_step"  # handed to torch.distributed by this rank
RING_SENT = "bytes/ring_sent_per_step"  # ring-model traffic out of this rank
RING_RECEIVED = "bytes/ring_received_per_step"  # and into it
RATIO = "compression/ratio_vs_dense"  # the dense gradient's bytes / bytes handed
DENSITY = "density/"  # + layer: fraction of the layer's entries the sparsifier sent
LOSS = "train/loss"
ACCURACY = "test/accuracy"


def score_tag(metric: str) -> str:
    """The tag of a workload's test metric: ``test/accuracy``, ``test/bits_per_byte``."""
    return ACCURACY if metric == "test accuracy" else "test/" + metric.replace(" ", "_")


def writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; call it early to fail before training.

    Raises:
        ValueError: the ``tensorboard`` package is not installed (says how to get it).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # torch imports tensorboard only here
        raise ValueError("--tensorboard needs the tensorboard package: "
                         "pip install 'thinwire[tensorboard]' (or pip install tensorboard)"
                         ) from error
    return SummaryWriter


class MeterBoard:
    """Writes one rank's :class:`~thinwire.comm.Meter` to TensorBoard after every step.

    Args:
        log_dir: the run folder (created).
        dense_bytes: bytes of the uncompressed gradient, for the compression ratio.
    """

    def __init__(self, log_dir: Path, dense_bytes: int) -> None:
        self.writer = writer_class()(log_dir=str(log_dir))
        self.dense_bytes = dense_bytes
        self._totals: tuple[float, ...] = (0.0, 0.0, 0.0)  # nbytes, sent, received so far
        self._density_steps: dict[str, int] = {}  # layer -> step of its last density point

    def step(self, meter: Meter, loss: float | None = None,
             trace: Mapping[str, Sequence[tuple[int, float, float]]] | None = None) -> None:
        """Log the step ``meter`` has just closed (call after ``meter.next_step()``).

        Args:
            meter: the rank's Meter; this step's bytes are its totals' growth since
                the previous call.
            loss: the step's training loss, if known.
            trace: a sparsifier's (step, threshold, density) points per layer; each
                new point is logged as that layer's density.
        """
        step = meter.step
        totals = tuple(meter.totals(field).get("total", 0.0)
                       for field in ("nbytes", "sent", "received"))
        handed, sent, received = (now - before for now, before in zip(totals, self._totals))
        self._totals = totals
        self.writer.add_scalar(HANDED, handed, step)
        self.writer.add_scalar(RING_SENT, sent, step)
        self.writer.add_scalar(RING_RECEIVED, received, step)
        if handed > 0:  # a lone worker hands nothing: no ratio to draw
            self.writer.add_scalar(RATIO, self.dense_bytes / handed, step)
        if loss is not None:
            self.writer.add_scalar(LOSS, loss, step)
        for layer, points in (trace or {}).items():
            if points and points[-1][0] != self._density_steps.get(layer):
                self._density_steps[layer] = points[-1][0]
                self.writer.add_scalar(DENSITY + layer, points[-1][2], step)

    def score(self, step: int, value: float, metric: str = "test accuracy") -> None:
        """Log a point of the workload's test metric, under :func:`score_tag`."""
        self.writer.add_scalar(score_tag(metric), value, step)

    def close(self) -> None:
        """Flush the events to disk and close the file."""
        self.writer.close()
