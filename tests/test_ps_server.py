"""The server facade and the worker loop in one process: the sequential reference, SSGD
futures, refusal, hogwild threads, periodic checkpoints, a task of the caller's own (no RPC,
no processes)."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from thinwire.cli import main
from thinwire.comm import Meter
from thinwire.jobs.ps_task import ClassifierTask, TaskSpec
from thinwire.ps import AsyncConfig, Layout, launch, load_checkpoint, run
from thinwire.ps.server import build_server
from thinwire.ps.wire import PushCodec
from thinwire.ps.worker import LocalTransport, run_worker

SPEC = TaskSpec(model="linear", batch_size=16, train_limit=96)


def _torch_sgd(spec: TaskSpec, passes: int, lr: float) -> torch.Tensor:
    """Plain ``torch.optim.SGD`` on the module, the same batches in the same order."""
    task = ClassifierTask(spec)
    model = task.model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for images, labels in task.batches(0, 1, passes):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return task.layout.flatten(dict(model.named_parameters()))


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    """Matrix products may sum in another order with more threads: compare like with like."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_sequential_reference_is_torch_sgd_exactly() -> None:
    result = run(AsyncConfig(method="sequential", passes=2, rule={"lr": 0.2}, audit=True), SPEC)
    assert torch.equal(result.weights, _torch_sgd(SPEC, 2, 0.2))
    assert result.updates == 12 and result.staleness["histogram"] == {0: 12}
    # a push is the step (4 bytes) and the gradient
    assert result.bytes == {"pull": 12 * 650 * 4, "push": 12 * (4 + 650 * 4)}
    assert [round(point["passes"], 6) for point in result.curve] == [0.0, 1.0, 2.0]
    assert result.curve[-1]["test_error"] == result.final["test_error"]


@dataclass(frozen=True)
class LeastSquares:
    """A task that is no classifier: least squares on fixed rows (meets TaskBuilder)."""

    rows: int = 10
    batch_size: int = 4

    def build(self) -> _LeastSquaresTask:
        return _LeastSquaresTask(self)


class _LeastSquaresTask:
    """Meets ps.Task with nothing of the experiments' models or data sets."""

    def __init__(self, spec: LeastSquares) -> None:
        generator = torch.Generator().manual_seed(0)
        self.spec = spec
        self.x = torch.randn(spec.rows, 3, generator=generator)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5])
        self.layout = Layout.of({"w": torch.zeros(3)})

    def initial_weights(self) -> torch.Tensor:
        return torch.zeros(3)

    def fingerprint(self) -> dict[str, object]:
        return dataclasses.asdict(self.spec)

    def steps(self, stream: int, streams: int, passes: int) -> int:
        rows = len(range(stream, self.spec.rows, streams))
        return passes * math.ceil(rows / self.spec.batch_size)

    def batches(self, stream: int, streams: int, passes: int,
                first_pass: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rows = list(range(stream, self.spec.rows, streams))
        for _ in range(passes):
            for start in range(0, len(rows), self.spec.batch_size):
                chosen = rows[start:start + self.spec.batch_size]
                yield self.x[chosen], self.y[chosen]

    def gradient(self, weights: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]
                 ) -> torch.Tensor:
        x, y = batch
        return 2 * x.T @ (x @ weights - y) / len(y)

    def evaluate(self, weights: torch.Tensor) -> dict[str, float]:
        loss = float(((self.x @ weights - self.y) ** 2).mean())
        return {"test_error": loss, "test_loss": loss}


@pytest.mark.usefixtures("one_thread")
def test_the_server_trains_any_task_it_is_given() -> None:
    """The front door holds no model: a least-squares task runs the sequential method, and
    its weights are plain SGD's on the same batches, exactly."""
    spec = LeastSquares()
    result = run(AsyncConfig(method="sequential", passes=3, rule={"lr": 0.05}), spec)
    task = spec.build()
    weights = task.initial_weights()
    for batch in task.batches(0, 1, 3):
        weights.add_(task.gradient(weights, batch), alpha=-0.05)
    assert result.updates == task.steps(0, 1, 3) == 9
    assert torch.equal(result.weights, weights)
    assert result.final["test_loss"] < task.evaluate(task.initial_weights())["test_loss"]
    assert result.summary()["task"] == {"rows": 10, "batch_size": 4}


def _local_server(config: AsyncConfig, spec: TaskSpec = SPEC):  # type: ignore[no-untyped-def]
    task = ClassifierTask(spec)
    return task, build_server(config, task)


def test_ssgd_push_futures_complete_when_the_round_closes() -> None:
    config = AsyncConfig(method="ssgd", workers=2, passes=1, rule={"lr": 0.1})
    task, server = _local_server(config)
    fingerprint = {**task.fingerprint(), **config.fingerprint()}
    server.join(0, fingerprint)
    server.join(1, fingerprint)
    codec = PushCodec(task.layout)
    grad = torch.ones(task.layout.numel)
    encoded = codec.encode(grad)
    first = server.push(0, 0, encoded.data, encoded.dense)
    assert not first.done()
    encoded = codec.encode(3 * grad)
    second = server.push(1, 0, encoded.data, encoded.dense)
    assert first.done() and second.done()
    assert first.value()["version"] == 1
    assert torch.equal(server.core.weights, task.initial_weights().add(2 * grad, alpha=-0.1))


