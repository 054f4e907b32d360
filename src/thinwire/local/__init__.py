"""Front door 5: local-update data parallelism (DiLoCo, Streaming DiLoCo) for any module.

Each worker steps its own replica for H steps, then the pseudo-gradients are
averaged through any thinwire scheme and an outer optimiser steps the global
weights (:class:`LocalUpdates`).

Floor: front door, beside pipeline, autodiff and ps (none imported).
"""

from thinwire.local.diloco import (
    LocalConfig,
    LocalUpdates,
    default_every,
    nesterov,
    outer_defaults,
    split,
)

__all__ = ["LocalConfig", "LocalUpdates", "default_every", "nesterov", "outer_defaults",
           "split"]
