"""Train a model split into pipeline stages with DCT-MP boundaries, optionally data parallel too.

Reports train/test loss and accuracy and the bytes per step of each entity:
X_act (forward across splits), X_grad (backward across splits), W_grad
(data-parallel gradients). By default the stages run as real processes on
torch.distributed.pipelining; --local runs them one after the other in this
process (same maths, faster for sweeps). Writes results.json, results.md and
bytes.png to --out.
"""

from __future__ import annotations

import argparse
from typing import Any

from thinwire import schemes
from thinwire.jobs import common
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
from thinwire.pipeline.registry import boundary_config_class, boundary_kinds
from thinwire.pipeline.stages import SCHEDULES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="criteo", choices=sorted(TASKS),
                        help="model and data: DLRM on synthetic Criteo or breast cancer, "
                             "or the transformer on digits")
    parser.add_argument("--stages", type=int, default=RunConfig.stages, help="pipeline stages")
    parser.add_argument("--splits", action=common.CommaList, default=None, metavar="NAME,...",
                        help="comma-separated modules to split after (default: the task's, "
                             "e.g. bottom.3)")
    parser.add_argument("--boundary", default=RunConfig.boundary, choices=boundary_kinds(),
                        help="what crosses a split")
    parser.add_argument("--ratio", type=float, default=None,
                        help="fraction of each row dct-mp / xgrad-topk keep, in (0, 1] "
                             "(default: the boundary's, 0.1 for dct-mp)")
    parser.add_argument("--threshold", default=None, choices=list(THRESHOLDS),
                        help="dct-mp row threshold (default: topk)")
    parser.add_argument("--values", default=None, choices=["native", "fp16"],
                        help="dtype dct-mp values cross in (default: native)")
    parser.add_argument("--boundary-option", action="append", default=[], metavar="KEY=VALUE",
                        help="any other option of the boundary, e.g. compression=0.75 for sketch")
    parser.add_argument("--replicas", type=int, default=RunConfig.replicas,
                        help="data-parallel replicas of every stage (hybrid)")
    parser.add_argument("--dp-scheme", default=RunConfig.dp_scheme,
                        help="scheme for W_grad across replicas, a name from thinwire schemes")
    parser.add_argument("--dp-option", action="append", default=[], metavar="KEY=VALUE",
                        help="option of the data-parallel scheme, e.g. ratio=0.1")
    parser.add_argument("--schedule", default=RunConfig.schedule, choices=sorted(SCHEDULES),
                        help="pipeline schedule")
    parser.add_argument("--microbatches", type=int, default=RunConfig.microbatches,
                        help="microbatches per step and replica")
    parser.add_argument("--local", action="store_true",
                        help="run the stages in this process instead of as processes")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per worker per step, where a worker is one replica of the "
                             "pipeline (its stages pass the same rows on); the step's rows in "
                             "all are this times --replicas (default: 256; 32 breast-cancer, "
                             "64 digits)")
    parser.add_argument("--epochs", type=float, default=None,
                        help="passes over the data (default: 1; 5 breast-cancer, 20 digits)")
    parser.add_argument("--steps", type=int, default=None,
                        help="stop after this many steps (default: none, every epoch in full)")
    parser.add_argument("--optimizer", default=RunConfig.optimizer, choices=sorted(OPTIMIZERS),
                        help="optimiser of every stage")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: 1e-3; 3e-3 digits)")
    parser.add_argument("--seed", type=int, default=RunConfig.seed,
                        help="model initialisation and data order")
    parser.add_argument("--train-size", type=int, default=RunConfig.train_size,
                        help="synthetic criteo training rows")
    parser.add_argument("--test-size", type=int, default=RunConfig.test_size,
                        help="synthetic criteo test rows")
    common.add_outputs(parser, "pipeline")
    add_timeout(parser)


