"""The command line: the compare job end to end, and clear errors for bad input."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
from pathlib import Path

import pytest
import torch

import thinwire
from thinwire.cli import COMMANDS, build_parser, main
from thinwire.cli import async_ as async_cli
from thinwire.cli import dad as dad_cli
from thinwire.cli import pipeline as pipeline_cli
from thinwire.cli.compare import run_options
from thinwire.cli.pipeline import config_from
from thinwire.jobs import common, compare
from thinwire.jobs.common import HelpFormatter
from thinwire.jobs.compare import parse_bandwidth, scheme_config
from thinwire.ps import launch as ps_launch
from thinwire.schemes.registry import split_option


def test_parse_bandwidth() -> None:
    assert parse_bandwidth("100mbit") == 1e8
    assert parse_bandwidth("1gbit") == 1e9
    assert parse_bandwidth("2.5kbit") == 2500
    for bad in ("fast", "0mbit", "100", "10 furlongs"):
        with pytest.raises(ValueError, match="bandwidth="):
            parse_bandwidth(bad)


def test_shared_knobs_map_onto_each_schemes_options() -> None:
    assert scheme_config("dct-dp", 0.1, 10, []) == {"ratio": 0.1, "life_span": 10}
    assert scheme_config("topk", 0.1, 10, ["values=fp16"]) == {"ratio": 0.1, "values": "fp16"}
    assert scheme_config("dense", 0.1, 10, ["rank=2"]) == {}


def test_compare_writes_results_and_the_json_summary(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    summary = tmp_path / "summary.json"
    code = main(["compare", "--schemes", "dense,dct-dp", "--workers", "2", "--steps", "40",
                 "--ratio", "0.1", "--life-span", "10", "--hidden", "32", "--lr", "0.2",
                 "--out", str(tmp_path / "run"), "--json", str(summary)])
    assert code == 0
    assert summary.read_text() == (tmp_path / "run" / "results.json").read_text()
    written = json.loads(summary.read_text())
    assert written["command"] == "compare" and written["options"]["life_span"] == 10
    assert "run" not in written["options"]  # the options as given, not the handler
    runs = written["runs"]
    assert [r["scheme"] for r in runs] == ["dense", "dct-dp"]
    for r in runs:
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["wall_s"] > 0
    dense, dct = runs
    lone, bound = written["references"]
    assert (lone["scheme"], lone["workers"], bound["scheme"], bound["workers"]) == (
        "lone worker", 1, "compute-only bound", 2)
    for row in (lone, bound):  # the same recipe and seed as the schemes beside them
        assert row["recipe"] == dense["recipe"] == dct["recipe"]
        assert row["recipe"]["seed"] == 0 and row["recipe"]["lr"] == 0.2
    assert bound["steps_to_target"] == dense["steps_to_target"]
    if bound["time_to_target_s"] is not None:
        assert bound["bound_multiple"] == 1.0
        assert dense["bound_multiple"] >= 1.0  # communication is never free in the model
    assert dense["compression_ratio"] == pytest.approx(1.0)
    assert dct["bytes_sent_per_step"] < dense["bytes_sent_per_step"] / 2
    assert dense["test_accuracy"] > 0.5  # it learned something in 40 steps
    assert all(r["replicas_identical"] for r in runs)
    # one compute probe for every scheme: the modelled times differ by bytes and overhead only
    assert dense["compute_ms_per_step"] == dct["compute_ms_per_step"] > 0
    for r in runs:  # ring traffic per worker, in total and per collective
        per_collective = r["traffic_per_collective"]
        assert r["bytes_received_per_step"] == pytest.approx(
            sum(c["received"] for c in per_collective.values()))
        assert r["wire_sent_per_step"] == pytest.approx(
            sum(c["sent"] for c in per_collective.values()))
    # 2 workers: a ring all-reduce moves 2(n-1)/n = 1 payload each way, an all-gather n-1 = 1
    assert dense["traffic_per_collective"]["all_reduce"]["sent"] == pytest.approx(
        dense["bytes_sent_per_step"])
    assert dct["traffic_per_collective"]["all_gather"]["nbytes"] > 0
    for name in ("results.md", "accuracy_vs_bytes.png", "threshold.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    printed = capsys.readouterr().out
    assert "\ndct-dp " in printed and "ring recv B/step" in printed
    assert "lone worker (1)" in printed and "compute-only bound (2)" in printed


def test_bad_input_is_a_clear_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--schemes", "nope", "--workers", "2"]) == 2
    assert "unknown scheme 'nope'" in capsys.readouterr().err
    assert main(["compare", "--ratio", "1.5", "--schemes", "dct-dp"]) == 2
    assert "ratio=1.5" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["compare", "--sparsity", "0.9"],
                                  ["train", "--sparsity", "0.9"],
                                  ["pipeline", "--sparsity", "0.9"]])
def test_the_old_sparsity_flag_is_an_error_naming_ratio(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert "--sparsity is spelled --ratio (the fraction kept" in capsys.readouterr().err


def test_an_old_option_key_is_an_error_naming_the_new_one(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "spawn", _no_spawn)
    assert main(["compare", "--schemes", "dct-dp", "--option", "sparsity=0.9"]) == 2
    assert "'sparsity' is spelled 'ratio' now" in capsys.readouterr().err


def test_train_outside_torchrun_explains_how_to_launch(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--scheme", "dense"]) == 2
    assert "torchrun" in capsys.readouterr().err


def _no_spawn(*args: object, **kwargs: object) -> None:
    raise AssertionError("bad input must be rejected before any process starts")


def test_compare_under_fp16_autocast_with_clipping_in_the_hook(tmp_path: Path) -> None:
    """fp16 registers a GradScaler with every scheme's hook (one 4-byte overflow vote a
    step, counted), and topk clips each worker's gradient in the same held step."""
    summary = tmp_path / "summary.json"
    code = main(["compare", "--schemes", "dense,topk", "--workers", "2", "--steps", "40",
                 "--lr", "0.2", "--hidden", "32", "--precision", "fp16", "--max-norm", "0.5",
                 "--no-lone", "--out", str(tmp_path / "run"), "--json", str(summary)])
    assert code == 0
    dense, topk = json.loads(summary.read_text())["runs"]
    for run in (dense, topk):
        assert run["precision"] == "fp16" and 0 <= run["overflow_steps"] < 40
        assert run["replicas_identical"] and run["test_accuracy"] > 0.3  # chance: 0.1
    assert dense["clipped_steps"] is None and topk["clipped_steps"] > 0
    assert dense["grad_norm_after_backward"]["median"] > 0  # clip_grad_norm_'s, after backward
    assert topk["grad_norm_after_backward"] is None  # clipped in the hook
    assert dense["bytes_sent_per_step"] == dense["dense_bytes_per_step"] + 4


