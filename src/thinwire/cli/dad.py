"""Compare dSGD, dAD, edAD, rank-dAD and PowerSGD side by side on sites with split labels.

Each mode trains the same network from the same weights on local gloo
processes (one per site); no class is on two sites. Prints, per mode, the
bytes each site hands to torch.distributed per step, the maximum gradient
error against pooled training, and the test AUC; writes results.json and
figures (AUC per mode, effective rank per layer, bytes) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from thinwire.autodiff.engine import MODES
from thinwire.autodiff.power import STOPPING
from thinwire.data import sitedata
from thinwire.jobs import dad_plots as plots
from thinwire.jobs.dad import Run, run_all, table
from thinwire.launch import add_timeout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="digits",
                        help=f"one of {sitedata.names()} (default digits)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="modes to compare (default: all)")
    parser.add_argument("--ranks", nargs="+", type=int, default=[4],
                        help="maximum ranks for rank-dad and powersgd (default 4)")
    parser.add_argument("--sites", type=int, default=2, help="number of sites (default 2)")
    parser.add_argument("--batch", type=int, default=32, help="batch per site (default 32)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    parser.add_argument("--max-steps", type=int, default=0,
                        help="cap on steps per epoch, 0 for whole epochs (default 0)")
    parser.add_argument("--hidden", nargs="+", type=int, default=[256, 256],
                        help="hidden layer widths (paper: 1024 1024; default 256 256)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--theta", type=float, default=1e-3, help="rank-dad stopping threshold")
    parser.add_argument("--stopping", choices=STOPPING, default="paper",
                        help="rank-dad stopping rule: the paper's (consecutive directions "
                             "repeat, default) or residual (a component adds < theta)")
    parser.add_argument("--error-feedback", action="store_true",
                        help="rank-dad keeps what its factors left out for the next step "
                             "(not in the paper; O(h^2) per layer like PowerSGD)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--private-input", action="store_true",
                        help="keep the first layer's inputs (the raw data) on each site")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/dad", help="output folder")
    add_timeout(parser)


def _runs(args: argparse.Namespace) -> list[Run]:
    common = {"epochs": args.epochs, "batch": args.batch, "hidden": tuple(args.hidden),
              "lr": args.lr, "seed": args.seed, "dtype": args.dtype, "max_steps": args.max_steps}
    private = {"private_input": True} if args.private_input else {}
    runs = []
    for mode in args.modes:
        if mode in ("rank-dad", "powersgd"):
            for rank in args.ranks:
                options: dict[str, Any] = {"rank": rank, **private}
                label = f"{mode} r={rank}"
                if mode == "rank-dad":
                    options["theta"] = args.theta
                    options["stopping"] = args.stopping
                    if args.error_feedback:
                        options["error_feedback"] = True
                        label = f"rank-dad+ef r={rank}"
                runs.append(Run(label, mode, options, **common))
        else:
            runs.append(Run(mode, mode, dict(private), **common))
    return runs


def _check(args: argparse.Namespace) -> None:
    for name in ("sites", "batch", "epochs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= 1")
    if args.max_steps < 0:
        raise ValueError(f"--max-steps={args.max_steps} must be >= 0")
    if any(w < 1 for w in args.hidden):
        raise ValueError(f"--hidden={args.hidden} must all be >= 1")


def run(args: argparse.Namespace) -> int:
    _check(args)
    try:
        data = sitedata.load(args.dataset, args.seed)
    except sitedata.Unavailable as error:
        raise ValueError(str(error)) from error
    results = run_all(data, _runs(args), args.sites, args.timeout)
    os.makedirs(args.out, exist_ok=True)
    print(f"{data.name}: {args.sites} sites, labels split, batch {args.batch} per site, "
          f"{results[0]['steps_per_epoch']} steps per epoch")
    print(table(results))
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    plots.auc(results, os.path.join(args.out, "auc.png"), f"test AUC, {data.name}")
    plots.effective_rank(results, os.path.join(args.out, "effective_rank.png"))
    plots.bytes_per_step(results, os.path.join(args.out, "bytes.png"))
    print(f"wrote {args.out}/results.json, auc.png, effective_rank.png, bytes.png")
    return 0
