"""Compare dSGD, dAD, edAD, rank-dAD and PowerSGD side by side on sites with split labels.

Each mode trains the same network from the same weights on local gloo
processes (one worker per site); no class is on two sites. Prints, per mode,
the bytes each site hands to torch.distributed per step, the maximum gradient
error against pooled training, and the test AUC; writes results.json,
results.md and figures (auc.png, effective_rank.png, bytes.png) to --out.
"""

from __future__ import annotations

import argparse
from typing import Any

from thinwire.autodiff.engine import MODES, AutodiffConfig
from thinwire.autodiff.power import STOPPING
from thinwire.data import sitedata
from thinwire.jobs import common
from thinwire.jobs import dad_plots as plots
from thinwire.jobs.dad import HEADER, Run, run_all, table, table_rows
from thinwire.launch import add_timeout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", default="digits", help=f"one of {sitedata.names()}")
    parser.add_argument("--modes", action=common.CommaList, default=list(MODES), choices=MODES,
                        help="comma-separated modes to compare")
    parser.add_argument("--ranks", action=common.CommaList, item=int, default=[4],
                        help="comma-separated maximum ranks for rank-dad and powersgd")
    parser.add_argument("--workers", type=int, default=2,
                        help="sites, one worker process each")
    parser.add_argument("--batch-size", type=int, default=Run.batch,
                        help="samples per worker per step (a worker: one site)")
    parser.add_argument("--epochs", type=int, default=Run.epochs, help="passes over the data")
    parser.add_argument("--steps", type=int, default=0,
                        help="stop after this many steps in all; 0 runs every epoch in full")
    parser.add_argument("--hidden", action=common.CommaList, item=int, default=[256, 256],
                        help="comma-separated hidden layer widths (the paper's: 1024,1024)")
    parser.add_argument("--lr", type=float, default=Run.lr, help="Adam learning rate")
    parser.add_argument("--theta", type=float, default=AutodiffConfig.theta,
                        help="rank-dad stopping threshold")
    parser.add_argument("--stopping", choices=STOPPING, default=AutodiffConfig.stopping,
                        help="rank-dad stopping rule: the paper's (consecutive directions "
                             "repeat) or residual (a component adds < theta)")
    parser.add_argument("--error-feedback", action="store_true",
                        help="rank-dad keeps what its factors left out for the next step "
                             "(not in the paper; O(h^2) per layer like PowerSGD)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default=Run.dtype,
                        help="dtype of the weights and data")
    parser.add_argument("--private-input", action="store_true",
                        help="keep the first layer's inputs (the raw data) on each site")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="any other option of every mode, e.g. iterations=5 or "
                             "private_fallback=factor")
    parser.add_argument("--seed", type=int, default=Run.seed, help="weights and batch order")
    common.add_outputs(parser, "dad")
    add_timeout(parser)


# Options a flag of their own sets; --option refuses them.
_OWN_FLAGS = {"mode": "--modes", "rank": "--ranks", "theta": "--theta", "stopping": "--stopping",
              "error_feedback": "--error-feedback", "private_input": "--private-input"}


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options = common.parse_options(args.option, {"dad": AutodiffConfig})
    taken = [key for key in options if key in _OWN_FLAGS]
    if taken:
        raise ValueError(f"--option {taken[0]!r}: set it with {_OWN_FLAGS[taken[0]]}")
    AutodiffConfig(**options)  # values in range, before anything is spawned
    return options


def _runs(args: argparse.Namespace) -> list[Run]:
    recipe = {"epochs": args.epochs, "batch": args.batch_size, "hidden": tuple(args.hidden),
              "lr": args.lr, "seed": args.seed, "dtype": args.dtype, "steps": args.steps}
    shared = {**_options(args), **({"private_input": True} if args.private_input else {})}
    runs = []
    for mode in args.modes:
        if mode in ("rank-dad", "powersgd"):
            for rank in args.ranks:
                options: dict[str, Any] = {**shared, "rank": rank}
                label = f"{mode} r={rank}"
                if mode == "rank-dad":
                    options["theta"] = args.theta
                    options["stopping"] = args.stopping
                    if args.error_feedback:
                        options["error_feedback"] = True
                        label = f"rank-dad+ef r={rank}"
                runs.append(Run(label, mode, options, **recipe))
        else:
            runs.append(Run(mode, mode, dict(shared), **recipe))
    return runs


def _check(args: argparse.Namespace) -> None:
    for flag in ("workers", "batch_size", "epochs"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)} must be >= 1")
    if args.steps < 0:
        raise ValueError(f"--steps={args.steps} must be >= 0 (0: every epoch in full)")
    if any(w < 1 for w in args.hidden):
        raise ValueError(f"--hidden={args.hidden} must all be >= 1")


def run(args: argparse.Namespace) -> int:
    _check(args)
    runs = _runs(args)
    try:
        data = sitedata.load(args.dataset, args.seed)
    except sitedata.Unavailable as error:
        raise ValueError(str(error)) from error
    results = run_all(data, runs, args.workers, args.timeout, progress=True)
    out = common.run_folder(args.out, "dad")
    setting = (f"{data.name}: {args.workers} sites, labels split, batch {args.batch_size} per "
               f"site, {results[0]['steps_per_epoch']} steps per epoch")
    common.write_results(
        out, "dad", args, results,
        f"# thinwire dad\n\n{setting}.\n\n"
        f"{common.markdown_table(HEADER, table_rows(results))}\n")
    plots.auc(results, str(out / "auc.png"), f"test AUC, {data.name}")
    plots.effective_rank(results, str(out / "effective_rank.png"))
    plots.bytes_per_step(results, str(out / "bytes.png"))
    print(setting)
    print(table(results))
    print(f"wrote {out}/results.json, results.md, auc.png, effective_rank.png, bytes.png")
    return 0
