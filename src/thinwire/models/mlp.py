"""The multilayer perceptron the compare job trains."""

from __future__ import annotations

from torch import nn


def mlp(inputs: int = 64, hidden: int = 256, depth: int = 2, classes: int = 10) -> nn.Sequential:
    """``depth`` hidden ReLU layers of width ``hidden``, then a linear classifier."""
    if depth < 1 or hidden < 1:
        raise ValueError(f"depth={depth!r} and hidden={hidden!r} must both be >= 1")
    layers: list[nn.Module] = []
    width = inputs
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)
