"""Hybrid DCT: pipeline stages × data-parallel replicas (DCT KDD'21 §3.1, Table 3).

``stages × replicas`` processes. Rank ``r`` holds stage ``r % stages`` of
replica ``r // stages``. Each replica is one pipeline (DCT-MP on its
boundaries, ``X_act`` / ``X_grad``); the copies of one stage across replicas
form that stage's data-parallel group, where a registered scheme (DCT-DP or
any other) reduces the parameter gradients (``W_grad``) through DDP and
:func:`thinwire.ddp.register`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from thinwire.comm import Meter
from thinwire.ddp import register
from thinwire.schemes import Scheme


@dataclass(frozen=True)
class Layout:
    """Where each rank sits in a stages × replicas grid."""

    stages: int  # pipeline depth, >= 1
    replicas: int  # data-parallel copies of every stage, >= 1

    def __post_init__(self) -> None:
        for field in ("stages", "replicas"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}={value!r} must be an integer >= 1")

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        """Global ranks of one replica's stages, in stage order."""
        return [replica * self.stages + stage for stage in range(self.stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """Global ranks holding ``stage``, in replica order."""
        return [replica * self.stages + stage for replica in range(self.replicas)]


@dataclass(frozen=True)
class Groups:
    """This rank's process groups."""

    pipeline: dist.ProcessGroup | None  # its replica's stages (None: the world is the pipeline)
    data: dist.ProcessGroup | None  # its stage's replicas (None: no data parallelism)


def make_groups(layout: Layout) -> Groups:
    """Create every pipeline and data-parallel group (all ranks, same order).

    Raises:
        ValueError: the world size is not ``stages * replicas``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"world size {world} != stages {layout.stages} × replicas "
                         f"{layout.replicas}")
    if layout.replicas == 1:
        return Groups(None, None)
    pipeline = data = None
    for replica in range(layout.replicas):
        group = dist.new_group(layout.pipeline_ranks(replica))
        if replica == layout.replica_of(rank):
            pipeline = group
    for stage in range(layout.stages):
        group = dist.new_group(layout.replica_ranks(stage))
        if stage == layout.stage_of(rank):
            data = group
    return Groups(pipeline, data)


def data_parallel(module: nn.Module, scheme: Scheme, group: dist.ProcessGroup,
                  meter: Meter | None = None) -> DistributedDataParallel:
    """Wrap a stage in DDP over its replicas, gradients reduced by ``scheme`` (``W_grad``).

    The pipeline schedule runs every microbatch but the last under
    ``no_sync`` and lets DDP reduce once, after the last backward.
    """
    ddp = DistributedDataParallel(module, process_group=group)
    register(ddp, scheme, group=group, meter=meter)
    return ddp
