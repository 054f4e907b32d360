"""A GRU sequence classifier built from ``nn.Linear`` cells, unrolled over time (dAD §3.5).

The recurrence is PyTorch's own ``nn.GRU`` (gate order r, z, n; the hidden
bias of the candidate gate sits inside the reset product)::

    r = σ(W_ir·x + b_ir + W_hr·h + b_hr)
    z = σ(W_iz·x + b_iz + W_hz·h + b_hz)
    n = tanh(W_in·x + b_in + r ⊙ (W_hn·h + b_hn))
    h' = (1 − z) ⊙ n + z ⊙ h

but the two affine maps are ``nn.Linear`` modules called once per time
step, so forward hooks see every step and dAD can stack time into rows.
The classifier on the last hidden state follows §4.1.2: fully connected
layers (512 and 256 wide in the paper) with ReLU, then the output layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class GRUClassifier(nn.Module):
    """GRU over (batch, time, features) sequences, then an MLP on the last hidden state.

    Args:
        features: input size per time step.
        classes: output size.
        hidden: GRU hidden size (64 in the paper).
        widths: hidden layers of the classifier ((512, 256) in the paper).

    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, features: int, classes: int, hidden: int = 64,
                 widths: Sequence[int] = (512, 256)) -> None:
        super().__init__()
        for name, value in (("features", features), ("classes", classes), ("hidden", hidden),
                            *((f"widths[{i}]", w) for i, w in enumerate(widths))):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        self.hidden = hidden
        self.x2h = nn.Linear(features, 3 * hidden)  # input-to-hidden: W_i·x + b_i
        self.h2h = nn.Linear(hidden, 3 * hidden)  # hidden-to-hidden: W_h·h + b_h
        layers: list[nn.Module] = []
        width = hidden
        for size in widths:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, classes))
        self.head = nn.Sequential(*layers)

    def cell(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One GRU step: (batch, features), (batch, hidden) -> (batch, hidden)."""
        ir, iz, i_n = self.x2h(x).chunk(3, dim=1)
        hr, hz, h_n = self.h2h(h).chunk(3, dim=1)
        r = torch.sigmoid(ir + hr)
        z = torch.sigmoid(iz + hz)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h

    def forward(self, sequences: torch.Tensor) -> torch.Tensor:
        """Logits (batch, classes) of (batch, time, features) sequences."""
        if sequences.dim() != 3:
            raise ValueError(f"sequences must be (batch, time, features), got "
                             f"{tuple(sequences.shape)}")
        h = sequences.new_zeros(sequences.shape[0], self.hidden)
        for t in range(sequences.shape[1]):
            h = self.cell(sequences[:, t], h)
        logits: torch.Tensor = self.head(h)
        return logits
