"""Run one method of the comparison: sequential in-process, or a server and workers on RPC.

The launcher starts the server and the workers as processes (forkserver with
torch preloaded, so each start is cheap), watches them, and is the one that
notices a worker process ending without leaving: it tells the server, which
then stops waiting for that worker's streams. Every run has a deadline after
which all its processes are killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from multiprocessing import forkserver
from typing import Any

import torch

from thinwire.comm import Meter
from thinwire.progress import StepBar
from thinwire.ps.checkpoint import load_checkpoint
from thinwire.ps.config import AsyncConfig, Task, TaskBuilder, pushes_per_pass
from thinwire.ps.core import Snapshot
from thinwire.ps.server import build_server, serve, server_results
from thinwire.ps.wire import PushCodec
from thinwire.ps.worker import LocalTransport, run_worker, work

_PRELOAD = ["torch", "torch.distributed.rpc", "sklearn.datasets", "sklearn.model_selection",
            "thinwire.ps.server", "thinwire.ps.worker"]


@dataclass
class RunResult:
    """The outcome of one run: the global model, its learning curve and the server's records."""

    config: AsyncConfig
    spec: TaskBuilder  # the task every process rebuilt
    weights: torch.Tensor  # the final global model (flat)
    final: dict[str, float]  # test error and loss of the final model
    curve: list[dict[str, float]]  # per snapshot: version, passes, seconds since the first
    # pull, test error and loss
    staleness: dict[str, Any]  # histogram of tau, dropped, outcome counts
    updates: int  # updates the server applied (including a resumed run's earlier ones)
    updates_per_second: float  # server updates per second, first pull to last update
    apply_seconds: float  # time spent inside the update rule
    wall_seconds: float  # the launcher's wall time for the run
    bytes: dict[str, int]  # bytes pulled and pushed, summed over workers
    workers: dict[int, dict[str, Any]]  # per worker: pushes and outcomes, or its error
    membership: list[str]  # final status of each stream: left, dead or refused
    server_state: dict[str, Any] = field(repr=False, default_factory=dict)  # final core state

    def summary(self) -> dict[str, Any]:
        """Everything but tensors, for JSON results files."""
        return {"config": {k: (dict(v) if isinstance(v, Mapping) else v)
                           for k, v in asdict(self.config).items()},
                "task": asdict(self.spec), "final": self.final, "curve": self.curve,
                "staleness": self.staleness, "updates": self.updates,
                "updates_per_second": self.updates_per_second,
                "apply_seconds": self.apply_seconds, "wall_seconds": self.wall_seconds,
                "bytes": self.bytes, "workers": self.workers, "membership": self.membership}


def run(config: AsyncConfig, spec: TaskBuilder, *,
        kill_after: Mapping[int, int] | None = None,
        worker_specs: Mapping[int, TaskBuilder] | None = None,
        progress: bool = False) -> RunResult:
    """Train ``spec``'s model with ``config.method`` and evaluate the global model.

    Args:
        config: method, workers, rule, pushes, checkpoints, deadline.
        spec: the task every process rebuilds, e.g.
            :class:`thinwire.jobs.ps_task.TaskSpec`.
        kill_after: fault injection: ``{m: n}`` makes worker ``m`` send its
            ``n + 1``-th push and kill its own process (SIGKILL) while that push
            is in flight.
        worker_specs: start worker ``m`` with another task spec (a deployment
            mistake: the server refuses such a worker at join).
        progress: show a progress bar of pushes.

    Raises:
        TimeoutError: the run passed ``config.timeout_s`` (all processes are killed).
        RuntimeError: the server process failed.
        ValueError: a bad configuration or ``kill_after`` (before any process starts).
    """
    check_kill_after(config, kill_after or {})
    task = spec.build()
    per_pass = pushes_per_pass(config, task)
    first_pass = 0
    if config.resume is not None:
        received = _received(load_checkpoint(config.resume)["core"])
        first_pass = round(received / per_pass)
    with _one_thread():
        return _run(config, spec, task, per_pass, first_pass, kill_after or {},
                    worker_specs or {}, progress)


def check_kill_after(config: AsyncConfig, kill_after: Mapping[int, int]) -> None:
    """Fault injection must name worker processes of this run.

    Raises:
        ValueError: a worker outside ``0 .. workers - 1``, any worker in the
            sequential method (it has no worker processes), or a negative count.
    """
    workers = 0 if config.method == "sequential" else config.workers
    for worker, pushes in sorted(kill_after.items()):
        if not 0 <= worker < workers:
            allowed = f"0..{workers - 1}" if workers else "none (sequential runs in-process)"
            raise ValueError(f"--kill-after worker {worker} is outside the run; workers: "
                             f"{allowed}")
        if pushes < 0:
            raise ValueError(f"--kill-after pushes {pushes} for worker {worker} must be >= 0")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread while the launcher computes: several processes share the cores,
    and a spinning thread pool on a busy machine can be a hundred times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _run(config: AsyncConfig, spec: TaskBuilder, task: Task, per_pass: int,
         first_pass: int, kill_after: Mapping[int, int], worker_specs: Mapping[int, TaskBuilder],
         progress: bool) -> RunResult:
    start = time.monotonic()
    if config.method == "sequential":
        server_out, workers = _run_local(config, task, first_pass, progress)
    else:
        server_out, workers = _run_processes(config, spec, per_pass, first_pass, kill_after,
                                             worker_specs, progress)
    wall = time.monotonic() - start
    state = server_out["core"]
    snapshots = [Snapshot(*entry) for entry in state["snapshots"]]
    started = state["first_pull"] or 0.0  # training time: from the first pull, not start-up
    curve = [{"version": s.version, "passes": s.received / per_pass,
              "seconds": max(0.0, s.seconds - started), **task.evaluate(s.weights)}
             for s in snapshots]
    totals: dict[str, int] = {}
    for report in workers.values():
        for entity, nbytes in report.get("bytes", {}).items():
            totals[entity] = totals.get(entity, 0) + nbytes
    return RunResult(config, spec, state["weights"], task.evaluate(state["weights"]), curve,
                     server_out["staleness"], int(state["version"]),
                     float(server_out["updates_per_second"]), float(server_out["apply_seconds"]),
                     wall, totals, workers, list(server_out["status"]), state)


