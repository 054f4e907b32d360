"""Workers: pull, compute a gradient on the shard, push (DC-ASGD Algorithm 1).

A worker process runs ``threads_per_worker`` streams. Each stream pulls its
own copy of the weights, so hogwild threads never share a model; they share
the worker's push codec and with it one error-feedback buffer (DCT §3.3).
The loop is the same whether the server is reached over RPC
(:class:`RpcTransport`) or in-process (:class:`LocalTransport`, used by the
sequential reference and by tests).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed.rpc as rpc

from thinwire.comm import Meter
from thinwire.ps import server as ps_server
from thinwire.ps.config import AsyncConfig, Task, TaskBuilder, run_fingerprint
from thinwire.ps.layout import Layout
from thinwire.ps.staleness import CLOSED
from thinwire.ps.wire import Encoded, PushCodec


class Transport(Protocol):
    """How a worker reaches the server."""

    def join(self, worker: int, fingerprint: dict[str, Any]) -> list[int]: ...
    def pull(self, stream: int) -> tuple[int, torch.Tensor]: ...
    def push(self, stream: int, seq: int, encoded: Encoded) -> dict[str, Any]: ...
    def leave(self, stream: int) -> None: ...


def _record_pull(meter: Meter | None, layout: Layout, weights: torch.Tensor) -> None:
    if meter is not None:
        for name, numel in zip(layout.names, layout.numels, strict=True):
            meter.record("pull", name, "recv", numel * weights.element_size())


class RpcTransport:
    """Calls the server's RPC functions; records pulled bytes as ``"pull"``/``"recv"``."""

    def __init__(self, layout: Layout, meter: Meter | None = None,
                 server: str = ps_server.SERVER_NAME) -> None:
        self.layout = layout
        self.meter = meter
        self.server = server

    def join(self, worker: int, fingerprint: dict[str, Any]) -> list[int]:
        streams: list[int] = rpc.rpc_sync(self.server, ps_server.rpc_join,
                                          args=(worker, fingerprint))
        return streams

    def pull(self, stream: int) -> tuple[int, torch.Tensor]:
        version, weights = rpc.rpc_sync(self.server, ps_server.rpc_pull, args=(stream,))
        _record_pull(self.meter, self.layout, weights)
        return int(version), weights

    def push(self, stream: int, seq: int, encoded: Encoded) -> dict[str, Any]:
        answer: dict[str, Any] = self.push_async(stream, seq, encoded).wait()
        return answer

    def push_async(self, stream: int, seq: int, encoded: Encoded) -> Any:
        return rpc.rpc_async(self.server, ps_server.rpc_push,
                             args=(stream, seq, encoded.data, encoded.dense))

    def leave(self, stream: int) -> None:
        rpc.rpc_sync(self.server, ps_server.rpc_leave, args=(stream,))


class DyingTransport:
    """Fault injection: after ``after`` pushes, send one more and kill this process at once.

    The process receives SIGKILL while its last push is in flight (no cleanup,
    no ``leave``), which is how a machine failure looks to the server.
    """

    def __init__(self, inner: RpcTransport, after: int) -> None:
        self.inner = inner
        self.after = after
        self.pushes = 0
        self._lock = threading.Lock()

    def join(self, worker: int, fingerprint: dict[str, Any]) -> list[int]:
        return self.inner.join(worker, fingerprint)

    def pull(self, stream: int) -> tuple[int, torch.Tensor]:
        return self.inner.pull(stream)

    def push(self, stream: int, seq: int, encoded: Encoded) -> dict[str, Any]:
        with self._lock:
            self.pushes += 1
            doomed = self.pushes > self.after
        if doomed:
            self.inner.push_async(stream, seq, encoded)
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.push(stream, seq, encoded)

    def leave(self, stream: int) -> None:
        self.inner.leave(stream)


class LocalTransport:
    """Calls a :class:`~thinwire.ps.server.ParameterServer` in this process.

    Pulls return a copy, as a remote pull would, so a worker can never write
    into the server's weights.
    """

    def __init__(self, server: ps_server.ParameterServer, meter: Meter | None = None) -> None:
        self.server = server
        self.meter = meter

    def join(self, worker: int, fingerprint: dict[str, Any]) -> list[int]:
        return self.server.join(worker, fingerprint)

    def pull(self, stream: int) -> tuple[int, torch.Tensor]:
        version, weights = self.server.pull(stream)
        _record_pull(self.meter, self.server.codec.layout, weights)
        return version, weights.clone()

    def push(self, stream: int, seq: int, encoded: Encoded) -> dict[str, Any]:
        answer: dict[str, Any] = self.server.push(stream, seq, encoded.data.clone(),
                                                  encoded.dense).wait()
        return answer

    def leave(self, stream: int) -> None:
        self.server.leave(stream)


def _journal(folder: str, stream: int, seq: int, sent: torch.Tensor) -> None:
    """Save the gradient a push carries before sending it (atomic: temp file + rename)."""
    path = os.path.join(folder, f"s{stream}-{seq}.pt")
    temporary = f"{path}.tmp"
    torch.save(sent.clone(), temporary)
    os.replace(temporary, path)


