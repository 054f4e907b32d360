"""thinwire inside a PyTorch Lightning job: ``DDPStrategy(ddp_comm_hook=...)``.

    python examples/lightning_ddp.py --devices 2 --scheme dct-dp --steps 50   # Lightning spawns
    torchrun --nproc-per-node 2 examples/lightning_ddp.py --scheme dct-dp --steps 50

Lightning wraps the model in DistributedDataParallel and registers the hook itself;
thinwire supplies the hook (:func:`thinwire.ddp.comm_hook`) and its state
(:func:`thinwire.ddp.hook_state`). Lightning 2.x registers communication hooks on CUDA
only and silently drops them on CPU, although gloo runs them; the callback below
registers the same hook there. Needs ``pip install 'thinwire[examples]'``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import thinwire


class Classifier(L.LightningModule):
    """A small MLP on the 8x8 digits."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class RegisterOnCPU(L.Callback):
    """Registers the hook where Lightning does not (CPU devices) and couples the momentum."""

    def __init__(self, state: thinwire.ddp.HookState) -> None:
        self.state = state

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        if pl_module.device.type == "cpu" and isinstance(model, DistributedDataParallel):
            model.register_comm_hook(self.state, thinwire.ddp.comm_hook)
        # The optimiser's momentum moves into the scheme's error feedback (docs/convergence.md).
        for optimizer in trainer.optimizers:
            thinwire.optim.couple(optimizer, self.state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="dct-dp", help="thinwire scheme (default: dct-dp)")
    parser.add_argument("--steps", type=int, default=50, help="optimiser steps (default: 50)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
                        help="processes on this machine (default: torchrun's, else 2)")
    parser.add_argument("--json", default=None, help="rank 0 writes a summary here")
    args = parser.parse_args()

    torch.manual_seed(0)
    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16.0,
                         torch.tensor(digits.target))
    model = Classifier(args.lr)
    scheme = thinwire.schemes.build(args.scheme)
    meter = thinwire.Meter()
    state = thinwire.ddp.hook_state(model, scheme, meter=meter)
    strategy = DDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                           ddp_comm_hook=thinwire.ddp.comm_hook)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                        callbacks=[RegisterOnCPU(state)],
                        max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    # Meter steps follow the optimiser's, so bytes are per training step.
    trainer.fit(model, DataLoader(data, batch_size=32, shuffle=True))
    meter.step = trainer.global_step
    if trainer.global_rank == 0:
        summary = {"scheme": args.scheme, "world_size": trainer.world_size,
                   "steps": trainer.global_step, "loss": float(trainer.callback_metrics["loss"]),
                   "bytes_sent_per_step": meter.summary()["bytes_sent_per_step"]}
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(summary, handle)


if __name__ == "__main__":
    main()
    # Gloo's worker threads still hold work that references Python tensors; tearing the
    # group down at interpreter exit can abort the process. Free DDP (its reference
    # cycles hold the group) and destroy the group while Python is still alive.
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
