"""Train with an asynchronous parameter server: sequential, ssgd, asgd or dc-asgd."""

from __future__ import annotations

import argparse
import ast
import json
import os
from typing import Any

import torch

from thinwire.data.imagesets import IMAGE_SETS
from thinwire.jobs.ps_task import MODELS, TaskSpec
from thinwire.ps import launch
from thinwire.ps.config import METHODS, AsyncConfig


def _option(text: str) -> tuple[str, Any]:
    """``key=value`` with a Python literal value (``sparsity=0.99``, ``values='fp16'``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} must look like key=value")
    try:
        return key.replace("-", "_"), ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key.replace("-", "_"), value


def _kill(text: str) -> tuple[int, int]:
    worker, sep, pushes = text.partition(":")
    if not sep or not worker.isdigit() or not pushes.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} must look like WORKER:PUSHES, e.g. 2:50")
    return int(worker), int(pushes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    method = parser.add_argument_group("method")
    method.add_argument("--rule", choices=sorted(METHODS), default="dc-asgd",
                        help="sequential (one stream, in-process), ssgd (barrier), asgd, dc-asgd")
    method.add_argument("--workers", type=int, default=4, help="worker processes")
    method.add_argument("--threads-per-worker", type=int, default=1,
                        help="hogwild threads per worker, sharing one error buffer")
    method.add_argument("--passes", type=int, default=10, help="passes over the training set")
    method.add_argument("--lr", type=float, default=0.1, help="learning rate")
    method.add_argument("--lambda", dest="lam", type=float, default=None,
                        help="dc-asgd: variance control lambda (default: the paper's, "
                             "2 for --variant abs, 0.04 for square)")
    method.add_argument("--variant", choices=["square", "abs"], default=None,
                        help="dc-asgd: lambda*g*g (Option II) or lambda*|g| (Option I)")
    method.add_argument("--adaptive", action="store_true",
                        help="dc-asgd: divide lambda by sqrt(MeanSquare(g))")
    method.add_argument("--momentum", type=float, default=0.0)
    method.add_argument("--weight-decay", type=float, default=0.0)
    method.add_argument("--milestones", type=float, nargs="*", default=[],
                        help="passes after which lr drops (and lambda grows)")
    method.add_argument("--lr-decay", type=float, default=0.1,
                        help="learning-rate factor at each milestone")
    method.add_argument("--lam-growth", type=float, default=None,
                        help="dc-asgd: lambda factor at each milestone (default 10)")
    method.add_argument("--max-staleness", type=int, default=None,
                        help="drop pushes older than this many updates")
    push = parser.add_argument_group("pushes")
    push.add_argument("--push", default="dense",
                      help="push scheme: dense, fp16, topk, dct-dp, laplace")
    push.add_argument("--push-opt", type=_option, action="append", default=[],
                      metavar="KEY=VALUE", help="push scheme option, e.g. sparsity=0.99")
    task = parser.add_argument_group("task")
    task.add_argument("--dataset", choices=sorted(IMAGE_SETS), default="digits")
    task.add_argument("--model", choices=sorted(MODELS), default="convnet")
    task.add_argument("--batch-size", type=int, default=32)
    task.add_argument("--seed", type=int, default=0)
    task.add_argument("--train-limit", type=int, default=None,
                      help="use only the first N training examples")
    files = parser.add_argument_group("files, network, faults")
    files.add_argument("--out", default="results/async", help="folder for the results")
    files.add_argument("--checkpoint", default=None, help="server checkpoint path")
    files.add_argument("--checkpoint-every", type=int, default=0,
                       help="also checkpoint every N updates")
    files.add_argument("--resume", default=None, help="resume the server from a checkpoint")
    files.add_argument("--interface", default="lo",
                       help="network interface RPC listens on (default: loopback only)")
    files.add_argument("--init-method", default=None,
                       help="RPC rendezvous, e.g. tcp://10.0.0.1:29500 (default: a local file)")
    files.add_argument("--timeout", type=float, default=3600.0, help="deadline for the run, s")
    files.add_argument("--kill-after", type=_kill, action="append", default=[],
                       metavar="WORKER:PUSHES", help="fault injection: that worker dies "
                       "with a push in flight after this many pushes")
    files.add_argument("--no-progress", action="store_true", help="no progress bar")


# Rule option -> the flag that sets it, for messages.
_FLAGS = {"lam": "--lambda", "variant": "--variant", "lam_growth": "--lam-growth",
          "adaptive": "--adaptive"}


def _rule_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"lr": args.lr, "momentum": args.momentum,
                               "weight_decay": args.weight_decay, "lr_decay": args.lr_decay}
    compensation = {"lam": args.lam, "variant": args.variant, "lam_growth": args.lam_growth,
                    "adaptive": args.adaptive or None}
    given = {k: v for k, v in compensation.items() if v is not None}
    if args.rule == "dc-asgd":
        options.update(given)
    elif given:
        flags = ", ".join(_FLAGS[k] for k in given)
        raise ValueError(f"{flags} apply to --rule dc-asgd only, not {args.rule!r}")
    return options


def run_command(args: argparse.Namespace) -> dict[str, Any]:
    """Run the configured method; write ``<out>/<rule>-w<workers>.json`` and ``.pt`` weights."""
    config = AsyncConfig(
        method=args.rule, workers=args.workers, threads_per_worker=args.threads_per_worker,
        passes=args.passes, rule=_rule_options(args), milestones=tuple(args.milestones),
        max_staleness=args.max_staleness, push=args.push, push_options=dict(args.push_opt),
        checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every, resume=args.resume,
        interface=args.interface, init_method=args.init_method, timeout_s=args.timeout)
    spec = TaskSpec(dataset=args.dataset, model=args.model, batch_size=args.batch_size,
                    seed=args.seed, train_limit=args.train_limit)
    result = launch.run(config, spec, kill_after=dict(args.kill_after),
                        progress=not args.no_progress)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{args.rule}-w{args.workers}")
    summary = result.summary()
    with open(f"{stem}.json", "w") as handle:
        json.dump(summary, handle, indent=1, default=str)
    torch.save(result.weights, f"{stem}.pt")
    return summary


def run(args: argparse.Namespace) -> int:
    summary = run_command(args)
    staleness = summary["staleness"]
    print(f"{args.rule}: test error {summary['final']['test_error']:.4f} after "
          f"{summary['updates']} updates ({summary['updates_per_second']:.1f}/s); "
          f"mean staleness {staleness['mean']:.2f}, dropped {staleness['outcomes']['stale']}, "
          f"non-finite {staleness['outcomes']['nonfinite']}; "
          f"bytes pulled {summary['bytes'].get('pull', 0)}, pushed "
          f"{summary['bytes'].get('push', 0)}; results in {args.out}")
    for worker, report in sorted(summary["workers"].items()):
        if "error" in report:
            print(f"  worker {worker}: {report['error']}")
    return 0
