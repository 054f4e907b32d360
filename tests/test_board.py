"""The Meter on TensorBoard: per-step bytes, ratio and density, as the Meter counted them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thinwire.cli import main
from thinwire.comm import Meter
from thinwire.jobs import board

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every scalar event in ``folder``."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_each_step_logs_what_the_meter_counted_in_that_step(tmp_path: Path) -> None:
    meter = Meter(rank=0, world_size=2)
    writer = board.MeterBoard(tmp_path, dense_bytes=4000)
    trace = {"fc.weight": [(0, 0.5, 0.01)]}
    meter.record("W_grad", "fc.weight", "all_reduce", 100)
    meter.next_step()
    writer.step(meter, loss=2.5, trace=trace)
    meter.record("W_grad", "fc.weight", "all_gather", 250)
    meter.record("W_grad", "fc.bias", "all_gather", 150)
    meter.next_step()
    writer.step(meter, loss=2.0, trace=trace)  # no new density point: none logged
    trace["fc.weight"].append((2, 0.4, 0.02))
    meter.next_step()  # a step that hands nothing (a lone worker's): no ratio
    writer.step(meter, trace=trace)
    writer.score(3, 0.75)
    writer.score(3, 2.5, "bits per byte")
    writer.close()
    logged = scalars(tmp_path)
    assert logged[board.HANDED] == [(1, 100.0), (2, 400.0), (3, 0.0)]
    assert logged[board.RATIO] == [(1, 40.0), (2, 10.0)]
    # ring model at n = 2: all-reduce sends the payload once, all-gather (n-1) times
    assert logged[board.RING_SENT] == [(1, 100.0), (2, 400.0), (3, 0.0)]
    assert logged[board.DENSITY + "fc.weight"] == [(1, pytest.approx(0.01)),
                                                   (3, pytest.approx(0.02))]
    assert logged[board.LOSS] == [(1, 2.5), (2, 2.0)]
    assert logged[board.ACCURACY] == [(3, 0.75)]
    assert logged["test/bits_per_byte"] == [(3, 2.5)]  # text-lm's metric, by its name


def test_compare_writes_one_tensorboard_run_per_scheme(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    code = main(["compare", "--schemes", "dense,topk", "--workers", "2", "--steps", "4",
                 "--eval-every", "2", "--hidden", "16", "--out", str(tmp_path / "run"),
                 "--json", str(summary), "--tensorboard", str(tmp_path / "tb"), "--no-lone"])
    assert code == 0
    runs = {r["scheme"]: r for r in json.loads(summary.read_text())["runs"]}
    dense_bytes = runs["dense"]["dense_bytes_per_step"]
    for name, run in runs.items():
        logged = scalars(tmp_path / "tb" / name)
        handed = [value for _, value in logged[board.HANDED]]
        assert [step for step, _ in logged[board.HANDED]] == [1, 2, 3, 4]
        assert sum(handed) / 4 == pytest.approx(run["bytes_sent_per_step"])
        assert [value for _, value in logged[board.RATIO]] == pytest.approx(
            [dense_bytes / value for value in handed])
        assert [step for step, _ in logged[board.ACCURACY]] == [2, 4]
    densities = {tag for tag in scalars(tmp_path / "tb" / "topk") if
                 tag.startswith(board.DENSITY)}
    assert densities and densities == {board.DENSITY + key
                                       for key in runs["topk"]["density_per_layer"]}
    assert not any(tag.startswith(board.DENSITY) for tag in scalars(tmp_path / "tb" / "dense"))


def test_a_missing_tensorboard_package_is_named_before_training(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name: str, *args: object, **kwargs: object) -> object:
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    assert main(["compare", "--tensorboard", "tb", "--steps", "1"]) == 2
    assert "pip install 'thinwire[tensorboard]'" in capsys.readouterr().err