@pytest.mark.parametrize(("argv", "expected"), [
    (["--option", "bogus=3"], "'bogus' is not an option of dense, ddp, dct-dp; valid keys: "),
    (["--option", "rank"], "'rank' must look like KEY=VALUE"),
    (["--schemes", "dense,powersgd:ratio=0.1"], "'ratio' is not an option of powersgd"),
    (["--schemes", "topk:rank"], "'rank' must look like KEY=VALUE"),  # in a scheme's spelling
])
def test_compare_rejects_unknown_or_malformed_options_before_spawning(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare, "spawn", _no_spawn)
    assert main(["compare", "--schemes", "dense,dct-dp", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err
    if "valid keys" in expected:
        assert "life_span" in err and "ratio" in err


def test_option_for_one_of_several_schemes_is_accepted() -> None:
    assert compare.parse_options(["rank=2"], ["dense", "powersgd"]) == {"rank": 2}


def test_a_scheme_spelled_with_its_own_options_runs_with_them_under_its_spelling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, dict[str, object]]] = []

    def record(_worker: object, workers: int, runs: list[tuple[str, dict[str, object]]],
               *args: object, **kwargs: object) -> list[list[dict[str, object]]]:
        seen.extend(runs)
        result = {"weights": [torch.zeros(1)], "bytes_sent_per_step": 1.0,
                  "wire_sent_per_step": 1.0, "bytes_received_per_step": 1.0,
                  "compute_ms_per_step": 1.0, "overhead_ms_per_step": 0.0,
                  "steps_to_target": None}
        return [[dict(result, scheme=name) for name, _ in runs] for _ in range(workers)]

    monkeypatch.setattr(compare, "spawn", record)
    options = run_options(build_parser().parse_args(["compare"]))
    results = compare.compare(["powersgd", "powersgd:rank=4", "topk:ratio=0.05"], 2, options,
                              1e8, extra=["rank=3"])
    assert seen == [("powersgd", {"rank": 3}), ("powersgd", {"rank": 4}),
                    ("topk", {"ratio": 0.05})]
    assert [r["scheme"] for r in results] == ["powersgd", "powersgd:rank=4", "topk:ratio=0.05"]


