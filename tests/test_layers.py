"""The package's floors hold: import-linter checks the contract in pyproject.toml.

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
    env = {**os.environ, "PYTHONPATH": str(source_root)}
    return subprocess.run([sys.executable, "-c", code], cwd=source_root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_floors() -> None:
    result = _lint(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "thinwire floors KEPT" in result.stdout


@pytest.mark.parametrize(("module", "line", "reported"), [
    # a front door reaching up to the command line
    ("ps/core.py", "import thinwire.cli", "thinwire.ps.core -> thinwire.cli"),
    # a front door taking a model
    ("autodiff/engine.py", "from thinwire.models import gru", "thinwire.autodiff.engine -> "
                                                               "thinwire.models.gru"),
    # the codec floor reaching a scheme
    ("compress/base.py", "import thinwire.schemes", "thinwire.compress.base -> thinwire.schemes"),
    # side-by-side packages of one floor stay apart
    ("data/digits.py", "import thinwire.models.mlp", "thinwire.data.digits -> "
                                                     "thinwire.models.mlp"),
])
def test_an_import_up_a_floor_breaks_the_contract(tmp_path: Path, module: str, line: str,
                                                  reported: str) -> None:
    shutil.copytree(ROOT / "src" / "thinwire", tmp_path / "thinwire",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "thinwire" / module, "a") as handle:
        handle.write(f"\n{line}  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "thinwire floors BROKEN" in result.stdout
    assert reported in result.stdout


def test_a_package_outside_every_floor_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "src" / "thinwire", tmp_path / "thinwire",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "thinwire" / "extras").mkdir()
    (tmp_path / "thinwire" / "extras" / "__init__.py").write_text('"""Not on any floor."""\n')
    result = _lint(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "thinwire.extras" in result.stdout
