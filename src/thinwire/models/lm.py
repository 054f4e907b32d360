"""A small decoder-only (causal) transformer language model over bytes.

GPT-2's layout at toy size: token and learned position embeddings, pre-norm
blocks of causal self-attention and a GELU MLP (4x the width), a final norm
and a linear head over the 256 byte values. Attention is
``scaled_dot_product_attention`` with ``is_causal=True``, so a position sees
only the bytes before it and the model is trained on every position of a
window at once. Weights start from N(0, 0.02) with the residual projections
scaled by 1 / sqrt(2 layers), as GPT-2 does, so the residual stream keeps
its scale through the depth. ``tied=True`` shares the embedding with the head's
weight, as GPT-2 and nanoGPT do.
"""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB = 256  # byte values


class CausalSelfAttention(nn.Module):
    """``x + proj(softmax(QK^T / sqrt(d) + causal mask) V)`` over ``heads`` heads, pre-norm."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width!r} must be a multiple of heads={heads!r}")
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm(x)).split(width, dim=2)
        shape = (batch, tokens, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + out


class Block(nn.Module):
    """Causal self-attention, then ``x + W2 GELU(W1 LN(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention = CausalSelfAttention(width, heads)
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        update: torch.Tensor = self.down(nn.functional.gelu(self.up(self.norm(x))))
        return x + update


class ByteLM(nn.Module):
    """Called as ``model(tokens)`` with byte ids (B, T), T <= ``context``; returns next-byte
    logits (B, T, 256)."""

    def __init__(self, context: int = 64, width: int = 128, heads: int = 4,
                 layers: int = 2, tied: bool = False) -> None:
        super().__init__()
        for name, value in (("context", context), ("width", width), ("heads", heads),
                            ("layers", layers)):
            if value < 1:
                raise ValueError(f"{name}={value!r} must be >= 1")
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        if tied:  # GPT-2 and nanoGPT: one matrix embeds a byte and scores it
            self.head.weight = self.embed.weight
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() >= 2:  # GPT-2: residual projections shrink with the depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                     "down.weight")) else 0.02
                nn.init.normal_(param, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        logits: torch.Tensor = self.head(self.norm(self.blocks(x)))
        return logits


def byte_lm(context: int = 64, width: int = 128, heads: int = 4, layers: int = 2,
            seed: int = 0, tied: bool = False) -> ByteLM:
    """:class:`ByteLM` initialised from ``seed`` (the global RNG is left as it was)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return ByteLM(context, width, heads, layers, tied)
    finally:
        torch.random.set_rng_state(state)
