"""The ``thinwire`` command line: one subcommand per module, listed in COMMANDS.

Floor: the top. A subcommand's module parses its flags and calls a job
(:mod:`thinwire.jobs`) or a front door; nothing in the package imports this one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from thinwire.jobs.common import HelpFormatter, add_renamed_flags
from thinwire.launch import RankFailed

DESCRIPTION = """\
Distributed training that is cheap on the wire, on torch.distributed.

Every training subcommand takes the same flags: --steps, --batch-size (samples per
worker per step), --workers, --lr, --seed, scheme options as KEY=VALUE (--option, or
--dp-option, --push-option, --boundary-option where a subcommand has several), --timeout,
and --out DIR, where it writes results.json, results.md and its figures (--json PATH
writes results.json again). Lists are comma-separated (--schemes dense,topk).
'thinwire schemes' lists every scheme option with its meaning and allowed range;
'thinwire schemes NAME' shows one.
"""

# subcommand -> module with add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, str] = {
    "compare": "thinwire.cli.compare",
    "train": "thinwire.cli.train",
    "schemes": "thinwire.cli.schemes",
    "async": "thinwire.cli.async_",
    "pipeline": "thinwire.cli.pipeline",
    "dad": "thinwire.cli.dad",
    "lighthouse": "thinwire.cli.lighthouse",
}


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a flag's old spelling that prefixes its new one (--dp-opt of
    # --dp-option) is an error, not a silent alias.
    parser = argparse.ArgumentParser(prog="thinwire", description=DESCRIPTION,
                                     formatter_class=HelpFormatter, allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0],
                                  description=module.__doc__, formatter_class=HelpFormatter,
                                  allow_abbrev=False)
        module.add_arguments(sub)
        add_renamed_flags(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ValueError as error:  # bad input: a clear message, not a traceback
        print(f"thinwire {args.command}: error: {error}", file=sys.stderr)
        return 2
    except RankFailed as error:  # a peer failed or stalled: the message names ranks and steps
        print(f"thinwire {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
