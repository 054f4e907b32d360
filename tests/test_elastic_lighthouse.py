"""A Lighthouse that dies and is restarted at the same address while the workers train: they go
on at their next quorum, none restarted, with equal weights after every commit."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust logs, read when it is imported
pytest.importorskip("torchft")

from thinwire.elastic.job import weights_hash  # noqa: E402  (needs torchft)

STEPS = 40  # inner steps, a sync every 2
DOWN_AT = 10  # the Lighthouse is killed once worker 0 has committed this step
DOWN_S = 1.0  # and restarted this long after
DEADLINE_S = 240.0  # hang guard for the whole scenario
PRELOAD = ["torch", "torchft.manager", "thinwire.elastic", "thinwire.local", "thinwire.schemes"]


def _worker(replica: int, address: str, out: str) -> None:
    os.environ["RUST_LOG"] = "error"
    torch.set_num_threads(1)
    from thinwire import elastic, schemes
    from thinwire.local import LocalUpdates

    elastic.manager.QUORUM_ASK_S = 1.0  # ask a restarted Lighthouse again soon
    manager = elastic.connect(address, min_workers=2, replica_id=f"worker{replica}",
                              timeout_s=30, quorum_timeout_s=120, heartbeat_timeout_s=1.0)
    torch.manual_seed(100 + replica)
    model = nn.Linear(6, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    updates = elastic.ElasticLocalUpdates(
        LocalUpdates(model, inner, schemes.build("int4", chunk=8), every=2), manager)
    log = Path(out, f"worker{replica}.jsonl")
    while updates.steps < STEPS:
        generator = torch.Generator().manual_seed(1000 * replica + updates.steps)
        inner.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(5, 6, generator=generator)),
                                    torch.randint(0, 3, (5,), generator=generator)).backward()
        inner.step()
        commits = updates.record["commits"]
        updates.step()
        if updates.record["commits"] > commits:
            entry = {"step": updates.steps, "at": time.monotonic(), "weights": weights_hash(
                list(updates.updates.global_state().values()))}
            with log.open("a") as file:
                file.write(json.dumps(entry) + "\n")
        time.sleep(0.05)  # a step that takes time, as training does
    updates.finish()
    with log.open("a") as file:
        file.write(json.dumps({"end": updates.record}) + "\n")
    manager.shutdown(wait=False)


def _serve(port: int) -> None:
    """The Lighthouse as `thinwire lighthouse` runs it: a process of its own, until killed."""
    from thinwire.elastic import start_lighthouse

    server = start_lighthouse(f"[::]:{port}", min_workers=2, join_timeout_s=2,
                              heartbeat_timeout_s=1)
    while server is not None:  # held: a collected server stops listening
        time.sleep(3600)


def _lighthouse(context: Any, port: int) -> Any:
    process = context.Process(target=_serve, args=(port,))
    process.start()
    return process


def _free_port() -> int:
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::", 0))
        return int(probe.getsockname()[1])


def _committed(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [entry for line in path.read_text().splitlines()
            if "step" in (entry := json.loads(line))]


def test_a_restarted_lighthouse_lets_the_workers_go_on(tmp_path: Path) -> None:
    port = _free_port()
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    lighthouse = _lighthouse(context, port)
    workers = [context.Process(target=_worker, args=(replica, f"http://localhost:{port}",
                                                     str(tmp_path))) for replica in range(2)]
    start = time.monotonic()
    try:
        for process in workers:
            process.start()
        while not any(entry["step"] >= DOWN_AT
                      for entry in _committed(tmp_path / "worker0.jsonl")):
            assert time.monotonic() - start < DEADLINE_S, "no commit before the restart"
            assert all(process.exitcode is None for process in workers), "a worker ended"
            time.sleep(0.05)
        lighthouse.kill()  # SIGKILL: its connections close, as a lost host's would
        lighthouse.join()
        down = time.monotonic()
        time.sleep(DOWN_S)
        lighthouse = _lighthouse(context, port)
        for process in workers:
            process.join(timeout=max(1.0, DEADLINE_S - (time.monotonic() - start)))
        assert [process.exitcode for process in workers] == [0, 0]
    finally:
        for process in workers:
            if process.is_alive():
                process.kill()
        lighthouse.kill()
    logs = [_committed(tmp_path / f"worker{replica}.jsonl") for replica in range(2)]
    for log in logs:
        steps = [entry["step"] for entry in log]
        assert steps == list(range(2, STEPS + 1, 2))  # every sync committed, none twice
        assert any(entry["at"] > down + DOWN_S for entry in log)  # after the restart
    assert [entry["weights"] for entry in logs[0]] == [entry["weights"] for entry in logs[1]]
    ends = [json.loads((tmp_path / f"worker{replica}.jsonl").read_text().splitlines()[-1])
            for replica in range(2)]
    assert all(end["end"]["failures"] == 0 for end in ends)
