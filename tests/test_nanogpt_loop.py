"""A nanoGPT-style training loop with a per-step scheme: the loop as its users write it.

Gradient accumulation through ``require_backward_grad_sync``, AdamW, a GradScaler that
is disabled in float32, clipping where ``state.clips_in_hook`` says, and a checkpoint
of one file per rank with the optimiser restored before DDP exists.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import thinwire
from thinwire.launch import spawn

VOCAB, BLOCK, WIDTH, MICRO = 16, 8, 16, 2
CLIP = 1.0


class TinyGPT(nn.Module):
    """One pre-norm causal self-attention block and an MLP: nanoGPT's shape, small."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(BLOCK, WIDTH)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(WIDTH) for _ in range(3))
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1],
                                                             dtype=h.dtype)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        logits = self.head(self.norm3(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _model(rank: int) -> nn.Module:
    torch.manual_seed(1337 + rank)  # nanoGPT seeds each rank apart; DDP's wrap broadcasts
    return TinyGPT().double()


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    tokens = torch.randint(0, VOCAB, (4, BLOCK + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _setup(rank: int, scheme: str | None, checkpoint: dict[str, Any] | None
           ) -> tuple[nn.Module, DistributedDataParallel, torch.optim.Optimizer, Any, Any]:
    """nanoGPT's order: model and optimiser restored first, then DDP, then register."""
    model = _model(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99),
                                  weight_decay=0.1)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # float32: nanoGPT's disabled scaler
    net = DistributedDataParallel(model)
    state = None
    if scheme is not None:
        built = thinwire.schemes.build(scheme)
        state = thinwire.ddp.register(net, built, optimizer=optimizer, scaler=scaler,
                                      max_norm=CLIP if built.traits.clips_in_hook else None)
        if checkpoint is not None:
            state.load_state_dict(checkpoint["scheme"])
    return model, net, optimizer, scaler, state


def _loop(rank: int, net: DistributedDataParallel, optimizer: torch.optim.Optimizer,
          scaler: Any, state: Any, steps: range) -> None:
    for step in steps:
        for micro in range(MICRO):
            net.require_backward_grad_sync = micro == MICRO - 1
            loss = net(*_batch(rank, step, micro)) / MICRO
            scaler.scale(loss).backward()
        if state is None or not state.clips_in_hook:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)


def _train(rank: int, world_size: int, scheme: str | None, steps: int, split: int | None,
           directory: str) -> list[torch.Tensor]:
    model, net, optimizer, scaler, state = _setup(rank, scheme, None)
    _loop(rank, net, optimizer, scaler, state, range(split or steps))
    if split is not None:
        path = os.path.join(directory, f"{scheme}-{split}-rank{rank}.pt")  # one per rank
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheme": None if state is None else state.state_dict()}, path)
        model, net, optimizer, scaler, state = _setup(rank, scheme, torch.load(path))
        _loop(rank, net, optimizer, scaler, state, range(split, steps))
    return [p.detach().clone() for p in model.parameters()]


def _all(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    long = thinwire.optim.ADAM_WARMUP + 4
    return {
        "dense": _train(rank, world_size, None, 6, None, directory),
        "everything": _train(rank, world_size, "topk:ratio=1.0", 6, None, directory),
        "straight": _train(rank, world_size, "topk:ratio=0.05", long, None, directory),
        "resumed": _train(rank, world_size, "topk:ratio=0.05", long,
                          thinwire.optim.ADAM_WARMUP - 1, directory),
        "dense-long": _train(rank, world_size, None, long, None, directory),
    }


def test_the_nanogpt_loop_with_a_per_step_scheme(tmp_path: Any) -> None:
    runs = spawn(_all, 2, str(tmp_path))
    for rank in runs:
        # nothing dropped, clipped in the hook where dense clips after backward: AdamW's
        # steps to float64 rounding (the clip threshold is not reached at these losses)
        for a, b in zip(rank["dense"], rank["everything"]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        for a, b in zip(rank["straight"], rank["resumed"]):  # across the warm-up's switch
            assert torch.equal(a, b)
        assert not all(torch.equal(a, b) for a, b in zip(rank["straight"], rank["dense-long"]))
    for a, b in zip(runs[0]["resumed"], runs[1]["resumed"]):
        assert torch.equal(a, b)
