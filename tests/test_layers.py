"""The package's floors hold and it has no import cycles: import-linter checks the
contracts in pyproject.toml.

Each check runs in a child process whose path holds only the tree under test:
the linter finds ``thinwire`` through the import system, which in this
process already points at the real sources.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "pyproject.toml"


def _lint(source_root: Path) -> subprocess.CompletedProcess[str]:
    """Run the contracts of pyproject.toml over the ``thinwire`` found in ``source_root``."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(CONFIG)!r}, no_cache=True, "
            "no_logo=True))")
    # wide lines, so that a reported import is never wrapped whatever the terminal
    env = {**os.environ, "PYTHONPATH": str(source_root), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", code], cwd=source_root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_floors_and_has_no_cycles() -> None:
    result = _lint(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "thinwire floors KEPT" in result.stdout
    assert "thinwire has no import cycles KEPT" in result.stdout


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "src" / "thinwire", tmp_path / "thinwire",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "thinwire"


@pytest.mark.parametrize(("module", "line", "contract", "reported"), [
    # a front door reaching up to the command line
    ("ps/core.py", "import thinwire.cli", "floors", "thinwire.ps.core -> thinwire.cli"),
    # a front door taking a model
    ("autodiff/engine.py", "from thinwire.models import gru", "floors",
     "thinwire.autodiff.engine -> thinwire.models.gru"),
    # the codec floor reaching a scheme
    ("compress/base.py", "import thinwire.schemes", "floors",
     "thinwire.compress.base -> thinwire.schemes"),
    # side-by-side packages of one floor stay apart
    ("data/digits.py", "import thinwire.models.mlp", "floors",
     "thinwire.data.digits -> thinwire.models.mlp"),
    # a cycle inside one floor: sparse imports payload already
    ("compress/payload.py", "import thinwire.compress.sparse", "has no import cycles",
     ".payload -> .sparse"),
])
def test_an_injected_import_breaks_its_contract(tmp_path: Path, module: str, line: str,
                                                contract: str, reported: str) -> None:
    with open(_copy(tmp_path) / module, "a") as handle:
        handle.write(f"\n{line}  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"thinwire {contract} BROKEN" in result.stdout
    assert reported in result.stdout


def test_a_package_outside_every_floor_breaks_the_contract(tmp_path: Path) -> None:
    extras = _copy(tmp_path) / "extras"
    extras.mkdir()
    (extras / "__init__.py").write_text('"""Not on any floor."""\n')
    result = _lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "thinwire floors BROKEN" in result.stdout
    assert "- thinwire.extras" in result.stdout
