"""The RPC face of the parameter server: a thin layer over :class:`ParameterServerCore`.

Every handler here decodes, calls the core, and meters. Workers reach it
with ``torch.distributed.rpc`` (TensorPipe) through the module-level
functions :func:`rpc_join`, :func:`rpc_pull`, :func:`rpc_push` and
:func:`rpc_leave`, which find the process's server in ``_SERVER``.

Security: RPC deserialises what peers send (Python objects are unpickled),
so any process that can reach the server can run code in it. Every agent
listens on the loopback interface unless told otherwise; only trusted peers
may ever be allowed to connect.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.rpc as rpc

from thinwire.comm import Meter, done
from thinwire.ps.checkpoint import load_checkpoint, save_checkpoint
from thinwire.ps.config import AsyncConfig, Task, TaskBuilder, run_fingerprint, updates_per_pass
from thinwire.ps.core import ParameterServerCore, PushResult
from thinwire.ps.rules import build_rule
from thinwire.ps.staleness import MALFORMED, PENDING
from thinwire.ps.wire import MalformedPush, PushCodec

Future = torch.futures.Future[dict[str, Any]]  # what a push answers
SERVER_NAME = "ps"


class ParameterServer:
    """Decodes pushes, meters bytes, releases synchronous rounds, writes checkpoints.

    Args:
        core: the state machine that applies updates.
        codec: decodes pushes (the same scheme config the workers encode with).
        threads_per_worker: streams per worker; worker ``m`` owns streams
            ``m * T .. m * T + T - 1``.
        meter: records pulls as entity ``"pull"`` (``"send"``) and pushes as
            ``"push"`` (``"recv"``), per tensor, in exact bytes.
        checkpoint_path: where :meth:`checkpoint` writes; None disables it.
        checkpoint_every: also checkpoint after every this many updates (0: never).
        extra_state: saved alongside the core's state (run configuration, progress).
    """

    def __init__(self, core: ParameterServerCore, codec: PushCodec, threads_per_worker: int = 1,
                 meter: Meter | None = None, checkpoint_path: str | None = None,
                 checkpoint_every: int = 0, extra_state: Mapping[str, Any] | None = None) -> None:
        self.core = core
        self.codec = codec
        self.threads_per_worker = threads_per_worker
        self.meter = meter
        self.checkpoint_path = checkpoint_path
        self.checkpoint_every = checkpoint_every
        self.extra_state = dict(extra_state or {})
        self._pending: list[tuple[int, Future, dict[str, Any]]] = []
        self._pending_lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._checkpointed = core.version

    def streams_of(self, worker: int) -> list[int]:
        first = worker * self.threads_per_worker
        return list(range(first, first + self.threads_per_worker))

    def join(self, worker: int, fingerprint: Mapping[str, Any]) -> list[int]:
        """Admit all of ``worker``'s streams, or refuse them all.

        Raises:
            ValueError: the worker's model or configuration differs from the server's.
        """
        streams = self.streams_of(worker)
        if worker < 0 or streams[-1] >= self.core.streams:
            raise ValueError(f"worker={worker!r} is out of range for {self.core.streams} streams")
        try:
            for stream in streams:
                self.core.join(stream, fingerprint)
        except ValueError:
            self.core.mark_dead(streams)  # a refused worker is never waited for
            self._release()
            raise
        return streams

    def pull(self, stream: int) -> tuple[int, torch.Tensor]:
        version, weights = self.core.pull(stream)
        if self.meter is not None:
            for name, numel in zip(self.codec.layout.names, self.codec.layout.numels, strict=True):
                self.meter.record("pull", name, "send", numel * weights.element_size())
        return version, weights

    def push(self, stream: int, seq: int, data: torch.Tensor, dense: bool) -> Future:
        """Apply one push; the future holds the :class:`PushResult` as a dict.

        In synchronous mode the future completes when the push's round closes,
        which is the SSGD barrier, without holding an RPC thread while it waits.
        """
        try:
            grad = self.codec.decode(data, dense, self.meter)
        except MalformedPush:
            result = self.core.reject(stream, MALFORMED, seq)
        else:
            result = self.core.push(stream, grad, seq)
        self._maybe_checkpoint()
        answer = dataclasses.asdict(result)
        if result.outcome != PENDING or result.round is None:
            return done(answer)
        future: Future = Future()
        with self._pending_lock:
            self._pending.append((result.round, future, answer))
        self._release()  # the round may have closed before the future was registered
        return future

    def leave(self, stream: int) -> None:
        self.core.leave(stream)
        self._release()

    def worker_died(self, worker: int) -> None:
        """Forget a worker whose process ended without leaving (its pushes in flight are lost)."""
        self.core.mark_dead(self.streams_of(worker))
        self._release()

    def expire(self) -> None:
        if self.core.expire():
            self._release()

    def _release(self) -> None:
        closed = self.core.rounds_closed
        with self._pending_lock:
            ready = [p for p in self._pending if p[0] < closed]
            self._pending = [p for p in self._pending if p[0] >= closed]
        for _, future, answer in ready:
            future.set_result({**answer, "version": self.core.version})

    def _maybe_checkpoint(self) -> None:
        if (self.checkpoint_every and self.checkpoint_path is not None
                and self.core.version >= self._checkpointed + self.checkpoint_every):
            self.checkpoint()

    def checkpoint(self) -> None:
        """Write the core's state (one consistent version) to ``checkpoint_path``."""
        if self.checkpoint_path is None:
            return
        with self._checkpoint_lock:
            state = self.core.state_dict()
            if state["version"] < self._checkpointed:
                return  # a newer checkpoint was written meanwhile
            save_checkpoint(self.checkpoint_path, {"core": state, **self.extra_state})
            self._checkpointed = state["version"]


