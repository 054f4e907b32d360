"""edAD on recurrent models: recompute every delta through time by replaying the forward (§3.5).

In an unrolled recurrent network a Linear layer is called once per time step,
and what joins two calls is the cell's own arithmetic, not one activation, so
Eq. 5's chain rule cannot be written per layer. It can still be evaluated
exactly from what edAD gathers: each site replays the forward on a zero
placeholder of the pooled batch's shape, pins every Linear call's input to the
gathered rows (:class:`_Pin`), seeds autograd with the gathered output delta and
reads the global delta of every earlier call (Algorithm 2 lines 9-20, unrolled
over time as §3.5 says). A model whose output depends on its raw input other
than through a Linear call, or on randomness, is caught by the engine's
own-rows check against autograd.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn


class _Pin(torch.autograd.Function):
    """Forward: the gathered rows. Backward: the gradient goes to the replayed input."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, replayed: torch.Tensor,
                gathered: torch.Tensor) -> torch.Tensor:
        return gathered.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _calls_per_site(rows: Sequence[torch.Tensor], calls: int,
                    name: str) -> list[list[torch.Tensor]]:
    """Split each site's rows (its calls stacked in order) into ``calls`` equal chunks."""
    chunks = []
    for site, block in enumerate(rows):
        if block.shape[0] % calls:
            raise ValueError(f"edad: site {site} sent {block.shape[0]} rows for {name!r}, not a "
                             f"multiple of its {calls} calls here: every site must run the "
                             "same number of time steps")
        chunks.append(list(block.chunk(calls) if block.shape[0] else [block] * calls))
    return chunks


def replay(model: nn.Module, layers: dict[str, nn.Linear], calls: dict[str, int],
           example: torch.Tensor, batches: Sequence[int],
           acts: Mapping[str, Sequence[torch.Tensor]], top: Sequence[torch.Tensor],
           last: str) -> dict[str, torch.Tensor]:
    """Global deltas of every Linear layer from the output layer's, through the model's forward.

    Args:
        model: the network; its forward takes one tensor whose leading size is the batch.
        layers: name -> ``nn.Linear``.
        calls: how many times each layer is called per forward (time steps).
        example: this site's model input (its shape past the batch and its dtype are used).
        batches: every site's batch size, in rank order.
        acts: per layer, every site's gathered input rows (its calls stacked in order).
        top: every site's weighted delta rows of the output layer ``last``.
        last: the output layer.

    Returns:
        Per layer other than ``last``, the global delta rows, stacked site by
        site in the order of ``acts`` (so ``Δᵀ·A`` is the layer's gradient).

    Raises:
        ValueError: the sites' shapes do not fit one pooled replay (different
            sequence lengths), or a call's input is not (batch, ..., features).
    """
    pinned: dict[str, list[torch.Tensor]] = {}
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    chunks = {name: _calls_per_site(acts[name], calls[name], name) for name in layers}
    top_chunks = _calls_per_site(top, calls[last], last)

    def pooled(site_chunks: list[list[torch.Tensor]], call: int, like: torch.Tensor,
               name: str) -> torch.Tensor:
        parts = [site_chunks[s][call].reshape(batch, *like.shape[1:-1],
                                              site_chunks[s][call].shape[-1])
                 for s, batch in enumerate(batches)]
        joined = torch.cat(parts)
        if joined.shape[:-1] != like.shape[:-1]:
            raise ValueError(f"edad: call {call} of {name!r} has shape {tuple(like.shape)} on "
                             f"the pooled replay but the sites sent {tuple(joined.shape)}")
        return joined

    def pin(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
            call = len(pinned.setdefault(name, []))
            if call >= calls[name]:
                raise ValueError(f"edad: {name!r} was called more often in the replay than "
                                 f"the {calls[name]} times of the step")
            gathered = pooled(chunks[name], call, args[0], name)
            pinned[name].append(gathered)
            return (_Pin.apply(args[0], gathered),)
        return hook

    def keep(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            outputs[name].append(out)
        return hook

    handles = [h for name, layer in layers.items()
               for h in (layer.register_forward_pre_hook(pin(name)),
                         layer.register_forward_hook(keep(name)))]
    try:
        placeholder = example.new_zeros(sum(batches), *example.shape[1:])
        with torch.enable_grad():
            model(placeholder)
            seeds = [pooled(top_chunks, c, out, last) for c, out in enumerate(outputs[last])]
            earlier = [name for name in layers if name != last]
            flat = [out for name in earlier for out in outputs[name]]
            grads = (torch.autograd.grad(outputs[last], flat, seeds, allow_unused=True)
                     if flat else ())
    finally:
        for handle in handles:
            handle.remove()
    deltas: dict[str, torch.Tensor] = {}
    position = 0
    for name in earlier:
        per_call = []
        for out in outputs[name]:
            grad = grads[position]
            position += 1
            per_call.append(torch.zeros_like(out) if grad is None else grad)
        # back to each site's own row order: its calls stacked, as it sent them
        sites = [torch.cat([c.split(list(batches))[s].reshape(-1, c.shape[-1])
                            for c in per_call]) for s in range(len(batches))]
        deltas[name] = torch.cat(sites).detach()
    return deltas
