"""List the schemes and pipeline boundaries, and what each option means: default, range.

``thinwire schemes NAME`` shows one scheme or boundary; ``--kind`` lists one kind of name
(the parameter server's push schemes, say), which is how the user guide's tables are made.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from thinwire import schemes
from thinwire.jobs.common import field_comments
from thinwire.jobs.local_run import DiLoCoOptions
from thinwire.pipeline import boundary_config_class, boundary_kinds
from thinwire.ps.wire import build_push


def push_names() -> list[str]:
    """The registered schemes a parameter-server push takes (those :func:`build_push`
    builds at their defaults), in registry order."""
    names = []
    for name in schemes.names():
        try:
            build_push(name)
        except ValueError:
            continue
        names.append(name)
    return names


# --kind: which names are listed when no NAME is given.
KINDS = {"scheme": schemes.names, "push": push_names, "boundary": boundary_kinds}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", default=None,
                        help="show only this scheme or pipeline boundary (default: all)")
    parser.add_argument("--markdown", action="store_true",
                        help="print options as Markdown tables (option, default, meaning), "
                             "as the user guide shows them: NAME's, or every scheme's")
    parser.add_argument("--kind", choices=sorted(KINDS), default=None,
                        help="without NAME, list only this kind: every scheme, the schemes "
                             "a parameter-server push takes (thinwire async --push), or every "
                             "pipeline boundary (default: all of them; with --markdown, every "
                             "scheme)")


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


def markdown(name: str, config: type) -> str:
    """``config``'s options as the user guide's table: a header naming ``name``, then one
    row per option: its name, its default as a Python literal, and its field comment."""
    comments = field_comments(config)
    rows = [f"| `{name}` option | default | meaning |", "| --- | --- | --- |"]
    for field in dataclasses.fields(config):
        text = comments.get(field.name, "").replace("|", "\\|")
        rows.append(f"| `{field.name}` | `{field.default!r}` | {text} |")
    return "\n".join(rows)


def config_of(name: str) -> type:
    """The config class of scheme or pipeline boundary ``name``.

    Raises:
        ValueError: ``name`` is neither (the message lists both kinds of name).
    """
    if name in schemes.names():
        return schemes.config_class(name)
    if name in boundary_kinds():
        return boundary_config_class(name)
    raise ValueError(f"{name!r} is no scheme ({', '.join(schemes.names())}) and no pipeline "
                     f"boundary ({', '.join(boundary_kinds())})")


def run(args: argparse.Namespace) -> int:
    if args.name is not None and args.kind is not None:
        raise ValueError(f"give a NAME ({args.name!r}) or --kind ({args.kind!r}), not both")
    if args.markdown:
        chosen = [args.name] if args.name is not None else KINDS[args.kind or "scheme"]()
        print("\n\n".join(markdown(name, config_of(name)) for name in chosen))
        return 0
    if args.name is not None:
        return _show_one(args.name)
    if args.kind is not None:
        print("\n\n".join(describe(name, config_of(name)) for name in KINDS[args.kind]()))
        return 0
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


def _show_one(name: str) -> int:
    """Print one scheme's or boundary's options (ValueError: neither, as :func:`config_of`)."""
    config = config_of(name)
    if name in schemes.names():
        print("Scheme. Set an option with --option KEY=VALUE (thinwire compare, train), "
              "--dp-option (pipeline) or --push-option (async).\n")
    else:
        print("Pipeline boundary (thinwire pipeline --boundary KIND). Set an option with "
              "--boundary-option KEY=VALUE.\n")
    print(describe(name, config))
    return 0
