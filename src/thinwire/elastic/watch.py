"""Peers that fall silent, found within the heartbeat: the group is cut rather than waited on.

A dead peer's connections close, and every survivor's collective fails at
once. A stalled one (stopped, swapped out, a paused VM) keeps them open, and
its peers would wait out the group's timeout on it. So every worker of a
quorum's group beats in the quorum's store from a thread of its own, which a
stalled process stops with the rest of it, and watches the others' beats.
Where one has not moved for ``silence_s`` (or the store, held by one of the
workers, stops answering), the watch cuts this worker's side of the group:
gloo's connections are shut (aborting gloo's group does not wake a wait in
flight), NCCL's communicator is aborted. The collective in flight fails, the
step or sync does not commit, and the next quorum leaves the silent worker
out. A stalled worker that wakes finds its own connections cut by the others
and its watch finds their beats stopped: it fails too, and is healed at its
next quorum.

gloo's connections are the sockets that opened while the group formed (Linux
lists them in /proc; elsewhere nothing is cut and a stalled peer costs the
group's timeout). A socket another thread of the process opened in that
moment is shut with them if the group is cut.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store  # torch.distributed.Store, typed

BEATS_PER_SILENCE = 5  # beats in each silence_s: a peer is missed after silence_s, not later
# a peer's first beat may come this many silence_s after the watch starts: each worker's
# side of the group forms at its own moment (and a healed one is loading its state)
FIRST_BEAT_SILENCES = 3
PROC_FDS = "/proc/self/fd"


def _sockets() -> dict[int, str]:
    """This process's open sockets: descriptor to kernel name (``socket:[inode]``, unique
    while open); empty where the system does not list them (not Linux)."""
    try:
        fds = os.listdir(PROC_FDS)
    except OSError:
        return {}
    found = {}
    for fd in fds:
        try:
            name = os.readlink(os.path.join(PROC_FDS, fd))
        except OSError:  # closed since listed
            continue
        if name.startswith("socket:"):
            found[int(fd)] = name
    return found


def open_sockets() -> set[str]:
    """The kernel names of this process's open sockets (:func:`shut_sockets` takes them)."""
    return set(_sockets().values())


def shut_sockets(names: set[str]) -> int:
    """Shut the connected sockets among ``names`` (their owner's reads and writes fail at
    once; listening ones are left alone: gloo aborts the process on a failed accept).

    Returns:
        How many were shut.
    """
    shut = 0
    for fd, name in _sockets().items() if names else ():
        if name not in names:
            continue
        try:
            connection = socket.socket(fileno=fd)  # borrowed: detached, never closed
        except OSError:  # closed by its owner meanwhile, the number reused
            continue
        try:
            if not connection.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                connection.shutdown(socket.SHUT_RDWR)
                shut += 1
        except OSError:  # closed by its owner meanwhile
            pass
        finally:
            connection.detach()
    return shut


class PeerWatch:
    """This worker's beat in the quorum's store, and the watch on its peers' beats.

    The watch ends with :meth:`stop`, or once ``group`` is no longer torch.distributed's
    default group (ended after a failed step, or at the end of the job).

    Args:
        group: the quorum's group, torch.distributed's default group.
        store: a client of the quorum's store whose waits are bounded by ``silence_s``.
        rank: this worker's rank in the quorum's group.
        world_size: the group's workers.
        silence_s: how long a peer's beat may stand still before the group is cut.
        cut: cuts this worker's side of the group; called once, from the watch's thread,
            with the reason.

    Attributes:
        silent: why the group was cut (a peer's rank and how long it was silent, or the
            store's error); None while it is not.
    """

    def __init__(self, group: dist.ProcessGroup, store: Store, rank: int,
                 world_size: int, silence_s: float, cut: Callable[[str], None]) -> None:
        if not silence_s > 0:
            raise ValueError(f"silence_s={silence_s!r} must be > 0")
        self.group, self.store, self.rank, self.world_size = group, store, rank, world_size
        self.silence_s, self.cut = silence_s, cut
        self.silent: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a cut and a stop do not overlap
        self._thread = threading.Thread(target=self._run, name=f"thinwire-peer-watch-{rank}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch (the group is ending): no beat, no cut after this returns."""
        with self._lock:
            self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        now = time.monotonic()
        seen = {rank: (-1, now) for rank in peers}  # a peer's last beat count, when it moved
        while not self._stop.wait(self.silence_s / BEATS_PER_SILENCE):
            if dist.group.WORLD is not self.group:
                return
            try:
                self.store.add(_key(self.rank), 1)
                counts = {rank: self.store.add(_key(rank), 0) for rank in peers}
            except Exception as error:  # noqa: BLE001  (its host is stalled or gone)
                self._silent(f"the quorum's store did not answer within {self.silence_s:g} s "
                             f"({error})")
                return
            now = time.monotonic()
            for rank, count in counts.items():
                last, since = seen[rank]
                allowed = self.silence_s * (FIRST_BEAT_SILENCES if count == 0 else 1)
                if count != last:
                    seen[rank] = (count, now)
                elif now - since > allowed:
                    self._silent(f"worker of rank {rank} in the quorum was silent for "
                                 f"{now - since:.1f} s (more than {allowed:g} s)")
                    return

    def _silent(self, why: str) -> None:
        with self._lock:
            if not self._stop.is_set() and dist.group.WORLD is self.group:
                self.silent = why
                self.cut(why)


def _key(rank: int) -> str:
    return f"thinwire/beat/{rank}"
