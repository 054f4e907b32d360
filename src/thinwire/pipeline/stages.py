"""Split stages on ``torch.distributed.pipelining``: static metadata, metered sends.

Static metadata, because without ``input_args``/``output_args`` a
``PipelineStage`` infers shapes by running each stage on uninitialised buffers,
and a DCT-MP receiver would scatter at garbage indices (GPipe and 1F1B alike,
torch 2.13). :func:`build_stage` runs the split model once on an example
microbatch, without gradients, and hands the engine every stage's exact
metadata: floating tensors require grad (their gradients cross back), integer
indices do not, so nothing crosses back for them (Algorithm 2 lines 13-14's
values-only backward). Metering happens where bytes are handed to
torch.distributed, the stage's sends: forward ``X_act``, backward ``X_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from thinwire._version import __version__
from thinwire.comm import Meter
from thinwire.comm.fingerprint import check_peers
from thinwire.pipeline.split import Stage

# name -> schedule class; each takes (stage, n_microbatches, loss_fn=...).
SCHEDULES: dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class MeteredStage(PipelineStage):
    """A ``PipelineStage`` that records every tensor it hands to torch.distributed.

    The other arguments are ``PipelineStage``'s.

    Args:
        meter: records ``X_act`` for forward sends and ``X_grad`` for backward sends.
        names: the split names, one per boundary; boundary ``i`` lies between
            stages ``i`` and ``i + 1`` and is the meter's layer.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device, input_args: tuple[torch.Tensor, ...],
                 output_args: tuple[torch.Tensor, ...], *, group: dist.ProcessGroup | None = None,
                 meter: Meter | None = None, names: Sequence[str] = ()) -> None:
        super().__init__(submodule, stage_index, num_stages, device, input_args=input_args,
                         output_args=output_args, group=group)
        self.meter = meter
        self.names = list(names)

    def _record(self, ops: list[dist.P2POp], entity: str, boundary: int) -> list[dist.P2POp]:
        if self.meter is not None and ops:
            layer = self.names[boundary] if 0 <= boundary < len(self.names) else f"split{boundary}"
            for op in ops:
                tensor = op.tensor
                self.meter.record(entity, layer, "send", tensor.numel() * tensor.element_size())
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._record(super().get_fwd_send_ops(fwd_chunk_id), "X_act", self.stage_index)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._record(super().get_bwd_send_ops(bwd_chunk_id), "X_grad",
                            self.stage_index - 1)


def microbatch(value: Any, n_microbatches: int) -> Any:
    """The first of ``n_microbatches`` equal chunks of a batch (tensor, tuple or dict)."""
    if isinstance(value, torch.Tensor):
        if value.shape[0] % n_microbatches:
            raise ValueError(f"a batch of {value.shape[0]} does not split into "
                             f"{n_microbatches} equal microbatches")
        return value[: value.shape[0] // n_microbatches]
    if isinstance(value, tuple):
        return tuple(microbatch(v, n_microbatches) for v in value)
    if isinstance(value, dict):
        return {k: microbatch(v, n_microbatches) for k, v in value.items()}
    return value


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _example(tensor: torch.Tensor) -> torch.Tensor:
    """Metadata carrier: floating tensors carry a gradient back, integer ones do not."""
    return tensor.detach().clone().requires_grad_(tensor.is_floating_point())


def stage_metadata(stages: Sequence[Stage], index: int, example: Any, n_microbatches: int,
                   side: Mapping[str, Any] | None = None
                   ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Example input and output tensors of stage ``index`` for one microbatch.

    Runs stages ``0..index`` locally on the first microbatch of ``example``,
    without gradients and without touching the boundaries' meters or traces.
    """
    if not 0 <= index < len(stages):
        raise ValueError(f"index={index!r} must be in [0, {len(stages)})")
    inputs = _as_tuple(microbatch(example, n_microbatches))
    side_mb = microbatch(dict(side or {}), n_microbatches)
    meters = [(m, m.meter) for s in stages for m in (s.sender, s.receiver) if m is not None]
    try:
        for module, _ in meters:
            module.meter = None
        with torch.no_grad():
            for stage in stages[:index]:
                inputs = _as_tuple(stage(*inputs, **side_mb))
            outputs = _as_tuple(stages[index](*inputs, **side_mb))
    finally:
        for module, meter in meters:
            module.meter = meter
    return tuple(_example(t) for t in inputs), tuple(_example(t) for t in outputs)


def build_stage(stages: Sequence[Stage], index: int, example: Any, n_microbatches: int, *,
                side: Mapping[str, Any] | None = None, group: dist.ProcessGroup | None = None,
                meter: Meter | None = None, names: Sequence[str] = (),
                wrap: Callable[[nn.Module], nn.Module] | None = None,
                device: torch.device | None = None) -> MeteredStage:
    """Stage ``index`` of a split model as a ``PipelineStage`` with static metadata.

    Args:
        stages: from :func:`thinwire.pipeline.split` (every rank splits the same model).
        index: this rank's stage (its rank in ``group``).
        example: a whole batch as the schedule will receive it (first stage's input).
        n_microbatches: the schedule's microbatch count; the batch must divide by it.
        side: side inputs of ``example`` (passed to ``schedule.step`` as kwargs).
        group: the pipeline's process group (default: the world).
        meter: records the bytes of every send.
        names: split names, for the meter.
        wrap: wraps the stage module (e.g. DDP over the stage's replicas).

    Raises:
        ValueError: a boundary kind the engine cannot carry, or a bad microbatching.
        PeerMismatchError: another rank of ``group`` split another model, with other
            boundaries or microbatches, or runs another thinwire version (raised on
            every rank alike; ``build_stage`` is a collective over ``group``).
    """
    check_peers(_fingerprint(stages, n_microbatches), "the pipeline stages", group, device)
    for stage in stages:
        for module in (stage.sender, stage.receiver):
            if module is not None and not getattr(module, "pipelines", True):
                raise ValueError(
                    f"boundary {module.name!r} ({type(module).__name__}) runs only in one "
                    "process: its backward payload is not the gradient of a forward tensor, "
                    "which is all a pipeline schedule can send back")
    input_args, output_args = stage_metadata(stages, index, example, n_microbatches, side)
    submodule = stages[index] if wrap is None else wrap(stages[index])
    return MeteredStage(submodule, index, len(stages), device or torch.device("cpu"),
                        input_args, output_args, group=group, meter=meter, names=names)


def _fingerprint(stages: Sequence[Stage], n_microbatches: int) -> dict[str, Any]:
    """What every rank of a pipeline must share: each stage's modules (boundary
    configs included, via their reprs) and parameters, the microbatches, the version."""
    return {"microbatches": n_microbatches, "thinwire": __version__,
            "stages": {str(i): repr(stage) for i, stage in enumerate(stages)},
            "parameters": {f"{i}.{name}": f"{tuple(p.shape)} {p.dtype}"
                           for i, stage in enumerate(stages)
                           for name, p in stage.named_parameters()}}


def build_schedule(name: str, stage: PipelineStage, n_microbatches: int,
                   loss_fn: Callable[..., torch.Tensor]) -> Any:
    """A registered schedule (``"gpipe"`` or ``"1f1b"``) over ``stage``.

    Raises:
        ValueError: unknown schedule name.
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} must be one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](stage, n_microbatches, loss_fn=loss_fn)
