"""The shaped-link harness's pure parts: shaping, commands, floors, projections, the report.

Nothing here needs root or creates a namespace; one test trains two local
gloo ranks (no namespaces) to check the PyTorch anchors' byte accounting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from benchmarks import overhead, report
from benchmarks.machine import CpuWatch, busy_seconds
from benchmarks.netem import harness, net
from benchmarks.netem.anchors import ANCHORS, powersgd_bytes
from benchmarks.netem.summary import (
    derive,
    floor_s,
    median_runs,
    reference_rows,
    same_trajectory,
    speedups,
)
from benchmarks.netem.worker import (
    WireMeter,
    global_weights,
    label_of,
    shaper_bytes,
    task,
    train,
    window_traffic,
)
from thinwire import schemes
from thinwire.comm import Meter
from thinwire.launch import spawn
from thinwire.models.mlp import mlp

PREFIX = "tw-4242"


# Shaping ------------------------------------------------------------------------------------

def test_tbf_burst_is_a_millisecond_of_traffic_and_the_queue_a_tenth_of_a_second() -> None:
    tbf = net.tbf_for(1e8)
    assert (tbf.burst_bytes, tbf.limit_bytes) == (12_500, 1_250_000 + 12_500)
    assert tbf.args() == ["rate", "100000000bit", "burst", "12500", "limit", "1262500"]
    assert net.tbf_for(1e9).burst_bytes == 125_000
    assert net.tbf_for(1e6).burst_bytes == net.TBF_MIN_BURST  # never below two frames
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="rate_bps="):
            net.tbf_for(bad)


def _args(*argv: str) -> argparse.Namespace:
    return harness.resolve(harness.build_parser().parse_args(list(argv)))


def test_rates_and_worker_counts_are_parsed_and_checked() -> None:
    args = _args("--rates", "1gbit, 100mbit", "--workers", "2,4")
    assert args.rate_bps == [1e9, 1e8] and args.worker_list == [2, 4]
    assert (args.cap_s, args.max_steps) == (harness.FULL["cap_s"], harness.FULL["max_steps"])
    quick = _args("--quick")
    assert quick.rate_list == ["100mbit"] and quick.cap_s == harness.QUICK["cap_s"]
    assert _args("--quick", "--cap-s", "3").cap_s == 3  # explicit flags win
    for argv, bad in ((["--rates", "fast"], "bandwidth="), (["--workers", "1"], "workers="),
                      (["--workers", "two"], "workers="), (["--target", "1.5"], "target="),
                      (["--cap-s", "0"], "cap_s=")):
        with pytest.raises(ValueError, match=bad):
            _args(*argv)


# Commands -----------------------------------------------------------------------------------

def _namespaces_touched(command: list[str]) -> list[str]:
    if command[:3] in (["ip", "netns", "add"], ["ip", "netns", "del"]):
        return [command[3]]
    assert command[1] == "-n", f"runs in the caller's namespace: {command}"
    touched = [command[2]]
    if "netns" in command:  # a veth peer placed into another namespace
        touched.append(command[command.index("netns") + 1])
    return touched


def test_workload_flag_takes_the_workloads_recipe_and_explicit_flags_win() -> None:
    demo = _args()
    assert (demo.workload, demo.optimizer, demo.lr, demo.batch_size, demo.target) == (
        harness.DEMO, "sgd", 0.05, 32, 0.95)
    dlrm = _args("--workload", "dlrm-click")
    recipe = harness.recipe("dlrm-click")  # the workload's own, not the demo's
    assert recipe["optimizer"] == "sgd" and recipe["lr"] != demo.lr
    assert (dlrm.optimizer, dlrm.lr, dlrm.momentum, dlrm.batch_size, dlrm.target) == (
        recipe["optimizer"], recipe["lr"], recipe["momentum"], recipe["batch_size"],
        recipe["target"])
    transformer = _args("--workload", "transformer-digits", "--lr", "0.002", "--target", "0.5")
    assert (transformer.optimizer, transformer.lr, transformer.target) == ("adamw", 0.002, 0.5)
    options = harness.worker_options(transformer)
    assert (options["workload"], options["optimizer"]) == ("transformer-digits", "adamw")
    with pytest.raises(SystemExit):
        harness.build_parser().parse_args(["--workload", "imagenet"])


def test_a_workload_task_trains_its_own_model_on_its_shard() -> None:
    options = harness.worker_options(_args("--workload", "digits-mlp"))
    job = task(options, rank=1, world_size=2)
    loss = job.loss(job.model)
    loss.backward()
    assert loss.ndim == 0 and math.isfinite(float(loss.detach())) and job.compute_s > 0
    assert all(p.grad is not None for p in job.model.parameters())
    assert 0.0 <= job.accuracy() <= 1.0


def test_setup_touches_only_its_own_namespaces_and_addresses() -> None:
    commands = net.setup_commands(PREFIX, 3)
    bridge, workers = net.names(PREFIX, 3)
    assert workers == [f"{PREFIX}-w0", f"{PREFIX}-w1", f"{PREFIX}-w2"]
    for command in commands:
        assert all(ns.startswith(PREFIX) for ns in _namespaces_touched(command)), command
    addresses = [c[c.index("add") + 1] for c in commands if c[3:5] == ["addr", "add"]]
    assert addresses == ["10.77.0.1/24", "10.77.0.2/24", "10.77.0.3/24"]
    for ns in [bridge, *workers]:  # loopback up everywhere
        assert ["ip", "-n", ns, "link", "set", "lo", "up"] in commands
    veths = [c for c in commands if "veth" in c]
    assert len(veths) == 3 and all(c[c.index("netns") + 1] == bridge for c in veths)
    with pytest.raises(ValueError, match="prefix="):
        net.names("lab-1", 2)
    with pytest.raises(ValueError, match="workers="):
        net.names(PREFIX, 0)


def test_every_link_is_shaped_in_both_directions() -> None:
    commands = net.shape_commands(PREFIX, 2, 1e8)
    assert len(commands) == 4
    devices = {(c[2], c[6]) for c in commands}
    assert devices == {(f"{PREFIX}-w0", "eth0"), (f"{PREFIX}-w1", "eth0"),
                       (f"{PREFIX}-br", "w0"), (f"{PREFIX}-br", "w1")}
    for command in commands:
        assert command[3:5] == ["qdisc", "replace"] and "tbf" in command
        assert command[command.index("rate") + 1] == "100000000bit"


def test_the_congestion_control_is_read_inside_a_worker_namespace() -> None:
    assert net.congestion_control_command(f"{PREFIX}-w0") == [
        "ip", "netns", "exec", f"{PREFIX}-w0", "cat",
        "/proc/sys/net/ipv4/tcp_congestion_control"]


def test_teardown_deletes_workers_before_the_bridge() -> None:
    created = [f"{PREFIX}-br", f"{PREFIX}-w0", f"{PREFIX}-w1"]
    assert net.teardown_commands(created) == [
        ["ip", "netns", "del", f"{PREFIX}-w0"], ["ip", "netns", "del", f"{PREFIX}-w1"],
        ["ip", "netns", "del", f"{PREFIX}-br"]]


def test_cleanup_finds_only_our_leftovers_of_finished_runs() -> None:
    listing = (f"{PREFIX}-w0 (id: 2)\n{PREFIX}-br (id: 1)\ntw-7-w0\nblue (id: 0)\n"
               "tw-x-br\n\n")
    assert net.leftovers(listing) == [f"{PREFIX}-w0", f"{PREFIX}-br", "tw-7-w0", "tw-x-br"]
    assert net.leftovers(listing, alive={4242}) == ["tw-7-w0", "tw-x-br"]


def test_workers_start_in_their_namespace_bound_to_the_veth() -> None:
    command = harness.worker_command(f"{PREFIX}-w1", "/usr/bin/python3", 1, 2, 29501,
                                     Path("spec.json"), Path("out"))
    assert command[:4] == ["ip", "netns", "exec", f"{PREFIX}-w1"]
    assert command[4:7] == ["/usr/bin/python3", "-m", "benchmarks.netem.worker"]
    assert command[command.index("--init-method") + 1] == "tcp://10.77.0.1:29501"
    env = harness.worker_env()
    assert env["GLOO_SOCKET_IFNAME"] == net.WORKER_IF == "eth0"
    assert str(harness.REPO) in env["PYTHONPATH"].split(":")


def test_only_complete_result_lines_are_read(tmp_path: Path) -> None:
    lines = tmp_path / "results.jsonl"
    assert harness.finished(lines) == []
    lines.write_text('{"scheme": "a"}\n{"scheme": "b"}\n{"sche')  # rank 0 mid-write
    assert [r["scheme"] for r in harness.finished(lines)] == ["a", "b"]


def test_without_root_it_explains_and_exits_non_zero(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(net.os, "geteuid", lambda: 1000)
    assert harness.main(["--quick"]) == 2
    assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(net.os, "geteuid", lambda: 0)
    monkeypatch.setattr(net.shutil, "which", lambda tool: None if tool == "tc" else "/bin/ip")
    assert "'tc'" in (net.missing_requirements() or "")


def test_unregistered_schemes_are_skipped_with_a_note() -> None:
    entries, notes = harness.plan(_args("--schemes", "torch-dense,dct-dp,no-such-scheme",
                                        "--ratio", "0.1"))
    assert [e["name"] for e in entries] == ["torch-dense", "dct-dp"]
    assert entries[1]["config"] == {"ratio": 0.1, "life_span": 1000}  # dct-dp's own
    assert len(notes) == 1 and "no-such-scheme" in notes[0]
    tuned, _ = harness.plan(_args("--schemes", "dct-dp", "--option", "life_span=7"))
    assert tuned[0]["config"]["life_span"] == 7
    every, _ = harness.plan(_args("--schemes", "all"))
    assert [e["name"] for e in every] == [*ANCHORS, *schemes.names()]  # new ones join as is
    with pytest.raises(ValueError, match="ratio="):  # bad options fail before any namespace
        harness.plan(_args("--schemes", "dct-dp", "--ratio", "1.5"))


def test_a_variant_runs_a_scheme_with_its_own_options_under_its_label() -> None:
    entries, _ = harness.plan(_args("--schemes", "dct-dp,dct-dp:capacity=1.5:life_span=9",
                                    "--option", "life_span=7"))
    assert [label_of(e) for e in entries] == ["dct-dp", "dct-dp:capacity=1.5:life_span=9"]
    assert [e["name"] for e in entries] == ["dct-dp", "dct-dp"]
    assert entries[0]["config"]["life_span"] == 7 and "capacity" not in entries[0]["config"]
    assert entries[1]["config"]["capacity"] == 1.5 and entries[1]["config"]["life_span"] == 9
    with pytest.raises(ValueError, match="no option capacityy"):  # a typo is not ignored
        harness.plan(_args("--schemes", "dct-dp:capacityy=4"))
    with pytest.raises(ValueError, match="capacity=0.5"):
        harness.plan(_args("--schemes", "dct-dp:capacity=0.5"))
    with pytest.raises(ValueError, match="takes no options"):
        harness.plan(_args("--schemes", "torch-powersgd:rank=4"))


def test_local_updates_are_planned_with_their_own_and_their_schemes_options() -> None:
    entries, notes = harness.plan(_args("--schemes",
                                        "diloco,diloco+int4:every=10:fragments=2:delay=4"))
    assert not notes and [label_of(e) for e in entries] == [
        "diloco", "diloco+int4:every=10:fragments=2:delay=4"]
    assert entries[1]["name"] == "diloco+int4"
    assert entries[1]["config"] == {"every": 10, "fragments": 2, "delay": 4}
    with pytest.raises(ValueError, match="no option rank"):  # int4 has no rank
        harness.plan(_args("--schemes", "diloco+int4:rank=2"))
    with pytest.raises(ValueError, match="delay"):  # a delay no fragment's spacing allows
        harness.plan(_args("--schemes", "diloco:every=10:fragments=2:delay=5"))


def test_a_local_update_run_is_judged_on_its_global_weights() -> None:
    model = mlp(4, 8, 1, classes=2)
    own = {k: p.detach().clone() for k, p in model.named_parameters()}

    class Updates:  # what global_weights reads of LocalUpdates
        def global_state(self) -> dict[str, Any]:
            return {k: v + 1.0 for k, v in own.items()}

    with global_weights(model, Updates()):  # type: ignore[arg-type]
        assert all(torch.equal(p, own[k] + 1.0) for k, p in model.named_parameters())
    assert all(torch.equal(p, own[k]) for k, p in model.named_parameters())
    with global_weights(model, None):  # per-step schemes: the model as it is
        assert all(torch.equal(p, own[k]) for k, p in model.named_parameters())


# Floors and projections ---------------------------------------------------------------------

def test_floor_is_compute_plus_the_busier_direction_over_the_rate() -> None:
    assert floor_s(0.02, 1_250_000, 10, 1e8) == pytest.approx(0.02 + 0.1)
    assert floor_s(0.0, 10, 2_500_000, 1e9) == pytest.approx(0.02)
    with pytest.raises(ValueError, match="rate_bps="):
        floor_s(0.1, 1, 1, 0)
    with pytest.raises(ValueError, match="sent_bytes=-1"):
        floor_s(0.1, -1, 1, 1e6)


def _run(scheme: str, rate: str, rate_bps: float, workers: int, step_s: float,
         sent: float, reached: int | None, steps: int, losses: list[float]) -> dict[str, Any]:
    return {"scheme": scheme, "kind": "torch" if scheme.startswith("torch") else "thinwire",
            "status": "ok", "rate": rate, "rate_bps": rate_bps, "workers": workers,
            "steps": steps, "median_step_s": step_s, "p10_step_s": step_s * 0.9,
            "p90_step_s": step_s * 1.2, "train_s": steps * step_s, "compute_s": 0.02,
            "overhead_s_per_step": 0.001, "bytes_handed_per_step": sent,
            "wire_sent_per_step": sent, "bytes_received_per_step": sent,
            "shaper_tx_per_step": sent * 1.05, "shaper_rx_per_step": sent * 1.04,
            "dense_bytes": 17_399_848, "reached_step": reached,
            "reached_train_s": None if reached is None else reached * step_s,
            "final_accuracy": 0.9, "curve": [[steps, steps * step_s, 0.9]], "losses": losses,
            "window_first_step": 4}


def _runs() -> list[dict[str, Any]]:
    losses = [2.3, 1.9, 1.5, 1.2, 1.0, 0.8]
    return [
        _run("torch-dense", "1gbit", 1e9, 2, 0.16, 17_399_848, 50, 50, losses),
        _run("dct-dp", "1gbit", 1e9, 2, 0.05, 150_000, 200, 200, losses),
        _run("torch-dense", "100mbit", 1e8, 2, 1.5, 17_399_848, None, 20, losses[:4]),
        {**_run("dct-dp", "100mbit", 1e8, 2, 0.06, 150_000, 200, 200, losses),
         "threshold_refreshes": {"0.weight": 2, "2.weight": 4}},
        _run("topk", "100mbit", 1e8, 2, 0.07, 348_000, None, 100, [9.0]),
    ]


def test_time_to_target_is_measured_or_projected_from_the_same_schemes_steps() -> None:
    runs = derive(_runs())
    dense_fast, dct_fast, dense_slow, dct_slow, topk = runs
    assert dct_slow["time_to_target_kind"] == "measured"
    assert dct_slow["time_to_target_s"] == pytest.approx(200 * 0.06)
    assert dense_slow["time_to_target_kind"] == "projected"
    assert dense_slow["steps_to_target"] == 50 and dense_slow["projected_from"] == "1gbit"
    assert dense_slow["time_to_target_s"] == pytest.approx(20 * 1.5 + 30 * 1.5)
    assert dense_slow["trajectory_matches"] is True
    assert topk["time_to_target_kind"] == "not reached" and topk["time_to_target_s"] is None
    floor = 0.02 + 8 * 150_000 / 1e8
    assert dct_slow["floor_s"] == pytest.approx(floor)
    assert dct_slow["floor_ratio"] == pytest.approx(0.06 / floor)
    assert dct_slow["wire_floor_s"] == pytest.approx(0.02 + 8 * 157_500 / 1e8)
    assert dct_slow["wire_floor_ratio"] == pytest.approx(0.06 / dct_slow["wire_floor_s"])
    assert derive([{**_runs()[0], "shaper_tx_per_step": None,
                    "shaper_rx_per_step": None}])[0]["wire_floor_s"] is None
    ratios = speedups(runs, "torch-dense")
    assert ratios[("100mbit", 2, "dct-dp")] == pytest.approx(75.0 / 12.0)
    assert ("100mbit", 2, "topk") not in ratios
    assert same_trajectory([1.0, 2.0], [1.0, 2.0, 3.0])
    assert not same_trajectory([1.0, 2.5], [1.0, 2.0]) and not same_trajectory([], [1.0])


def test_reference_rows_come_from_dense_alone_and_dense_with_free_links() -> None:
    recipe = {"workload": "demo", "optimizer": "sgd", "lr": 0.05, "momentum": 0.9,
              "batch_size": 32, "seed": 0, "target": 0.95, "hidden": 2048, "depth": 2}
    runs = derive([{**run, "recipe": recipe} for run in _runs()])
    lone = {**_run("torch-dense", "-", 1.0, 1, 0.02, 0, 90, 90, [1.0]), "recipe": recipe}
    rows = reference_rows(runs, lone)
    assert {(r["scheme"], r["rate"]) for r in rows} == {
        (name, rate) for name in ("lone worker", "compute-only bound")
        for rate in ("1gbit", "100mbit")}
    for row in rows:  # the same recipe and seed as the schemes beside them
        assert row["recipe"] == recipe == runs[0]["recipe"]
    bound = {r["rate"]: r for r in rows if r["scheme"] == "compute-only bound"}
    # dense's steps at 2 workers (projected at 100mbit from 1gbit's) x the compute step
    assert bound["1gbit"]["time_to_target_s"] == pytest.approx(50 * 0.02)
    assert bound["100mbit"]["time_to_target_s"] == pytest.approx(50 * 0.02)
    assert bound["1gbit"]["bound_multiple"] == 1.0
    alone = next(r for r in rows if r["scheme"] == "lone worker")
    assert (alone["workers"], alone["time_to_target_s"]) == (1, pytest.approx(90 * 0.02))
    dct_slow = runs[3]
    assert dct_slow["bound_multiple"] == pytest.approx(200 * 0.06 / (50 * 0.02))
    assert runs[4]["bound_multiple"] is None  # topk never reached the target
    for row in reference_rows(runs, None):  # no lone run: its row has no time
        assert row["scheme"] == "compute-only bound" or row["time_to_target_s"] is None


def test_rounds_collapse_to_each_schemes_median_run() -> None:
    losses = [2.3, 1.9]
    rounds = [  # dct-dp reaches the target at 30, never, 10 s; dense at 20, 40 s
        _run("dct-dp", "100mbit", 1e8, 2, 0.3, 150_000, 100, 100, losses),
        _run("torch-dense", "100mbit", 1e8, 2, 0.2, 17_399_848, 100, 100, losses),
        _run("dct-dp", "100mbit", 1e8, 2, 0.5, 150_000, None, 100, losses),
        _run("torch-dense", "100mbit", 1e8, 2, 0.4, 17_399_848, 100, 100, losses),
        _run("dct-dp", "100mbit", 1e8, 2, 0.1, 150_000, 100, 100, losses),
        {"scheme": "topk", "status": "failed", "rate": "100mbit", "workers": 2},
    ]
    runs = median_runs(derive(rounds))
    assert [run["scheme"] for run in runs] == ["dct-dp", "torch-dense", "topk"]
    dct, dense, topk = runs
    assert dct["median_step_s"] == 0.3  # the whole median run, not a mix of fields
    assert dct["time_to_target_rounds_s"] == pytest.approx([30.0, None, 10.0])
    assert dense["time_to_target_s"] == pytest.approx(20.0)  # lower median of two
    assert topk["status"] == "failed"
    assert speedups(runs, "torch-dense")[("100mbit", 2, "dct-dp")] == pytest.approx(20 / 30)
    assert median_runs(rounds[:2]) == rounds[:2]  # one round: as it was


def test_window_traffic_leaves_the_warm_up_steps_out() -> None:
    meter = Meter(rank=0, world_size=2)
    for step in range(5):
        meter.record("W_grad", "w", "all_reduce", 1000 if step < 2 else 100)
        meter.next_step()
    traffic = window_traffic(meter, first_step=2)
    assert traffic["bytes_handed_per_step"] == 100
    assert traffic["wire_sent_per_step"] == 100  # 2 (n - 1) / n = 1 for two workers
    assert shaper_bytes("no-such-interface0") is None
    wire = WireMeter("no-such-interface0", None, host=1)
    assert wire.port == "w1"
    wire.begin()
    assert wire.per_step(10)[:2] == (None, None)  # no shaper outside the harness


# PyTorch's hooks ----------------------------------------------------------------------------

def test_powersgd_bytes_follow_the_hooks_compression_test() -> None:
    shapes = [tuple(p.shape) for p in mlp(64, 2048, 2).parameters()]
    unc, p_bytes, q_bytes = powersgd_bytes(shapes, rank=2, min_compression_rate=2)
    # (2048, 64), (2048, 2048) and (10, 2048) compress; biases do not.
    assert unc == 4 * (2048 + 2048 + 10)
    assert p_bytes == 4 * 2 * (2048 + 2048 + 10) and q_bytes == 4 * 2 * (64 + 2048 + 2048)
    for shape in shapes:  # the same decision as torch's own helper
        n, m = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
        compressed = powersgd_bytes([shape], 2, 2)[0] == 0
        assert compressed == _should_compress(n, m, min(n, m, 2), 2)[0]


def _train_anchors(rank: int, world_size: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    return [train({"name": name, "config": config}, options)
            for name, config in (("torch-dense", {}), ("torch-fp16", {}),
                                 ("torch-powersgd", {}),
                                 ("dct-dp", {"ratio": 0.1, "life_span": 5}))]


def test_anchors_train_in_step_and_count_what_their_hooks_send() -> None:
    options = {"hidden": 48, "depth": 2, "batch_size": 16, "lr": 0.05, "momentum": 0.9,
               "seed": 0, "target": 0.99, "eval_every": 4, "max_steps": 8, "cap_s": 60.0,
               "warmup": 3, "min_steps": 8, "rank": 2, "timeout_s": 60, "threads": 1,
               "interface": "no-such-interface0"}
    per_rank = spawn(_train_anchors, 2, options, timeout_s=120.0)
    shapes = [tuple(p.shape) for p in mlp(64, 48, 2).parameters()]
    numel = sum(math.prod(s) for s in shapes)
    dense, fp16, powersgd, dct = per_rank[0]
    for result in per_rank[0]:
        assert result["status"] == "ok" and result["steps"] == 8, result.get("note")
    assert dense["bytes_handed_per_step"] == 4 * numel
    assert fp16["bytes_handed_per_step"] == 2 * numel
    assert powersgd["bytes_handed_per_step"] == sum(powersgd_bytes(shapes, 2, 2))
    assert powersgd["bytes_per_entity"]["factor"] > 0
    assert dct["bytes_handed_per_step"] < dense["bytes_handed_per_step"]
    for mine, theirs in zip(per_rank[0], per_rank[1]):  # same stops, same replicas
        assert [c[0] for c in mine["curve"]] == [c[0] for c in theirs["curve"]]
        assert [c[2] for c in mine["curve"]] == [c[2] for c in theirs["curve"]]


# The report ---------------------------------------------------------------------------------

def _netem_record(load: float) -> dict[str, Any]:
    return {"command": "python -m benchmarks.netem --rates 1gbit,100mbit --workers 2",
            "date": "2026-01-02 03:04 UTC",
            "machine": {"cpu": "Test CPU", "cores": 2, "kernel": "6.1", "python": "3.11",
                        "torch": "2.13.0"},
            "load_before": [load, load, load], "load_after": [1.0, 1.0, 1.0], "quick": False,
            "options": {"hidden": 2048, "depth": 2, "batch_size": 32, "lr": 0.05,
                        "momentum": 0.9, "seed": 0, "target": 0.95, "eval_every": 10,
                        "rank": 2},
            "sparsity": 0.99, "life_span": 100, "rates": ["1gbit", "100mbit"], "workers": [2],
            "notes": ["skipping 'clt-k': not registered in this build of thinwire"],
            "tbf": {"1gbit": vars(net.tbf_for(1e9)), "100mbit": vars(net.tbf_for(1e8))},
            "link_check": {"100mbit": 95.6e6}, "tcp_congestion_control": "cubic",
            "qdisc": {"1gbit-2w": {"a:eth0": {"bytes": 10, "drops": 0, "overlimits": 1}},
                      "100mbit-2w": {"a:eth0": {"bytes": 10, "drops": 3, "overlimits": 1}}},
            "runs": derive(_runs()) + [{"scheme": "torch-powersgd", "status": "failed",
                                        "note": "no result", "rate": "1gbit", "workers": 2}]}


def _overhead_record() -> dict[str, Any]:
    seconds = {"1000000": {"dense": 0.001, "topk": 0.01, "dct_L1000": 0.002,
                           "scheme clt-k": 0.012}}
    return {"command": "python -m benchmarks.overhead --sizes 1000000", "machine": "Test CPU",
            "date": "2026-01-02 03:00", "cores": 2, "load_before": [0.1, 0.1, 0.1],
            "seconds": seconds,
            "ratio_vs_topk": {n: {k: v / r["topk"] for k, v in r.items()}
                              for n, r in seconds.items()}}


def test_report_renders_tables_and_figures_from_results_files(tmp_path: Path) -> None:
    netem_file = tmp_path / "netem.json"
    netem_file.write_text(json.dumps(_netem_record(load=3.5)))
    overhead_file = tmp_path / "overhead.json"
    overhead_file.write_text(json.dumps(_overhead_record()))
    docs = tmp_path / "docs"
    docs.mkdir()
    assert report.main(["--netem", str(netem_file), "--overhead", str(overhead_file),
                        "--docs", str(docs)]) == 0
    page = (docs / "results.md").read_text()
    assert "python -m benchmarks.netem --rates 1gbit,100mbit --workers 2" in page
    assert "Test CPU, 2 cores" in page and "2026-01-02 03:04 UTC" in page
    assert "Machine activity: 1-minute load average 3.5 before the run." in page
    assert "**Provisional:** the machine was loaded (1-minute load average 3.5" in page
    assert "| dct-dp | 10.00 m @200 (0.8x / -) | 12.00 m @200 (6.2x / -) |" in page
    assert "| torch-dense | 8.00 m @50 (1.0x / -) | 75.00 p @50 (1.0x / -) |" in page
    assert "not reached (100 steps)" in page
    assert "thresholds recomputed on 2 %" in page  # 6 of 2 tensors x 200 steps
    assert "| 100mbit | 12,500 | 1,262,500 | 95.6 Mbit/s (0.956 of the rate) |" in page
    assert "Packets the shapers dropped: 1gbit-2w 0, 100mbit-2w 3." in page
    assert "The workers' TCP congestion control: cubic (the machine's default)." in page
    assert "torch-powersgd at 1gbit, 2 workers: failed (no result)" in page
    assert "skipping 'clt-k'" in page
    assert "| scheme clt-k | 12.00 (1.20x) |" in page
    for name in ("time_to_accuracy", "step_vs_floor", "bytes_vs_workers", "overhead"):
        assert (docs / "figures" / f"{name}.png").stat().st_size > 0
        assert f"figures/{name}.png" in page
    assert json.loads((docs / "data" / "netem.json").read_text())["rates"] == ["1gbit",
                                                                             "100mbit"]


def test_report_adds_a_column_per_shipped_workload_run(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "data").mkdir(parents=True)
    record = _netem_record(load=0.2)
    record["options"] |= {"workload": "dlrm-click", "optimizer": "sgd", "target": 0.79}
    record["runs"] = [run for run in record["runs"] if run.get("rate") == "100mbit"
                      or run["status"] != "ok"]
    record["rates"] = ["100mbit"]
    (docs / "data" / "netem-workload-dlrm-click.json").write_text(json.dumps(record))
    page = report.render(None, None, docs)
    assert "## Time to target on the workload matrix" in page
    assert "| scheme | dlrm-click (100mbit, 2 workers) |" in page
    assert "- dlrm-click: sgd lr 0.05 momentum 0.9, batch 32 per worker, target 79.0%." in page
    assert "| dct-dp | 12.00 m @200 |" in page  # no torch-powersgd here: no ratio
    assert "not reached (100 steps)" in page
    slower = [{**run, "time_to_target_s": 3 * run["time_to_target_s"]}
              for run in record["runs"] if run.get("time_to_target_s")]
    record |= {"rounds": 3, "runs": record["runs"] + slower + slower}
    (docs / "data" / "netem-workload-dlrm-click.json").write_text(json.dumps(record))
    page = report.render(None, None, docs)
    assert "target 79.0%, median of 3 rounds." in page
    assert "| dct-dp | 36.00 m @200 |" in page  # the median round: 12, 36, 36 s


def test_report_compares_dct_dp_pieces_round_by_round(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "data").mkdir(parents=True)
    record = _netem_record(load=0.2)
    rounds = [{**_run(label, "100mbit", 1e8, 2, step_s, 150_000, 100, 100, [2.0, 1.0]),
               **({"streaming": {"fc.weight": True}} if label == "dct-dp" else {})}
              for step_s, label in ((0.052, "dct-dp"), (0.06, "dct-dp:piece=0"),
                                    (0.048, "dct-dp"), (0.055, "dct-dp:piece=0"),
                                    (0.05, "dct-dp"), (0.058, "dct-dp:piece=0"))]
    failed = {"scheme": "dct-dp", "status": "failed", "note": "hang", "rate": "100mbit",
              "workers": 2}
    record |= {"rates": ["100mbit"], "rounds": 3, "runs": derive(rounds) + [failed]}
    (docs / "data" / "netem-pieces.json").write_text(json.dumps(record))
    fast = {**record, "command": "python -m benchmarks.netem --rates 1gbit", "rates": ["1gbit"],
            "runs": derive([{**_run("dct-dp", "1gbit", 1e9, 2, 0.03, 150_000, 100, 100, [1.0]),
                             "streaming": {"fc.weight": False}}])}
    (docs / "data" / "netem-pieces-auto.json").write_text(json.dumps(fast))
    page = report.render(None, None, docs)
    assert "## dct-dp in pieces" in page and record["command"] in page
    # The median round (by time to target) gives the ratio and the time: 0.05 s a step.
    assert ("| 100mbit, 2 workers | dct-dp | 50.0 (48.0, 50.0, 52.0) | 1.56 | 1.0 | 150,000 "
            "| 5.00 s @100 | pieces |") in page
    assert "| 100mbit, 2 workers | dct-dp:piece=0 | 58.0 (55.0, 58.0, 60.0) | 1.81 |" in page
    assert "python -m benchmarks.netem --rates 1gbit" in page  # every file, in name order
    assert page.index("--rates 1gbit") < page.index(record["command"])
    assert "| 1gbit, 2 workers | dct-dp | 30.0 (30.0) |" in page and "| one payload |" in page
    assert "predate `stream`" not in page
    for run in fast["runs"]:
        del run["streaming"]
    (docs / "data" / "netem-pieces-auto.json").write_text(json.dumps(fast))
    assert report.render(None, None, docs).count("These runs predate `stream`") == 1


def test_cpu_used_by_others_is_busy_time_less_our_own() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    stat = f"cpu  {3 * ticks} {ticks} {2 * ticks} {50 * ticks} 7 {ticks} {ticks} 0 0 0\ncpu0 1\n"
    assert busy_seconds(stat) == pytest.approx(6.0)  # user + nice + system (+ steal 0)
    assert busy_seconds("intr 1 2\n") is None
    share = CpuWatch().others_share()
    assert share is None or 0.0 <= share


def test_report_without_results_says_how_to_make_them(tmp_path: Path) -> None:
    page = report.render(None, None, tmp_path)
    assert "sudo python -m benchmarks.netem" in page and "python -m benchmarks.overhead" in page
    quiet = _netem_record(load=0.2)
    assert report.provisional(quiet) is None
    assert "--quick" in (report.provisional({**quiet, "quick": True}) or "")
    assert "other processes used 30 %" in (report.provisional(
        {**quiet, "others_cpu_share": 0.3}) or "")
    assert report.provisional({**quiet, "others_cpu_share": 0.05}) is None
    # Measured over the run, the share decides; a load left by the run before does not.
    assert report.provisional({**_netem_record(load=3.5), "others_cpu_share": 0.05}) is None


# The overhead benchmark's scheme rows -------------------------------------------------------

def test_overhead_times_registered_schemes_and_skips_the_rest() -> None:
    assert overhead.matrix_shape(1_000_000) == (1000, 1000)
    assert overhead.matrix_shape(25_000_000) == (5000, 5000)
    assert overhead.matrix_shape(7) == (1, 7)
    assert overhead.scheme_available("topk") is None
    assert "not registered" in (overhead.scheme_available("no-such-scheme") or "")
    assert overhead.measure_scheme("dct-dp", 4096, 0.01, 10, 2, repeats=2) > 0


def test_report_falls_back_to_the_data_the_page_ships(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "data").mkdir(parents=True)
    shipped = json.dumps(_netem_record(load=0.2), indent=1)
    (docs / "data" / "netem.json").write_text(shipped)
    (docs / "data" / "overhead.json").write_text(json.dumps(_overhead_record()))
    assert report.main(["--results", str(tmp_path / "empty"), "--docs", str(docs)]) == 0
    page = (docs / "results.md").read_text()
    assert "| dct-dp | 10.00 m @200" in page and "| scheme clt-k | 12.00 (1.20x) |" in page
    assert (docs / "data" / "netem.json").read_text() == shipped  # read, not rewritten


def test_report_adds_the_gpu_overhead_run_with_floor_ratios(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    (docs / "data").mkdir(parents=True)
    assert "on a GPU" not in report.render(None, None, docs)
    record = _overhead_record()
    record["seconds"]["1000000"]["floor scheme clt-k"] = 0.006
    record["ratio_vs_topk"]["1000000"]["floor scheme clt-k"] = 0.6
    record["ratio_vs_floor"] = {"1000000": {"scheme clt-k": 2.0}}
    record["machine"] = "Test CPU, Test GPU"
    (docs / "data" / "overhead-cuda.json").write_text(json.dumps(record))
    page = report.render(None, None, docs)
    assert "## Compression overhead per step on a GPU" in page
    assert "| scheme clt-k | 12.00 (1.20x; 2.00x floor) |" in page
    assert (docs / "figures" / "overhead-cuda.png").stat().st_size > 0
