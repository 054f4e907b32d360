"""thinwire inside a Hugging Face ``accelerate`` script: register after ``prepare``.

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --scheme dct-dp --steps 50
    accelerate launch --cpu --num_processes 2 examples/accelerate_ddp.py

``accelerator.prepare`` wraps the model in DistributedDataParallel; one call to
:func:`thinwire.ddp.register` then compresses its gradient exchange, and
:func:`thinwire.optim.couple` moves SGD's momentum into the scheme. Needs
``pip install 'thinwire[examples]'``.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import thinwire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="dct-dp", help="thinwire scheme (default: dct-dp)")
    parser.add_argument("--steps", type=int, default=50, help="optimiser steps (default: 50)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    parser.add_argument("--json", default=None, help="rank 0 writes a summary here")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    digits = load_digits()
    data = TensorDataset(torch.tensor(digits.data, dtype=torch.float32) / 16.0,
                         torch.tensor(digits.target))
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(data, batch_size=32, shuffle=True)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)

    meter = thinwire.Meter(accelerator.process_index, accelerator.num_processes)
    scheme = thinwire.schemes.build(args.scheme)
    if accelerator.num_processes > 1:  # a single process has no DDP wrapper and no exchange
        state = thinwire.ddp.register(model, scheme, meter=meter)
        # The optimiser's momentum moves into the scheme's error feedback (docs/convergence.md).
        thinwire.optim.couple(optimizer.optimizer, state)

    step, loss = 0, torch.zeros(())
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            meter.next_step()
            step += 1
            if step == args.steps:
                break
    if accelerator.is_main_process:
        summary = {"scheme": args.scheme, "world_size": accelerator.num_processes,
                   "steps": step, "loss": float(loss.detach()),
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
