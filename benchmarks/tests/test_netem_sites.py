"""The shaped-link harness with sites: which namespace each rank runs in, the address plan,
the cross-site traffic check, and that without ``--sites`` nothing changes.

Nothing here needs root or creates a namespace; one test trains four local gloo ranks
(two sites of two shards, no namespaces) through the sharded worker.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks.netem import harness, net
from benchmarks.netem.summary import SITE_RATIO_BAND, derive, site_check_summary, site_traffic
from benchmarks.netem.worker import train
from thinwire.launch import spawn

PREFIX = "tw-4242"


def _args(*argv: str) -> argparse.Namespace:
    return harness.resolve(harness.build_parser().parse_args(list(argv)))


# Which namespace, which address --------------------------------------------------------------

def test_ranks_of_a_site_share_its_namespace_and_address() -> None:
    assert [net.host_of(rank, 4, 2) for rank in range(4)] == [0, 0, 1, 1]
    assert [net.host_of(rank, 6, 3) for rank in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [net.host_of(rank, 4, 4) for rank in range(4)] == [0, 1, 2, 3]  # a shard a site
    assert net.host_of(0, 1, 2) == 0  # the lone worker runs in site 0
    assert net.address_plan(4, 2) == [("s0", "10.77.0.1"), ("s0", "10.77.0.1"),
                                      ("s1", "10.77.0.2"), ("s1", "10.77.0.2")]
    # the rendezvous address (host 0's) is where rank 0 runs, with sites or without
    assert net.address_plan(4, 2)[0][1] == net.address_plan(4)[0][1] == net.address(0)
    for rank, world, sites, bad in ((4, 4, 2, "rank="), (-1, 4, 2, "rank="),
                                    (0, 4, 3, "sites="), (0, 4, 5, "sites="),
                                    (0, 4, 0, "sites=")):
        with pytest.raises(ValueError, match=bad):
            net.host_of(rank, world, sites)
    with pytest.raises(ValueError, match="kind="):
        net.port(0, "x")


def test_without_sites_every_rank_keeps_a_namespace_of_its_own() -> None:
    assert [net.host_of(rank, 3) for rank in range(3)] == [0, 1, 2]
    assert net.address_plan(3) == [("w0", "10.77.0.1"), ("w1", "10.77.0.2"),
                                   ("w2", "10.77.0.3")]
    topology = net.Topology(PREFIX, 3)
    assert (topology.kind, topology.hosts) == (net.WORKER, 3)
    assert [topology.namespace(rank) for rank in range(3)] == [
        f"{PREFIX}-w0", f"{PREFIX}-w1", f"{PREFIX}-w2"]
    # the commands are the ones the harness ran before sites existed
    assert net.setup_commands(PREFIX, 2) == net.setup_commands(PREFIX, 2, net.WORKER)
    assert net.names(PREFIX, 2) == (f"{PREFIX}-br", [f"{PREFIX}-w0", f"{PREFIX}-w1"])


def test_a_site_topology_has_one_shaped_port_per_site() -> None:
    topology = net.Topology(PREFIX, 4, sites=2)
    assert (topology.kind, topology.hosts) == (net.SITE, 2)
    assert [topology.namespace(rank, 4) for rank in range(4)] == [
        f"{PREFIX}-s0", f"{PREFIX}-s0", f"{PREFIX}-s1", f"{PREFIX}-s1"]
    assert topology.namespace(0, 1) == f"{PREFIX}-s0"  # the lone worker
    setup = net.setup_commands(PREFIX, 2, net.SITE)
    assert [c[3] for c in setup if c[1:3] == ["netns", "add"]] == [
        f"{PREFIX}-br", f"{PREFIX}-s0", f"{PREFIX}-s1"]
    veths = [c for c in setup if "veth" in c]
    assert [c[c.index("name") + 1] for c in veths] == ["s0", "s1"]
    addresses = [c[c.index("add") + 1] for c in setup if c[3:5] == ["addr", "add"]]
    assert addresses == ["10.77.0.1/24", "10.77.0.2/24"]
    shaped = {(c[2], c[6]) for c in net.shape_commands(PREFIX, 2, 1e8, net.SITE)}
    assert shaped == {(f"{PREFIX}-s0", "eth0"), (f"{PREFIX}-s1", "eth0"),
                      (f"{PREFIX}-br", "s0"), (f"{PREFIX}-br", "s1")}
    assert net.leftovers(f"{PREFIX}-s0\n{PREFIX}-br\n", alive=set()) == [
        f"{PREFIX}-s0", f"{PREFIX}-br"]
    command = harness.worker_command(topology.namespace(3, 4), "python", 3, 4, 29501,
                                     harness.REPO / "spec.json", harness.REPO)
    assert command[3] == f"{PREFIX}-s1"
    assert command[command.index("--init-method") + 1] == "tcp://10.77.0.1:29501"


# Flags --------------------------------------------------------------------------------------

def test_without_sites_the_flags_resolve_as_before() -> None:
    args = _args("--workers", "2,4")
    assert args.sites is None
    assert args.schemes == ",".join(harness.DEFAULT_SCHEMES)
    assert harness.worker_options(args)["sites"] is None
    entries, _ = harness.plan(args)
    assert [e["name"] for e in entries][:3] == ["torch-dense", "torch-fp16", "torch-powersgd"]
    with pytest.raises(ValueError, match="--sites"):
        harness.plan(_args("--schemes", "native-hsdp,topk"))


def test_sites_take_native_hsdp_as_the_anchor_and_must_split_the_workers() -> None:
    args = _args("--sites", "2", "--workers", "4", "--workload", "digits-mlp")
    assert args.schemes == ",".join(harness.SITE_SCHEMES)
    assert harness.worker_options(args)["sites"] == 2
    entries, _ = harness.plan(args)
    assert [e["name"] for e in entries] == list(harness.SITE_SCHEMES)
    with pytest.raises(ValueError, match="DDP"):
        harness.plan(_args("--sites", "2", "--workers", "4", "--schemes", "torch-dense"))
    for argv, bad in ((["--sites", "2", "--workers", "2,3"], "3 workers"),
                      (["--sites", "1", "--workers", "4"], "sites=1")):
        with pytest.raises(ValueError, match=bad):
            _args(*argv)


# The cross-site traffic check ---------------------------------------------------------------

def _sharded_run(**changes: Any) -> dict[str, Any]:
    run = {"scheme": "native-hsdp", "status": "ok", "rate": "100mbit", "rate_bps": 1e8,
           "workers": 4, "sites": 2, "shards_per_site": 2, "compute_s": 0.05,
           "median_step_s": 0.3, "wire_sent_per_step": 1000.0,
           "bytes_received_per_step": 1000.0, "bytes_handed_per_step": 1000.0,
           "dense_bytes": 2000, "dense_shard_bytes": 1000,
           "shaper_tx_per_step": 2100.0, "shaper_rx_per_step": 2120.0,
           "loopback_tx_per_step": 6000.0, "reached_step": 10, "reached_train_s": 3.0,
           "steps": 10, "train_s": 3.0, "losses": [1.0]}
    return {**run, **changes}


def test_the_site_port_must_carry_the_sites_cross_site_bytes_and_no_more() -> None:
    check = site_traffic(_sharded_run())
    assert (check["meter_tx"], check["meter_rx"]) == (2000.0, 2000.0)  # two shards' bytes
    assert check["tx_ratio"] == pytest.approx(1.05) and check["ok"] is True
    assert check["intra_site_least"] == 2 * 2 * 1 * 1000  # all-gather + reduce-scatter
    # the site's own traffic on the shaper: far above the band
    leaked = site_traffic(_sharded_run(shaper_tx_per_step=2100.0 + 4000.0))
    assert leaked["tx_ratio"] > SITE_RATIO_BAND[1] and leaked["ok"] is False
    # the loopback carried less than FSDP must move inside a site: it went elsewhere
    assert site_traffic(_sharded_run(loopback_tx_per_step=100.0))["ok"] is False
    assert site_traffic(_sharded_run(shaper_rx_per_step=None))["ok"] is None


def test_derive_counts_a_sites_shared_port_in_the_floor_and_checks_every_run() -> None:
    runs = derive([_sharded_run(), _sharded_run(scheme="topk", shaper_tx_per_step=9000.0)])
    assert runs[0]["floor_s"] == pytest.approx(0.05 + 8 * 2000 / 1e8)  # both shards' bytes
    assert runs[0]["compression_ratio"] == 1.0  # against the shard, not the whole model
    summary = site_check_summary(runs)
    assert set(summary["runs"]) == {"100mbit-4w-native-hsdp-r0", "100mbit-4w-topk-r0"}
    assert summary["all_ok"] is False  # topk's port carried 4.5x its bytes
    unsharded = derive([_sharded_run(sites=None, shards_per_site=1)])[0]
    assert "site_traffic" not in unsharded
    assert unsharded["floor_s"] == pytest.approx(0.05 + 8 * 1000 / 1e8)


# The sharded worker -------------------------------------------------------------------------

def _train_sharded(rank: int, world_size: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    return [train({"name": name, "config": {}}, options) for name in ("native-hsdp", "dense")]


def test_the_worker_trains_through_fsdp_and_native_hsdp_alike() -> None:
    options = {"workload": "digits-mlp", "optimizer": "sgd", "batch_size": 16, "lr": 0.05,
               "momentum": 0.9, "seed": 0, "target": 0.99, "eval_every": 3, "max_steps": 6,
               "cap_s": 60.0, "warmup": 2, "min_steps": 6, "rank": 2, "timeout_s": 60,
               "threads": 1, "interface": "no-such-interface0", "sites": 2}
    per_rank = spawn(_train_sharded, 4, options, timeout_s=180.0)
    native, dense = per_rank[0]
    for result in (native, dense):
        assert result["status"] == "ok" and result["steps"] == 6, result.get("note")
        assert (result["sites"], result["shards_per_site"]) == (2, 2)
        # across sites each rank hands over its shard, half the model
        assert result["bytes_handed_per_step"] == result["dense_shard_bytes"]
        assert 2 * result["dense_shard_bytes"] >= result["dense_bytes"]
    assert native["kind"] == "torch" and dense["kind"] == "thinwire"
    assert native["losses"] == dense["losses"]  # 2 x 2: thinwire's dense is native HSDP
    scores = [[(step, score) for step, _, score in r[0]["curve"]] for r in per_rank]
    assert scores == [scores[0]] * 4  # every rank stops and evaluates alike
