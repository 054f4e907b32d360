"""Front door 2: DCT-MP boundaries for model / pipeline parallel training (DCT KDD'21 §2.2).

``compact`` / ``expand`` are the functional boundary; ``split`` cuts a
sequential model into stages with a boundary pair at each cut;
``build_stage`` / ``build_schedule`` run those stages on
``torch.distributed.pipelining``; ``hybrid`` adds data-parallel replicas.

Floor: front door, beside autodiff and ps (neither imported), above ddp.
Library code only: models, data and jobs come in as arguments.
"""

from typing import TYPE_CHECKING, Any

from thinwire.pipeline import sketch as _sketch  # noqa: F401  (registers sketch, xgrad-topk)
from thinwire.pipeline.boundary import (
    Compact,
    DCTMPConfig,
    Expand,
    Receiver,
    Sender,
    batch_laplace_threshold,
    compact,
    expand,
    index_dtype,
    laplace_thresholds,
    row_thresholds,
    select,
)
from thinwire.pipeline.hybrid import Groups, Layout, data_parallel, make_groups
from thinwire.pipeline.registry import (
    boundary_config,
    boundary_config_class,
    boundary_kinds,
    build_boundary,
    register_boundary,
)
from thinwire.pipeline.split import Chain, Pipeline, Stage, split, split_positions, steps

if TYPE_CHECKING:
    from thinwire.pipeline.stages import (
        SCHEDULES,
        MeteredStage,
        build_schedule,
        build_stage,
        stage_metadata,
    )

# torch.distributed.pipelining imports torch._dynamo (seconds per process): ``stages`` is
# loaded on first use, so that a process that only splits a model (a DLRM workload, the
# compare job's ranks) never pays for it.
_STAGES = ("SCHEDULES", "MeteredStage", "build_schedule", "build_stage", "stage_metadata")


def __getattr__(name: str) -> Any:
    if name in _STAGES:
        from thinwire.pipeline import stages

        return getattr(stages, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "SCHEDULES",
    "Chain",
    "Compact",
    "DCTMPConfig",
    "Expand",
    "Groups",
    "Layout",
    "MeteredStage",
    "Pipeline",
    "Receiver",
    "Sender",
    "Stage",
    "boundary_config",
    "boundary_config_class",
    "boundary_kinds",
    "build_boundary",
    "build_schedule",
    "build_stage",
    "compact",
    "data_parallel",
    "expand",
    "index_dtype",
    "batch_laplace_threshold",
    "laplace_thresholds",
    "make_groups",
    "register_boundary",
    "row_thresholds",
    "select",
    "split",
    "split_positions",
    "stage_metadata",
    "steps",
]
