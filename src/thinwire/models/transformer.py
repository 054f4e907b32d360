"""A small transformer encoder whose FFN ReLU outputs are split points (DCT KDD'21 §3.2).

The paper puts DCT-MP after the ReLU of an encoder layer's feed-forward
network. A pre-norm encoder layer here is three chain entries so that point
is a module boundary:

* ``layerI.attn``: ``x + MHA(LN(x))``
* ``layerI.ffn_relu``: ``x -> (x, ReLU(W1 LN(x)))`` -- the split point; its
  last output (B, T, ffn) is what DCT-MP compacts per token, while the
  residual stream ``x`` (B, T, d_model) crosses dense alongside it.
* ``layerI.ffn_out``: ``(x, h) -> x + W2 h``

:func:`digits_sequences` makes scikit-learn's 8x8 digits a real sequence
task: each image is 8 tokens (its rows) of 8 pixels.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from thinwire.pipeline.split import Chain


class Embed(nn.Module):
    """Token projection plus a learned position embedding."""

    def __init__(self, features: int, tokens: int, width: int) -> None:
        super().__init__()
        self.project = nn.Linear(features, width)
        self.position = nn.Parameter(torch.randn(tokens, width) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded: torch.Tensor = self.project(tokens) + self.position
        return embedded


class SelfAttention(nn.Module):
    """Pre-norm residual self-attention: ``x + MHA(LN(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm(x)
        attended: torch.Tensor = self.attention(normed, normed, normed, need_weights=False)[0]
        return x + attended


class FeedForwardIn(nn.Module):
    """First half of the FFN: keeps the residual, returns ``(x, ReLU(W1 LN(x)))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.relu(self.linear(self.norm(x)))


class FeedForwardOut(nn.Module):
    """Second half of the FFN: ``x + W2 h``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, width)

    def forward(self, carry: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, hidden = carry
        update: torch.Tensor = self.linear(hidden)
        return x + update


class Classify(nn.Module):
    """Final norm, mean over tokens, linear classifier."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.linear(self.norm(x).mean(dim=1))
        return logits


def encoder(features: int = 8, tokens: int = 8, classes: int = 10, *, width: int = 32,
            heads: int = 4, hidden: int = 128, layers: int = 2, seed: int = 0) -> Chain:
    """The encoder chain; split points are ``"layer{i}.ffn_relu"``.

    Called as ``model(tokens)`` with tokens (B, T, features); returns logits (B, classes).
    """
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        blocks: OrderedDict[str, nn.Module] = OrderedDict(embed=Embed(features, tokens, width))
        for i in range(layers):
            blocks[f"layer{i}"] = nn.Sequential(OrderedDict(
                attn=SelfAttention(width, heads),
                ffn_relu=FeedForwardIn(width, hidden),
                ffn_out=FeedForwardOut(width, hidden),
            ))
        blocks["head"] = Classify(width, classes)
        model = Chain(blocks)
    finally:
        torch.random.set_rng_state(state)
    return model


def splits(layers: int, stages: int) -> tuple[str, ...]:
    """Split points for ``stages`` stages: after the FFN ReLU of the last layers (§3.2)."""
    if not 1 <= stages <= layers + 1:
        raise ValueError(f"stages={stages!r} must be in [1, {layers + 1}] for {layers} layers")
    return tuple(f"layer{i}.ffn_relu" for i in range(layers - stages + 1, layers))


Split = tuple[torch.Tensor, torch.Tensor]


def digits_sequences(*, seed: int = 0, test_fraction: float = 0.25) -> tuple[Split, Split]:
    """scikit-learn's digits as (tokens (n, 8, 8) in [0, 1], labels (n,)), train and test."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels)

    def convert(x: object, y: object) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor(x, dtype=torch.float32).reshape(-1, 8, 8) / 16.0,
                torch.tensor(y, dtype=torch.int64))

    return convert(train_x, train_y), convert(test_x, test_y)
