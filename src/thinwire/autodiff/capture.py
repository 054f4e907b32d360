"""Hooks that keep each ``nn.Linear``'s inputs A and output deltas Δ for one step.

A forward hook stores the layer's input and registers a tensor hook on its
output; autograd hands that hook ``∂L/∂Z``, the delta of Eq. 2–3. A layer
called several times in one forward (an unrolled recurrent cell) gets one
(A, Δ) pair per call, stacked in call order: time becomes rows (§3.5). The
tensor hook fires with the gradient of the output as the layer produced it,
also when an in-place activation later overwrites that tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from thinwire.autodiff.edad import Call


@dataclass
class _Calls:
    """What one layer saw during the current step."""

    acts: list[torch.Tensor] = field(default_factory=list)
    deltas: dict[int, torch.Tensor] = field(default_factory=dict)
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # each call's output shape


@dataclass(frozen=True)
class Step:
    """One step's statistics, per layer in forward order of first call."""

    batch: int  # local batch size: leading size of the model's first input
    forwards: int  # grad-enabled forward passes seen
    acts: dict[str, torch.Tensor]  # (rows, h_in)
    deltas: dict[str, torch.Tensor]  # (rows, h_out); zero rows where no gradient arrived
    order: list[str]  # layers in order of first call
    backward_seen: bool  # whether any delta arrived
    calls: list[Call]  # every leaf module call, when recorded
    counts: dict[str, int]  # how many times each layer was called (time steps)
    example: torch.Tensor | None  # the model's first tensor input, when it was the only input


class Capture:
    """Installs the hooks on ``model``; :meth:`take` returns and clears one step.

    Args:
        model: the network; its root records the local batch size.
        layers: name -> ``nn.Linear`` to watch.
        record_calls: also record every leaf module call (edAD's chain check).
    """

    def __init__(self, model: nn.Module, layers: dict[str, nn.Linear],
                 record_calls: bool = False) -> None:
        self._layers = layers
        self._calls: dict[str, _Calls] = {name: _Calls() for name in layers}
        self._order: list[str] = []
        self._sequence: list[Call] = []
        self._batch = 0
        self._forwards = 0
        self._example: torch.Tensor | None = None
        self._paused = False
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._on_model, with_kwargs=True)]
        for name, layer in layers.items():
            self._handles.append(layer.register_forward_hook(self._linear_hook(name)))
        if record_calls:
            for name, module in model.named_modules():
                if not list(module.children()):
                    self._handles.append(module.register_forward_hook(self._call_hook(name)))

    def _on_model(self, module: nn.Module, args: tuple[object, ...],
                  kwargs: dict[str, object]) -> None:
        if not torch.is_grad_enabled() or self._paused:
            return
        self._forwards += 1
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and first.dim() > 0:
            self._batch += int(first.shape[0])
        single = len(args) == 1 and not kwargs and first is not None and first.dim() > 0
        self._example = first.detach() if single and first is not None else None

    def _linear_hook(self, name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if not torch.is_grad_enabled() or self._paused:
                return
            calls = self._calls[name]
            slot = len(calls.acts)
            if slot == 0:
                self._order.append(name)
            calls.acts.append(args[0].detach())
            calls.shapes.append(tuple(output.shape))
            if output.requires_grad:
                def keep(grad: torch.Tensor) -> None:
                    calls.deltas[slot] = grad.detach()
                output.register_hook(keep)
        return hook

    def _call_hook(self, name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            if not torch.is_grad_enabled() or self._paused:
                return
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if isinstance(output, torch.Tensor) and first is not None:
                self._sequence.append(Call(name, module, first, output))
            else:
                self._sequence.append(Call(name, module, torch.empty(0), torch.empty(0)))
        return hook

    def take(self) -> Step:
        """The statistics since the last call, as (rows, features) matrices; then clear."""
        acts: dict[str, torch.Tensor] = {}
        deltas: dict[str, torch.Tensor] = {}
        seen = False
        for name in self._order:
            calls = self._calls[name]
            layer = self._layers[name]
            acts[name] = torch.cat([a.reshape(-1, layer.in_features) for a in calls.acts])
            parts = []
            for slot, shape in enumerate(calls.shapes):
                grad = calls.deltas.get(slot)
                if grad is None:  # this call's output did not reach the loss
                    grad = torch.zeros(shape, dtype=layer.weight.dtype)
                else:
                    seen = True
                parts.append(grad.reshape(-1, layer.out_features))
            deltas[name] = torch.cat(parts)
        counts = {name: len(self._calls[name].acts) for name in self._order}
        step = Step(self._batch, self._forwards, acts, deltas, list(self._order), seen,
                    list(self._sequence), counts, self._example)
        self.clear()
        return step

    def clear(self) -> None:
        self._calls = {name: _Calls() for name in self._layers}
        self._order = []
        self._sequence = []
        self._batch = 0
        self._forwards = 0
        self._example = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Ignore the model's calls inside the block (the engine's own replays)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
