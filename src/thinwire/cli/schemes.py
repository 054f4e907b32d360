"""List the schemes and pipeline boundaries, and what each option means: default, range."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from thinwire import schemes
from thinwire.jobs.common import field_comments
from thinwire.jobs.local_run import DiLoCoOptions
from thinwire.pipeline import boundary_config_class, boundary_kinds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def describe(name: str, config: type) -> str:
    """``name`` and one line per option of its ``config``: name, default, type, then what
    the config's own comment says it means (its allowed range included)."""
    comments = field_comments(config)
    lines = [name]
    for field in dataclasses.fields(config):
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        head = f"  {field.name}={field.default!r} ({kind})"
        text = comments.get(field.name, "")
        lines.append(textwrap.fill(text, width=100, initial_indent=f"{head:40s} ",
                                   subsequent_indent=" " * 41) if text else head)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    del args
    print("Schemes. Set an option with --option KEY=VALUE (thinwire compare, train), "
          "--dp-option (pipeline) or --push-option (async).\n")
    print("\n\n".join(describe(name, schemes.config_class(name)) for name in schemes.names()))
    print("\n\nLocal updates (thinwire compare --schemes diloco,diloco+SCHEME): every H steps "
          "the pseudo-gradients are averaged through SCHEME (dense alone). Set an option with "
          "--option KEY=VALUE, as the scheme's own.\n")
    print(describe("diloco", DiLoCoOptions))
    print("\n\nPipeline boundaries (thinwire pipeline --boundary KIND). Set an option with "
          "--boundary-option KEY=VALUE.\n")
    print("\n\n".join(describe(kind, boundary_config_class(kind)) for kind in boundary_kinds()))
    return 0
