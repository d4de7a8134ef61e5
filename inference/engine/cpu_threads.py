"""How many threads the engine's ops run on, on a CPU shared with other processes.

torch runs each op's parallel part on one OpenMP thread per core, and each op ends at a barrier
where every thread waits for the slowest. When another process keeps one of the cores busy (the
gateway and the worker beside an embedded node, a test suite beside CI's), the thread on that core
gets a time slice of a few milliseconds now and then, and every op of a few tens of microseconds
waits for it: measured here, a busy core made a bf16 decode step up to ten times slower with two
threads, while one thread on the free core ran at its normal, single-core speed.

`CoreShare` therefore sizes the thread count to the cores the other processes leave free,
measured from the kernel's counters (`/proc/stat` for the whole machine, `/proc/self/stat` for
this process): every `interval_s` it computes how many cores the others used since the last look,
and uses the rest (at least one). It looks again at each engine step that comes after the
interval, so the count follows load that comes and goes, and changes torch's setting only when
the count changes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

_TICKS = os.sysconf("SC_CLK_TCK")


def _machine_busy_ticks() -> int:
    """Ticks every CPU spent doing anything but idling, since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle, iowait = fields[3], fields[4]
    # guest time is already counted in user time; steal is another VM's use of our core.
    return sum(fields[:8]) - idle - iowait


def _own_ticks() -> int:
    """Ticks this process's threads spent on a CPU, since it started."""
    stat = Path("/proc/self/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


class CoreShare:
    """The thread count for the cores other processes leave free (`cores`: this process's
    affinity by default)."""

    def __init__(self, cores: int | None = None, interval_s: float = 0.5) -> None:
        self.cores = cores or len(os.sched_getaffinity(0))
        self.interval_s = interval_s
        self.threads = self.cores
        self.others = 0.0  # cores the other processes used over the last interval
        self._last = self._sample()
        torch.set_num_threads(self.threads)

    @staticmethod
    def _sample() -> tuple[float, int, int]:
        return time.monotonic(), _machine_busy_ticks(), _own_ticks()

    def update(self) -> int:
        """Look again once the interval has passed (until then, one clock read a step); the
        thread count to use now."""
        if time.monotonic() - self._last[0] < self.interval_s:
            return self.threads
        now, busy, own = sample = self._sample()
        seconds = now - self._last[0]
        others_ticks = (busy - self._last[1]) - (own - self._last[2])
        self._last = sample
        self.others = max(0.0, others_ticks / _TICKS / seconds)
        threads = max(1, self.cores - round(self.others))
        if threads != self.threads:
            self.threads = threads
            torch.set_num_threads(threads)
        return threads
