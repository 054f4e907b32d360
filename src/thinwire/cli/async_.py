"""Train with an asynchronous parameter server: sequential, ssgd, asgd or dc-asgd.

Writes results.json, results.md, test_error.png and the final weights
(weights.pt) to --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from thinwire import schemes
from thinwire.data.imagesets import IMAGE_SETS
from thinwire.jobs import common
from thinwire.jobs.ps_task import MODELS, TaskSpec
from thinwire.launch import add_timeout
from thinwire.ps import launch
from thinwire.ps.config import METHODS, AsyncConfig


def _kill(text: str) -> tuple[int, int]:
    worker, sep, pushes = text.partition(":")
    if not sep or not worker.isdigit() or not pushes.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} must look like WORKER:PUSHES, e.g. 2:50")
    return int(worker), int(pushes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    method = parser.add_argument_group("method")
    method.add_argument("--rule", choices=sorted(METHODS), default=AsyncConfig.method,
                        help="sequential (one stream, in-process), ssgd (barrier), asgd, dc-asgd")
    method.add_argument("--workers", type=int, default=AsyncConfig.workers,
                        help="worker processes")
    method.add_argument("--threads-per-worker", type=int, default=1,
                        help="hogwild threads per worker, sharing one error buffer")
    method.add_argument("--epochs", type=int, default=AsyncConfig.passes,
                        help="passes over the training set")
    method.add_argument("--steps", type=int, default=None,
                        help="stop each worker after this many steps, a step being one push "
                             "from each of its threads, or at the end of --epochs, whichever "
                             "comes first (default: none, every epoch in full)")
    method.add_argument("--lr", type=float, default=0.1, help="learning rate")
    method.add_argument("--lambda", dest="lam", type=float, default=None,
                        help="dc-asgd: variance control lambda (default: the paper's, "
                             "2 for --variant abs, 0.04 for square)")
    method.add_argument("--variant", choices=["square", "abs"], default=None,
                        help="dc-asgd: lambda*g*g (Option II) or lambda*|g| (Option I) "
                             "(default: square)")
    method.add_argument("--adaptive", action="store_true",
                        help="dc-asgd: divide lambda by sqrt(MeanSquare(g))")
    method.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    method.add_argument("--weight-decay", type=float, default=0.0, help="L2 penalty")
    method.add_argument("--milestones", action=common.CommaList, item=float, default=[],
                        help="comma-separated epochs after which lr drops (and lambda grows), "
                             "e.g. 5,8")
    method.add_argument("--lr-decay", type=float, default=0.1,
                        help="learning-rate factor at each milestone")
    method.add_argument("--lam-growth", type=float, default=None,
                        help="dc-asgd: lambda factor at each milestone (default: 10)")
    method.add_argument("--max-staleness", type=int, default=None,
                        help="drop pushes older than this many updates (default: keep all)")
    push = parser.add_argument_group("pushes")
    push.add_argument("--push", default=AsyncConfig.push,
                      help="push scheme: dense, fp16, topk, dct-dp, laplace")
    push.add_argument("--push-option", action="append", default=[], metavar="KEY=VALUE",
                      help="option of the push scheme, e.g. ratio=0.01")
    task = parser.add_argument_group("task")
    task.add_argument("--dataset", choices=sorted(IMAGE_SETS), default=TaskSpec.dataset,
                      help="image set")
    task.add_argument("--model", choices=sorted(MODELS), default=TaskSpec.model,
                      help="network")
    task.add_argument("--batch-size", type=int, default=TaskSpec.batch_size,
                      help="samples per worker per step; a worker's --threads-per-worker "
                           "threads split them, each pushing a gradient of batch-size / "
                           "threads samples")
    task.add_argument("--seed", type=int, default=TaskSpec.seed,
                      help="model initialisation and data order")
    task.add_argument("--train-limit", type=int, default=None,
                      help="use only the first N training examples (default: all)")
    files = parser.add_argument_group("files, network, faults")
    common.add_outputs(files, "async")
    files.add_argument("--checkpoint", default=None, help="server checkpoint path")
    files.add_argument("--checkpoint-every", type=int, default=0,
                       help="also checkpoint every N updates (0: only at the end)")
    files.add_argument("--resume", default=None, help="resume the server from a checkpoint")
    files.add_argument("--interface", default=AsyncConfig.interface,
                       help="network interface RPC listens on (lo: loopback only)")
    files.add_argument("--init-method", default=None,
                       help="RPC rendezvous, e.g. tcp://10.0.0.1:29500 (default: a local file)")
    add_timeout(files, "a pull or push waiting longer on the server fails its worker")
    files.add_argument("--deadline", type=float, default=AsyncConfig.timeout_s,
                       metavar="SECONDS", help="limit on the whole run: its processes are "
                       "killed after it")
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


def per_thread_batch(batch_size: int, threads: int) -> int:
    """The samples behind each push: a worker's ``batch_size`` split over its ``threads``.

    Raises:
        ValueError: ``batch_size`` is not a positive multiple of ``threads``.
    """
    if batch_size < 1 or threads < 1 or batch_size % threads:
        raise ValueError(f"--batch-size {batch_size} (samples per worker per step) must be a "
                         f"positive multiple of --threads-per-worker {threads}")
    return batch_size // threads


def run_command(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """Run the configured method; write the run folder. Returns the summary and the folder."""
    push_options = common.parse_options(
        args.push_option, {args.push: schemes.config_class(args.push)}, "--push-option")
    config = AsyncConfig(
        method=args.rule, workers=args.workers, threads_per_worker=args.threads_per_worker,
        passes=args.epochs, rule=_rule_options(args), milestones=tuple(args.milestones),
        max_staleness=args.max_staleness, push=args.push, push_options=push_options,
        checkpoint=args.checkpoint, checkpoint_every=args.checkpoint_every, resume=args.resume,
        interface=args.interface, init_method=args.init_method, rpc_timeout_s=args.timeout,
        timeout_s=args.deadline)
    spec = TaskSpec(dataset=args.dataset, model=args.model,
                    batch_size=per_thread_batch(args.batch_size, args.threads_per_worker),
                    seed=args.seed, train_limit=args.train_limit, steps=args.steps)
    result = launch.run(config, spec, kill_after=dict(args.kill_after),
                        progress=not args.no_progress)
    out = common.run_folder(args.out, "async")
    summary = result.summary()
    row = summary_row(args.rule, summary)
    common.write_results(
        out, "async", args, [summary],
        f"# thinwire async\n\n{args.rule} with {args.workers} workers "
        f"({args.threads_per_worker} threads each), {args.epochs} epochs of {args.dataset} "
        f"on {args.model}, {args.push} pushes.\n\n"
        f"{common.markdown_table(HEADER, [row])}\n")
    torch.save(result.weights, out / "weights.pt")
    plot_curve(summary, out / "test_error.png")
    return summary, out


HEADER = ["rule", "test error", "updates", "updates/s", "mean staleness", "dropped",
          "non-finite", "bytes pulled", "bytes pushed"]


def summary_row(rule: str, summary: dict[str, Any]) -> list[str]:
    staleness = summary["staleness"]
    return [rule, f"{summary['final']['test_error']:.4f}", str(summary["updates"]),
            f"{summary['updates_per_second']:.1f}", f"{staleness['mean']:.2f}",
            str(staleness["outcomes"]["stale"]), str(staleness["outcomes"]["nonfinite"]),
            f"{summary['bytes'].get('pull', 0):,}", f"{summary['bytes'].get('push', 0):,}"]


def plot_curve(summary: dict[str, Any], path: Path) -> None:
    """Test error of the global model against epochs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.0, 3.4))
    curve = summary["curve"]
    axis.plot([p["passes"] for p in curve], [p["test_error"] for p in curve], marker="o")
    axis.set(xlabel="epochs (pushes received / pushes per pass)", ylabel="test error",
             title=f"{summary['config']['method']}, {summary['config']['workers']} workers")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args: argparse.Namespace) -> int:
    summary, out = run_command(args)
    print(common.text_table(HEADER, [summary_row(args.rule, summary)]))
    for worker, report in sorted(summary["workers"].items()):
        if "error" in report:
            print(f"  worker {worker}: {report['error']}")
    print(f"wrote {out}/results.json, results.md, test_error.png, weights.pt")
    return 0
