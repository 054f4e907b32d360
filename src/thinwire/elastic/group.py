"""The quorum's workers as torch.distributed's default group, re-formed at each new quorum."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroup, create_store_client

from thinwire.elastic.watch import PeerWatch, open_sockets, shut_sockets
from thinwire.launch import end_process_group

BACKENDS = ("gloo", "nccl")
_LOG = logging.getLogger("thinwire.elastic")


class QuorumGroup(ProcessGroup):  # type: ignore[misc]
    """torchft's reconfigurable process group, kept as torch.distributed's default group.

    torchft's Manager calls :meth:`configure` whenever the Lighthouse forms a
    quorum of other workers; this destroys the last default group and forms
    one of the new quorum's workers, ranked as the quorum ranks them. Every
    thinwire exchange then runs over it unchanged (``group=None``), and a
    scheme's mean divides by the number of workers in it. One process per
    replica group: torch.distributed's default group is the quorum's.

    Args:
        backend: ``"gloo"``, or ``"nccl"`` (each worker's current CUDA device).
        timeout: how long a collective waits on a peer, and forming the group on
            the quorum's store, before failing (then the step does not commit).
        silence_s: a peer whose beat stands still this long (stalled, or gone with its
            connections open) has this worker's side of the group cut at once, failing
            the collective in flight (:mod:`thinwire.elastic.watch`); None: a stalled
            peer costs ``timeout``.

    Attributes:
        generation: the quorums this worker has been configured for so far.
        watch: the watch on the current group's peers (None without ``silence_s``, or
            alone in the group).
    """

    def __init__(self, backend: str = "gloo", timeout: timedelta = timedelta(seconds=60),
                 silence_s: float | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
        super().__init__(0, 1)
        self.backend = backend
        self.timeout = timeout
        self.silence_s = silence_s
        self.generation = 0
        self.watch: PeerWatch | None = None
        self.store: object = None  # the replica group's own store, where this process holds it

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:
        """Form the default group of the quorum: ``world_size`` workers meeting on the
        store at ``store_addr`` (host:port/prefix, unique to the quorum)."""
        self.shutdown()
        store = create_store_client(store_addr, self.timeout)
        device = (torch.device("cuda", torch.cuda.current_device())
                  if self.backend == "nccl" else None)
        before = open_sockets()
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size,
                                timeout=self.timeout, device_id=device)
        self.generation += 1
        if self.silence_s is not None and world_size > 1:
            group = dist.group.WORLD
            assert group is not None
            self.watch = PeerWatch(group, create_store_client(
                store_addr, timedelta(seconds=self.silence_s)), rank, world_size,
                self.silence_s, self._cutter(group, open_sockets() - before))

    def _cutter(self, group: dist.ProcessGroup, sockets: set[str]) -> Callable[[str], None]:
        """What cuts this worker's side of ``group``: NCCL's abort; gloo's connections, the
        ``sockets`` its forming opened, shut (gloo's abort leaves a wait in flight waiting)."""

        def cut(why: str) -> None:
            _LOG.warning("leaving the quorum's group at once: %s", why)
            if self.backend == "nccl":
                group.abort()
            else:
                shut_sockets(sockets)

        return cut

    def size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 0

    def getBackendName(self) -> str:  # noqa: N802  (torch's spelling)
        return self.backend

    def abort(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Destroy the default group, if one is formed, and end its watch."""
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        end_process_group()
