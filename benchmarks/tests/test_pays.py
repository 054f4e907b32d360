"""Where distributing pays: scaling efficiency, the modelled time to target and their page."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import efficiency, linkmodel, report

RECIPE = {"workload": "text-lm", "optimizer": "adamw", "lr": 1e-3, "momentum": 0.9,
          "weight_decay": None, "batch_size": 4, "steps": 100, "seed": 0, "precision": "fp32",
          "max_norm": None, "hidden": 256}


def _efficiency(fractions: dict[str, list[tuple[int, float]]]) -> dict[str, Any]:
    record = {"workload": "text-lm", "recipe": RECIPE, "metric": "bits per byte",
              "target": 2.5, "lower_is_better": True, "seeds": 1, "eval_every": 10,
              "compute_ms_per_step": 25.0, "curves": {n: [points] for n, points in
                                                      fractions.items()},
              "command": "python -m benchmarks.efficiency", "load": "0.1, 0.1, 0.1"}
    record.update(efficiency.summarise(record))
    return record


def test_steps_to_a_lower_is_better_target_and_the_verdict() -> None:
    assert efficiency.steps_to([(10, 3.0), (20, 2.5), (30, 2.4)], 2.5, True) == 20
    assert efficiency.steps_to([(10, 0.5), (20, 0.7)], 0.9, False) is None
    good = _efficiency({"1": [(100, 2.6), (200, 2.5)], "4": [(50, 2.6), (80, 2.4)],
                        "8": [(40, 2.5)]})
    assert good["steps_to_target"] == {"1": 200, "4": 80, "8": 40}
    assert good["step_fraction"]["4"] == pytest.approx(0.4)
    assert efficiency.verdict(good) == (True, "")
    bad = _efficiency({"1": [(100, 2.5)], "4": [(70, 2.5)], "8": [(60, 2.6)]})
    ok, why = efficiency.verdict({**bad, "compute_ms_per_step": 2.0})
    assert not ok and "4 workers need 0.70x" in why and "8 workers: target not reached" in why
    assert "a compute step takes 2.0 ms" in why


def _run(scheme: str, steps: int | None, wire: float, overhead_ms: float = 1.0) -> dict[str, Any]:
    return {"scheme": scheme, "steps_to_target": steps, "compute_ms_per_step": 20.0,
            "overhead_ms_per_step": overhead_ms, "wire_sent_per_step": wire,
            "bytes_received_per_step": wire / 2, "collectives_per_step": 2, "recipe": RECIPE,
            "workload": "text-lm", "target": 2.5, "metric": "bits per byte",
            "test_score": 2.4, "test_accuracy": 0.4, "final_loss": 1.7}


def _linkmodel() -> dict[str, Any]:
    runs = [_run("dense", 100, 4e6, 0.0), _run("topk", 110, 8e4), _run("clt-k", None, 1e4)]
    references = [{"scheme": "lone worker", "time_to_target_s": 400 * 0.02,
                   "steps_to_target": 400, "recipe": RECIPE},
                  {"scheme": "compute-only bound", "time_to_target_s": 100 * 0.02,
                   "steps_to_target": 100, "recipe": RECIPE}]
    record = {"workload": "text-lm", "metric": "bits per byte", "target": 2.5,
              "recipe": RECIPE, "rates": ["10mbit", "100mbit"], "delay_s": linkmodel.DELAY_S,
              "cells": {"4": {"runs": runs, "references": references}},
              "command": "python -m benchmarks.linkmodel", "load_before": [0.1, 0.1, 0.1],
              "load_after": [0.2, 0.2, 0.2], "cores": 2}
    record["table"] = linkmodel.table(record)
    return record


def test_time_to_target_is_steps_times_compute_codec_bytes_and_latency() -> None:
    record = _linkmodel()
    topk = record["table"]["100mbit"]["4"]["topk"]
    per_step = 0.021 + 8 * 8e4 / 1e8 + 2 * 2 * 3 * linkmodel.DELAY_S["100mbit"]
    assert topk["time_s"] == pytest.approx(110 * per_step)
    assert topk["bound_multiple"] == pytest.approx(110 * per_step / 2.0)
    assert topk["vs_lone"] == pytest.approx(8.0 / (110 * per_step))
    assert record["table"]["10mbit"]["4"]["compute-only bound"]["bound_multiple"] == 1.0
    assert record["table"]["10mbit"]["4"]["clt-k"]["time_s"] is None
    # at the break-even rate the scheme and the lone worker finish together
    rate = linkmodel.break_even(_run("dense", 100, 4e6, 0.0), 4, 8.0, 0.0)
    assert rate is not None
    assert 100 * (0.02 + 8 * 4e6 / rate) == pytest.approx(8.0)
    assert linkmodel.break_even(_run("dense", 500, 4e6), 4, 8.0, 0.0) is None  # never


def test_streaming_diloco_waits_only_for_the_link_time_its_delay_does_not_cover() -> None:
    # a fragment syncs every 50 / 2 = 25 steps; its exchange carries 25 steps' link time
    synced = {**_run("diloco", 100, 1e5), "local": {"every": 50, "fragments": 2, "delay": 0}}
    overlapped = {**synced, "local": {"every": 50, "fragments": 2, "delay": 5}}
    link = 8 * 1e5 / 1e7  # s per step at 10 Mbit/s, delay 0
    assert linkmodel.time_at(synced, 4, 1e7, 0.0) == pytest.approx(100 * (0.021 + link))
    hidden = 5 * 0.021  # five steps of compute and codec per exchange
    assert linkmodel.time_at(overlapped, 4, 1e7, 0.0) == pytest.approx(
        100 * (0.021 + (25 * link - hidden) / 25))
    assert linkmodel.time_at(overlapped, 4, 1e9, 0.0) == pytest.approx(100 * 0.021)  # hidden
    lone = 100 * 0.03
    rate = linkmodel.break_even(overlapped, 4, lone, 0.0)
    assert rate is not None
    assert linkmodel.time_at(overlapped, 4, rate, 0.0) == pytest.approx(lone)


def test_an_exchange_a_sync_late_or_a_step_late_hides_behind_the_steps_it_overlaps() -> None:
    link = 8 * 1e5 / 1e7  # s per step at 10 Mbit/s: 0.08, above a step's 0.021 of compute
    late = {**_run("diloco", 100, 1e5), "local": {"every": 50, "fragments": 1, "delay": 0,
                                                  "overlap": True}}
    # the exchange has the whole next cycle, but the link carries one at a time
    assert linkmodel.time_at(late, 4, 1e7, 0.0) == pytest.approx(100 * link)
    assert linkmodel.time_at(late, 4, 1e8, 0.0) == pytest.approx(100 * 0.021)  # hidden
    two = {**late, "local": {**late["local"], "fragments": 2}}
    assert linkmodel.time_at(two, 4, 1e7, 0.0) == pytest.approx(100 * link)
    delayed = {**_run("dense", 100, 1e5), "delayed": True}
    assert linkmodel.time_at(delayed, 4, 1e7, 0.0) == pytest.approx(100 * link)
    assert linkmodel.time_at(delayed, 4, 1e8, 0.0) == pytest.approx(100 * 0.021)
    assert linkmodel.time_at({**delayed, "delayed": False}, 4, 1e8, 0.0) == pytest.approx(
        100 * (0.021 + link / 10))


def _earlier(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """A linkmodel file with its lone worker, written to ``tmp_path``."""
    earlier = _linkmodel()
    earlier["lone"] = {**_run("dense", 400, 0.0), "recipe": RECIPE}
    path = tmp_path / "linkmodel.json"
    path.write_text(json.dumps(earlier))
    return earlier, path


def test_a_later_run_adds_its_schemes_to_an_earlier_file_of_the_same_recipe(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    earlier, path = _earlier(tmp_path)
    fresh = [_run("topk", 90, 8e4), _run("diloco:every=10", 150, 2e4)]
    monkeypatch.setattr(linkmodel, "recipe", lambda options: RECIPE)
    monkeypatch.setattr(linkmodel, "compare", lambda *args, **kwargs: [dict(r) for r in fresh])
    assert linkmodel.main(["--workers", "4", "--schemes", "topk,diloco:every=10",
                           "--add-to", str(path), "--rates", "100mbit"]) == 0
    record = json.loads(path.read_text())
    runs = {r["scheme"]: r["steps_to_target"] for r in record["cells"]["4"]["runs"]}
    assert runs == {"dense": 100, "clt-k": None, "topk": 90, "diloco:every=10": 150}
    bound = next(r for r in record["cells"]["4"]["references"]
                 if r["scheme"] == "compute-only bound")
    assert bound["steps_to_target"] == 100  # the earlier dense run's
    assert record["earlier"]["command"] == earlier["command"]
    monkeypatch.setattr(linkmodel, "recipe", lambda options: {**RECIPE, "steps": 900})
    assert linkmodel.main(["--workers", "4", "--schemes", "topk", "--add-to", str(path),
                           "--rates", "100mbit"]) == 0  # a budget does not change a run
    codec = tmp_path / "codec.json"
    codec.write_text(json.dumps({"ms_per_step": {"topk": 3.5, "floor": 0.1},
                                 "command": "python -m benchmarks.codec"}))
    assert linkmodel.main(["--workers", "4", "--schemes", "", "--add-to", str(path),
                           "--codec-from", str(codec), "--rates", "100mbit"]) == 0
    runs = {r["scheme"]: r for r in json.loads(path.read_text())["cells"]["4"]["runs"]}
    assert runs["topk"]["overhead_ms_per_step"] == 3.5
    assert runs["topk"]["probe_overhead_ms"] == 1.0  # the run's own, kept
    assert runs["dense"]["overhead_ms_per_step"] == 0.0  # not in the codec file: as measured
    monkeypatch.setattr(linkmodel, "recipe", lambda options: {**RECIPE, "lr": 1.0})
    with pytest.raises(SystemExit):  # another recipe's runs do not mix
        linkmodel.main(["--workers", "4", "--schemes", "topk", "--add-to", str(path)])


def test_runs_of_earlier_compare_files_join_under_todays_names(tmp_path: Path) -> None:
    local = {"every": 30, "fragments": 1, "delay": 0, "overlap": False}
    ranks = {**_run("diloco+sparseloco", None, 1e3), "workers": 4, "local": local,
             "config": {"every": 30, "outer_lr": 1.0, "k": 64, "aggregate": "ranks"}}
    senders = {**ranks, "scheme": "diloco+sparseloco:aggregate=senders", "steps_to_target": 150,
               "config": {**ranks["config"], "aggregate": "senders"}}
    other_seed = {**senders, "recipe": {**RECIPE, "seed": 1}}
    step = {**_run("topk", 110, 8e4), "workers": 4}
    bound = {**_run("compute-only bound", 100, 0.0), "workers": 4, "reference": True}
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({"runs": [{"every": 30, "results": {"runs": [
        ranks, senders, bound]}}, {"results": {"runs": [other_seed, step]}}]}))
    assert [r["scheme"] for r in linkmodel.compared(path, RECIPE, 4)] == [
        "diloco+sparseloco:every=30:aggregate=ranks", "diloco+sparseloco:every=30", "topk"]
    assert linkmodel.compared(path, RECIPE, 2) == []


def test_runs_read_in_join_an_earlier_file_where_it_has_no_longer_run_of_their_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, path = _earlier(tmp_path)
    shorter = {**_run("topk", None, 8e4), "workers": 4, "recipe": {**RECIPE, "steps": 50}}
    new = {**_run("fp16", 100, 2e6), "workers": 4}
    compared = tmp_path / "compare.json"
    compared.write_text(json.dumps({"runs": [shorter, new]}))
    monkeypatch.setattr(linkmodel, "recipe", lambda options: RECIPE)
    assert linkmodel.main(["--workers", "4", "--schemes", "", "--add-to", str(path),
                           "--runs-from", str(compared), "--rates", "100mbit"]) == 0
    runs = {r["scheme"]: r["steps_to_target"]
            for r in json.loads(path.read_text())["cells"]["4"]["runs"]}
    assert runs == {"dense": 100, "clt-k": None, "topk": 110, "fp16": 100}


def test_a_local_update_run_pays_its_inner_schemes_codec_once_per_sync() -> None:
    measured = {"int4": 20.0, "topk:ratio=0.1": 8.0, "dense": 1.0}
    run = {**_run("diloco+int4:every=50:fragments=2", 100, 1e4),
           "local": {"every": 50, "fragments": 2, "delay": 0}}
    assert linkmodel.codec_ms(run, measured) == pytest.approx(20.0 / 50)
    own = {**run, "scheme": "diloco+topk:ratio=0.1:every=25", "local": {"every": 25}}
    assert linkmodel.codec_ms(own, measured) == pytest.approx(8.0 / 25)
    plain = {**run, "scheme": "diloco", "local": {"every": 10}}
    assert linkmodel.codec_ms(plain, measured) == pytest.approx(0.1)
    assert linkmodel.codec_ms(_run("powersgd", 100, 1e4), measured) is None  # not measured


def test_the_page_shows_every_workloads_verdict_and_both_reference_rows(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "efficiency-text-lm.json").write_text(json.dumps(
        _efficiency({"1": [(200, 2.5)], "4": [(80, 2.5)], "8": [(40, 2.5)]})))
    (data / "efficiency-digits-mlp.json").write_text(json.dumps(
        {**_efficiency({"1": [(80, 2.5)], "4": [(70, 2.5)], "8": [(60, 2.5)]}),
         "workload": "digits-mlp"}))
    record = _linkmodel()
    record["break_even_bps"] = {"4": {"dense": 5e8, "topk": 2e6, "clt-k": None}}
    (data / "linkmodel-text-lm.json").write_text(json.dumps(record))
    page = "\n".join(report.pays_section(tmp_path, tmp_path / "figures"))
    assert "| text-lm | 2.5 bits per byte |" in page and "| yes |" in page
    assert "digits-mlp" in page and "**no**: 4 workers need 0.88x" in page
    assert "| **lone worker** |" in page and "| **compute-only bound** |" in page
    assert "topk 2.0 Mbit/s" in page and "clt-k never" in page
    assert (tmp_path / "figures" / "time_vs_rate_text-lm.png").stat().st_size > 0


def test_the_workload_matrix_carries_both_reference_rows_and_a_lower_is_better_target() -> None:
    path = Path(__file__).parents[2] / "docs" / "data" / "netem-workload-text-lm.json"
    record = json.loads(path.read_text())
    text = report.workloads_section([(record, path)])
    assert "target 2.58 bits per byte" in text
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| **")}
    assert rows["| **lone worker**"].count("60.94 m @2600") == 3  # one run, every rate
    assert rows["| **compute-only bound**"].count(" c @1600") == 3  # dense's steps x compute


def test_each_workload_matrix_cell_shows_its_own_worker_counts_bound() -> None:
    path = Path(__file__).parents[2] / "docs" / "data" / "netem-workload-text-lm.json"
    record = json.loads(path.read_text())
    record["workers"] = [2, 4]
    record["runs"] += [{**run, "workers": 4} for run in record["runs"]]
    record["references"] += [{**ref, "workers": 4, "steps_to_target": 950}
                             for ref in record["references"]
                             if ref["scheme"] == "compute-only bound"]
    text = report.workloads_section([(record, path)])
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| **")}
    assert rows["| **compute-only bound**"].count(" c @1600") == 3
    assert rows["| **compute-only bound**"].count(" c @950") == 3
    assert rows["| **lone worker**"].count("60.94 m @2600") == 6
    assert "More workers than cores in text-lm (4 workers)" in text
    assert "More workers than cores" not in report.workloads_section(
        [(json.loads(path.read_text()), path)])
