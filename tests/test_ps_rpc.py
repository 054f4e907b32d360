"""The parameter server over torch RPC (TensorPipe) with workers in their own processes.

Each test runs a whole job: a server process and worker processes on loopback, with a
generous deadline after which every process is killed (``AsyncConfig.timeout_s``), a
hang guard that a busy machine never trips. Rendezvous uses a file in a fresh temporary
folder, so no ports are chosen and runs never collide.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest
import torch

from thinwire.cli import async_ as ps_cli
from thinwire.jobs.ps_task import ClassifierTask, TaskSpec
from thinwire.ps import AsyncConfig, build_rule, load_checkpoint, run
from thinwire.ps.config import updates_per_pass

SPEC = TaskSpec(model="linear", batch_size=16, train_limit=160)


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _torch_sgd(spec: TaskSpec, passes: int, lr: float) -> torch.Tensor:
    task = ClassifierTask(spec)
    optimizer = torch.optim.SGD(task.model.parameters(), lr=lr)
    for images, labels in task.batches(0, 1, passes):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(task.model(images), labels).backward()
        optimizer.step()
    return task.layout.flatten(dict(task.model.named_parameters()))


@pytest.mark.usefixtures("one_thread")
def test_cli_one_worker_over_rpc_is_sequential_sgd_exactly(tmp_path: object) -> None:
    parser = argparse.ArgumentParser()
    ps_cli.add_arguments(parser)
    out = os.path.join(str(tmp_path), "out")
    args = parser.parse_args([
        "--rule", "asgd", "--workers", "1", "--epochs", "2", "--lr", "0.2", "--model", "linear",
        "--batch-size", "16", "--train-limit", "160", "--out", out, "--timeout", "600",
        "--no-progress"])
    assert ps_cli.run(args) == 0
    weights = torch.load(os.path.join(out, "weights.pt"))
    assert torch.equal(weights, _torch_sgd(SPEC, 2, 0.2))
    with open(os.path.join(out, "results.json")) as handle:
        summary = json.load(handle)["runs"][0]
    for name in ("results.md", "test_error.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    assert summary["updates"] == 20 and summary["staleness"]["histogram"] == {"0": 20}
    # a push is the step (4 bytes) and the gradient
    assert summary["bytes"] == {"pull": 20 * 650 * 4, "push": 20 * (4 + 650 * 4)}
    assert summary["membership"] == ["left"]


def test_killed_and_refused_workers_cost_only_their_own_updates(tmp_path: object) -> None:
    """Four workers: #2 dies (SIGKILL) with its 4th push in flight, #3 was started with
    another model and is refused at join. The server and workers #0, #1 finish, and a
    replay of the server's audit log from the gradients the workers journaled before
    sending reproduces the final weights bit for bit: every applied update was whole."""
    journal = os.path.join(str(tmp_path), "journal")
    os.makedirs(journal)
    config = AsyncConfig(method="dc-asgd", workers=4, passes=3, rule={"lr": 0.1, "lam": 0.5},
                         audit=True, journal_dir=journal, timeout_s=600)
    other = dataclasses.replace(SPEC, model="convnet")
    result = run(config, SPEC, kill_after={2: 3}, worker_specs={3: other})

    task = ClassifierTask(SPEC)
    assert result.workers[2]["error"] == "killed by SIGKILL"
    assert "refused" in result.workers[3]["error"]
    assert "model: worker has 'convnet', server has 'linear'" in result.workers[3]["error"]
    for m in (0, 1):
        assert result.workers[m]["pushes"] == task.steps(m, 4, 3)
        assert result.workers[m]["outcomes"] == {"applied": task.steps(m, 4, 3)}
    assert result.membership == ["left", "left", "dead", "refused"]
    assert torch.isfinite(result.weights).all()

    audit = result.server_state["audit"]
    applied = [entry for entry in audit if entry[4] == "applied"]
    victim = [entry for entry in applied if entry[0] == 2]
    assert [entry[1] for entry in victim] in ([0, 1, 2], [0, 1, 2, 3])  # last one in flight
    assert len(applied) == result.updates == 2 * task.steps(0, 4, 3) + len(victim)
    rule = build_rule("dc-asgd", **config.rule_options(updates_per_pass(config, task)))
    versions = [task.initial_weights()]
    for stream, seq, _, pulled_version, _ in applied:
        grad = torch.load(os.path.join(journal, f"s{stream}-{seq}.pt"))
        versions.append(rule.apply(versions[-1], grad, versions[pulled_version]))
    assert torch.equal(versions[-1], result.weights)


def test_ssgd_sparse_hogwild_pushes_then_restart_from_checkpoint(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "server.ckpt")
    config = AsyncConfig(method="ssgd", workers=2, threads_per_worker=2, passes=1,
                         rule={"lr": 0.1}, push="dct-dp",
                         push_options={"ratio": 0.1, "life_span": 4, "drain_every": 3,
                                       "min_numel": 0},
                         checkpoint=path, timeout_s=600)
    task = ClassifierTask(SPEC)
    rounds = max(task.steps(s, 4, 1) for s in range(4))
    pushes = sum(task.steps(s, 4, 1) for s in range(4))
    first = run(config, SPEC)
    assert first.updates == rounds
    assert first.staleness["histogram"] == {0: pushes}
    assert first.bytes["push"] < 0.5 * first.bytes["pull"]
    assert all(first.workers[m]["drains"] > 0 for m in range(2))
    saved = load_checkpoint(path)["core"]
    assert saved["version"] == rounds and torch.equal(saved["weights"], first.weights)

    second = run(dataclasses.replace(config, resume=path), SPEC)
    assert second.updates == 2 * rounds
    assert second.server_state["rule"]["step"] == 2 * rounds
    assert second.staleness["outcomes"]["pending"] == 2 * pushes
    restored = second.server_state["snapshots"][:len(first.server_state["snapshots"])]
    for before, after in zip(first.server_state["snapshots"], restored, strict=True):
        assert before[:2] == after[:2] and torch.equal(before[3], after[3])
    assert second.curve[-1]["passes"] == pytest.approx(2.0)
    assert second.final["test_error"] <= first.curve[0]["test_error"]
