"""The fault-injection benchmark's summary of a run's events, and its results-page section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.faults import _added_to, fault_costs, section, summarise


def _event(replica: int, step: int, time: float, score: float | None = None,
           committed: bool = True, digest: str = "a", workers: int = 4) -> dict[str, Any]:
    return {"replica": replica, "step": step, "time": time, "workers": workers,
            "committed": committed, "weights_hash": digest, "score": score}


def test_the_summary_finds_the_target_failed_syncs_heals_and_disagreement() -> None:
    lines = [_event(0, 10, 100.0, 3.0), _event(1, 10, 100.1, digest="a"),
             _event(0, 20, 101.0, committed=False, workers=4),
             _event(0, 30, 102.0, 2.5, digest="b", workers=3), _event(1, 30, 102.1, digest="c"),
             {"replica": 4, "heal": 30, "time": 101.5, "seconds": 0.4},
             {"replica": 1, "heal": 10, "time": 99.0, "seconds": 0.2},  # before the first sync
             {"replica": 0, "done": True, "started": 90.0, "record": {},
              "bytes_sent_per_step": 1234.0}]
    summary = summarise("thinwire", "diloco+int4", lines, [], 0.0, (2.58, True))
    assert summary["steps_to_target"] == 30 and summary["seconds_to_target"] == 2.0
    assert summary["syncs"] == 3 and summary["syncs_failed"] == 1
    assert [(h["replica"], h["seconds"]) for h in summary["heals"]] == [(4, 0.4)]
    assert summary["syncs_checked"] == 2 and not summary["weights_equal_after_every_sync"]
    assert summary["syncs_unequal"] == [30]  # 10 agreed; 20 did not commit
    assert summary["workers_per_sync"] == [(10, 4), (20, 4), (30, 3)]
    assert summary["bytes_sent_per_step"] == 1234.0


def test_the_section_sets_each_run_against_its_fault_free_twin(tmp_path: Path) -> None:
    run = {"label": "thinwire-local", "scheme": "diloco+int4", "steps_to_target": 1300,
           "seconds_to_target": 100.0, "wall_s": 200.0, "syncs_failed": 0, "syncs": 160,
           "heals": [], "weights_equal_after_every_sync": True, "syncs_checked": 160,
           "bytes_sent_per_step": 2500.0, "faults": False}
    faulty = {**run, "faults": True, "seconds_to_target": 120.0, "wall_s": 260.0, "syncs_failed": 2,
              "heals": [{"replica": 2, "step": 800, "after_s": 50.0, "seconds": 1.5}],
              "fault_costs": [{"fault": "SIGSTOP", "replica": 1, "step": 600,
                               "waits_s": {0: 6.5, 2: 7.0, 3: 12.0}}], "commit_gap_s": 1.2}
    record = {"machine": {"when": "today", "cpus": 2, "load_before": [1.0], "load_after": [2.0]},
              "schedule": {"join_at": 800, "kill_inner": 405, "kill_exchange": 1200,
                           "relaunch_s": 5.0, "stop_s": 20.0}, "compute_ms_per_step": 25.0,
              "workload": "text-lm", "command": "python -m benchmarks.faults", "workers": 4,
              "metric": "bits per byte", "target": 2.58, "min_workers": 2, "eval_every": 50,
              "runs": [run, faulty]}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "efficiency-text-lm.json").write_text(
        '{"steps_to_target": {"1": 2600.0, "4": 950.0}}')
    text = section(record, tmp_path)
    assert ("| thinwire-local `diloco+int4` | yes | 1300 | 120 | 1.20 | 260 | 1.30 | 2 of 160 "
            "| 1.5 |") in text
    assert "| thinwire-local `diloco+int4` | SIGSTOP | 1 | 600 | 7.0, 12 | 1.2 |" in text
    assert "| lone worker | no | 2600 | 65 (modelled) |" in text
    assert "| compute-only bound (4 workers) | no | 950 | 24 (modelled) |" in text


def test_runs_added_to_a_data_file_keep_its_runs_and_name_both_commands() -> None:
    base = {"workload": "text-lm", "workers": 4, "min_workers": 3, "steps": 1600,
            "eval_every": 50, "schedule": {"join_at": 800}, "local": {}, "per_step": {},
            "command": "python -m benchmarks.faults --sides torchft",
            "machine": {"when": "then", "load_before": [1.0], "load_after": [2.0]},
            "runs": [{"label": "torchft"}]}
    later = {**base, "command": "python -m benchmarks.faults --sides thinwire-per-step",
             "machine": {"when": "now", "load_before": [3.0]}, "runs": []}
    merged = _added_to(base, later)
    assert merged["runs"] == [{"label": "torchft"}]
    assert merged["command"] == ("python -m benchmarks.faults --sides torchft; then "
                                 "python -m benchmarks.faults --sides thinwire-per-step")
    assert merged["machine"] == {"when": "then", "load_before": [1.0], "load_after": [3.0]}
    with pytest.raises(ValueError, match="schedule"):
        _added_to(base, {**later, "schedule": {"join_at": 400}})


def test_each_fault_costs_the_others_their_wait_to_their_next_commit() -> None:
    events = [_event(0, 10, 100.0, workers=3), _event(1, 10, 100.0, workers=3),
              _event(2, 10, 100.0, workers=3),
              _event(0, 20, 104.0, committed=False, workers=3),
              _event(2, 20, 104.0, committed=False, workers=3),
              _event(0, 30, 110.0, workers=2), _event(2, 30, 111.0, workers=2),
              _event(3, 30, 111.0, workers=2),
              _event(0, 40, 112.0, workers=2),  # the stalled worker 2 took part in this one
              _event(0, 50, 118.0, workers=1)]
    kills = [{"replica": 1, "died": 103.0, "step": 20, "exitcode": -9}]
    stop = {"replica": 2, "stopped": 111.5, "step": 35}
    costs = fault_costs(events, kills, stop)
    # worker 3 was not training yet when worker 1 died; a failed sync is no commit
    assert costs == [{"fault": "SIGKILL", "replica": 1, "step": 20,
                      "waits_s": {0: 7.0, 2: 8.0}},
                     {"fault": "SIGSTOP", "replica": 2, "step": 35, "waits_s": {0: 6.5}}]
    summary = summarise("thinwire", "powersgd", events, kills, 0.0, (2.58, True), stop)
    assert summary["fault_costs"] == costs and summary["commit_gap_s"] == 6.0
