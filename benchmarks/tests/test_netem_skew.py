"""The skewed-collective benchmark: its plan, its checks, and its workers on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.netem import harness, net, skew
from benchmarks.netem.summary import FRAME_OVERHEAD
from thinwire.comm.collectives import PAIR_MIN_BYTES


def test_every_case_runs_every_collective_on_the_same_bytes() -> None:
    names = ["all_gather", "all_reduce", "exchange"]
    assert skew.cases([100, 200], [0.0, 5.0]) == [
        (size, lag, name) for size in (100, 200) for lag in (0.0, 5.0) for name in names]
    with pytest.raises(ValueError, match="collective='broadcast'"):
        skew.collective("broadcast", 8, 2)


def test_bad_lists_rounds_and_worker_counts_are_refused() -> None:
    assert skew.numbers("261000, 1500000", int) == [261000, 1500000]
    for bad in ("", "1,-2", ","):
        with pytest.raises(ValueError, match="comma-separated"):
            skew.numbers(bad, float)
    with pytest.raises(ValueError, match="rounds=0"):
        skew.main(["--rounds", "0"])
    with pytest.raises(ValueError, match="workers='1,4'"):
        skew.main(["--workers", "1,4"])


def test_what_the_bytes_need_follows_the_ring_traffic_of_each_collective() -> None:
    rate = 8e6 * FRAME_OVERHEAD  # 1 MB/s of TCP payload
    assert skew.need_ms("all_gather", 1000, 2, rate) == pytest.approx(1.0)
    assert skew.need_ms("all_reduce", 1000, 2, rate) == pytest.approx(1.0)
    assert skew.need_ms("all_gather", 1000, 4, rate) == pytest.approx(3.0)  # 3 others
    assert skew.need_ms("exchange", 1000, 4, rate) == pytest.approx(3.0)  # an all-gather's
    assert skew.need_ms("all_reduce", 1000, 4, rate) == pytest.approx(1.5)  # 2 (n-1)/n
    # 261,000 bytes between two ranks at 100 Mbit/s, as the shipped data says
    assert skew.need_ms("all_gather", 261_000, 2, 1e8) == pytest.approx(21.84, abs=0.01)


def test_without_root_it_says_what_it_needs(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(net.os, "geteuid", lambda: 1000)
    assert skew.main(["--out", "/nonexistent/x.json"]) == 2
    assert "needs root" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("count", [2, 3])  # the exchange: broadcasts / an all-gather
def test_workers_on_loopback_time_every_case_on_the_first_and_the_late_rank(
        tmp_path: Path, count: int) -> None:
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.netem.skew", "--workers", str(count),
               "--init-method",
               f"tcp://127.0.0.1:{_free_port()}", "--sizes", str(PAIR_MIN_BYTES),
               "--skews-ms", "0,2",
               "--rounds", "2", "--out", str(out)]
    workers = [subprocess.Popen([*command, "--worker", str(rank)], cwd=harness.REPO,
                                env={**harness.worker_env(), "GLOO_SOCKET_IFNAME": "lo"})
               for rank in range(count)]
    try:  # a few seconds idle; the guard is for a busy machine, and nothing outlives it
        assert [w.wait(timeout=300) for w in workers] == [0] * count
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    rows = json.loads(out.read_text())
    assert [(r["workers"], r["bytes"], r["skew_ms"], r["collective"]) for r in rows] == [
        (count, *case) for case in skew.cases([PAIR_MIN_BYTES], [0, 2])]
    for row in rows:
        assert row["first_rank_ms"] > 0 and row["later_rank_ms"] > 0


def test_the_table_shows_each_rank_against_what_the_bytes_need() -> None:
    text = skew.table([{"workers": 2, "bytes": 261000, "skew_ms": 13.0,
                        "collective": "all_gather",
                        "first_rank_ms": 34.8, "later_rank_ms": 31.6, "bytes_need_ms": 21.8}])
    assert "261,000" in text and "31.6" in text and "21.8" in text