def _received(state: Mapping[str, Any]) -> int:
    return sum(n for k, n in state["staleness"]["outcomes"].items() if k != "closed")


def _run_local(config: AsyncConfig, task: Task, first_pass: int,
               progress: bool) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    server = build_server(config, task)
    meter = Meter()
    codec = PushCodec(task.layout, config.push, **config.push_options)
    bar = StepBar(task.steps(0, 1, config.passes), show=progress, unit="push")
    report = run_worker(0, config, task, codec, LocalTransport(server, meter), meter,
                        lambda: bar.update(1, "sequential"), first_pass)
    bar.close()
    server.checkpoint()
    return server_results(server), {0: report}


def _context() -> Any:
    """A forkserver context whose server has torch and thinwire imported once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    # TensorPipe logs a warning for every pipe closed at shutdown; keep C++ logs to errors
    # in the processes the forkserver starts, unless the user chose a level.
    saved = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]
    return context


def _run_processes(config: AsyncConfig, spec: TaskBuilder, per_pass: int, first_pass: int,
                   kill_after: Mapping[int, int], worker_specs: Mapping[int, TaskBuilder],
                   progress: bool) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    context = _context()
    with tempfile.TemporaryDirectory(prefix="thinwire-ps-") as workdir:
        init_method = config.init_method or f"file://{workdir}/rendezvous"
        deaths = context.Queue()
        stop = context.Event()
        counters = [context.Value("q", 0) for _ in range(config.workers)]
        server = context.Process(target=serve, name="thinwire-ps",
                                 args=(config, spec, workdir, init_method, deaths, stop))
        workers = [context.Process(target=work, name=f"thinwire-worker{m}",
                                   args=(m, config, worker_specs.get(m, spec), workdir,
                                         init_method, counters[m], first_pass,
                                         kill_after.get(m)))
                   for m in range(config.workers)]
        processes = [server, *workers]
        deadline = time.monotonic() + config.timeout_s
        try:
            for process in processes:
                process.start()
            # The bar starts at the first push: after the workers have joined the server.
            bar = StepBar(per_pass * config.passes, show=progress, unit="push")
            try:
                _supervise(server, workers, counters, deaths, deadline, bar, config.method)
            finally:
                bar.close()
            stop.set()  # every worker has ended: the server may shut its agent down
            server.join(max(1.0, deadline - time.monotonic()))
            if server.is_alive():
                raise TimeoutError("the parameter server did not stop by the run's deadline "
                                   "(AsyncConfig.timeout_s); all processes were killed")
            if server.exitcode != 0:
                raise RuntimeError(f"the parameter server failed (exit code {server.exitcode}):\n"
                                   f"{_read(workdir, 'server.error')}")
            server_out = torch.load(os.path.join(workdir, "server.pt"), weights_only=False)
            reports = {m: _worker_report(workdir, m, workers[m].exitcode)
                       for m in range(config.workers)}
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join(5.0)
            deaths.close()
    return server_out, reports


def _supervise(server: Any, workers: list[Any], counters: list[Any], deaths: Any,
               deadline: float, bar: StepBar, method: str) -> None:
    """Watch the processes until every worker has ended (or the server failed)."""
    reported: set[int] = set()
    shown = 0
    while len(reported) < len(workers) and server.is_alive():
        pushes = sum(counter.value for counter in counters)
        if pushes > shown:
            bar.update(pushes - shown, method)
            shown = pushes
        for m, process in enumerate(workers):
            if m not in reported and not process.is_alive() and process.exitcode is not None:
                reported.add(m)
                if process.exitcode != 0:
                    deaths.put(m)  # the server stops waiting for this worker's streams
        if time.monotonic() > deadline:
            raise TimeoutError("the run passed its deadline (AsyncConfig.timeout_s); all its "
                               "processes were killed")
        time.sleep(0.02)


def _read(workdir: str, name: str) -> str:
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
        return "(no error report)"
    with open(path) as handle:
        return handle.read()


def _worker_report(workdir: str, worker: int, exitcode: int | None) -> dict[str, Any]:
    path = os.path.join(workdir, f"worker{worker}.pt")
    if os.path.exists(path):
        report: dict[str, Any] = torch.load(path, weights_only=False)
        return report
    if exitcode is not None and exitcode < 0:
        return {"worker": worker, "error": f"killed by {signal.Signals(-exitcode).name}"}
    return {"worker": worker, "error": _read(workdir, f"worker{worker}.error").strip()
            or f"exit code {exitcode}"}

