"""Split a sequential model after named modules into stages, a boundary at each split.

A splittable model is an ``nn.Sequential`` (nested ones are flattened). What
flows from one module to the next -- the *carry* -- is a tensor or a tuple of
tensors; at a split, the last tensor of the carry (the split module's
activation) is compressed and any tensors before it (a residual stream) cross
dense. Modules that need inputs other than the carry (DLRM's categorical
features) name them in a ``side_inputs`` attribute; :class:`Chain` and
:class:`Stage` pass them as keyword arguments, which is also how
``torch.distributed.pipelining`` hands per-microbatch kwargs to every stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from thinwire.comm import Meter
from thinwire.pipeline.boundary import Receiver, Sender, check_activation
from thinwire.pipeline.registry import boundary_config, build_boundary

Carry = torch.Tensor | tuple[torch.Tensor, ...]


def call_step(module: nn.Module, carry: Any, side: Mapping[str, Any]) -> Any:
    """Run one module of a chain on ``carry``, with the side inputs it names."""
    if isinstance(module, nn.Sequential):
        for inner in module:
            carry = call_step(inner, carry, side)
        return carry
    names: Sequence[str] = getattr(module, "side_inputs", ())
    if not names:
        return module(carry)
    missing = [name for name in names if name not in side]
    if missing:
        raise ValueError(f"{type(module).__name__} needs side input(s) {missing}; "
                         f"got {sorted(side)}")
    return module(carry, **{name: side[name] for name in names})


class Chain(nn.Sequential):
    """``nn.Sequential`` that also hands keyword side inputs to the modules naming them."""

    def forward(self, input: Any, **side: Any) -> Any:  # noqa: A002  (nn.Sequential's name)
        return call_step(self, input, side)


def steps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a sequential model runs, in order, nested ``nn.Sequential`` flattened.

    Raises:
        TypeError: ``model`` is not an ``nn.Sequential``.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"only nn.Sequential models can be split, got {type(model).__name__}")
    flat: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, container: nn.Sequential) -> None:
        for child_name, child in container.named_children():
            name = f"{prefix}{child_name}"
            if isinstance(child, nn.Sequential):
                visit(f"{name}.", child)
            else:
                flat.append((name, child))

    visit("", model)
    return flat


def split_positions(model: nn.Module, at: Sequence[str]) -> list[int]:
    """Positions in :func:`steps` after which the model is cut, one per name, ascending.

    A name is a module of the flattened sequence, or an ``nn.Sequential``
    container (cut after its last module).

    Raises:
        ValueError: an unknown name, a module inside a non-sequential module,
            the last module, or two names at one position.
    """
    flat = steps(model)
    position = {name: i for i, (name, _) in enumerate(flat)}
    for name, module in model.named_modules():
        if name and isinstance(module, nn.Sequential):
            inner = [i for step, i in position.items() if step.startswith(name + ".")]
            if inner:
                position.setdefault(name, max(inner))
    points = [name for name, _ in flat[:-1]]
    known = dict(model.named_modules())
    positions = []
    for name in at:
        if name not in position:
            parent = next((p for p in _parents(name) if p in position), None)
            if name in known and parent is not None:
                raise ValueError(
                    f"cannot split inside {parent!r} ({type(known[parent]).__name__}): it "
                    f"runs {name!r} itself; split points are {points}")
            raise ValueError(f"no module named {name!r} to split after; split points are "
                             f"{points}")
        if position[name] == len(flat) - 1:
            raise ValueError(f"splitting after {name!r}, the model's last module, leaves an "
                             f"empty stage; split points are {points}")
        positions.append(position[name])
    if len(set(positions)) != len(positions):
        raise ValueError(f"split points {list(at)} name the same position twice")
    return sorted(positions)


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


class Stage(nn.Module):
    """One pipeline stage: [receiver] -> modules -> [sender].

    ``forward(*crossing, **side)`` takes what the previous stage sent (or the
    model's input) and returns what crosses to the next stage (or the model's
    output). The modules are the model's own (shared, not copied).
    """

    def __init__(self, modules: Sequence[nn.Module], receiver: Receiver | None = None,
                 sender: Sender | None = None) -> None:
        super().__init__()
        self.receiver = receiver
        self.body = nn.ModuleList(modules)
        self.sender = sender

    def forward(self, *crossing: Any, **side: Any) -> Any:
        if self.receiver is not None:
            carry = self.receiver(*crossing)
        else:
            carry = crossing[0] if len(crossing) == 1 else crossing
        for module in self.body:
            carry = call_step(module, carry, side)
        return self.sender(carry) if self.sender is not None else carry


class Pipeline(nn.Module):
    """The stages run one after the other in this process: the split model, locally.

    Numerically what a pipeline schedule computes on the same batch; the
    boundaries' meters record what would cross between processes.
    """

    def __init__(self, stages: Sequence[Stage]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, input: Any, **side: Any) -> Any:  # noqa: A002
        crossing: Any = (input,)
        for stage in self.stages:
            crossing = stage(*crossing, **side)
            if not isinstance(crossing, tuple):
                crossing = (crossing,)
        return crossing[0] if len(crossing) == 1 else crossing


def split(model: nn.Module, at: Sequence[str], example: Any, *,
          side: Mapping[str, Any] | None = None, boundary: str = "dct-mp",
          meter: Meter | None = None, **options: Any) -> list[Stage]:
    """Cut ``model`` after each module named in ``at``; a boundary pair at each cut.

    The model runs once on ``example`` (without gradients) to learn each
    split's activation width and dtype, which the receiving side needs.

    Args:
        model: an ``nn.Sequential`` (e.g. :class:`Chain`); its modules are shared.
        at: names of modules (or ``nn.Sequential`` containers) to cut after.
        example: an input batch (any batch size).
        side: side inputs of ``example`` (e.g. categorical features).
        boundary: a registered boundary kind (``"dct-mp"``, ``"sketch"``, ``"xgrad-topk"``).
        meter: records what each boundary hands over (single-process use);
            leave None under a pipeline schedule, whose stage meters the sends.
        **options: the boundary kind's config (e.g. ``ratio=0.1``).

    Returns:
        ``len(at) + 1`` stages.

    Raises:
        ValueError: a bad split name, a split activation that is not (B, d) or
            (B, T, d), or a bad boundary option.
    """
    config = boundary_config(boundary, **options)
    positions = split_positions(model, at)
    flat = steps(model)
    side = dict(side or {})
    acts: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        carry = example
        for i, (_, module) in enumerate(flat[: positions[-1] + 1] if positions else []):
            carry = call_step(module, carry, side)
            if i in positions:
                acts[i] = carry[-1] if isinstance(carry, tuple) else carry
    stages: list[Stage] = []
    receiver: Receiver | None = None
    start = 0
    for position in positions:
        name = flat[position][0]
        check_activation(acts[position], f"activation after {name!r}")
        sender, next_receiver = build_boundary(boundary, config, name,
                                               int(acts[position].shape[-1]),
                                               acts[position].dtype, meter)
        stages.append(Stage([m for _, m in flat[start: position + 1]], receiver, sender))
        receiver, start = next_receiver, position + 1
    stages.append(Stage([m for _, m in flat[start:]], receiver, None))
    return stages