def run_stream(stream: int, config: AsyncConfig, task: Task, codec: PushCodec,
               transport: Transport, meter: Meter | None = None,
               on_push: Callable[[], None] | None = None, first_pass: int = 0) -> Counter[str]:
    """One stream's loop over its shard: pull, gradient, encode, push; then leave.

    Returns:
        How many pushes had each outcome.
    """
    outcomes: Counter[str] = Counter()
    seq = 0
    try:
        for batch in task.batches(stream, config.streams, config.passes, first_pass):
            _, weights = transport.pull(stream)
            encoded = codec.encode(task.gradient(weights, batch), meter)
            if config.journal_dir is not None:
                _journal(config.journal_dir, stream, seq, encoded.sent)
            answer = transport.push(stream, seq, encoded)
            outcomes[answer["outcome"]] += 1
            seq += 1
            if meter is not None:
                meter.next_step()
            if on_push is not None:
                on_push()
            if answer["outcome"] == CLOSED:
                break  # the server no longer counts this stream
    finally:
        transport.leave(stream)
    return outcomes


def run_worker(worker: int, config: AsyncConfig, task: Task, codec: PushCodec,
               transport: Transport, meter: Meter | None = None,
               on_push: Callable[[], None] | None = None, first_pass: int = 0) -> dict[str, Any]:
    """Join, run every stream of ``worker`` (threads when more than one), report.

    Raises:
        ValueError: the server refused the worker (different model or configuration).
    """
    streams = transport.join(worker, run_fingerprint(config, task))
    results: dict[int, Counter[str]] = {}
    errors: list[BaseException] = []

    def body(stream: int) -> None:
        try:
            results[stream] = run_stream(stream, config, task, codec, transport, meter,
                                         on_push, first_pass)
        except BaseException as error:  # re-raised in the calling thread
            errors.append(error)

    if len(streams) == 1:
        body(streams[0])
    else:
        threads = [threading.Thread(target=body, args=(s,), name=f"stream{s}") for s in streams]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    total: Counter[str] = Counter()
    for counts in results.values():
        total.update(counts)
    memory = codec.memory
    return {"worker": worker, "streams": streams, "outcomes": dict(total),
            "pushes": sum(total.values()), "nonfinite_local": codec.nonfinite,
            "drains": getattr(memory, "drains", 0),
            "meter": meter.summary() if meter is not None else {},
            "bytes": _bytes_by_entity(meter)}


def _bytes_by_entity(meter: Meter | None) -> dict[str, int]:
    if meter is None:
        return {}
    return {entity: int(nbytes) for entity, nbytes in meter.totals(by="entity").items()}


def work(worker: int, config: AsyncConfig, spec: TaskBuilder, workdir: str, init_method: str,
         counter: Any, first_pass: int = 0, die_after: int | None = None) -> None:
    """Worker process: join the RPC group as ``worker{m}``, train, report, shut down.

    Args:
        counter: a shared integer the launcher reads for progress.
        die_after: fault injection, see :class:`DyingTransport`.
    """
    ps_server.prepare_process(config.interface)
    try:
        task = spec.build()
        codec = PushCodec(task.layout, config.push, **config.push_options)
        meter = Meter(worker + 1, config.workers + 1)
        rpc.init_rpc(
            f"worker{worker}", rank=worker + 1, world_size=config.workers + 1,
            rpc_backend_options=ps_server.backend_options(config, init_method))
    except BaseException:
        _write_error(workdir, worker)
        sys.exit(1)  # reported by the launcher from the files just written

    def on_push() -> None:
        with counter.get_lock():
            counter.value += 1

    failed = False
    try:
        transport: Transport = RpcTransport(task.layout, meter)
        if die_after is not None:
            transport = DyingTransport(RpcTransport(task.layout, meter), die_after)
        result = run_worker(worker, config, task, codec, transport, meter, on_push, first_pass)
        torch.save(result, os.path.join(workdir, f"worker{worker}.pt"))
    except BaseException:
        _write_error(workdir, worker)
        failed = True
    finally:
        rpc.shutdown(graceful=False)
    if failed:
        sys.exit(1)


def _write_error(workdir: str, worker: int) -> None:
    """Save the traceback, and a one-line summary the launcher reports."""
    with open(os.path.join(workdir, f"worker{worker}.traceback"), "w") as handle:
        handle.write(traceback.format_exc())
    with open(os.path.join(workdir, f"worker{worker}.error"), "w") as handle:
        handle.write(error_summary(sys.exc_info()[1]))


def error_summary(error: BaseException | None) -> str:
    """One line for an exception; for one raised on the server, the server's own message."""
    lines = str(error).splitlines()
    for number, line in enumerate(lines[:-1]):
        if "On WorkerInfo" in line:  # torch RPC: the remote exception's repr comes next
            return lines[number + 1]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
