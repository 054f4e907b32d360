"""The local launcher: a stalled peer fails the run in bounded time, naming ranks and phases."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from thinwire.launch import RankFailed, phase, spawn

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 5.0  # the process group's timeout under test: short, so the test stays quick


def _stall(rank: int, world_size: int) -> None:
    for step in range(3):
        phase(f"step {step}")
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # a stopped peer: never answers again
        dist.all_reduce(torch.ones(4))


def test_a_stopped_peer_fails_the_run_within_the_timeout_naming_rank_and_phase() -> None:
    # A hang would end in the deadline's TimeoutError; RankFailed means the process
    # group's short timeout bounded the wait.
    with pytest.raises(RankFailed) as caught:
        spawn(_stall, 2, timeout_s=TIMEOUT_S, deadline_s=600.0)
    lines = str(caught.value).splitlines()
    assert lines[0].startswith("rank 0 failed during 'step 2'")
    assert "Timed out" in lines[0]
    assert "rank 1 last during 'step 2' (stopped)" in lines[1]


def _unreached(rank: int, world_size: int) -> None:
    raise AssertionError("spawn must validate its limits before starting processes")


@pytest.mark.parametrize("bad", [{"timeout_s": 0.0}, {"deadline_s": -1.0}])
def test_spawn_rejects_non_positive_limits(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        spawn(_unreached, 2, **bad)


def test_spawn_under_nccl_needs_a_gpu_per_rank() -> None:
    ranks = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"world_size={ranks} under nccl needs a GPU per rank"):
        spawn(_unreached, ranks, backend="nccl")


# A rank drawing a progress bar, as the CLI's local jobs do: tqdm's lock is a named
# semaphore made in the rank, which the parent's resource tracker reports if it outlives it.
_BAR_JOB = """
from thinwire.launch import spawn
from thinwire.progress import StepBar

def work(rank, world_size):
    bar = StepBar(2, show=rank == 0)
    bar.update(2)
    bar.close()
    return rank

if __name__ == "__main__":
    print(spawn(work, 2))
"""


@pytest.mark.timeout(400)
def test_spawn_leaves_no_semaphore_of_its_ranks_behind(tmp_path: Path) -> None:
    (tmp_path / "bar_job.py").write_text(textwrap.dedent(_BAR_JOB))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")]),
           "OMP_NUM_THREADS": "1"}
    # Generous hang guard: a busy machine must not trip it, a hang still fails.
    done = subprocess.run([sys.executable, str(tmp_path / "bar_job.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[0, 1]"
    assert "leaked semaphore" not in done.stderr, done.stderr[-3000:]
