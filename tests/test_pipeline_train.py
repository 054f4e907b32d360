"""DCT-MP training helpers: data, models, simulated replicas, the CLI in one process."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from thinwire.cli import main
from thinwire.comm import Meter
from thinwire.compress import keep_count
from thinwire.data.criteo import CARDINALITIES, breast_cancer, synthetic_criteo
from thinwire.jobs.dct_mp import RunConfig, SimulatedReplicas, train_local
from thinwire.models.dlrm import dlrm


def test_synthetic_criteo_is_criteo_shaped_deterministic_and_learnable() -> None:
    train, test = synthetic_criteo(2000, 500, seed=4)
    again, _ = synthetic_criteo(2000, 500, seed=4)
    assert train.dense.shape == (2000, 13) and train.categorical.shape == (2000, 26)
    assert torch.equal(train.categorical, again.categorical)
    assert torch.equal(train.labels, again.labels)
    assert len(CARDINALITIES) == 26
    assert bool((train.categorical < torch.tensor(CARDINALITIES)).all())
    assert 0.2 < float(train.labels.mean()) < 0.3  # about Criteo's click rate
    oracle = test.oracle()  # the teacher beats always-negative: there is signal
    assert oracle["accuracy"] > 1 - float(test.labels.mean()) + 0.03


def test_breast_cancer_is_real_and_criteo_shaped() -> None:
    train, test = breast_cancer(seed=0, bins=8)
    assert len(train) + len(test) == 569
    assert train.dense.shape[1] == train.categorical.shape[1] == 30
    assert int(train.categorical.max()) == 7 and int(train.categorical.min()) == 0
    torch.testing.assert_close(train.dense.mean(0), torch.zeros(30), atol=1e-4, rtol=0)


def test_dlrm_has_the_papers_widths() -> None:
    model = dlrm(13, CARDINALITIES)
    widths = [m.out_features for m in model.bottom if isinstance(m, torch.nn.Linear)]
    assert widths == [512, 256, 64, 16]
    assert [m.out_features for m in model.top if isinstance(m, torch.nn.Linear)] == [
        512, 256, 128, 1]
    assert model.interact.out_features == 16 + 27 * 26 // 2
    dense = torch.randn(4, 13)
    categorical = torch.zeros(4, 26, dtype=torch.int64)
    assert model(dense, categorical=categorical).shape == (4, 1)


def test_simulated_replicas_with_dense_average_the_shards() -> None:
    model = dlrm(5, [3, 4], bottom=(8, 4), top=(8, 1), seed=1)
    reference = copy.deepcopy(model)
    dense, categorical = torch.randn(8, 5), torch.randint(0, 3, (8, 2))
    labels = torch.randint(0, 2, (8, 1)).float()
    loss = torch.nn.functional.binary_cross_entropy_with_logits
    meter = Meter()
    replicas = SimulatedReplicas("dense", {}, 2, meter)
    sent = []
    for r in range(2):
        model.zero_grad()
        rows = slice(4 * r, 4 * r + 4)
        loss(model(dense[rows], categorical=categorical[rows]), labels[rows]).backward()
        sent.append(replicas.encode(r, {k: p.grad for k, p in model.named_parameters()}))
    total = replicas.mean(sent)
    loss(reference(dense, categorical=categorical), labels).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(total[name], p.grad, rtol=1e-6, atol=1e-7)
    params = sum(p.numel() for p in model.parameters())
    assert sum(r.nbytes for r in meter.records) == 2 * 4 * params
    with pytest.raises(ValueError, match="unknown scheme"):
        SimulatedReplicas("nope", {}, 2, meter)


def test_train_local_meters_the_payload_and_reports_metrics() -> None:
    config = RunConfig(task="breast-cancer", stages=3, boundary_options={"ratio": 0.1},
                       batch_size=32, max_steps=3, replicas=2, dp_scheme="dct-dp",
                       dp_options={"ratio": 0.1, "life_span": 2})
    result = train_local(config)
    assert result["steps"] == 3 and result["splits"] == ["bottom.3", "top.3"]
    k = keep_count(256, 0.1)
    per_boundary = 32 * k  # two replicas of 16 rows
    assert result["bytes_per_entity"]["X_act"] == 2 * per_boundary * (4 + 1)
    assert result["bytes_per_entity"]["X_grad"] == 2 * per_boundary * 4
    assert result["bytes_per_entity"]["W_grad"] > 0
    for part in ("train", "test"):
        assert 0.0 <= result[part]["accuracy"] <= 1.0 and result[part]["loss"] > 0


def test_run_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="task="):
        RunConfig(task="imagenet")
    with pytest.raises(ValueError, match="divide"):
        RunConfig(batch_size=30, replicas=2, microbatches=4)
    with pytest.raises(ValueError, match="split names"):
        RunConfig(stages=3, splits=("bottom.3",))
    with pytest.raises(ValueError, match="stages="):
        RunConfig(stages=0)


def test_cli_local_transformer_run_reports_bytes(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    code = main(["pipeline", "--local", "--task", "digits", "--stages", "3", "--steps", "2",
                 "--batch-size", "32", "--ratio", "0.1", "--json", str(out),
                 "--out", str(tmp_path / "run")])
    assert code == 0
    assert "X_act B/step" in capsys.readouterr().out
    assert out.read_text() == (tmp_path / "run" / "results.json").read_text()
    for name in ("results.md", "bytes.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    result = json.loads(out.read_text())["runs"][0]
    assert result["splits"] == ["layer0.ffn_relu", "layer1.ffn_relu"]
    k = keep_count(128, 0.1)
    residual = 32 * 8 * 32 * 4  # (B, T, d_model) fp32 crosses dense beside the payload
    assert result["bytes_per_entity"]["X_act"] == 2 * (residual + 32 * 8 * k * 5)
    assert result["bytes_per_entity"]["X_grad"] == 2 * (residual + 32 * 8 * k * 4)


@pytest.mark.parametrize("argv, message", [
    (["--ratio", "-0.5"], "ratio=-0.5"),
    (["--splits", "bottom.99"], "no module named 'bottom.99'"),
    (["--stages", "3", "--splits", "bottom.3"], "split names"),
    (["--boundary-option", "oops"], "KEY=VALUE"),
    (["--boundary-option", "bogus=1"],
     "--boundary-option 'bogus' is not an option of dct-mp; valid keys: ratio, threshold"),
    (["--replicas", "2", "--dp-option", "bogus=1"],
     "--dp-option 'bogus' is not an option of dense; valid keys: nonfinite"),
])
def test_cli_bad_input_is_a_clear_error(argv: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["pipeline", "--local", "--task", "breast-cancer", "--steps", "1", *argv])
    assert code == 2
    assert message in capsys.readouterr().err
