"""The job's latest committed step, in a file every worker reads: one history per job.

torchft heals a worker that joins from the most advanced worker of its
quorum. Where no live worker holds the job's latest commit (a worker stopped
for longer than the others trained, a worker relaunched after they finished),
the most advanced one is stale, and a quorum of such workers would commit the
same steps a second time with other weights. Each committing worker records
its commit in :class:`JobRecord` (``job.json`` in the job's folder, replaced
atomically); a worker behind it with no live peer to heal it stops with
:class:`StaleWorker` instead. Assumed: a folder every worker of the job sees
(a shared file system). Without one, each worker sees only its own commits,
and a worker relaunched elsewhere is not protected.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

FILE = "job.json"  # the record's name in the job's folder


class StaleWorker(RuntimeError):
    """This worker is behind the job's latest commit, and no live peer can heal it."""


@dataclass(frozen=True)
class Commit:
    """One committed sync (local updates) or step (per step), as the record keeps it."""

    commit: int  # torchft's count of commits after it: one history's clock, used in healing
    step: int  # the training step it ends (inner steps under local updates)
    weights: str  # weights_hash of the global weights after it
    worker: str  # the worker that wrote it
    where: str  # where that worker writes its results or checkpoints ("" if nowhere)
    over: bool  # it is the job's last step


def weights_hash(tensors: list[torch.Tensor]) -> str:
    """The first 16 hex digits of the sha256 of ``tensors``' bytes, in order."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
                      .numpy().tobytes())
    return hasher.hexdigest()[:16]


class JobRecord:
    """The job's latest commit, read and written by each of its workers.

    Args:
        path: the record's file (``FOLDER/job.json``), in a folder every worker sees.
        steps: the job's length in training steps: a commit at it ends the job, and a
            worker that starts or wakes behind it stops at once. None: no end recorded.
        worker: names this worker in the record.
        where: where this worker writes its results or checkpoints, named to a stale
            worker as where to find the latest state.

    Raises:
        ValueError: ``steps`` is not None or an integer >= 1.
    """

    def __init__(self, path: str | os.PathLike[str], *, steps: int | None = None,
                 worker: str = "", where: str = "") -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                                  or steps < 1):
            raise ValueError(f"steps={steps!r} must be None or an integer >= 1")
        self.path = Path(path)
        self.steps = steps
        self.worker = worker
        self.where = where

    def latest(self) -> Commit | None:
        """The latest commit recorded, or None where none is (a new job).

        Raises:
            ValueError: the file is not a job record.
        """
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return Commit(**json.loads(text))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{self.path} is not a thinwire job record ({error}): remove "
                             "it, or give the job a folder of its own") from error

    def check(self, commit: int, *, in_quorum: bool) -> None:
        """Stop a worker at ``commit`` that is behind the job with no one to heal it.

        Args:
            commit: this worker's count of commits (torchft's step; after its quorum,
                the most advanced of the quorum's workers).
            in_quorum: the quorum has formed: every live worker that could heal this one
                is in it. Before it (or at the start) only a job that is over stops it.

        Raises:
            StaleWorker: the record holds a later commit, and the job is over or (in a
                quorum) no worker of it holds that commit; the message names the step,
                the weights, the record and where the latest state was written.
        """
        latest = self.latest()
        if latest is None or latest.commit <= commit or not (in_quorum or latest.over):
            return
        why = ("the job is over" if latest.over else
               "no live worker holds it (the workers that trained it are gone)")
        where = f" (it writes to {latest.where})" if latest.where else ""
        raise StaleWorker(
            f"the job committed step {latest.step:,} already (commit {latest.commit}, "
            f"weights {latest.weights}), recorded in {self.path} by {latest.worker or '?'}"
            f"{where}; this worker is at commit {commit} and {why}: training on would commit "
            "those steps a second time with other weights. Resume from that step's state "
            "where it was saved, or start a new job in a new folder")

    def write(self, commit: int, step: int, weights: str) -> None:
        """Record a commit this worker's quorum made (a later one than the record's).

        A record already at ``commit`` with the same weights (a peer of the same quorum
        wrote it) or at a later commit (a peer went on) is left as it is.

        Raises:
            StaleWorker: the record holds ``commit`` with other weights: a second history.
        """
        latest = self.latest()
        if latest is not None and latest.commit >= commit:
            if latest.commit == commit and latest.weights != weights:
                raise StaleWorker(
                    f"step {step:,} (commit {commit}) was committed with weights {weights} "
                    f"here and with {latest.weights} by {latest.worker or '?'} "
                    f"({self.path}): two histories of one job")
            return
        entry = Commit(commit, step, weights, self.worker, self.where,
                       self.steps is not None and step >= self.steps)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(f".{self.path.name}.{socket.gethostname()}.{os.getpid()}")
        part.write_text(json.dumps(asdict(entry), indent=1) + "\n")
        os.replace(part, self.path)  # a reader sees the old record or the new, never half
