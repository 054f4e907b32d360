"""What a benchmark record says about the machine: CPU, cores, and who else was using it."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

# /proc/stat columns counted as busy: user, nice, system and steal (time another guest of
# the host took). Interrupt and softirq time are left out: on these benchmarks most of it
# is the benchmark's own network traffic, which no process is charged for.
_BUSY = (0, 1, 2, 7)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}".strip()


def busy_seconds(stat: str) -> float | None:
    """CPU-seconds all cores have been busy, from the text of ``/proc/stat``."""
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(f) for f in fields[1:]]
            return sum(ticks[i] for i in _BUSY if i < len(ticks)) / os.sysconf("SC_CLK_TCK")
    return None


def _own_seconds() -> float:
    """CPU-seconds of this process and of the children it has waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class CpuWatch:
    """Share of the machine's CPU used by *other* processes while a benchmark ran.

    The machine's busy time (``/proc/stat``) minus this process's and its
    reaped children's, over wall time times cores. Timings taken while other
    work used a good share of the cores are not worth quoting.
    """

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float | None, float]:
        try:
            busy = busy_seconds(Path("/proc/stat").read_text())
        except OSError:
            busy = None
        return time.monotonic(), busy, _own_seconds()

    def others_share(self) -> float | None:
        """Mean fraction of all cores others kept busy since construction (None if unknown)."""
        wall0, busy0, own0 = self.start
        wall1, busy1, own1 = self._sample()
        cores = os.cpu_count() or 1
        if busy0 is None or busy1 is None or wall1 <= wall0:
            return None
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / ((wall1 - wall0) * cores)