def config_from(args: argparse.Namespace) -> RunConfig:
    """The :class:`RunConfig` the arguments describe.

    Raises:
        ValueError: an unknown boundary or scheme, or an option key that they do
            not have (named with the valid keys), or a value out of range.
    """
    options = common.parse_options(
        args.boundary_option, {args.boundary: boundary_config_class(args.boundary)},
        "--boundary-option")
    for name in ("ratio", "threshold", "values"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.boundary == "dct-mp":
        options.setdefault("ratio", 0.1)
    dp_options = common.parse_options(
        args.dp_option, {args.dp_scheme: schemes.config_class(args.dp_scheme)}, "--dp-option")
    tuned = {name: getattr(args, name) for name in ("batch_size", "epochs", "lr")
             if getattr(args, name) is not None}
    # --batch-size is per replica; RunConfig counts the step's rows over all replicas.
    per_replica = tuned.get("batch_size", TASK_DEFAULTS[args.task].get("batch_size",
                                                                       RunConfig.batch_size))
    if per_replica < 1 or per_replica % args.microbatches:
        raise ValueError(f"--batch-size {per_replica} (rows per replica) must be >= 1 and "
                         f"divide into --microbatches {args.microbatches}")
    tuned["batch_size"] = per_replica * args.replicas
    return RunConfig(**{**TASK_DEFAULTS[args.task], **tuned}, task=args.task, stages=args.stages,
                     splits=None if args.splits is None else tuple(args.splits),
                     boundary=args.boundary, boundary_options=options,
                     replicas=args.replicas, dp_scheme=args.dp_scheme,
                     dp_options=dp_options, schedule=args.schedule,
                     microbatches=args.microbatches, max_steps=args.steps,
                     optimizer=args.optimizer, seed=args.seed, train_size=args.train_size,
                     test_size=args.test_size)


ENTITIES = ("X_act", "X_grad", "W_grad")
HEADER = ["task", "boundary", "mode", "steps", "train loss", "train acc", "test loss",
          "test acc", *(f"{entity} B/step" for entity in ENTITIES)]


def summary_row(result: dict[str, Any]) -> list[str]:
    """The run in one row of :data:`HEADER`: metrics, and bytes per step of each entity."""
    config = result["config"]
    mode = "local" if "ranks" not in result else \
        f"{config['stages']}x{config['replicas']} {config['schedule']}"
    return [config["task"], f"{config['boundary']} {config['boundary_options']}", mode,
            str(result["steps"]), f"{result['train']['loss']:.4f}",
            f"{result['train']['accuracy']:.4f}", f"{result['test']['loss']:.4f}",
            f"{result['test']['accuracy']:.4f}",
            *(f"{result['bytes_per_entity'].get(entity, 0.0):,.0f}" for entity in ENTITIES)]


def plot_bytes(result: dict[str, Any], path: str) -> None:
    """Bytes per step of each entity (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entities = sorted(result["bytes_per_entity"])
    figure, axis = plt.subplots(figsize=(5.0, 3.4))
    axis.bar(entities, [result["bytes_per_entity"][e] for e in entities])
    axis.set_yscale("log")
    axis.set(ylabel="bytes per step, all ranks", title=f"{result['config']['boundary']} at "
             f"{', '.join(result['splits']) or 'no split'}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    if args.local:
        result = train_local(config, progress=True)
    else:
        result = train_engine(config, timeout_s=args.timeout, progress=True)
        result["ranks"] = [{k: v for k, v in r.items() if k != "state"} for r in result["ranks"]]
    out = common.run_folder(args.out, "pipeline")
    row = summary_row(result)
    oracle = result.get("oracle") or {}
    note = (f" The teacher that drew the labels: loss {oracle['loss']:.4f}, accuracy "
            f"{oracle['accuracy']:.4f}." if oracle else "")
    common.write_results(
        out, "pipeline", args, [result],
        f"# thinwire pipeline\n\nSplits at {', '.join(result['splits']) or '(none)'}; bytes "
        f"per step summed over ranks.{note}\n\n{common.markdown_table(HEADER, [row])}\n")
    plot_bytes(result, str(out / "bytes.png"))
    print(common.text_table(HEADER, [row]))
    print(f"wrote {out}/results.json, results.md, bytes.png")
    return 0
