"""Train one workload under several schemes side by side and compare them.

Spawns local worker processes (gloo) and trains with the same seed and data
shards under each scheme (:func:`thinwire.jobs.compare.compare`). Prints a table
and writes results.json, results.md, accuracy_vs_bytes.png and threshold.png
to --out.
"""

from __future__ import annotations

import argparse
import math
import sys

from thinwire import optim
from thinwire.jobs import board, common
from thinwire.jobs.compare import (
    compare,
    header,
    lone_worker,
    parse_bandwidth,
    plot,
    references,
    table_rows,
)
from thinwire.jobs.dataparallel import CLIP_AT, PRECISIONS, RUN_FEEDBACKS, RunOptions
from thinwire.jobs.workloads import CORPORA, OPTIMIZERS, RECIPES, SCHEDULES, WORKLOADS, LMShape
from thinwire.launch import add_timeout

# What `thinwire compare` runs when --schemes is not given (every name in --schemes works).
DEFAULT_SCHEMES = ("dense", "fp16", "topk", "dct-dp", "powersgd", "clt-k")

def add_scheme_options(parser: argparse.ArgumentParser) -> None:
    """``--ratio``, ``--life-span`` (defaults: each scheme's own) and ``--option KEY=VALUE``."""
    parser.add_argument("--ratio", type=float, default=None,
                        help="fraction of the entries a sparsifier keeps, in (0, 1] (default: "
                             "each scheme's own, which under Adam follows the optimiser)")
    parser.add_argument("--life-span", type=int, default=None,
                        help="dct-dp threshold life-span L in steps (default: its own)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="set KEY on every scheme that has it, e.g. --option values=fp16 "
                             "(thinwire schemes lists them)")


def add_recipe_options(parser: argparse.ArgumentParser) -> None:
    """The workload and how to train it; what is not given comes from its recipe."""
    parser.add_argument("--workload", default=RunOptions.workload, choices=sorted(WORKLOADS),
                        help="model and data set")
    parser.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                        help="the user's optimiser (default: the workload's recipe)")
    parser.add_argument("--momentum", type=float, default=None,
                        help="SGD momentum, or AdamW's beta1 (default: the workload's recipe)")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="SGD's weight decay, or AdamW's decoupled one (default: torch's: "
                             "0 for SGD, 0.01 for AdamW)")
    parser.add_argument("--beta2", type=float, default=RunOptions.beta2,
                        help="AdamW's second-moment decay (nanoGPT: 0.99 or 0.95)")
    parser.add_argument("--schedule", default=RunOptions.schedule, choices=SCHEDULES,
                        help="the learning rate over the run: constant, or a cosine decay to "
                             "--min-lr x --lr at the last step (nanoGPT's); both after "
                             "--lr-warmup")
    parser.add_argument("--lr-warmup", type=int, default=RunOptions.lr_warmup, metavar="STEPS",
                        help="steps the learning rate rises linearly to --lr first")
    parser.add_argument("--min-lr", type=float, default=RunOptions.min_lr, metavar="FRACTION",
                        help="--schedule cosine: the rate at the last step, as a fraction of "
                             "--lr (nanoGPT: 0.1)")
    parser.add_argument("--max-norm", type=float, default=None,
                        help="clip gradients at this norm, as clip_grad_norm_ (default: no "
                             "clipping); see --clip-at")
    parser.add_argument("--clip-at", default=RunOptions.clip_at, choices=CLIP_AT,
                        help="worker: sparse schemes clip each worker's gradient in the hook "
                             "(thinwire.ddp.register's max_norm), the others after backward; "
                             "after-backward: every scheme clips .grad after backward, as an "
                             "unchanged script")
    parser.add_argument("--precision", default=RunOptions.precision, choices=list(PRECISIONS),
                        help="autocast of the forward and loss; fp16 adds a GradScaler, "
                             "registered with the hook (thinwire.ddp.register's scaler)")
    parser.add_argument("--coupling", default=RunOptions.coupling, choices=optim.RULES,
                        help="how the optimiser meets the scheme (thinwire.ddp.register's "
                             "coupling): auto, the optimiser family's (SGD: momentum; Adam, "
                             "AdamW: none); momentum: its momentum moves into the workers' "
                             "error feedback; none: the optimiser as it is")
    parser.add_argument("--no-couple", dest="coupling", action="store_const", const="none",
                        help="the same as --coupling none")
    parser.add_argument("--warmup", type=int, default=None, metavar="STEPS",
                        help="steps averaged dense before the schemes compress (default: the "
                             f"optimiser family's: {optim.ADAM_WARMUP} under AdamW, 0 under SGD)")
    parser.add_argument("--feedback", default=RunOptions.feedback, choices=RUN_FEEDBACKS,
                        help="what a coupled clt-k keeps the momentum in: auto (its own "
                             "error feedback, as gradients are taken at the virtual iterate; "
                             "EF21 where they cannot be: Adam with amsgrad) or error (its own "
                             "always)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimiser steps per scheme (default: the workload's recipe)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per worker per step (default: the workload's recipe)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: the workload's recipe)")
    parser.add_argument("--eval-every", type=int, default=RunOptions.eval_every,
                        help="steps between test-accuracy points (steps to target are "
                             "counted at these points)")
    parser.add_argument("--hidden", type=int, default=RunOptions.hidden,
                        help="width of the MLP's hidden layers")
    parser.add_argument("--width", type=int, default=None,
                        help=f"a language model's width, for {' and '.join(sorted(CORPORA))} "
                             f"(default: {LMShape.width})")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"a language model's transformer blocks (default: {LMShape.layers})")
    parser.add_argument("--context", type=int, default=None,
                        help=f"a language model's window in bytes (default: {LMShape.context})")
    parser.add_argument("--target", type=float, default=None,
                        help="the test metric that counts as trained, for steps to target "
                             "(default: the workload's, docs/guide/cli.md)")
    parser.add_argument("--tied", action="store_true",
                        help="a language model shares its embedding with its output layer, "
                             "as GPT-2 and nanoGPT do")
    parser.add_argument("--seed", type=int, default=RunOptions.seed,
                        help="model initialisation, data order and split")
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="log rank 0's bytes per step, compression ratio, per-layer "
                             "density, loss and accuracy to TensorBoard, one run per scheme "
                             "in DIR/<scheme> (needs the tensorboard package)")


