"""A scheme's state around an exchange that may fail, and the part of it a joining worker takes.

Rollback: before an exchange, :class:`Rollback` copies the scheme's
``state_dict``; if the exchange does not commit, the scheme is rebuilt as it
was built, warm-up included (:func:`~thinwire.schemes.rebuild`), and loaded
with that copy, so nothing the failed exchange did (absorbed gradients,
residuals, thresholds, factors, counters, a round left pending between DDP
buckets, a callback that completes late) survives it.

Healing: every part of a scheme's state is shared by the workers (counters,
thresholds, PowerSGD's Q, CLT-k's steps) except its error memory, kept under
``"memory"``, which holds what this worker has not sent yet. A joining worker
takes everything else from a live peer and keeps its own memory (empty when
it starts): taking the peer's would send the peer's residual twice.
"""

from __future__ import annotations

import copy
from typing import Any

from thinwire.schemes import Scheme, rebuild

MEMORY = "memory"  # the state_dict key of a scheme's per-worker error memory


class Rollback:
    """The state of ``scheme`` now, to put back if the exchange about to start fails."""

    def __init__(self, scheme: Scheme) -> None:
        self.state = copy.deepcopy(scheme.state_dict())

    def restore(self, scheme: Scheme) -> Scheme:
        """The scheme as it was: a fresh one (:func:`~thinwire.schemes.rebuild`: its name,
        options, warm-up and meter) loaded with the saved state (``scheme`` itself, loaded,
        if it was not built by name).

        Returns:
            The scheme to use from now on.
        """
        fresh = scheme if scheme.origin is None else rebuild(scheme)
        fresh.load_state_dict(copy.deepcopy(self.state))
        return fresh


def shared_state(scheme: Scheme) -> dict[str, Any]:
    """What a live worker sends a joining one: ``scheme``'s state but its error memory."""
    return {key: value for key, value in copy.deepcopy(scheme.state_dict()).items()
            if key != MEMORY}


def load_shared(scheme: Scheme, shared: dict[str, Any]) -> None:
    """Load a peer's :func:`shared_state` into ``scheme``, keeping its own error memory."""
    own = scheme.state_dict()
    scheme.load_state_dict({**shared, **({MEMORY: own[MEMORY]} if MEMORY in own else {})})
