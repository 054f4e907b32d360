"""Python source as bytes, from the standard library of the interpreter that runs thinwire.

A second real text beside Shakespeare's plays, with other statistics (code:
indentation, identifiers, long-range brackets), that every Python installation
ships. The files are the standard library's ``*.py`` modules outside
:data:`SKIPPED` (tests, third-party packages, and generated codec tables), read
in path order; every :data:`VALIDATION_EVERY`-th file is validation, so no line
of a validation file is ever trained on. The split is fixed, independent of any
seed, but follows the interpreter: :func:`corpus` names its version, which
results record. Nothing downloads.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from thinwire.data.shakespeare import Corpus

VALIDATION_EVERY = 10  # file i (path order, from 0) is validation when i % 10 == 9
# Folders left out: tests and demos, installed packages, the codecs' generated tables.
SKIPPED = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                     "idlelib", "lib2to3", "turtledemo", "__pycache__", "ensurepip",
                     "encodings", "pydoc_data"})
MAX_FILE_BYTES = 200_000  # larger files are generated data, not code (pydoc topics)


def stdlib_dir() -> Path:
    """Where this interpreter keeps its standard library's source.

    Raises:
        FileNotFoundError: the interpreter ships no source (a frozen or stripped build).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file():
        raise FileNotFoundError(f"no standard-library source under {root} (os.py is missing): "
                                "the code-lm corpus needs an interpreter that ships its .py "
                                "files")
    return root


def source_files(root: Path | None = None) -> list[Path]:
    """The corpus's files under ``root`` (default: :func:`stdlib_dir`), in path order."""
    root = root or stdlib_dir()
    return sorted(path for path in root.rglob("*.py")
                  if not SKIPPED & set(path.relative_to(root).parts[:-1])
                  and path.stat().st_size <= MAX_FILE_BYTES)


def corpus(root: Path | None = None) -> Corpus:
    """Every file's bytes, split by file (see the module's docstring).

    Raises:
        FileNotFoundError: no standard-library source and ``root`` is not given.
    """
    root = root or stdlib_dir()
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    names: tuple[list[str], list[str]] = ([], [])
    for index, path in enumerate(source_files(root)):
        held_out = index % VALIDATION_EVERY == VALIDATION_EVERY - 1
        parts[held_out].append(path.read_bytes())
        names[held_out].append(path.relative_to(root).as_posix())
    if not parts[1]:
        raise FileNotFoundError(f"fewer than {VALIDATION_EVERY} source files under {root}")
    return Corpus(b"".join(parts[0]), b"".join(parts[1]), tuple(names[0]), tuple(names[1]))


def version() -> str:
    """The interpreter whose standard library :func:`corpus` reads, e.g. ``"3.11.7"``."""
    return ".".join(map(str, sys.version_info[:3]))
