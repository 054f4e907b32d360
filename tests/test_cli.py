"""The command line: the compare job end to end, and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from thinwire.cli import main
from thinwire.jobs import compare
from thinwire.jobs.compare import parse_bandwidth, scheme_config


def test_parse_bandwidth() -> None:
    assert parse_bandwidth("100mbit") == 1e8
    assert parse_bandwidth("1gbit") == 1e9
    assert parse_bandwidth("2.5kbit") == 2500
    for bad in ("fast", "0mbit", "100", "10 furlongs"):
        with pytest.raises(ValueError, match="bandwidth="):
            parse_bandwidth(bad)


def test_shared_knobs_map_onto_each_schemes_options() -> None:
    assert scheme_config("dct-dp", 0.9, 10, []) == {"sparsity": 0.9, "life_span": 10}
    assert scheme_config("topk", 0.9, 10, ["values=fp16"]) == {"ratio": pytest.approx(0.1),
                                                                "values": "fp16"}
    assert scheme_config("dense", 0.9, 10, ["rank=2"]) == {}


def test_compare_writes_results_and_the_json_summary(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "summary.json"
    code = main(["compare", "--schemes", "dense,dct-dp", "--workers", "2", "--steps", "40",
                 "--sparsity", "0.9", "--life-span", "10", "--hidden", "32", "--lr", "0.2",
                 "--out", str(tmp_path / "run"), "--json", str(summary)])
    assert code == 0
    runs = json.loads(summary.read_text())["runs"]
    assert [r["scheme"] for r in runs] == ["dense", "dct-dp"]
    for r in runs:
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["wall_s"] > 0
    dense, dct = runs
    assert dense["compression_ratio"] == pytest.approx(1.0)
    assert dct["bytes_sent_per_step"] < dense["bytes_sent_per_step"] / 2
    assert dense["test_accuracy"] > 0.5  # it learned something in 40 steps
    full = json.loads((tmp_path / "run" / "results.json").read_text())["runs"]
    assert all(r["replicas_identical"] for r in full)
    assert (tmp_path / "run" / "accuracy_vs_bytes.png").stat().st_size > 0
    assert (tmp_path / "run" / "threshold.png").stat().st_size > 0
    assert "| dct-dp |" in capsys.readouterr().out


def test_bad_input_is_a_clear_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--schemes", "nope", "--workers", "2"]) == 2
    assert "unknown scheme 'nope'" in capsys.readouterr().err
    assert main(["compare", "--sparsity", "1.5", "--schemes", "dct-dp"]) == 2
    assert "sparsity=1.5" in capsys.readouterr().err


def test_train_outside_torchrun_explains_how_to_launch(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--scheme", "dense"]) == 2
    assert "torchrun" in capsys.readouterr().err


def _no_spawn(*args: object, **kwargs: object) -> None:
    raise AssertionError("bad input must be rejected before any process starts")


@pytest.mark.parametrize(("option", "expected"), [
    ("bogus=3", "'bogus' is not an option of dense, dct-dp; valid keys: "),
    ("rank", "'rank' must look like KEY=VALUE"),
])
def test_compare_rejects_unknown_or_malformed_options_before_spawning(
        option: str, expected: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "spawn", _no_spawn)
    assert main(["compare", "--schemes", "dense,dct-dp", "--option", option]) == 2
    err = capsys.readouterr().err
    assert expected in err
    if "valid keys" in expected:
        assert "life_span" in err and "sparsity" in err


def test_option_for_one_of_several_schemes_is_accepted() -> None:
    assert compare.parse_options(["rank=2"], ["dense", "powersgd"]) == {"rank": 2}


@pytest.mark.parametrize("seconds", ["0", "-5", "nan", "soon"])
def test_timeout_must_be_positive_seconds(seconds: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["compare", "--timeout", seconds])
    assert caught.value.code == 2
    assert "must be a finite number of seconds > 0" in capsys.readouterr().err


def test_diverged_replicas_fail_the_compare_job(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rank0 = {"scheme": "dense", "test_accuracy": 0.5, "final_loss": 1.0,
             "bytes_sent_per_step": 8.0, "wire_sent_per_step": 8.0,
             "bytes_received_per_step": 8.0, "compute_ms_per_step": 1.0,
             "overhead_ms_per_step": 0.1, "wall_s": 1.0, "curve": [(1, 8.0, 0.5)],
             "threshold_trace": {}, "weights": [torch.zeros(2)], "steps_to_target": None,
             "target": 0.9, "coupled": False, "density_per_layer": {}}

    def diverging(*args: object, **kwargs: object) -> list[list[dict[str, object]]]:
        return [[rank0], [{"weights": [torch.ones(2)]}]]

    monkeypatch.setattr(compare, "spawn", diverging)
    code = main(["compare", "--schemes", "dense", "--workers", "2", "--out", str(tmp_path)])
    assert code == 1
    assert "replicas diverged under dense" in capsys.readouterr().err


def test_train_rejects_unknown_options_before_joining_the_job(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")  # as under torchrun; nothing may join a group
    assert main(["train", "--scheme", "dct-dp", "--option", "bogus=1"]) == 2
    assert "'bogus' is not an option of dct-dp" in capsys.readouterr().err