def test_a_run_records_the_scheme_as_registered(tmp_path: Path) -> None:
    """Under AdamW register chooses topk's options (ADAM_OPTIONS): the run says so."""
    code = main(["compare", "--schemes", "topk,topk:ratio=0.02", "--workers", "2", "--steps",
                 "4", "--optimizer", "adamw", "--hidden", "16", "--no-lone",
                 "--out", str(tmp_path)])
    assert code == 0
    chosen, given = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert {key: chosen["config"][key] for key in ("ratio", "values", "indices")} == (
        thinwire.optim.ADAM_OPTIONS["topk"])
    assert (given["config"]["ratio"], given["config"]["values"]) == (0.02, "native")


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
             "target": 0.9, "coupled": False, "density_per_layer": {}, "test_score": 0.5,
             "metric": "test accuracy", "workload": "digits-mlp", "recipe": {}}

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


@pytest.mark.parametrize(("argv", "expected"), [
    (["--device", "gpu"], "--device 'gpu' must be cpu, cuda or cuda:N"),
    (["--device", f"cuda:{torch.cuda.device_count()}"], "GPU"),
    (["--device", "cpu", "--backend", "nccl"], "--backend nccl needs a GPU; --device cpu"),
])
def test_train_rejects_a_device_it_cannot_use_before_joining_the_job(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")  # as under torchrun; nothing may join a group
    assert main(["train", "--scheme", "dense", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_rank_device_reads_the_local_rank_for_a_bare_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from thinwire.cli.train import rank_device

    assert rank_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("cuda") == torch.device("cuda", 3)
    assert rank_device("cuda:1") == torch.device("cuda", 1)


def _subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = commands.choices[name]
    return sub


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_has_help_that_shows_its_default(command: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    parser = _subcommand(command)
    formatter = HelpFormatter(prog="thinwire")
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help"
        assert "default" in formatter._get_help_string(action), action.option_strings[0]
    with pytest.raises(SystemExit) as caught:
        main([command, "--help"])
    assert caught.value.code == 0
    printed = capsys.readouterr().out
    flags = [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]
    assert printed.count("(default") >= len(flags) - 1  # all but --help


def test_top_level_help_speaks_to_users(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    printed = capsys.readouterr().out
    assert "``" not in printed and "COMMANDS" not in printed and "thinwire." not in printed
    for command in COMMANDS:  # a long name's help starts on the next line
        assert f"\n    {command} " in printed or f"\n    {command}\n" in printed


# The shared vocabulary: what each subcommand must take (train's workers are torchrun's;
# a pipeline's processes are stages x replicas).
VOCABULARY = {
    "compare": ["--steps", "--batch-size", "--workers", "--lr", "--seed", "--option"],
    "train": ["--steps", "--batch-size", "--lr", "--seed", "--option"],
    "pipeline": ["--steps", "--batch-size", "--lr", "--seed", "--boundary-option",
                 "--dp-option", "--epochs"],
    "dad": ["--steps", "--batch-size", "--workers", "--lr", "--seed", "--option", "--epochs"],
    "async": ["--steps", "--batch-size", "--workers", "--lr", "--seed", "--push-option",
              "--epochs"],
}
OLD_SPELLINGS = ["--dp-opt", "--push-opt", "--boundary-opt", "--max-steps", "--passes",
                 "--batch", "--sites"]


@pytest.mark.parametrize("command", list(VOCABULARY))
def test_one_vocabulary_and_no_old_spellings(command: str) -> None:
    flags = {flag for a in _subcommand(command)._actions for flag in a.option_strings
             if a.help != argparse.SUPPRESS}  # old spellings are hidden errors
    assert set(VOCABULARY[command]) | {"--out", "--json", "--timeout"} <= flags
    # dad once counted its workers with --sites; compare and train take it for sites of
    # sharded workers (thinwire.fsdp)
    old = set(OLD_SPELLINGS) - ({"--sites"} if command in ("compare", "train") else set())
    assert not flags & old


@pytest.mark.parametrize(("old", "new"), [(["pipeline", "--dp-opt", "ratio=0.1"], "--dp-option"),
                                          (["async", "--push-opt", "ratio=0.1"], "--push-option"),
                                          (["dad", "--batch", "8"], "--batch-size"),
                                          (["pipeline", "--max-steps", "8"], "--steps"),
                                          (["dad", "--sites", "2"], "--workers"),
                                          (["async", "--passes", "2"], "--epochs")])
def test_old_spellings_are_errors_that_name_the_new_one(old: list[str], new: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(old)
    assert caught.value.code == 2
    assert f"{old[1]} is spelled {new}" in capsys.readouterr().err


def test_old_spellings_stay_out_of_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["dad", "--help"])
    printed = capsys.readouterr().out
    assert "--batch-size" in printed and "--batch " not in printed and "--sites" not in printed


def test_renamed_flags_are_only_answered_where_the_new_one_exists() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps")
    common.add_renamed_flags(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    assert "--max-steps" in flags and "--batch" not in flags and "--sites" not in flags


@pytest.mark.parametrize(("old", "new", "hint"), [
    ("sparsity=0.99", "ratio", "ratio=0.01"), ("include=('fc*',)", "exclude", ""),
    ("start_iter=5", "warmup_steps", "")])
def test_old_option_keys_are_errors_that_name_the_new_key(old: str, new: str, hint: str) -> None:
    @dataclasses.dataclass(frozen=True)
    class Config:
        ratio: float = 0.01
        exclude: tuple[str, ...] = ()
        warmup_steps: int = 0

    with pytest.raises(ValueError, match=f"'{old.split('=')[0]}' is spelled '{new}' now") as error:
        common.parse_options([old], {"x": Config})
    assert hint in str(error.value)


@pytest.mark.parametrize(("argv", "dest", "expected"), [
    (["dad", "--modes", "dad,edad"], "modes", ["dad", "edad"]),
    (["dad", "--ranks", "2,4"], "ranks", [2, 4]),
    (["dad", "--hidden", "16, 8"], "hidden", [16, 8]),
    (["pipeline", "--splits", "bottom.3,top.3"], "splits", ["bottom.3", "top.3"]),
    (["async", "--milestones", "5,8"], "milestones", [5.0, 8.0])])
def test_lists_are_comma_separated_everywhere(argv: list[str], dest: str,
                                              expected: list[object]) -> None:
    assert getattr(build_parser().parse_args(argv), dest) == expected


@pytest.mark.parametrize("argv", [["dad", "--modes", "dad", "edad"],
                                  ["pipeline", "--splits", "bottom.3", "top.3"],
                                  ["async", "--milestones", "5", "8"]])
def test_a_space_separated_list_is_an_error_showing_the_comma_form(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert f"{argv[1]} takes a comma-separated list: {argv[1]} {argv[2]},{argv[3]}" in \
        capsys.readouterr().err


def test_list_elements_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["dad", "--modes", "dad,bogus"])
    assert "--modes 'bogus' is not one of dsgd, dad" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["dad", "--ranks", "2,x"])
    assert "--ranks '2,x'" in capsys.readouterr().err


@pytest.mark.parametrize("command", list(VOCABULARY))
def test_every_subcommand_documents_steps_and_a_per_worker_batch_size(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    printed = " ".join(capsys.readouterr().out.split())
    assert "--steps" in printed
    batch = printed[printed.rindex("--batch-size BATCH_SIZE"):][:300]  # its help, not usage
    assert "per worker" in batch, batch


def test_pipeline_batch_size_is_per_replica() -> None:
    one = config_from(build_parser().parse_args(["pipeline", "--batch-size", "64"]))
    two = config_from(build_parser().parse_args(["pipeline", "--batch-size", "64",
                                                 "--replicas", "2"]))
    assert (one.batch_size, two.batch_size) == (64, 128)
    default = config_from(build_parser().parse_args(["pipeline", "--task", "digits",
                                                     "--replicas", "2"]))
    assert default.batch_size == 2 * 64  # the task's per-replica default
    with pytest.raises(ValueError, match="--batch-size 30 .* --microbatches 4"):
        config_from(build_parser().parse_args(["pipeline", "--batch-size", "30"]))


def test_async_batch_size_is_per_worker_split_over_its_threads() -> None:
    assert async_cli.per_thread_batch(32, 1) == 32
    assert async_cli.per_thread_batch(32, 4) == 8
    with pytest.raises(ValueError, match="--batch-size 30 .* --threads-per-worker 4"):
        async_cli.per_thread_batch(30, 4)


def test_async_steps_bound_each_stream() -> None:
    from thinwire.jobs.ps_task import TaskSpec

    task = TaskSpec(model="linear", batch_size=8, train_limit=64, steps=3).build()
    assert len(list(task.batches(0, 2, passes=2))) == 3
    whole = TaskSpec(model="linear", batch_size=8, train_limit=64).build()
    assert len(list(whole.batches(0, 2, passes=2))) == 8
    with pytest.raises(ValueError, match="steps=0"):
        TaskSpec(steps=0)


def test_schemes_name_shows_one_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schemes", "topk"]) == 0
    printed = capsys.readouterr().out
    assert "\ntopk\n" in printed and "life_span" not in printed and "powersgd" not in printed
    assert main(["schemes", "sketch"]) == 0
    assert "compression=0.5" in capsys.readouterr().out
    assert main(["schemes", "bogus"]) == 2
    error = capsys.readouterr().err
    assert "'bogus' is no scheme (dense, " in error and "boundary (dct-mp" in error


def test_timeout_has_one_default_everywhere() -> None:
    defaults = {name: next(a.default for a in _subcommand(name)._actions
                           if "--timeout" in a.option_strings) for name in VOCABULARY}
    assert len(set(defaults.values())) == 1, defaults


def test_ratio_and_life_span_default_to_each_schemes_own() -> None:
    from thinwire.jobs.compare import scheme_config

    for command in ("compare", "train"):
        args = _subcommand(command).parse_args([])
        assert scheme_config("dct-dp", args.ratio, args.life_span, args.option) == {}
    assert scheme_config("dct-dp", 0.05, 10, []) == {"ratio": 0.05, "life_span": 10}


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("bad input must be rejected before any training starts")


@pytest.mark.parametrize(("argv", "expected"), [
    (["compare", "--schemes", "dense", "--option", "bogus=1"],
     "--option 'bogus' is not an option of dense, ddp; valid keys: delayed, nonfinite"),
    (["train", "--scheme", "topk", "--option", "bogus=1"],
     "--option 'bogus' is not an option of topk, ddp; valid keys: delayed, error_feedback, "),
    (["pipeline", "--boundary", "sketch", "--boundary-option", "bogus=1"],
     "--boundary-option 'bogus' is not an option of sketch; valid keys: compression"),
    (["pipeline", "--replicas", "2", "--dp-scheme", "powersgd", "--dp-option", "bogus=1"],
     "--dp-option 'bogus' is not an option of powersgd; valid keys: error_feedback, "),
    (["async", "--push", "topk", "--push-option", "bogus=1"],
     "--push-option 'bogus' is not an option of topk; valid keys: error_feedback, "),
    (["dad", "--option", "bogus=1"],
     "--option 'bogus' is not an option of dad; valid keys: error_feedback, iterations, "),
])
def test_every_subcommand_rejects_unknown_option_keys_naming_the_valid_ones(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")  # as under torchrun; nothing may join a group
    for module, name in ((compare, "spawn"), (pipeline_cli, "train_local"),
                         (pipeline_cli, "train_engine"), (ps_launch, "_run"),
                         (dad_cli, "run_all")):
        monkeypatch.setattr(module, name, _refuse)
    assert main(argv) == 2
    assert expected in capsys.readouterr().err


def test_option_values_are_python_literals_in_any_case() -> None:
    assert split_option("life-span=10") == ("life_span", 10)
    assert split_option("values=fp16") == ("values", "fp16")
    assert split_option("refresh_above=None") == ("refresh_above", None)
    assert split_option("warm_start=false") == ("warm_start", False)
    assert split_option("exclude=('0.*',)") == ("exclude", ("0.*",))


def test_schemes_lists_each_options_meaning_and_range(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schemes"]) == 0
    printed = capsys.readouterr().out
    assert "fraction of each tensor's entries kept, in (0, 1]" in printed  # dct-dp ratio
    assert "life_span=1000 (int)" in printed
    assert "r, columns of the factors P and Q, >= 1" in printed  # powersgd rank
    assert "ratio=0.01 (float)" in printed and "local-topk" in printed  # inherited comments
    assert "compression=0.5 (float)" in printed  # the pipeline boundaries' options too
    assert "fraction of the width removed by the sketch, in [0, 1)" in printed


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _as_torchrun_rank(monkeypatch: pytest.MonkeyPatch, world_size: int = 1) -> None:
    """The environment torchrun gives rank 0 of ``world_size`` on this machine."""
    for key, value in {"RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)


def test_train_rank_zero_writes_the_run_folder(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _as_torchrun_rank(monkeypatch)
    code = main(["train", "--scheme", "dct-dp", "--steps", "3", "--batch-size", "16",
                 "--backend", "gloo", "--out", str(tmp_path / "run"),
                 "--json", str(tmp_path / "copy.json")])
    assert code == 0
    result = json.loads((tmp_path / "copy.json").read_text())["runs"][0]
    assert result["scheme"] == "dct-dp" and result["steps"] == 3 and result["workers"] == 1
    for name in ("results.json", "results.md", "accuracy_vs_bytes.png", "threshold.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0


def test_train_runs_local_updates_under_torchrun(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _as_torchrun_rank(monkeypatch)
    code = main(["train", "--scheme", "diloco+int8", "--option", "every=2", "--steps", "4",
                 "--batch-size", "16", "--backend", "gloo", "--out", str(tmp_path / "run"),
                 "--json", str(tmp_path / "copy.json")])
    assert code == 0
    result = json.loads((tmp_path / "copy.json").read_text())["runs"][0]
    assert result["scheme"] == "diloco+int8" and result["local"]["syncs"] == 2


def test_train_refuses_local_updates_with_sites_before_joining_the_job(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _as_torchrun_rank(monkeypatch, world_size=4)
    assert main(["train", "--scheme", "diloco", "--sites", "2"]) == 2
    assert "takes no --sites" in capsys.readouterr().err


def test_async_writes_the_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["async", "--rule", "sequential", "--epochs", "1", "--model", "linear",
                 "--train-limit", "64", "--batch-size", "16", "--no-progress",
                 "--out", str(tmp_path / "run"), "--json", str(tmp_path / "copy.json")])
    assert code == 0
    assert "test error" in capsys.readouterr().out
    summary = json.loads((tmp_path / "copy.json").read_text())["runs"][0]
    assert summary["updates"] == 4
    for name in ("results.json", "results.md", "test_error.png", "weights.pt"):
        assert os.path.getsize(tmp_path / "run" / name) > 0


def test_out_defaults_to_a_dated_folder_per_subcommand(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    folder = common.run_folder(None, "dad")
    assert folder.parent == Path("runs") and folder.name.endswith("-dad") and folder.is_dir()


@pytest.mark.parametrize("command", ["compare", "train"])
def test_feedback_reaches_the_run_options(command: str) -> None:
    args = build_parser().parse_args([command, "--feedback", "error"])
    assert run_options(args).feedback == "error"
    assert run_options(build_parser().parse_args([command])).feedback == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--feedback", "ef21"])


def test_schemes_markdown_prints_the_guides_option_tables(
        capsys: pytest.CaptureFixture[str]) -> None:
    from thinwire import schemes as registry

    assert main(["schemes", "topk", "--markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[:2] == ["| `topk` option | default | meaning |", "| --- | --- | --- |"]
    fields = dataclasses.fields(registry.config_class("topk"))
    assert [line.split(" | ")[:2] for line in lines[2:]] == [
        [f"| `{f.name}`", f"`{f.default!r}`"] for f in fields]
    assert main(["schemes", "--markdown"]) == 0  # every scheme's: the guide's schemes.md
    printed = capsys.readouterr().out
    assert all(f"| `{name}` option |" in printed for name in registry.names())
    assert "| `dct-mp` option |" not in printed
    assert main(["schemes", "dct-mp", "--markdown"]) == 0
    assert "| `dct-mp` option |" in capsys.readouterr().out


def test_schemes_kind_lists_one_kind_of_name(capsys: pytest.CaptureFixture[str]) -> None:
    from thinwire import schemes as registry
    from thinwire.pipeline import boundary_kinds

    assert main(["schemes", "--kind", "boundary"]) == 0
    blocks = capsys.readouterr().out.strip().split("\n\n")
    assert [block.splitlines()[0] for block in blocks] == boundary_kinds()
    assert main(["schemes", "--kind", "push", "--markdown"]) == 0
    tables = capsys.readouterr().out.count(" option | default | meaning |")
    assert 0 < tables < len(registry.names())  # clt-k, powersgd: two rounds, no push
    assert main(["schemes", "topk", "--kind", "push"]) == 2
    assert "give a NAME ('topk') or --kind ('push'), not both" in capsys.readouterr().err


def test_async_steps_stop_the_run(tmp_path: Path) -> None:
    code = main(["async", "--rule", "sequential", "--epochs", "5", "--steps", "3",
                 "--model", "linear", "--train-limit", "64", "--batch-size", "16",
                 "--no-progress", "--out", str(tmp_path / "run"),
                 "--json", str(tmp_path / "copy.json")])
    assert code == 0
    summary = json.loads((tmp_path / "copy.json").read_text())["runs"][0]
    assert summary["updates"] == 3  # not 5 epochs x 4 batches


@pytest.mark.parametrize(("argv", "expected"), [
    (["--fault-tolerant"], "--fault-tolerant needs --replica-id N"),
    (["--fault-tolerant", "--replica-id", "-1"], "--replica-id -1 must be >= 0"),
    (["--fault-tolerant", "--replica-id", "0", "--sites", "2"], "takes no --sites"),
    (["--fault-tolerant", "--replica-id", "0", "--option", "bogus=1"], "'bogus' is not"),
    (["--fault-tolerant", "--replica-id", "0"], "--fault-tolerant needs --out DIR"),
    (["--fault-tolerant", "--replica-id", "0", "--heartbeat-timeout", "0"],
     "--heartbeat-timeout 0 must be > 0"),
    (["--lighthouse", "http://host:29510"], "--lighthouse needs --fault-tolerant"),
    (["--replica-id", "0"], "--replica-id needs --fault-tolerant"),
])
def test_fault_tolerant_train_rejects_bad_flags_before_joining_anything(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--scheme", "dct-dp", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_a_fault_tolerant_job_that_is_over_takes_no_relaunched_worker(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A worker relaunched into a job that committed its last step stops before it connects,
    naming the step and the record, and leaves the results written before it as they are."""
    pytest.importorskip("torchft")
    from thinwire.elastic import JobRecord

    JobRecord(tmp_path / "job.json", steps=20, worker="worker0",
              where=str(tmp_path / "worker-0")).write(21, 20, "0123456789abcdef")
    results = tmp_path / "worker-0" / "results.json"
    results.parent.mkdir()
    results.write_text("the first life's results")
    code = main(["train", "--fault-tolerant", "--replica-id", "0", "--out", str(tmp_path),
                 "--lighthouse", "http://localhost:1", "--scheme", "diloco+int4",
                 "--steps", "20", "--device", "cpu"])
    error = capsys.readouterr().err
    assert code == 1 and "step 20 already" in error and "the job is over" in error
    assert str(tmp_path / "job.json") in error
    assert results.read_text() == "the first life's results"
