"""One history per job (thinwire.elastic.job): a worker left behind with no one to heal it stops
instead of committing the job's steps a second time; a worker stalled while the others go on
is healed when it wakes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from thinwire import schemes
from thinwire.local import LocalUpdates

os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust logs, read when it is imported
pytest.importorskip("torchft")

from thinwire import elastic  # noqa: E402  (needs torchft)
from thinwire.elastic.job import JobRecord, StaleWorker, weights_hash  # noqa: E402

STEPS = 12  # inner steps, a sync every 2
STOP_AT = 5  # worker 2 stops itself (SIGSTOP) after this inner step, between two syncs
CRASH_AT = 8  # "crashed": workers 0 and 1 kill themselves after committing this step
WAKE_AT = 8  # "stalled": worker 2 is woken once the others committed this step
HEARTBEAT_S = 1.0  # the Lighthouse's heartbeat timeout, and the workers'
TIMEOUT_S = 60.0  # the group's: what a stalled peer would cost without the workers' watch
DEADLINE_S = 300.0  # hang guard for a whole scenario (about 30 s on a busy 2-core machine)
# Workers are forked from a server that has imported these once: four lives, one import
PRELOAD = ["torch", "torchft.manager", "thinwire.elastic", "thinwire.local", "thinwire.schemes"]


def _life(mode: str, replica: int, life: int, lighthouse: str, out: str,
          scenario: str) -> None:
    """One life of a worker, local updates (a sync every 2 inner steps) or per-step DDP: its
    commits and how it ended, one JSON line each, in ``out/worker<replica>-<life>.jsonl``."""
    os.environ["RUST_LOG"] = "error"
    torch.set_num_threads(1)
    log = Path(out, f"worker{replica}-{life}.jsonl")

    def note(entry: dict[str, Any]) -> None:
        with log.open("a") as file:
            file.write(json.dumps(entry) + "\n")

    torch.manual_seed(100 + replica)  # torchft heals all but one at step 0
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # "stalled": the others cut the stalled worker off after HEARTBEAT_S, far within the
    # group's timeout
    manager = elastic.connect(lighthouse, min_workers=2, replica_id=f"worker{replica}",
                              timeout_s=TIMEOUT_S, quorum_timeout_s=60,
                              heartbeat_timeout_s=HEARTBEAT_S)
    job = JobRecord(Path(out, "job.json"), steps=STEPS, worker=f"worker{replica}",
                    where=str(Path(out, f"worker-{replica}")))
    if mode == "local":
        updates = elastic.ElasticLocalUpdates(
            LocalUpdates(model, inner, schemes.build("int4", chunk=8), every=2), manager,
            job=job)
        record, finish = updates.record, updates.finish

        def steps() -> int:
            return updates.steps

        def weights() -> list[torch.Tensor]:
            return list(updates.updates.global_state().values())

        def train(x: torch.Tensor, y: torch.Tensor) -> None:
            inner.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            inner.step()
            if scenario == "stalled" and replica == 2 and updates.steps + 1 == STOP_AT + 1:
                updates.updates.scheme.launch = _stalled(  # type: ignore[method-assign]
                    updates.updates.scheme.launch, out)
            updates.step()

        if scenario == "stalled" and replica == 2:
            updates.membership.meet = _asking(  # type: ignore[method-assign]
                updates.membership.meet, out)
    else:
        net = elastic.ElasticDDP(model, inner, schemes.build("clt-k", ratio=0.25), manager,
                                 job=job)
        record, steps = net.record, manager.current_step

        def finish() -> None:
            pass

        def weights() -> list[torch.Tensor]:
            return list(model.parameters())

        def train(x: torch.Tensor, y: torch.Tensor) -> None:
            net.begin()
            if scenario == "stalled" and replica == 2 and manager.current_step() == STOP_AT:
                net.scheme.launch_flat = _stalled(  # type: ignore[method-assign]
                    net.scheme.launch_flat, out)
            nn.functional.cross_entropy(net(x), y).backward()
            net.commit()

        if scenario == "stalled" and replica == 2:
            net.membership.meet = _asking(net.membership.meet, out)  # type: ignore[method-assign]

    def committed(since: float) -> None:
        if record["commits"] > since:
            note({"step": steps(), "weights": weights_hash(weights()), "at": time.monotonic()})

    try:
        while steps() < STEPS:
            generator = torch.Generator().manual_seed(1000 * replica + 100 * life + steps())
            commits = record["commits"]
            train(torch.randn(5, 6, generator=generator),
                  torch.randint(0, 3, (5,), generator=generator))
            committed(commits)
            if scenario == "stalled" and replica < 2 and steps() == WAKE_AT:
                _wait_for(Path(out, "asking"), time.monotonic())  # it wakes in a live job
            if scenario == "crashed" and replica < 2 and steps() == CRASH_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            if scenario != "stalled" and replica == 2 and life == 1 and steps() == STOP_AT:
                Path(out, "stopped").touch()
                os.kill(os.getpid(), signal.SIGSTOP)  # until the test wakes it
        commits = record["commits"]
        finish()
        committed(commits)
        note({"end": "finished"})
    except StaleWorker as error:
        note({"end": "stale", "error": str(error)})
    finally:
        manager.shutdown(wait=False)


def _asking(meet: Any, out: str) -> Any:
    """The membership's meet of the stalled worker: marks its first quorum since it woke,
    which the others wait for."""

    def meeting(*args: Any, **kwargs: Any) -> Any:
        if Path(out, "woken").exists():
            Path(out, "asking").touch()
        return meet(*args, **kwargs)

    return meeting


def _stalled(launch: Any, out: str) -> Any:
    """The scheme's launch of a worker that stops (SIGSTOP) in the middle of an exchange:
    after the sync's quorum and roll call, before it sends its part; the test wakes it."""

    def stopping(*args: Any, **kwargs: Any) -> Any:
        Path(out, "stopped").write_text(str(time.monotonic()))
        os.kill(os.getpid(), signal.SIGSTOP)
        Path(out, "woken").touch()
        return launch(*args, **kwargs)

    return stopping


