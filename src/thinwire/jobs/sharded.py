"""One sharded training run: FSDP2 inside each site, a scheme (or native HSDP) across sites.

The sharded counterpart of :func:`thinwire.jobs.dataparallel.run_scheme`, with the
same results, for ``thinwire compare --sites`` and ``thinwire train --sites``. Every
rank trains on its own data shard, as under DDP; ``fully_shard`` shards the whole
model as one parameter group over each site's ranks (a workload's model may use a
submodule's weights without calling it, which per-module groups would not see).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from thinwire import fsdp, schemes
from thinwire.comm import Meter
from thinwire.data.digits import batches
from thinwire.jobs.dataparallel import (
    PRECISIONS,
    RunOptions,
    _anyone,
    backward,
    evaluation_point,
    prepare,
    run_record,
)
from thinwire.launch import phase

NATIVE = "native-hsdp"  # the anchor: torch's own HSDP on the 2-D mesh, uncompressed


def check_sites(sites: int, workers: int) -> None:
    """Raise ``ValueError`` unless ``sites`` sites can split ``workers`` workers evenly."""
    if (isinstance(sites, bool) or not isinstance(sites, int) or not 1 <= sites <= workers
            or workers % sites):
        divisors = [d for d in range(1, workers + 1) if workers % d == 0]
        raise ValueError(f"--sites {sites!r} must divide the {workers} workers evenly "
                         f"(shards per site = workers / sites); choose one of {divisors}")


def run_sharded(name: str, config: dict[str, Any], options: RunOptions, sites: int,
                progress: Callable[[int], None] | None = None,
                compute_s: float | None = None) -> dict[str, Any]:
    """Train ``options.workload`` sharded over ``sites`` sites of the default group.

    Args:
        name: a scheme for the cross-site exchange, or :data:`NATIVE` for torch's own
            HSDP (its all-reduce's bytes are counted from its buffer: the shard).
        sites: sites; each holds world size / sites shards.
        compute_s: as for :func:`~thinwire.jobs.dataparallel.run_scheme`.

    Returns:
        This rank's results, as ``run_scheme``'s; ``weights`` are the full parameters.

    Raises:
        ValueError: ``sites`` does not divide the world size, or an option the sharded
            run does not take (clipping, fp16 autocast).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_sites(sites, world_size)
    if options.max_norm is not None or options.precision == "fp16":
        raise ValueError("--sites runs take neither --max-norm nor --precision fp16 (the "
                         "FSDP hook has no local clip or loss scale)")
    phase(f"{name} setup (sharded)")
    device = torch.device(options.device)
    work, local, model, compute_s = prepare(options, device, rank, world_size, compute_s)
    meter = Meter(rank, world_size)
    sharded = shard_model(
        name, config, model, sites, meter, device.type,
        lambda parameters: options.build_optimizer(parameters)[0],
        coupling=options.coupling, warmup=options.warmup, feedback=options.feedback)
    scheme, state, optimizer = sharded.scheme, sharded.state, sharded.optimizer
    schedule = options.schedule_of(optimizer)
    coupled = state is not None and state.coupling is not None and state.coupling.coupled
    shard_bytes = sharded.shard_bytes
    dtype = PRECISIONS[options.precision]
    stream = batches(local, options.batch_size, seed=options.seed * 1000 + rank)
    curve: list[tuple[int, float, float]] = []
    losses: list[float] = []
    steps_to_target = None
    start = time.perf_counter()
    for step in range(1, options.steps + 1):
        phase(f"{name} step {step}")
        loss = backward(work, model, local.rows(next(stream)), optimizer, dtype)
        optimizer.step()
        schedule.step()
        sharded.after_step()
        meter.next_step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
        if step % options.eval_every == 0 or step == options.steps:
            steps_to_target = evaluation_point(step, work.score(model, options.eval_rows), work,
                                               meter, curve, steps_to_target)
            if options.until_target and _anyone(steps_to_target is not None, None, device):
                break
        if progress is not None:
            progress(1)
    wall_s = time.perf_counter() - start
    # the scheme as registered: under Adam, register may have chosen options (ADAM_OPTIONS)
    config = {} if scheme is None else asdict(scheme.origin[1] if scheme.origin is not None
                                              else schemes.config_class(name)(**config))
    result = run_record(name, work, options, model, device=device, coupled=coupled,
                        config=config, steps_to_target=steps_to_target, losses=losses,
                        meter=meter, scheme=scheme, compute_s=compute_s, wall_s=wall_s,
                        curve=curve)
    result.update({"sites": sites, "shards_per_site": world_size // sites,
                   "weights": full_weights(model), "dense_shard_bytes": shard_bytes})
    return result


@dataclass
class Sharded:
    """A model sharded inside each site, with what carries its gradient shards across sites."""

    scheme: schemes.Scheme | None  # thinwire's cross-site exchange; None for native HSDP
    state: fsdp.FSDPState | None  # the hook's state (its coupling); None for native
    optimizer: torch.optim.Optimizer  # on the sharded parameters
    shard_bytes: int  # this rank's gradient shards, padding included: a dense exchange's bytes
    after_step: Callable[[], None]  # meters native HSDP's all-reduce (no hook to live in)


def shard_model(name: str, config: dict[str, Any], model: nn.Module, sites: int, meter: Meter,
                device_type: str, optimizer_of: Callable[[Any], torch.optim.Optimizer], *,
                coupling: str = "auto", warmup: int | None = None,
                feedback: str = "auto") -> Sharded:
    """``fully_shard`` ``model`` over each site's ranks, build the optimiser on the shards,
    and connect the sites, the optimiser registered with the scheme as
    :func:`thinwire.fsdp.register` registers it.

    A collective over the default group: every rank calls it with the same arguments.

    Args:
        name: a scheme for the cross-site exchange (through :func:`thinwire.fsdp.register`),
            or :data:`NATIVE` for torch's own HSDP on the 2-D mesh, whose all-reduce of each
            rank's shard ``after_step`` records in ``meter`` (torch reports no bytes).
        config: the scheme's options (ignored for :data:`NATIVE`).
        sites: sites; each holds world size / sites shards (:func:`check_sites`).
        meter: records the bytes handed to torch.distributed across sites.
        optimizer_of: builds the optimiser from the sharded parameters.
        coupling, warmup, feedback: as for :func:`thinwire.fsdp.register`.

    Returns:
        The scheme as registered, the hook's state, the optimiser and the shard bytes;
        ``model`` is sharded in place.

    Raises:
        ValueError: ``sites`` does not divide the world size, or a bad scheme name or option.
    """
    check_sites(sites, dist.get_world_size())
    mesh = fsdp.site_mesh(sites, device_type)
    fully_shard(model, mesh=mesh if name == NATIVE else mesh["shard"])
    optimizer = optimizer_of(model.parameters())
    scheme, state = None, None
    if name != NATIVE:
        state = fsdp.register(model, schemes.build(name, **config), mesh["site"].get_group(),
                              meter=meter, optimizer=optimizer, coupling=coupling,
                              warmup=warmup, feedback=feedback)
        scheme = state.scheme
    element = next(model.parameters()).element_size()
    shard_bytes = sum(math.prod(s.shape) for s in fsdp.shards(model)) * element

    def after_step() -> None:
        if scheme is None:  # native HSDP all-reduces each rank's shard across sites
            meter.record("W_grad", "(all parameters)", "all_reduce", shard_bytes,
                         world_size=sites)

    return Sharded(scheme, state, optimizer, shard_bytes, after_step)


def full_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole, on the CPU (a collective over each site: every rank calls it)."""
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
            for p in model.parameters()]
