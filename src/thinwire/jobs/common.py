"""What every job and subcommand shares: help layout, KEY=VALUE options, the run folder, tables."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import json
import time
import tokenize
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from thinwire.schemes.registry import split_option


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already says what it is.

    Descriptions keep their line breaks (command examples stay readable).
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0:  # a switch: what it turns on is off unless given
            return f"{text} (default: off)"
        if action.default is None or action.default == []:
            return f"{text} (default: none)"
        if isinstance(action, CommaList):
            return f"{text} (default: {comma_default(action.default)})"
        return f"{text} (default: %(default)s)"

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, CommaList):  # one token, whatever nargs lets the action see
            return self._metavar_formatter(action, default_metavar)(1)[0]
        return super()._format_args(action, default_metavar)


class CommaList(argparse.Action):
    """A list flag spelled ``--modes dad,edad``; a space-separated list is an error that
    shows the comma-separated spelling (one list syntax on every subcommand).

    ``item`` converts each element; ``choices`` (when given) bounds them.
    """

    def __init__(self, option_strings: Sequence[str], dest: str,
                 item: Callable[[str], Any] = str, **kwargs: Any) -> None:
        self.item = item
        self.allowed = kwargs.pop("choices", None)
        kwargs.setdefault("metavar", "A,B,...")
        super().__init__(option_strings, dest, nargs="+", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        texts = [str(v) for v in values]
        flag = option_string or self.dest
        if len(texts) > 1:
            parser.error(f"{flag} takes a comma-separated list: {flag} {','.join(texts)}")
        parts = [part.strip() for part in texts[0].split(",") if part.strip()]
        if not parts:
            parser.error(f"{flag} needs at least one value")
        try:
            converted = [self.item(part) for part in parts]
        except ValueError as error:
            parser.error(f"{flag} {texts[0]!r}: {error}")
        if self.allowed is not None:
            bad = [part for part in converted if part not in self.allowed]
            if bad:
                parser.error(f"{flag} {bad[0]!r} is not one of {', '.join(map(str, self.allowed))}")
        setattr(namespace, self.dest, converted)


def comma_default(values: Sequence[Any]) -> str:
    """A list default as the command line spells it: ``"dad,edad"``."""
    return ",".join(str(v) for v in values)


# Old flag spellings -> the new one; a subcommand that has the new flag answers the old
# one with an error naming it (argparse's "unrecognized arguments" would not).
RENAMED_FLAGS: dict[str, str] = {
    "--sparsity": "--ratio (the fraction kept: ratio = 1 - sparsity)",
    "--dp-opt": "--dp-option",
    "--push-opt": "--push-option",
    "--boundary-opt": "--boundary-option",
    "--max-steps": "--steps",
    "--passes": "--epochs",
    "--batch": "--batch-size",
    "--sites": "--workers",
}

# Old option keys (KEY=VALUE) -> the new key.
RENAMED_KEYS: dict[str, str] = {
    "sparsity": "ratio",
    "include": "exclude",
    "start_iter": "warmup_steps",
}


class _Renamed(argparse.Action):
    """An old flag: parsing it is an error naming its new spelling."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> NoReturn:
        parser.error(f"{option_string} is spelled {self.metavar} now")


def add_renamed_flags(parser: argparse.ArgumentParser) -> None:
    """Answer each old spelling in :data:`RENAMED_FLAGS` whose new flag ``parser`` has
    (and whose old one it does not) with an error naming the new flag; hidden in --help."""
    flags = {flag for action in parser._actions for flag in action.option_strings}
    for old, new in RENAMED_FLAGS.items():
        if new.split()[0] in flags and old not in flags:
            parser.add_argument(old, action=_Renamed, nargs="*", metavar=new,
                                help=argparse.SUPPRESS)


def parse_options(texts: Sequence[str], configs: Mapping[str, type],
                  flag: str = "--option") -> dict[str, Any]:
    """``KEY=VALUE`` texts to a dict whose every KEY is a field of one of ``configs``.

    Args:
        texts: the flag's values, in order (a later KEY wins).
        configs: name -> config dataclass, e.g. ``{"dct-dp": DCTConfig}``.
        flag: the flag's spelling, for messages.

    Raises:
        ValueError: a malformed text, or a key none of ``configs`` has (the
            message names the flag, the configs and every valid key).
    """
    valid = sorted({f.name for config in configs.values() for f in dataclasses.fields(config)})
    parsed = dict(split_option(text, flag) for text in texts)
    unknown = [key for key in parsed if key not in valid]
    renamed = [key for key in unknown if RENAMED_KEYS.get(key) in valid]
    if renamed:
        old, new = renamed[0], RENAMED_KEYS[renamed[0]]
        hint = ""
        if old == "sparsity" and isinstance(parsed[old], (int, float)):
            hint = f" (the fraction kept, 1 - sparsity: {flag} ratio={1 - parsed[old]:g})"
        raise ValueError(f"{flag} {old!r} is spelled {new!r} now{hint}")
    if unknown:
        raise ValueError(f"{flag} {unknown[0]!r} is not an option of {', '.join(configs)}; "
                         f"valid keys: {', '.join(valid)}")
    return parsed


def add_outputs(parser: argparse._ActionsContainer, command: str) -> None:
    """``--out DIR`` and ``--json PATH``, the same for every subcommand."""
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="folder for results.json, results.md and the figures "
                             f"(default: runs/<date-time>-{command}/)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write results.json's content here")


def run_folder(out: Path | None, command: str) -> Path:
    """``out``, or ``runs/<date-time>-<command>``; created."""
    folder = out or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_results(folder: Path, command: str, args: argparse.Namespace, runs: Sequence[Any],
                  markdown: str, references: Sequence[Any] | None = None) -> None:
    """``results.json`` and ``results.md`` in ``folder``, and the JSON again at ``args.json``.

    ``results.json`` holds ``{"command", "options", "runs"}``: the subcommand, every
    option it ran with, and one entry per run; with ``references``, also
    ``"references"``: the rows the runs are measured against (``thinwire compare``'s
    lone worker and compute-only bound).
    """
    options = {key: value for key, value in vars(args).items() if not callable(value)}
    record: dict[str, Any] = {"command": command, "options": options, "runs": list(runs)}
    if references is not None:
        record["references"] = list(references)
    text = json.dumps(record, indent=1, default=str)
    (folder / "results.json").write_text(text)
    (folder / "results.md").write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the others right."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def field_comments(config: type) -> dict[str, str]:
    """Each dataclass field's trailing ``# comment`` in the source of ``config`` or its bases.

    The comment is where a config says what a field means and its allowed range;
    reading it keeps ``thinwire schemes`` from holding a second copy. Fields
    whose source cannot be read are left out.
    """
    comments: dict[str, str] = {}
    for cls in reversed(config.__mro__[:-1]):
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            name = token.line.strip().split(":", 1)[0]
            # a comment after a field's annotation, not a comment line of its own
            if token.type == tokenize.COMMENT and name.isidentifier() \
                    and not token.line.lstrip().startswith("#"):
                comments[name] = token.string.lstrip("#").strip()
    fields = {f.name for f in dataclasses.fields(config)}
    return {name: text for name, text in comments.items() if name in fields}
