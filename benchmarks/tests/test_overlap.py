"""The overlap check: a shaped-link run's measured step time beside the link model's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import overlap


def _run(scheme: str, config: dict[str, Any], train_s: float) -> dict[str, Any]:
    return {"scheme": scheme, "config": config, "rate": "10mbit", "rate_bps": 1e7,
            "workers": 2, "steps": 100, "train_s": train_s, "compute_s": 0.02,
            "overhead_s_per_step": 0.001, "shaper_tx_per_step": 5e4,
            "shaper_rx_per_step": 4e4}


def test_overlap_is_credited_only_where_the_run_overlaps(tmp_path: Path) -> None:
    link = 8 * 5e4 / 1e7  # 40 ms a step: the busier direction
    plain = overlap.check(_run("diloco+int4:every=10", {"every": 10}, 6.1))
    late = overlap.check(_run("diloco+int4:every=10:overlap=true",
                              {"every": 10, "overlap": True}, 4.0))
    delayed = overlap.check(_run("dense:delayed=true", {"delayed": True}, 4.0))
    anchor = overlap.check(_run("torch-dense", {}, 6.1))
    assert plain is not None and late is not None and delayed is not None and anchor is not None
    assert plain["modelled_ms"] == pytest.approx(1000 * (0.021 + link))
    assert anchor["modelled_ms"] == pytest.approx(plain["modelled_ms"])
    for row in (late, delayed):  # the link carries one exchange at a time
        assert row["modelled_ms"] == pytest.approx(1000 * link)
        assert row["no_overlap_ms"] == pytest.approx(plain["modelled_ms"])
        assert row["measured_over_modelled"] == pytest.approx(40.0 / (1000 * link))
    assert overlap.check({**_run("dense", {}, 1.0), "shaper_tx_per_step": None,
                          "shaper_rx_per_step": None}) is None
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"command": "python -m benchmarks.netem",
                                   "runs": [_run("dense", {}, 3.0)]}))
    out = tmp_path / "check.json"
    assert overlap.main([str(results), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["scheme"] == "dense"
