"""The codec benchmark: every scheme on the workload's own gradient, beside its floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import codec


def test_each_spelling_times_its_own_scheme_beside_the_floor(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    assert codec.main(["--workload", "digits-mlp", "--schemes", "dense,topk:ratio=0.1",
                       "--repeats", "2", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["ms_per_step"]) == {"dense", "topk:ratio=0.1", "floor"}
    assert all(ms > 0 for ms in record["ms_per_step"].values())
    assert record["over_floor"]["floor"] == 1.0 and record["load_before"]


def test_a_bad_option_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        codec.main(["--workload", "digits-mlp", "--schemes", "topk:rank=2"])
    assert caught.value.code == 2
    assert "'rank' is not an option of topk" in capsys.readouterr().err