def add_sites(parser: argparse.ArgumentParser) -> None:
    """``--sites S``: FSDP2 inside each of S sites, the scheme across them."""
    parser.add_argument("--sites", type=int, default=None, metavar="S",
                        help="shard the model with FSDP2 inside each of S sites (shards per "
                             "site = workers / S) and send each shard's gradient across sites "
                             "through the scheme (thinwire.fsdp); the scheme native-hsdp is "
                             "then torch's own HSDP. Default: no sharding (DDP)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                        help="comma-separated scheme names, from thinwire schemes; diloco and "
                             "diloco+SCHEME run local updates (docs/local-updates.md); "
                             "NAME:KEY=VALUE gives one run its own options, e.g. "
                             "powersgd,powersgd:rank=4")
    parser.add_argument("--workers", type=int, default=4, help="local worker processes")
    add_sites(parser)
    add_recipe_options(parser)
    add_scheme_options(parser)
    parser.add_argument("--bandwidth", default="100mbit",
                        help="link rate for the modelled time (compute + bytes / rate)")
    parser.add_argument("--no-lone", dest="lone", action="store_false",
                        help="skip the lone-worker reference run (dense, same recipe, one "
                             "worker); its row then shows no time")
    common.add_outputs(parser, "compare")
    add_timeout(parser)


def run_options(args: argparse.Namespace) -> RunOptions:
    """RunOptions from the command line; unset recipe options come from the workload."""
    recipe = RECIPES[args.workload]
    chosen = {key: getattr(args, key) for key in ("optimizer", "momentum", "lr", "steps",
                                                  "batch_size")}
    resolved = {key: recipe[key] if value is None else value for key, value in chosen.items()}
    return RunOptions(hidden=args.hidden, seed=args.seed, workload=args.workload,
                      eval_every=args.eval_every, beta2=args.beta2, schedule=args.schedule,
                      lr_warmup=args.lr_warmup, min_lr=args.min_lr, width=args.width,
                      layers=args.layers, context=args.context, tied=args.tied,
                      target=args.target,
                      coupling=args.coupling, warmup=args.warmup, feedback=args.feedback,
                      weight_decay=args.weight_decay, max_norm=args.max_norm,
                      clip_at=args.clip_at, precision=args.precision,
                      tensorboard=args.tensorboard, **resolved)


