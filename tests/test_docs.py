"""The documentation: every file it names ships, user pages are no lab notebook, and every
scheme option a page states exists in the code with the stated default."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from thinwire import schemes
from thinwire.autodiff import AutodiffConfig
from thinwire.pipeline import boundary_config_class, boundary_kinds
from thinwire.ps import rule_config_class, rule_names
from thinwire.ps.wire import build_push

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), REPO / "README.md", REPO / "CHANGELOG.md"]
# docs/data/x.json from the repository root, data/x.json and figures/x.png from docs/, or
# ../data/x.json from a page one folder down; a * stands for a family of files, of which
# at least one must exist.
REFERENCE = re.compile(
    r"(?<![\w/.-])((?:\.\./)*(?:docs/)?(?:data|figures)/[\w.*-]+\.(?:json|png|csv))")


def references(text: str, folder: Path = DOCS) -> set[str]:
    """The data files and figures ``text`` (a page in ``folder``) names, as paths from the
    repository root."""
    found = set()
    for ref in REFERENCE.findall(text):
        if ref.startswith("docs/"):
            found.add(ref)
        elif ref.startswith("../"):
            found.add((folder / ref).resolve().relative_to(REPO).as_posix())
        else:
            found.add(f"docs/{ref}")
    return found


def test_references_are_read_from_either_root() -> None:
    text = "see `docs/data/a.json`, [b](data/b-*.json) and ![c](figures/c.png); not x/data/d.json"
    assert references(text) == {"docs/data/a.json", "docs/data/b-*.json", "docs/figures/c.png"}
    assert references("[e](../data/e.json)", DOCS / "record") == {"docs/data/e.json"}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_every_data_file_and_figure_a_page_names_exists(page: Path) -> None:
    missing = sorted(ref for ref in references(page.read_text(), page.parent)
                     if not list(REPO.glob(ref)))
    assert not missing, f"{page.name} names files that do not ship: {missing}"


# Pages a user reads to use thinwire. The record of runs (docs/record/) and the generated
# pages (results.md, dated once in a header; choosing.md) carry their dates.
USER_PAGES = [REPO / "README.md", DOCS / "index.md", DOCS / "convergence.md",
              *sorted((DOCS / "guide").glob("*.md")),
              *(DOCS / f"{name}.md" for name in ("foundation", "scalecom", "dct-mp", "dad",
                                                 "async", "papers", "local-updates", "bench"))]
NOTEBOOK = re.compile(r"\bUTC\b|load average|git show")


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda page: page.relative_to(REPO).as_posix())
def test_user_pages_carry_no_run_times_loads_or_old_commits(page: Path) -> None:
    hits = [line.strip() for line in page.read_text().splitlines() if NOTEBOOK.search(line)]
    assert not hits, f"{page.name}: {hits}"


# ---- option tables: "| `NAME` option | default | meaning |" then "| `key` | `default` | ..."
TABLE = re.compile(r"^\| `([\w+-]+)` option \| default \|")  # names such as topk+int2
ROW = re.compile(r"^\| `(\w+)` \| `([^`]*)` \|")
INCLUDE = re.compile(r'^--8<-- "options/([\w+-]+)\.md"$', re.MULTILINE)


def config_of(name: str) -> type:
    """The config class a table headed ``name`` documents."""
    if name in schemes.names():
        return schemes.config_class(name)
    if name in boundary_kinds():
        return boundary_config_class(name)
    if name in rule_names():
        return rule_config_class(name)
    if name == "dad":
        return AutodiffConfig
    raise AssertionError(f"a table documents {name!r}, which is no scheme, boundary, rule or "
                         "the dad engine")


def option_tables(text: str) -> dict[str, dict[str, str]]:
    """Each options table in ``text``: its name -> {option: default as written}."""
    tables: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in text.splitlines():
        head = TABLE.match(line)
        if head:
            current = tables.setdefault(head.group(1), {})
            continue
        row = ROW.match(line) if current is not None else None
        if row and current is not None:
            current[row.group(1)] = row.group(2)
        elif not line.startswith("|"):
            current = None
    return tables


def _rows() -> list[tuple[str, str, str, str]]:
    return [(page.relative_to(DOCS).as_posix(), name, option, default)
            for page in sorted(DOCS.rglob("*.md"))
            for name, options in option_tables(page.read_text()).items()
            for option, default in options.items()]


def test_option_tables_are_read() -> None:
    text = ("| `topk` option | default | meaning |\n| --- | --- | --- |\n"
            "| `ratio` | `0.01` | kept |\n| `scope` | `'bucket'` | one \\| two |\n\nratio")
    assert option_tables(text) == {"topk": {"ratio": "0.01", "scope": "'bucket'"}}
    assert _rows(), "no options table found under docs/"


@pytest.mark.parametrize(("page", "name", "option", "default"), _rows(),
                         ids=lambda value: str(value))
def test_every_option_a_page_names_exists_with_the_stated_default(
        page: str, name: str, option: str, default: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(config_of(name))}
    assert option in fields, (f"{page}: {name} has no option {option!r} "
                              f"(it has {sorted(fields)}); regenerate the table with "
                              f"thinwire schemes {name} --markdown")
    assert ast.literal_eval(default) == fields[option].default, (
        f"{page}: {name}'s {option} defaults to {fields[option].default!r}, not {default}")


@pytest.mark.parametrize(("page", "name"), sorted({row[:2] for row in _rows()}),
                         ids=lambda value: str(value))
def test_every_options_table_lists_every_option(page: str, name: str) -> None:
    options = option_tables((DOCS / page).read_text())[name]
    missing = {f.name for f in dataclasses.fields(config_of(name))} - set(options)
    assert not missing, (f"{page}: the {name} table leaves out {sorted(missing)}; regenerate "
                         f"it with thinwire schemes {name} --markdown")


def _pushable(name: str) -> bool:
    try:
        build_push(name)
    except ValueError:
        return False
    return True


def with_includes(page: Path) -> str:
    """``page``'s text with its ``--8<-- "options/NAME.md"`` lines replaced by the files."""
    return INCLUDE.sub(lambda m: (DOCS / "snippets" / "options" / f"{m.group(1)}.md")
                       .read_text(), page.read_text())


