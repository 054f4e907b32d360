"""The loopback step benchmark's pure parts: round order and the summary."""

from __future__ import annotations

import pytest

from benchmarks.step import RATIOS, VARIANTS, order, summarise


def test_rounds_rotate_so_every_variant_leads_once_per_cycle() -> None:
    variants = list(VARIANTS)
    rounds = [order(variants, index) for index in range(len(variants))]
    assert all(sorted(r) == sorted(variants) for r in rounds)
    assert [r[0] for r in rounds] == variants
    assert order(variants, len(variants)) == variants


def test_summary_takes_medians_over_rounds_and_divides_them() -> None:
    times = {"compute": [1.0, 3.0, 2.0], "ddp": [2.0, 2.0, 9.0], "dense": [2.2, 2.1, 2.3],
             "dct-dp": [2.6, 2.5, 2.4], "powersgd": [1.0], "torch-powersgd": [2.0]}
    result = summarise(times)
    assert result["median_s"]["compute"] == 2.0 and result["median_s"]["ddp"] == 2.0
    assert result["ratios"]["dense/ddp"] == pytest.approx(1.1)
    assert result["ratios"]["dct-dp/compute"] == pytest.approx(1.25)
    assert result["ratios"]["powersgd/torch-powersgd"] == pytest.approx(0.5)
    assert "topk/compute" not in result["ratios"]  # not measured: left out
    assert set(result["ratios"]) <= set(RATIOS)