def test_a_worker_with_another_model_is_refused_with_a_clear_error() -> None:
    config = AsyncConfig(method="asgd", workers=2, threads_per_worker=2, passes=1)
    task, server = _local_server(config)
    other = ClassifierTask(TaskSpec(model="convnet", batch_size=16, train_limit=96))
    with pytest.raises(ValueError, match="model: worker has 'convnet', server has 'linear'"):
        server.join(1, {**other.fingerprint(), **config.fingerprint()})
    assert server.core.status == ["expected", "expected", "refused", "dead"]
    with pytest.raises(ValueError, match="push_options"):
        server.join(0, {**task.fingerprint(), **config.fingerprint(), "push_options": {"a": 1}})


def test_hogwild_threads_and_workers_in_one_process(tmp_path: object) -> None:
    """Two workers of two threads each, sparse pushes sharing one error buffer per worker."""
    path = os.path.join(str(tmp_path), "server.ckpt")
    config = AsyncConfig(method="dc-asgd", workers=2, threads_per_worker=2, passes=2,
                         rule={"lr": 0.1, "lam": 0.04}, push="dct-dp",
                         push_options={"ratio": 0.1, "life_span": 5, "drain_every": 3,
                                           "min_numel": 0},
                         checkpoint=path, checkpoint_every=5)
    task, server = _local_server(config)
    reports: dict[int, dict[str, object]] = {}

    def worker(m: int) -> None:
        codec = PushCodec(task.layout, config.push, **config.push_options)
        meter = Meter()
        reports[m] = run_worker(m, config, task, codec, LocalTransport(server, meter), meter)

    threads = [threading.Thread(target=worker, args=(m,)) for m in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    steps = sum(task.steps(s, 4, 2) for s in range(4))
    assert server.core.finished and server.core.version == steps
    assert sum(int(r["pushes"]) for r in reports.values()) == steps  # type: ignore[call-overload]
    assert all(int(r["drains"]) > 0 for r in reports.values())  # type: ignore[call-overload]
    pushed = sum(r["bytes"]["push"] for r in reports.values())  # type: ignore[index]
    pulled = sum(r["bytes"]["pull"] for r in reports.values())  # type: ignore[index]
    assert pushed < 0.5 * pulled
    assert server.meter is not None
    received = sum(r.nbytes for r in server.meter.records if r.entity == "push")
    assert received == pushed
    saved = load_checkpoint(path)["core"]  # written every 5 updates, atomically
    assert 5 <= saved["version"] <= steps
    assert os.listdir(str(tmp_path)) == ["server.ckpt"]
    assert torch.isfinite(server.core.weights).all()


def test_run_configuration_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="method='hogwild' must be one of"):
        AsyncConfig(method="hogwild")
    with pytest.raises(ValueError, match="workers=0 must be an integer >= 1"):
        AsyncConfig(workers=0)
    with pytest.raises(ValueError, match="threads_per_worker=2 must be 1"):
        AsyncConfig(method="sequential", threads_per_worker=2)
    with pytest.raises(ValueError, match=r"no option\(s\) \['lam'\]"):
        AsyncConfig(method="asgd", rule={"lam": 0.04})
    with pytest.raises(ValueError, match="milestones"):
        AsyncConfig(milestones=(3.0, 1.0))
    with pytest.raises(ValueError, match="ratio=1.5"):
        AsyncConfig(push="dct-dp", push_options={"ratio": 1.5})
    with pytest.raises(ValueError, match="agrees on its coordinates across ranks in a first round"):
        AsyncConfig(push="powersgd")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--push", "dct", "--push-option", "ratio=1.5"], "unknown scheme 'dct'"),
    (["--push", "dct-dp", "--push-option", "ratio=1.5"], "ratio=1.5"),
    (["--push", "dct-dp", "--push-option", "bogus=1"],
     "--push-option 'bogus' is not an option of dct-dp; valid keys: capacity, "),
    (["--workers", "2", "--kill-after", "9:5"], "worker 9 is outside the run; workers: 0..1"),
    (["--rule", "sequential", "--kill-after", "0:5"], "worker 0 is outside the run; workers: none"),
    (["--rule", "asgd", "--lambda", "1"], "--lambda apply to --rule dc-asgd only"),
])
def test_async_bad_input_is_rejected_before_any_process_starts(
        argv: list[str], expected: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_processes(*args: object, **kwargs: object) -> None:
        raise AssertionError("bad input must be rejected before any process starts")

    monkeypatch.setattr(launch, "_run", no_processes)
    assert main(["async", "--no-progress", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_nonfinite_and_malformed_pushes_are_counted_never_applied() -> None:
    config = AsyncConfig(method="asgd", workers=1, passes=1, push="topk",
                         push_options={"ratio": 0.1})
    task, server = _local_server(config)
    server.join(0, {**task.fingerprint(), **config.fingerprint()})
    before = server.core.weights
    poisoned = torch.ones(task.layout.numel)
    poisoned[3] = float("inf")
    encoded = PushCodec(task.layout, "topk", ratio=0.1).encode(poisoned)
    assert encoded.dense  # a non-finite gradient travels raw, for the server to reject
    assert server.push(0, 0, encoded.data, encoded.dense).value()["outcome"] == "nonfinite"
    assert server.push(0, 1, torch.zeros(7, dtype=torch.uint8), False).value()[
        "outcome"] == "malformed"
    assert server.core.weights is before and server.core.version == 0
    assert server.core.staleness.summary()["outcomes"]["nonfinite"] == 1