def _wait_for(path: Path, start: float) -> None:
    while not path.exists():
        if time.monotonic() - start > DEADLINE_S:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def _run(out: Path, mode: str, scenario: str) -> dict[str, list[dict[str, Any]]]:
    """Workers 0-2 train; worker 2 stops itself at STOP_AT; the others finish the job
    ("finished") or die after committing CRASH_AT ("crashed"); then worker 0 is relaunched
    and worker 2 woken, together. "stalled": worker 2 stops in the exchange of the sync
    after STOP_AT and is woken once the others committed WAKE_AT, which wait for it there.
    The logs of the lives, by name."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    # "stalled": the others' next quorum waits for the woken worker, live again, to ask
    lighthouse = elastic.start_lighthouse("[::]:0", min_workers=2,
                                          join_timeout_s=5.0 if scenario == "stalled" else 1.0,
                                          heartbeat_timeout_s=HEARTBEAT_S)
    address = lighthouse.address()
    lives: dict[str, Any] = {}
    start = time.monotonic()

    def launch(replica: int, life: int) -> Any:
        process = context.Process(target=_life, args=(mode, replica, life, address, str(out),
                                                       scenario))
        process.start()
        lives[f"worker{replica}-{life}"] = process
        return process

    try:
        first = [launch(replica, 1) for replica in range(3)]
        _wait_for(out / "stopped", start)
        if scenario == "stalled":  # the others go on without it; it wakes in their job
            record = JobRecord(out / "job.json")
            while (latest := record.latest()) is None or latest.step < WAKE_AT:
                if time.monotonic() - start > DEADLINE_S:
                    raise TimeoutError(f"the others never committed step {WAKE_AT}")
                time.sleep(0.02)
            os.kill(first[2].pid, signal.SIGCONT)
            for process in first:
                process.join(timeout=max(1.0, DEADLINE_S - (time.monotonic() - start)))
            assert [process.exitcode for process in first] == [0, 0, 0]
            return _logs(out, lives)
        for process in first[:2]:
            process.join(timeout=max(1.0, DEADLINE_S - (time.monotonic() - start)))
        assert [process.exitcode for process in first[:2]] == (
            [0, 0] if scenario == "finished" else [-signal.SIGKILL] * 2)
        relaunched = launch(0, 2)
        os.kill(first[2].pid, signal.SIGCONT)
        for process in (first[2], relaunched):
            process.join(timeout=max(1.0, DEADLINE_S - (time.monotonic() - start)))
    finally:
        for process in lives.values():
            if process.is_alive():
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
        lighthouse.shutdown()
    return _logs(out, lives)


def _logs(out: Path, lives: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text()
                   .splitlines()] if (out / f"{name}.jsonl").exists() else []
            for name in lives}


def _commits(logs: dict[str, list[dict[str, Any]]]) -> dict[int, set[str]]:
    """Every step committed by any life, with the weights each committed it with."""
    committed: dict[int, set[str]] = {}
    for entries in logs.values():
        for entry in entries:
            if "step" in entry:
                committed.setdefault(entry["step"], set()).add(entry["weights"])
    return committed


@pytest.mark.parametrize("scenario", ["finished", "crashed"])
@pytest.mark.parametrize("mode", ["local", "ddp"])
def test_a_stopped_worker_and_a_relaunched_one_never_commit_a_step_a_second_time(
        mode: str, scenario: str, tmp_path: Path) -> None:
    """The user's case: a worker stopped (SIGSTOP) while the others went on wakes after they
    ended (finished the job, or died); worker 0, relaunched, meets it. The pair is behind the
    job's latest commit with no live worker to heal it: both stop, naming the step and the
    record, and no step of the job is committed twice with different weights."""
    logs = _run(tmp_path, mode, scenario)
    committed = _commits(logs)
    twice = {step: sorted(weights) for step, weights in committed.items() if len(weights) > 1}
    assert not twice, f"steps committed with different weights: {twice}"
    last = STEPS if scenario == "finished" else CRASH_AT
    assert max(committed) == last  # the first history's, to its last commit
    for name in ("worker2-1", "worker0-2"):
        end = logs[name][-1]
        assert end["end"] == "stale", (name, logs[name])
        assert f"step {last:,}" in end["error"] and str(tmp_path / "job.json") in end["error"]
        assert str(tmp_path / "worker-0") in end["error"] or str(
            tmp_path / "worker-1") in end["error"]


@pytest.mark.parametrize("mode", ["local", "ddp"])
def test_a_worker_stalled_in_an_exchange_is_left_out_then_healed_when_it_wakes(
        mode: str, tmp_path: Path) -> None:
    """Worker 2 stops (SIGSTOP) in the middle of an exchange, longer than the heartbeat
    timeout. That sync or step fails everywhere: the others cut it off once its beat has
    stood still for the heartbeat timeout (a stalled peer holds its connections open,
    unlike a dead one: without the cut they would wait out the group's timeout), and commit
    without it within seconds. Woken behind them, it applies nothing from the exchange it
    stalled in, is healed at its next quorum and commits that sync and every one after it
    with the others' weights; no step is committed with two weights."""
    logs = _run(tmp_path, mode, "stalled")
    every = 2 if mode == "local" else 1  # the steps between two commits
    committed = _commits(logs)
    twice = {step: sorted(weights) for step, weights in committed.items() if len(weights) > 1}
    assert not twice, f"steps committed with different weights: {twice}"
    stopped = float((tmp_path / "stopped").read_text())
    # a failed sync is skipped; a failed step is taken again under the same number
    first = STOP_AT + 1 + (every if mode == "local" else 0)
    for name in ("worker0-1", "worker1-1"):
        commits = [entry for entry in logs[name] if "step" in entry]
        assert [entry["step"] for entry in commits if entry["step"] > STOP_AT] == list(
            range(first, STEPS + 1, every))
        # the heartbeat, a quorum, a sync or step: seconds, not the group's timeout (a
        # bound a loaded machine keeps, far below TIMEOUT_S)
        lost = next(entry["at"] for entry in commits if entry["at"] > stopped) - stopped
        assert lost < TIMEOUT_S / 3, f"{name} lost {lost:.1f} s to the stalled worker"
    woken = [entry["step"] for entry in logs["worker2-1"] if "step" in entry]
    after = [step for step in woken if step > STOP_AT]
    # healed, it commits every sync from the first quorum it meets (WAKE_AT + every on an
    # idle machine, a later one under load) to the last
    assert after and after[0] >= WAKE_AT + every
    assert after == list(range(after[0], STEPS + 1, every))
    assert logs["worker2-1"][-1] == {"end": "finished"}


# The record alone: what a worker sees, reads and writes.

def _record(tmp_path: Path, **options: Any) -> JobRecord:
    return JobRecord(tmp_path / "job.json", **{"steps": 100, "worker": "worker0",
                                               "where": str(tmp_path / "worker-0"), **options})


def test_a_new_job_has_no_record_and_stops_no_one(tmp_path: Path) -> None:
    record = _record(tmp_path)
    assert record.latest() is None
    record.check(0, in_quorum=True)


def test_a_commit_is_recorded_whole_and_a_later_one_replaces_it(tmp_path: Path) -> None:
    record = _record(tmp_path)
    record.write(3, 20, "aa")
    record.write(4, 30, "bb")
    latest = record.latest()
    assert latest is not None and (latest.commit, latest.step, latest.weights) == (4, 30, "bb")
    assert latest.worker == "worker0" and not latest.over
    assert [path.name for path in tmp_path.iterdir()] == ["job.json"]  # no part left behind
    record.write(3, 20, "aa")  # a slower peer of an earlier quorum: the record stays
    assert record.latest() == latest


def test_a_worker_behind_the_record_stops_only_where_no_one_can_heal_it(tmp_path: Path) -> None:
    record = _record(tmp_path)
    record.write(5, 40, "cc")
    record.check(2, in_quorum=False)  # before its quorum: a live peer may heal it
    record.check(5, in_quorum=True)  # healed to the latest commit
    with pytest.raises(StaleWorker, match="step 40 already") as caught:
        record.check(2, in_quorum=True)  # the quorum's most advanced worker is behind
    assert str(tmp_path / "job.json") in str(caught.value)
    assert str(tmp_path / "worker-0") in str(caught.value)


def test_a_job_that_is_over_takes_no_late_joiner(tmp_path: Path) -> None:
    record = _record(tmp_path)
    record.write(9, 100, "dd")
    latest = record.latest()
    assert latest is not None and latest.over
    with pytest.raises(StaleWorker, match="step 100 already.*the job is over"):
        record.check(0, in_quorum=False)
    record.check(9, in_quorum=False)  # a worker that took part in the last commit


def test_one_commit_with_two_weights_is_refused(tmp_path: Path) -> None:
    record = _record(tmp_path)
    record.write(5, 40, "cc")
    record.write(5, 40, "cc")  # a peer of the same quorum: the same weights
    with pytest.raises(StaleWorker, match="two histories"):
        record.write(5, 40, "ee")


def test_a_file_that_is_not_a_record_is_named(tmp_path: Path) -> None:
    (tmp_path / "job.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a thinwire job record"):
        _record(tmp_path).latest()


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_bad_steps_are_refused_by_name(steps: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"steps={steps!r}"):
        _record(tmp_path, steps=steps)