def _or_own(value: object) -> str:
    return "each scheme's own" if value is None else str(value)


def schedule_words(options: RunOptions) -> str:
    """The learning rate's schedule, in words."""
    rise = f"{options.lr_warmup} warm-up steps, then " if options.lr_warmup else ""
    decay = (f"cosine decay to {options.min_lr} x lr" if options.schedule == "cosine"
             else "constant")
    return rise + decay


def shape_words(options: RunOptions) -> str:
    """A language model's shape where options set it, e.g. `` (width 256, layers 4)``."""
    shape = options.shape()
    if shape is None:
        return ""
    return (f" (width {shape.width}, layers {shape.layers}, context {shape.context}"
            f"{', tied' if shape.tied else ''})")


def clipping(options: RunOptions) -> str:
    """How the run clips gradients, in words."""
    if options.max_norm is None:
        return "no clipping"
    return f"max norm {options.max_norm} at {options.clip_at}"


def run(args: argparse.Namespace) -> int:
    names = [name.strip() for name in args.schemes.split(",") if name.strip()]
    options = run_options(args)
    if options.tensorboard is not None:
        board.writer_class()
    bandwidth_bps = parse_bandwidth(args.bandwidth)
    results = compare(names, args.workers, options, bandwidth_bps, args.ratio,
                      args.life_span, args.option, args.timeout, sites=args.sites)
    dense = next((r for r in results if r["scheme"] == "dense"), None)
    lone = (dense if args.workers == 1 else lone_worker(options, args.timeout)
            if args.lone else None)
    extra = references(results, lone, args.workers)
    out = common.run_folder(args.out, "compare")
    rows = table_rows(results, extra)
    metric = results[0]["metric"]
    table = common.markdown_table(header(args.bandwidth, metric), rows)
    common.write_results(
        out, "compare", args, results,
        f"# thinwire compare\n\n{options.workload}{shape_words(options)}, {options.optimizer} "
        f"(lr {options.lr}, {schedule_words(options)}, "
        f"momentum {options.momentum}, beta2 {options.beta2}, weight decay "
        f"{'default' if options.weight_decay is None else options.weight_decay}, "
        f"{clipping(options)}, {options.precision}, "
        f"coupling {options.coupling}, warm-up "
        f"{'default' if options.warmup is None else options.warmup}), target {metric} "
        f"{results[0]['target']}; {args.workers} workers"
        f"{'' if args.sites is None else f' in {args.sites} sites (FSDP2 inside each)'}, "
        f"{options.steps} steps, "
        f"ratio {_or_own(args.ratio)}, life-span {_or_own(args.life_span)}; a step's compute "
        f"{results[0]['compute_ms_per_step']:.2f} ms (one probe for every scheme).\n\n"
        f"{table}\n\nlone worker: dense with the same recipe on one worker, no "
        f"communication; compute-only bound: dense's steps to target at {args.workers} "
        "workers with free communication. Times to target are steps x (compute + overhead "
        f"+ bytes / {args.bandwidth}); x bound: a time as a multiple of the bound's.\n",
        references=extra)
    figures = plot(results, out)
    print(common.text_table(header(args.bandwidth, metric), rows))
    print(f"wrote {out}/results.json, results.md, " + ", ".join(f.name for f in figures))
    diverged = [r["scheme"] for r in results if r["replicas_identical"] is False]
    broken = [r["scheme"] for r in results if not math.isfinite(r["test_accuracy"])]
    if diverged:  # the ranks no longer train one model: the run's numbers mean nothing
        print(f"thinwire compare: error: replicas diverged under {', '.join(diverged)}: the "
              "ranks' final weights differ", file=sys.stderr)
    if broken:
        print(f"thinwire compare: error: non-finite test accuracy under {', '.join(broken)}",
              file=sys.stderr)
    return 1 if diverged or broken else 0
