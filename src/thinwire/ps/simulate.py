"""Asynchrony without clocks: drive a core with an injected schedule of pulls and pushes.

A schedule is a list of ``("pull", stream)`` and ``("push", stream)``
events. A stream computes its gradient at the weights it pulled, as a real
worker does between its pull and its push, so the delay of every push is
fixed by the schedule alone. :func:`cyclic_schedule` is the stable system of
the paper's analysis ("if the system is stable, the delay tau is equal to
the number of workers", App. A): after the first round every push has
``tau = streams - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from thinwire.ps.core import EXPECTED, ParameterServerCore, PushResult

Event = tuple[str, int]


def cyclic_schedule(streams: int, pushes_per_stream: int) -> list[Event]:
    """Every stream pulls; then, round-robin, each stream pushes and pulls again.

    Raises:
        ValueError: ``streams`` or ``pushes_per_stream`` below 1.
    """
    if streams < 1 or pushes_per_stream < 1:
        raise ValueError(f"streams={streams!r} and pushes_per_stream={pushes_per_stream!r} "
                         "must be >= 1")
    events: list[Event] = [("pull", s) for s in range(streams)]
    for push in range(pushes_per_stream):
        for stream in range(streams):
            events.append(("push", stream))
            if push + 1 < pushes_per_stream:
                events.append(("pull", stream))
    return events


def run_schedule(core: ParameterServerCore, events: Sequence[Event],
                 gradient: Callable[[int, torch.Tensor], torch.Tensor],
                 pending: Mapping[int, torch.Tensor] | None = None) -> list[PushResult]:
    """Play ``events`` on ``core`` (joining streams that have not joined).

    Args:
        gradient: ``gradient(stream, weights)``, called when ``stream`` pulls.
        pending: gradients already computed by streams that pulled before
            ``events`` begin (e.g. before a server restart).

    Returns:
        The result of every push, in order.

    Raises:
        ValueError: an unknown event, or a push without a pull before it.
    """
    for stream in range(core.streams):
        if core.status[stream] == EXPECTED:
            core.join(stream, core.fingerprint)
    computed: dict[int, torch.Tensor] = dict(pending or {})
    results: list[PushResult] = []
    seqs = [0] * core.streams
    for kind, stream in events:
        if kind == "pull":
            _, weights = core.pull(stream)
            computed[stream] = gradient(stream, weights)
        elif kind == "push":
            if stream not in computed:
                raise ValueError(f"stream {stream} pushes before it pulled")
            results.append(core.push(stream, computed.pop(stream), seqs[stream]))
            seqs[stream] += 1
        else:
            raise ValueError(f"event kind {kind!r} must be 'pull' or 'push'")
    return results
