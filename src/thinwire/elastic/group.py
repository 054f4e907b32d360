"""The quorum's workers as torch.distributed's default group, re-formed at each new quorum."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroup, create_store_client

from thinwire.launch import end_process_group

BACKENDS = ("gloo", "nccl")


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

    Attributes:
        generation: the quorums this worker has been configured for so far.
    """

    def __init__(self, backend: str = "gloo", timeout: timedelta = timedelta(seconds=60)) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
        super().__init__(0, 1)
        self.backend = backend
        self.timeout = timeout
        self.generation = 0
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
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size,
                                timeout=self.timeout, device_id=device)
        self.generation += 1

    def size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 0

    def getBackendName(self) -> str:  # noqa: N802  (torch's spelling)
        return self.backend

    def abort(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Destroy the default group, if one is formed."""
        end_process_group()
