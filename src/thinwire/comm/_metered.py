"""Metering helpers shared by the multi-round exchanges."""

from __future__ import annotations

from collections.abc import Sequence

from thinwire.comm.meter import Meter

Segments = Sequence[tuple[str, int]]  # (layer, bytes) parts of one buffer, in order


def record_segments(meter: Meter | None, entity: str, collective: str, segments: Segments,
                    world_size: int, root: int = 0) -> None:
    """Record each ``(layer, nbytes)`` of one buffer handed to ``collective`` (one call)."""
    if meter is None:
        return
    for index, (layer, nbytes) in enumerate(segments):
        meter.record(entity, layer, collective, nbytes, world_size=world_size, root=root,
                     joined=index > 0)