@pytest.mark.parametrize(("page", "expected"), [
    ("guide/ddp.md", lambda: set(schemes.names())),
    ("guide/pipeline.md", lambda: set(schemes.names()) | set(boundary_kinds())),
    ("guide/ps.md", lambda: {n for n in schemes.names() if _pushable(n)} | set(rule_names())),
    ("guide/autodiff.md", lambda: {"dad"}),
])
def test_each_front_door_page_has_a_table_for_every_scheme_it_takes(page: str,
                                                                    expected: object) -> None:
    assert callable(expected)
    shown = set(option_tables(with_includes(DOCS / page)))
    assert shown == expected(), (f"{page}: tables for {sorted(shown)}, takes "
                                 f"{sorted(expected())}; make docs-tables regenerates them")


# `make docs-tables`: each line writes one options file from the registries.
GENERATE = re.compile(r"^\t\$\(BIN\)/thinwire (schemes .*) > \$\(OPTIONS\)/([\w-]+\.md)$",
                      re.MULTILINE)
KEPT_BY_HAND = {"asgd.md", "dc-asgd.md", "dad.md"}  # the update rules' and dAD's


def test_make_docs_tables_would_change_no_options_file(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Every generated table is what the registry says now (names, defaults and meanings),
    and every options file is either generated or kept by hand."""
    from thinwire.cli import main

    generated = GENERATE.findall((REPO / "Makefile").read_text())
    options = DOCS / "snippets" / "options"
    assert {name for _, name in generated} == {"schemes.md", "pushes.md", "boundaries.md"}
    assert {path.name for path in options.glob("*.md")} == {
        name for _, name in generated} | KEPT_BY_HAND
    for command, name in generated:
        assert main(command.split()) == 0
        assert capsys.readouterr().out == (options / name).read_text(), (
            f"docs/snippets/options/{name} is stale: make docs-tables regenerates it")


def test_the_guide_and_api_reference_build_with_warnings_as_errors(tmp_path: Path) -> None:
    """``make docs``: mkdocs with mkdocstrings, offline, strict."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "ddp" / "index.html").stat().st_size > 0
    built = (tmp_path / "site" / "guide" / "ddp" / "index.html").read_text()
    assert "<code>topk</code> option" in built  # the included options tables are there
