"""One worker's torchft Manager: its Lighthouse, its store, bounded waits, clear errors."""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torchft.manager import Manager

from thinwire.elastic.group import QuorumGroup

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the Lighthouse address
# A quorum request asks the Lighthouse again after this long without an answer (or at once
# after a refused connection): a restarted Lighthouse is found within it
QUORUM_ASK_S = 5.0


class QuorumLost(RuntimeError):
    """No quorum formed in time: the Lighthouse is gone, or too few workers are alive."""


def connect(lighthouse: str | None = None, *, min_workers: int = 1,
            replica_id: str | None = None, backend: str = "gloo", timeout_s: float = 60.0,
            quorum_timeout_s: float = 600.0, max_failures: int | None = 20,
            heartbeat_timeout_s: float | None = 5.0) -> Manager:
    """A torchft Manager for this worker, its exchanges on a :class:`QuorumGroup`.

    Each worker is a replica group of one process, launched and relaunched on
    its own (one ``torchrun --nproc-per-node 1`` each, or a plain process).
    Under torchrun, the replica group's store is torchrun's (``MASTER_ADDR``);
    otherwise this process starts one on its host name. At step 0 every worker
    but one takes its state from a live peer, so all start alike.

    Args:
        lighthouse: the Lighthouse's address (``http://host:29510``); None: the
            ``TORCHFT_LIGHTHOUSE`` environment variable.
        min_workers: the fewest workers a step or sync commits with, >= 1.
        replica_id: names this worker to the Lighthouse (a relaunched worker takes its
            old name); None: a fresh one.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: the longest a collective, a commit vote or a state transfer waits on
            a peer before the step fails (gloo's own default is 30 minutes).
        quorum_timeout_s: the longest a worker waits for a quorum: longer than the time
            between two syncs, since a joining worker waits for the others' next one.
        max_failures: consecutive steps or syncs that fail to commit before the worker
            gives up with an error; None: never.
        heartbeat_timeout_s: a worker of the quorum that stops answering this long
            (stopped, swapped out, lost with its connections open) fails the exchange in
            flight on every other worker at once (:mod:`thinwire.elastic.watch`), where a
            dead one's closed connections fail it at once anyway. The Lighthouse's heartbeat
            timeout is the value to use: the next quorum then leaves it out. None: a
            stalled worker costs the others ``timeout_s``.

    Raises:
        ValueError: a bad option, no Lighthouse address, torch.distributed's default group
            already formed, or a torchrun job of more than one process per replica group.
        QuorumLost: the Lighthouse did not answer within ``timeout_s``.
    """
    address = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not address:
        raise ValueError(f"no Lighthouse address: pass one (--lighthouse http://HOST:29510) "
                         f"or set {LIGHTHOUSE_ENV}; start one with `thinwire lighthouse` or "
                         "`torchft_lighthouse --min_replicas N`")
    if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
        raise ValueError(f"min_workers={min_workers!r} must be an integer >= 1")
    timeouts = [("timeout_s", timeout_s), ("quorum_timeout_s", quorum_timeout_s)]
    if heartbeat_timeout_s is not None:
        timeouts.append(("heartbeat_timeout_s", heartbeat_timeout_s))
    for name, value in timeouts:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")
    if max_failures is not None and (not isinstance(max_failures, int) or max_failures < 0):
        raise ValueError(f"max_failures={max_failures!r} must be None or an integer >= 0")
    if dist.is_initialized():
        raise ValueError("torch.distributed's default group is already formed: under fault "
                         "tolerance each quorum forms it (do not call init_process_group)")
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']}: a fault-tolerant worker is a "
                         "replica group of one process; launch one torchrun "
                         "--nproc-per-node 1 per worker")
    group = QuorumGroup(backend, timedelta(seconds=timeout_s), silence_s=heartbeat_timeout_s)
    store: dict[str, Any] = {}
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        host = socket.gethostname()
        own = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                            timeout=timedelta(seconds=timeout_s))
        store = {"store_addr": host, "store_port": own.port}
        group.store = own  # the replica group's store lives as long as its group
    try:
        return Manager(pg=group, load_state_dict=None, state_dict=None,
                       min_replica_size=min_workers, use_async_quorum=False,
                       timeout=timedelta(seconds=timeout_s),
                       quorum_timeout=timedelta(seconds=quorum_timeout_s),
                       connect_timeout=timedelta(seconds=timeout_s), rank=0, world_size=1,
                       lighthouse_addr=address, replica_id=replica_id, init_sync=True,
                       max_retries=max_failures,
                       quorum_retries=max(0, math.ceil(quorum_timeout_s / QUORUM_ASK_S) - 1),
                       **store)
    except RuntimeError as error:  # torchft's Rust client: the Lighthouse did not answer
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise QuorumLost(f"the Lighthouse is gone or unreachable at {address} (waited "
                         f"{timeout_s:g} s to connect): {cause}") from error


def quorum(manager: Manager) -> bool:
    """Start the step's quorum and wait for it (a joining worker is healed in it).

    Returns:
        Whether the quorum's group is formed and no error was reported in it (False:
        the step cannot commit; the next quorum tries again).

    Raises:
        QuorumLost: no quorum within the Manager's quorum timeout.
    """
    try:
        manager.start_quorum()
    except Exception as error:  # torchft raises a TimeoutError or a RuntimeError from Rust
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise QuorumLost("no quorum formed within the quorum timeout: the Lighthouse is gone "
                         "or unreachable, or fewer workers than the minimum are alive "
                         f"(torchft: {cause})") from error
    return manager.errored() is None and dist.is_initialized()


def start_lighthouse(bind: str = "[::]:29510", *, min_workers: int = 1,
                     join_timeout_s: float = 60.0, heartbeat_timeout_s: float = 5.0) -> Any:
    """torchft's Lighthouse in this process (``shutdown()`` it when done).

    Args:
        bind: the address to listen on (``[::]:0``: any free port).
        min_workers: the fewest workers that form a quorum.
        join_timeout_s: how long a new quorum waits for workers that are alive (heartbeat)
            but have not asked for it yet. Longer than the time between two syncs: else
            workers that join while the others train can form a quorum of their own,
            their training apart. A dead worker is not waited for (see the next).
        heartbeat_timeout_s: how long a silent worker counts as alive: what a lost worker
            costs the others' next quorum.

    Returns:
        The ``LighthouseServer``; its ``address()`` is what workers connect to.
    """
    from torchft.coordination import LighthouseServer

    if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
        raise ValueError(f"min_workers={min_workers!r} must be an integer >= 1")
    for name, value in (("join_timeout_s", join_timeout_s),
                        ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")
    return LighthouseServer(bind=bind, min_replicas=min_workers,
                            join_timeout_ms=int(1000 * join_timeout_s),
                            heartbeat_timeout_ms=int(1000 * heartbeat_timeout_s))
