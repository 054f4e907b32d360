"""edAD: recompute every hidden layer's global delta from gathered activations (Eq. 5).

For a chain ``Linear → φ → Linear → φ → … → Linear`` the delta of layer i is
``Δ_i = (Δ_{i+1}·W_{i+1}) ⊙ φ′_i(Z_i)`` (Eq. 3, in ``nn.Linear``'s (out, in)
weight layout). For the activations below, ``φ′`` is a function of the
activation's *output* ``A_i = φ(Z_i)`` alone, and ``A_i`` is exactly the
next layer's input, which edAD gathers anyway; so only the output layer's
delta has to cross the wire (Algorithm 2, lines 9–20). Recurrent models
(a layer called once per time step) are handled by :mod:`thinwire.autodiff.replay`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


def _slope(module: nn.Module) -> float:
    return float(module.negative_slope) if isinstance(module, nn.LeakyReLU) else 0.0


# activation type -> φ′ as a function of (module, output A = φ(Z)). Each matches the
# backward formula autograd itself uses, so recomputed deltas agree to rounding.
DERIVATIVES: dict[type[nn.Module], Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
    nn.ReLU: lambda module, out: (out > 0).to(out.dtype),
    nn.LeakyReLU: lambda module, out: torch.where(
        out > 0, torch.ones_like(out), torch.full_like(out, _slope(module))),
    nn.Tanh: lambda module, out: 1 - out * out,
    nn.Sigmoid: lambda module, out: out * (1 - out),
    nn.Identity: lambda module, out: torch.ones_like(out),
}


def supported_names() -> str:
    return ", ".join(kind.__name__ for kind in DERIVATIVES)


def derivative(module: nn.Module, name: str, out: torch.Tensor) -> torch.Tensor:
    """``φ′`` of ``module`` from its output.

    Raises:
        ValueError: the activation's derivative is not a function of its
            output (or is unsupported); the message names the module.
    """
    rule = DERIVATIVES.get(type(module))
    if rule is None:
        raise ValueError(f"edad cannot recompute deltas through {type(module).__name__} "
                         f"{name!r}: its derivative is not known from its output; supported "
                         f"activations: {supported_names()} (or use mode='dad')")
    if isinstance(module, nn.LeakyReLU) and _slope(module) < 0:
        raise ValueError(f"edad needs LeakyReLU {name!r} to have negative_slope >= 0 (got "
                         f"{module.negative_slope}): with a negative slope the sign of the output "
                         "no longer tells the sign of the input")
    return rule(module, out)


@dataclass(frozen=True)
class Call:
    """One module call seen by the forward hooks during a step."""

    name: str
    module: nn.Module
    input: torch.Tensor
    output: torch.Tensor


@dataclass(frozen=True)
class Link:
    """How layer i's output reaches layer i + 1's input: through ``activation``, or directly."""

    activation: nn.Module | None
    name: str


def chain(calls: Sequence[Call], layers: Sequence[str]) -> list[Link]:
    """Check that the step's calls form a chain of the given Linear layers; return the links.

    Args:
        calls: every leaf module call in forward order.
        layers: the Linear layers' names.

    Returns:
        ``len(layers) - 1`` links, in forward order.

    Raises:
        ValueError: a layer is called other than once, a module other than
            one supported activation sits between two layers, or a layer's
            input is not the previous layer's (activated) output -- e.g. a
            functional ``F.relu`` the hooks cannot see. Each message names
            the module.
    """
    wanted = set(layers)
    linear_calls = [i for i, call in enumerate(calls) if call.name in wanted]
    names = [calls[i].name for i in linear_calls]
    for name in layers:
        count = names.count(name)
        if count != 1:
            raise ValueError(f"edad's chain needs every nn.Linear called exactly once per "
                             f"forward; {name!r} was called {count} times")
    links = []
    for here, there in zip(linear_calls, linear_calls[1:], strict=False):
        between = calls[here + 1: there]
        produced = calls[here].output
        activation: nn.Module | None = None
        label = ""
        if len(between) > 1:
            kinds = ", ".join(f"{c.name!r} ({type(c.module).__name__})" for c in between)
            raise ValueError(f"edad allows one activation between {calls[here].name!r} and "
                             f"{calls[there].name!r}, found {kinds}; supported activations: "
                             f"{supported_names()}")
        if between:
            step = between[0]
            derivative(step.module, step.name, step.output[:0])  # raises when unsupported
            if step.input is not produced:
                raise ValueError(f"edad: the input of {step.name!r} is not the output of "
                                 f"{calls[here].name!r}; only plain chains are supported")
            activation, label, produced = step.module, step.name, step.output
        if calls[there].input is not produced:
            raise ValueError(f"edad: the input of {calls[there].name!r} is not the output of "
                             f"{calls[here].name!r} or of an activation module between them "
                             "(a functional activation such as F.relu, or an operation in "
                             f"between, cannot be recomputed); use modules ({supported_names()}) "
                             "or mode='dad'")
        links.append(Link(activation, label))
    return links


def recompute(top: torch.Tensor, weights: Sequence[torch.Tensor], acts: Sequence[torch.Tensor],
              links: Sequence[Link]) -> list[torch.Tensor]:
    """Global deltas of every layer from the output layer's (Eq. 5, Algorithm 2 line 11).

    Args:
        top: (rows, h_out) gathered delta of the last layer.
        weights: each layer's (out, in) weight, in forward order.
        acts: each layer's gathered input rows; ``acts[i + 1]`` is ``φ_i(Z_i)``.
            ``acts[0]`` is unused and may be empty (a private first layer).
        links: from :func:`chain`.

    Returns:
        Each layer's global delta, in forward order.
    """
    deltas = [top]
    for i in range(len(weights) - 2, -1, -1):
        upstream = deltas[0] @ weights[i + 1]
        link = links[i]
        if link.activation is not None:
            upstream = upstream * derivative(link.activation, link.name, acts[i + 1])
        deltas.insert(0, upstream)
    return deltas
