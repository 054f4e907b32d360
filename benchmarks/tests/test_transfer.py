"""The transfer protocol: choosing and checking are disjoint, cover what they must, and the
check set runs the shipped defaults only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import transfer
from thinwire.jobs import workloads


def test_the_protocol_separates_choosing_from_checking_and_covers_the_family() -> None:
    protocol = transfer.load_protocol()
    assert len(protocol["choose"]) >= 4 and len(protocol["check"]) >= 3
    every: set[int] = set()
    for which in transfer.SETS:
        configs = protocol[which]
        options = [transfer.run_options(protocol, config, seed=0) for config in configs]
        assert {o.workload for o in options} == set(workloads.CORPORA)  # both corpora
        assert {2, 8} <= {config["workers"] for config in configs}
        sizes = {sum(p.numel() for p in o.load().model(0).parameters()) for o in options}
        assert max(sizes) >= 3_000_000  # each set has the largest size
        every |= sizes
        assert any(o.schedule == "cosine" for o in options)
    assert max(every) >= 10 * min(every)  # three sizes spanning 10x
    choose = {json.dumps({k: v for k, v in c.items() if k != "name"}, sort_keys=True)
              for c in protocol["choose"]}
    assert not any(json.dumps({k: v for k, v in c.items() if k != "name"}, sort_keys=True)
                   in choose for c in protocol["check"])  # no check is a renamed choice


def test_the_check_set_refuses_tuned_schemes_and_unknown_configurations(tmp_path: Path) -> None:
    transfer.check_spellings("choose", ["topk:ratio=0.1"])
    with pytest.raises(ValueError, match="shipped defaults only"):
        transfer.check_spellings("check", ["topk", "topk:ratio=0.1"])
    with pytest.raises(ValueError, match="not in the 'check' set"):
        transfer.run("check", ["text-M-4w-nanogpt"], [0], ["topk"], tmp_path / "out.json",
                     60.0)


def test_a_configuration_named_twice_is_refused(tmp_path: Path) -> None:
    protocol = json.loads(transfer.PROTOCOL.read_text())
    protocol["check"].append(protocol["choose"][0])
    path = tmp_path / "protocol.json"
    path.write_text(json.dumps(protocol))
    with pytest.raises(ValueError, match="named twice"):
        transfer.load_protocol(path)


def test_the_table_says_which_rows_meet_the_goals() -> None:
    goals = transfer.load_protocol()["goals"]
    row = {"scheme": "topk", "local": False, "test_score": 2.04, "vs_dense": 0.02,
           "bytes_vs_dense": 0.0625}
    job = {"config": {"name": "c"}, "seed": 0, "dense": {"test_score": 2.0}, "rows": [
        row, {**row, "scheme": "clt-k", "vs_dense": 0.021},
        {**row, "scheme": "diloco+int4", "local": True, "bytes_vs_dense": 0.01}]}
    lines = transfer.table([job], goals).splitlines()
    assert lines[3].endswith("| +2.0 % | 1/16.0 | yes |")
    assert lines[4].endswith("| no |") and lines[5].endswith("| no |")
