"""DCT-MP on torch.distributed.pipelining across gloo processes: GPipe and 1F1B are
transparent at ratio 1, equal the one-process split model otherwise, and send
exactly the payload; hybrid stages × replicas keeps replicas identical."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from thinwire.cli import main
from thinwire.comm import Meter
from thinwire.comm.fingerprint import PeerMismatchError
from thinwire.compress import keep_count
from thinwire.launch import spawn
from thinwire.models.dlrm import dlrm
from thinwire.pipeline import Pipeline, build_schedule, build_stage, split

MICROBATCHES = 4
ROWS = 16
# (schedule, boundary kind, options); ratio 1 must reproduce the unsplit model.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("gpipe", "dct-mp", {"ratio": 1.0}), ("1f1b", "dct-mp", {"ratio": 1.0}),
    ("gpipe", "dct-mp", {"ratio": 0.25}), ("1f1b", "dct-mp", {"ratio": 0.25}),
    ("1f1b", "sketch", {"compression": 0.75}),
]


def _model() -> nn.Module:
    return dlrm(5, [3, 4, 6], bottom=(16, 12, 8, 4), top=(16, 12, 8, 1), seed=3)


def _batch() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    dense = torch.randn(ROWS, 5, generator=generator)
    categorical = torch.stack([torch.randint(0, c, (ROWS,), generator=generator)
                               for c in (3, 4, 6)], dim=1)
    return dense, {"categorical": categorical}, torch.randint(0, 2, (ROWS, 1),
                                                              generator=generator).float()


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _reference(model: nn.Module, boundary: str,
               options: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Microbatch by microbatch in one process, accumulated and scaled as the schedule does;
    the unsplit model itself at ratio 1."""
    dense, side, labels = _batch()
    net: nn.Module = model
    if options.get("ratio", 0.0) < 1:
        net = Pipeline(split(model, ["bottom.3"], dense, side=side, boundary=boundary,
                             **options))
    for chunk in range(MICROBATCHES):
        rows = slice(chunk * ROWS // MICROBATCHES, (chunk + 1) * ROWS // MICROBATCHES)
        _loss(net(dense[rows], categorical=side["categorical"][rows]), labels[rows]).backward()
    return {name: p.grad / MICROBATCHES for name, p in model.named_parameters()}


def _pipeline_worker(rank: int, world_size: int) -> list[dict[str, Any]]:
    dense, side, labels = _batch()
    results = []
    for schedule_name, boundary, options in CASES:
        model = _model()
        reference = _reference(copy.deepcopy(model), boundary, options)
        stages = split(model, ["bottom.3"], dense, side=side, boundary=boundary, **options)
        meter = Meter(rank, world_size)
        stage = build_stage(stages, rank, dense, MICROBATCHES, side=side, meter=meter,
                            names=["bottom.3"])
        schedule = build_schedule(schedule_name, stage, MICROBATCHES, _loss)
        if rank == 0:
            schedule.step(dense, **side)
        else:
            schedule.step(target=labels, **side)
        owned = {id(p) for p in stages[rank].parameters()}
        grads = {name: p.grad.clone() for name, p in model.named_parameters()
                 if id(p) in owned}
        results.append({"grads": grads, "reference": {k: reference[k] for k in grads},
                        "records": [(r.entity, r.layer, r.collective, r.nbytes)
                                    for r in meter.records]})
    stages = split(_model(), ["bottom.3"], dense, side=side, ratio=[0.5, 0.25][rank])
    try:
        build_stage(stages, rank, dense, MICROBATCHES, side=side)
        results.append({"mismatch": ""})
    except PeerMismatchError as error:
        results.append({"mismatch": str(error)})
    return results


@pytest.fixture(scope="module")
def pipeline_runs() -> list[list[dict[str, Any]]]:
    return spawn(_pipeline_worker, 2)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_schedules_match_the_one_process_reference_bit_for_bit(
        pipeline_runs: list[list[dict[str, Any]]], case: int) -> None:
    """Sparsity 0: the unsplit model's gradients; else: the one-process split model's."""
    seen = set()
    for rank in range(2):
        run = pipeline_runs[rank][case]
        assert run["grads"], f"rank {rank} owns no parameters"
        seen.update(run["grads"])
        for name, grad in run["grads"].items():
            assert torch.equal(grad, run["reference"][name]), (CASES[case], name)
    assert seen == {name for name, _ in _model().named_parameters()}


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_crossing_sends_exactly_the_payload(pipeline_runs: list[list[dict[str, Any]]],
                                                 case: int) -> None:
    _, boundary, options = CASES[case]
    rows = ROWS // MICROBATCHES
    width = 12
    forward, backward = pipeline_runs[0][case]["records"], pipeline_runs[1][case]["records"]
    if boundary == "sketch":
        m = keep_count(width, 1 - options["compression"])
        expected_forward = [("X_act", "bottom.3", "send", rows * m * 4)]
        expected_backward = [("X_grad", "bottom.3", "send", rows * m * 4)]
    elif options["ratio"] == 1:
        expected_forward = [("X_act", "bottom.3", "send", rows * width * 4)]
        expected_backward = [("X_grad", "bottom.3", "send", rows * width * 4)]
    else:
        k = keep_count(width, options["ratio"])
        expected_forward = [("X_act", "bottom.3", "send", rows * k * 4),  # fp32 values
                            ("X_act", "bottom.3", "send", rows * k * 1)]  # uint8 indices
        expected_backward = [("X_grad", "bottom.3", "send", rows * k * 4)]  # values only
    assert forward == expected_forward * MICROBATCHES
    assert backward == expected_backward * MICROBATCHES


def test_stages_split_with_different_boundaries_raise_the_same_error_on_both_ranks(
        pipeline_runs: list[list[dict[str, Any]]]) -> None:
    errors = [pipeline_runs[rank][-1]["mismatch"] for rank in range(2)]
    assert errors[0] == errors[1] and "the pipeline stages" in errors[0]
    assert "ratio=0.5" in errors[0] and "ratio=0.25" in errors[0]


def test_hybrid_two_stages_by_two_replicas_runs_from_the_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hybrid.json"
    code = main(["pipeline", "--task", "breast-cancer", "--stages", "2", "--replicas", "2",
                 "--schedule", "1f1b", "--microbatches", "2", "--batch-size", "16",
                 "--steps", "3", "--ratio", "0.1", "--dp-scheme", "dct-dp",
                 "--dp-option", "ratio=0.1", "--dp-option", "life_span=2",
                 "--out", str(tmp_path / "run"), "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    for entity in ("X_act", "X_grad", "W_grad"):
        assert entity in printed
    result = json.loads(out.read_text())["runs"][0]
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert [(r["stage"], r["replica"]) for _, r in sorted(ranks.items())] == [
        (0, 0), (1, 0), (0, 1), (1, 1)]
    for stage in range(2):
        copies = [r for r in ranks.values() if r["stage"] == stage]
        assert copies[0]["digest"] == copies[1]["digest"]  # replicas bit-identical
        assert copies[0]["digest"] != copies[0]["initial_digest"]  # and they trained
    for rank in ranks.values():
        entities = rank["meter"]["bytes_per_entity"]
        assert entities["W_grad"] > 0
        assert ("X_act" in entities) == (rank["stage"] == 0)
        assert ("X_grad" in entities) == (rank["stage"] == 1)
    # DCT-MP at 90 %: 16 rows per replica-step, k = 26 of 256, fp32 values + uint8 indices.
    k = keep_count(256, 0.1)
    assert result["bytes_per_entity"]["X_act"] == 2 * 16 * k * 5
    assert result["bytes_per_entity"]["X_grad"] == 2 * 16 * k * 4
    assert 0.0 <= result["test"]["accuracy"] <= 1.0
