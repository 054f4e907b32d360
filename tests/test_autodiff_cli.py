"""``thinwire dad``, its data sets and the label split across sites (dAD §4.1.1)."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest

from thinwire.cli import dad as cli
from thinwire.data import sitedata


def test_no_class_is_on_two_sites() -> None:
    labels = np.repeat(np.arange(10), 7)
    for sites in (1, 2, 3, 10):
        parts = sitedata.split_by_label(labels, sites)
        assert len(parts) == sites
        classes = [set(labels[p].tolist()) for p in parts]
        assert all(a.isdisjoint(b) for i, a in enumerate(classes) for b in classes[i + 1:])
        assert sorted(np.concatenate(parts).tolist()) == list(range(len(labels)))
    assert [len(set(labels[p])) for p in sitedata.split_by_label(labels, 3)] == [4, 3, 3]


@pytest.mark.parametrize("sites", [0, 11])
def test_split_refuses_more_sites_than_classes(sites: int) -> None:
    with pytest.raises(ValueError, match="sites"):
        sitedata.split_by_label(np.arange(10), sites)


def test_digits_ship_offline() -> None:
    data = sitedata.load("digits")
    assert data.train_x.shape == (1437, 64) and data.test_x.shape == (360, 64)
    assert data.classes == 10 and not data.sequential
    assert data.train_x.dtype == np.float32 and 0.0 <= data.train_x.min() <= data.train_x.max() <= 1


def test_missing_optional_sets_say_so(monkeypatch: pytest.MonkeyPatch, tmp_path: str) -> None:
    monkeypatch.setattr(sitedata, "FASHION_DIR", str(tmp_path))
    with pytest.raises(sitedata.Unavailable, match="dataset-fashion-mnist"):
        sitedata.load("fashion-mnist")
    with pytest.raises(ValueError, match="dataset"):
        sitedata.load("cifar10")
    with pytest.raises(ValueError, match="UEA set"):
        sitedata.load("uea:NATOPS")


def _args(tmp_path: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["--out", str(tmp_path), *extra])


@pytest.mark.parametrize("bad", [["--workers", "0"], ["--batch-size", "0"], ["--steps", "-1"],
                                 ["--hidden", "0"], ["--dataset", "mnist"],
                                 ["--option", "iterations=0"], ["--option", "rank=2"]])
def test_bad_arguments_are_value_errors(tmp_path: str, bad: list[str]) -> None:
    with pytest.raises(ValueError):
        cli.run(_args(tmp_path, *bad))


def test_dad_command_compares_modes_side_by_side(tmp_path: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.run(_args(tmp_path, "--modes", "dsgd,dad,edad,rank-dad", "--ranks", "2",
                         "--epochs", "2", "--steps", "2", "--hidden", "16",
                         "--dtype", "float64"))
    assert code == 0
    printed = capsys.readouterr().out
    for label in ("dsgd", "dad", "edad", "rank-dad r=2"):
        assert f"\n{label} " in printed
    with open(os.path.join(tmp_path, "results.json")) as handle:
        results = {r["label"]: r for r in json.load(handle)["runs"]}
    for mode in ("dsgd", "dad", "edad"):
        assert max(results[mode]["max_grad_error"].values()) < 1e-12
    assert max(results["edad"]["bytes_per_site"]) < max(results["dad"]["bytes_per_site"])
    assert set(results["rank-dad r=2"]["effective_rank_per_epoch"]) == {"0", "2"}
    for result in results.values():  # --steps 2 ends the run inside the first epoch
        assert result["steps_per_epoch"] > 2 and result["meter"]["steps"] == 2
        assert len(result["history"]) == 1
    for figure in ("results.md", "auc.png", "effective_rank.png", "bytes.png"):
        assert os.path.getsize(os.path.join(tmp_path, figure)) > 0
