"""List the schemes and pipeline boundaries, and what each option means: default, range.

``thinwire schemes NAME`` shows one scheme or boundary.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from thinwire import schemes
from thinwire.jobs.common import field_comments
from thinwire.pipeline import boundary_config_class, boundary_kinds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", default=None,
                        help="show only this scheme or pipeline boundary (default: all)")


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
    if args.name is not None:
        return _show_one(args.name)
    print("Schemes. Set an option with --option KEY=VALUE (thinwire compare, train), "
          "--dp-option (pipeline) or --push-option (async).\n")
    print("\n\n".join(describe(name, schemes.config_class(name)) for name in schemes.names()))
    print("\n\nPipeline boundaries (thinwire pipeline --boundary KIND). Set an option with "
          "--boundary-option KEY=VALUE.\n")
    print("\n\n".join(describe(kind, boundary_config_class(kind)) for kind in boundary_kinds()))
    return 0


def _show_one(name: str) -> int:
    """Print one scheme's or boundary's options.

    Raises:
        ValueError: ``name`` is neither (the message lists both kinds of name).
    """
    if name in schemes.names():
        print("Scheme. Set an option with --option KEY=VALUE (thinwire compare, train), "
              "--dp-option (pipeline) or --push-option (async).\n")
        print(describe(name, schemes.config_class(name)))
        return 0
    if name in boundary_kinds():
        print("Pipeline boundary (thinwire pipeline --boundary KIND). Set an option with "
              "--boundary-option KEY=VALUE.\n")
        print(describe(name, boundary_config_class(name)))
        return 0
    raise ValueError(f"{name!r} is no scheme ({', '.join(schemes.names())}) and no pipeline "
                     f"boundary ({', '.join(boundary_kinds())})")
