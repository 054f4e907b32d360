"""Train a model split into pipeline stages with DCT-MP boundaries (optionally × DP replicas).

Reports train/test loss and accuracy and the bytes per step of each entity:
X_act (forward across splits), X_grad (backward across splits), W_grad
(data-parallel gradients). By default the stages run as real processes on
torch.distributed.pipelining; --local runs them one after the other in this
process (same maths, faster for sweeps).
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path
from typing import Any

from thinwire.jobs.dct_mp import (
    OPTIMIZERS,
    TASK_DEFAULTS,
    TASKS,
    RunConfig,
    train_engine,
    train_local,
)
from thinwire.launch import add_timeout
from thinwire.pipeline.boundary import THRESHOLDS
from thinwire.pipeline.registry import boundary_kinds
from thinwire.pipeline.stages import SCHEDULES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="criteo", choices=sorted(TASKS),
                        help="model and data: DLRM on synthetic Criteo or breast cancer, "
                             "or the transformer on digits (default: criteo)")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (default: 2)")
    parser.add_argument("--splits", nargs="+", default=None, metavar="NAME",
                        help="modules to split after (default: the task's, e.g. bottom.3)")
    parser.add_argument("--boundary", default="dct-mp", choices=boundary_kinds(),
                        help="what crosses a split (default: dct-mp)")
    parser.add_argument("--sparsity", type=float, default=None,
                        help="eta for dct-mp / xgrad-topk, in [0, 1) (default: 0.9 for dct-mp)")
    parser.add_argument("--threshold", default=None, choices=list(THRESHOLDS),
                        help="dct-mp row threshold (default: topk)")
    parser.add_argument("--values", default=None, choices=["native", "fp16"],
                        help="dtype dct-mp values cross in (default: native)")
    parser.add_argument("--boundary-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="any other boundary option, e.g. compression=0.75 for sketch")
    parser.add_argument("--replicas", type=int, default=1,
                        help="data-parallel replicas of every stage (hybrid; default: 1)")
    parser.add_argument("--dp-scheme", default="dense",
                        help="registered scheme for W_grad across replicas (default: dense)")
    parser.add_argument("--dp-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="option of the DP scheme, e.g. sparsity=0.9")
    parser.add_argument("--schedule", default="gpipe", choices=sorted(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--local", action="store_true",
                        help="run the stages in this process instead of as processes")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per step, all replicas (default: 256; 32 breast-cancer, "
                             "64 digits)")
    parser.add_argument("--epochs", type=float, default=None,
                        help="passes over the data (default: 1; 5 breast-cancer, 20 digits)")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: 1e-3; 3e-3 digits)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=100_000,
                        help="synthetic criteo training rows (default: 100000)")
    parser.add_argument("--test-size", type=int, default=10_000)
    add_timeout(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (Python literals, else strings)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"option {pair!r} must look like KEY=VALUE")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text
    return options


def config_from(args: argparse.Namespace) -> RunConfig:
    """The :class:`RunConfig` the arguments describe."""
    options = parse_options(args.boundary_opt)
    for name in ("sparsity", "threshold", "values"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.boundary == "dct-mp":
        options.setdefault("sparsity", 0.9)
    tuned = {name: getattr(args, name) for name in ("batch_size", "epochs", "lr")
             if getattr(args, name) is not None}
    return RunConfig(**{**TASK_DEFAULTS[args.task], **tuned}, task=args.task, stages=args.stages,
                     splits=None if args.splits is None else tuple(args.splits),
                     boundary=args.boundary, boundary_options=options,
                     replicas=args.replicas, dp_scheme=args.dp_scheme,
                     dp_options=parse_options(args.dp_opt), schedule=args.schedule,
                     microbatches=args.microbatches, max_steps=args.steps,
                     optimizer=args.optimizer, seed=args.seed, train_size=args.train_size,
                     test_size=args.test_size)


def report(result: dict[str, Any]) -> str:
    """A few human-readable lines about one run."""
    config = result["config"]
    mode = "local" if "ranks" not in result else \
        f"{config['stages']} stages × {config['replicas']} replicas, {config['schedule']}"
    lines = [f"task {config['task']}: {config['boundary']} {config['boundary_options']} at "
             f"{result['splits'] or '(no split)'} ({mode}, {result['steps']} steps)"]
    for part in ("train", "test"):
        lines.append(f"  {part:5s} loss {result[part]['loss']:.4f}  "
                     f"accuracy {100 * result[part]['accuracy']:.2f}%")
    if result.get("oracle"):
        lines.append(f"  oracle loss {result['oracle']['loss']:.4f}  "
                     f"accuracy {100 * result['oracle']['accuracy']:.2f}%")
    for entity, nbytes in sorted(result["bytes_per_entity"].items()):
        lines.append(f"  {entity:7s} {nbytes:14,.0f} bytes per step")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    if args.local:
        result = train_local(config, progress=True)
    else:
        result = train_engine(config, timeout_s=args.timeout)
        result["ranks"] = [{k: v for k, v in r.items() if k != "state"} for r in result["ranks"]]
    print(report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0
