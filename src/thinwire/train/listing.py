"""List the registered schemes and what each option means, its default and allowed range."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from thinwire import schemes
from thinwire.cli_common import field_comments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def describe(name: str) -> str:
    """Scheme ``name`` and one line per option: name, type, default, then what the config's
    own comment says it means (its allowed range included)."""
    config = schemes.config_class(name)
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
    print("Set an option with --option KEY=VALUE (thinwire compare, train), --dp-option "
          "(pipeline) or --push-option (async).\n")
    print("\n\n".join(describe(name) for name in schemes.names()))
    return 0