_SERVER: ParameterServer | None = None


def _server() -> ParameterServer:
    if _SERVER is None:
        raise RuntimeError("no parameter server runs in this process")
    return _SERVER


def rpc_join(worker: int, fingerprint: dict[str, Any]) -> list[int]:
    return _server().join(worker, fingerprint)


def rpc_pull(stream: int) -> tuple[int, torch.Tensor]:
    return _server().pull(stream)


@rpc.functions.async_execution  # type: ignore[untyped-decorator]
def rpc_push(stream: int, seq: int, data: torch.Tensor, dense: bool) -> Future:
    return _server().push(stream, seq, data, dense)


def rpc_leave(stream: int) -> None:
    _server().leave(stream)


# Process entry points -------------------------------------------------------------


def prepare_process(interface: str) -> None:
    """Per-process settings: one intra-op thread, RPC agents listen on ``interface``."""
    torch.set_num_threads(1)
    # TensorPipe binds its TCP listener to this interface's address (loopback by default).
    os.environ["TP_SOCKET_IFNAME"] = interface
    warnings.filterwarnings("ignore", message="You are using a Backend")


def backend_options(config: AsyncConfig, init_method: str) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        init_method=init_method, rpc_timeout=config.rpc_timeout_s,
        num_worker_threads=max(16, 2 * config.streams + 4))


def build_server(config: AsyncConfig, task: Task) -> ParameterServer:
    """The server of ``config`` for ``task`` (resumed from ``config.resume`` if set)."""
    per_pass = updates_per_pass(config, task)
    rule = build_rule(config.rule_name, **config.rule_options(per_pass))
    core = ParameterServerCore(
        task.initial_weights(), rule, config.streams, max_staleness=config.max_staleness,
        synchronous=config.synchronous, fingerprint=run_fingerprint(config, task),
        audit=config.audit, lease_s=config.lease_s,
        snapshot_every=max(1, round(config.snapshot_every * per_pass)))
    if config.resume is not None:
        core.load_state_dict(load_checkpoint(config.resume)["core"])
    codec = PushCodec(task.layout, config.push, **config.push_options)
    return ParameterServer(core, codec, config.threads_per_worker, Meter(0, config.workers + 1),
                           config.checkpoint, config.checkpoint_every,
                           {"fingerprint": run_fingerprint(config, task)})


def server_results(server: ParameterServer) -> dict[str, Any]:
    """What the server process hands back to the launcher."""
    core = server.core
    return {"core": core.state_dict(), "updates_per_second": core.updates_per_second(),
            "apply_seconds": core.apply_seconds, "staleness": core.staleness.summary(),
            "meter": server.meter.summary() if server.meter else {}, "status": list(core.status)}


def serve(config: AsyncConfig, spec: TaskBuilder, workdir: str, init_method: str,
          deaths: Any, stop: Any) -> None:
    """Server process: serve until every stream has left, died or been refused.

    The results are written then; the RPC agent stays up until ``stop`` is
    set, so the answers to the last ``leave`` calls reach their workers
    before the agent shuts down.

    Args:
        deaths: a queue of worker ids whose processes ended without leaving
            (filled by the launcher, which watches the processes).
        stop: an event the launcher sets once every worker process has ended.
    """
    global _SERVER
    prepare_process(config.interface)
    try:
        task = spec.build()
        _SERVER = server = build_server(config, task)
        rpc.init_rpc(
            SERVER_NAME, rank=0, world_size=config.workers + 1,
            rpc_backend_options=backend_options(config, init_method))
    except BaseException:
        _write_error(workdir, "server")
        sys.exit(1)  # the launcher raises with the traceback just written
    failed = False
    try:
        while not server.core.wait_finished(timeout=0.05):
            while True:
                try:
                    server.worker_died(int(deaths.get_nowait()))
                except queue.Empty:
                    break
            server.expire()
        server.checkpoint()
        torch.save(server_results(server), os.path.join(workdir, "server.pt"))
        stop.wait(config.rpc_timeout_s)
    except BaseException:
        _write_error(workdir, "server")
        failed = True
    finally:
        rpc.shutdown(graceful=False)
        _SERVER = None
    if failed:
        sys.exit(1)


def _write_error(workdir: str, name: str) -> None:
    with open(os.path.join(workdir, f"{name}.error"), "w") as handle:
        handle.write(traceback.format_exc())


__all__ = ["ParameterServer", "PushResult", "build_server", "rpc_join", "rpc_leave",
           "rpc_pull", "rpc_push", "serve"]
