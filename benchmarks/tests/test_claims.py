"""The claims table: every number read from docs/data, a missing file marked pending."""

from __future__ import annotations

from benchmarks import claims


def test_missing_data_is_pending_with_its_command() -> None:
    page = claims.render({})
    rows = [line for line in page.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == len(claims.CLAIMS) + 1  # the header
    assert all("**pending**" in row for row in rows[1:])
    assert "`python -m benchmarks.async_ps --quick`" in page


def test_shipped_shaped_link_data_fills_its_rows() -> None:
    data = claims.load()
    page = claims.render({"netem": data["netem"]})
    netem_rows = [line for line in page.splitlines() if "benchmarks.netem" in line]
    assert netem_rows and not any("**pending**" in row for row in netem_rows)


def test_every_paper_has_claims() -> None:
    assert {c.paper for c in claims.CLAIMS} == {"DCT KDD'21", "DCT MLSys", "dAD", "DC-ASGD",
                                                "ScaleCom"}
