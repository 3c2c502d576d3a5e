"""What else runs on this rank's CPUs: the CPU time other processes take on the cores it may run on.

A neighbour (another job, a CPU hog, a second training run) takes the cores the loaders' workers need.
The workers' own clocks show it only as slower batches, which storage could explain as well; the host's
CPU times show it directly: the cores' busy time, less what this process and its descendants (the
loaders' workers) used, is the others'. Read at a window's opening and close only (about a millisecond:
the host's per-CPU times and this process tree's, from ``psutil``), never per batch nor at a look.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import psutil


@dataclass(frozen=True)
class CpuReading:
    """One reading: when (``time.perf_counter``), the usable cores' busy time, and this process tree's CPU time."""

    at: float
    busy_s: float
    ours_s: float


@dataclass(frozen=True)
class CpuShare:
    """Between two readings: the CPUs (cores' worth) other processes used, and the share of the cores busy."""

    others: float
    busy: float


def usable_cores() -> list[int]:
    """The CPU numbers this process may run on (its affinity; every CPU where the platform has none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity to read
        return list(range(psutil.cpu_count() or 1))


def _busy_s(times: object) -> float:
    """A CPU's busy seconds: all but idle and I/O wait (steal counts: the hypervisor gave the core to another)."""
    idle = getattr(times, "idle", 0.0) + getattr(times, "iowait", 0.0)
    total = sum(getattr(times, name) for name in times._fields if name not in ("guest", "guest_nice"))  # type: ignore[attr-defined]
    return total - idle


def _process_tree_s(me: psutil.Process) -> float:
    """CPU seconds of this process, its descendants alive now, and the children each of them has reaped.

    A worker that exited between two readings was reaped by its parent (the loader joins its workers): its
    whole time moved into the parent's children's times, so the difference of two readings is the tree's
    time in between, exited workers included.
    """
    total = sum(me.cpu_times()[:4])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:4])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return total


class HostCpu:
    """Reads the usable cores' busy time and this process tree's CPU time; :meth:`between` two readings.

    Where ``psutil`` cannot read the host's per-CPU times (or the cores do not match them), every reading
    is ``None`` and nothing is said of the others.
    """

    def __init__(self) -> None:
        self._cores = usable_cores()
        self._me: Optional[psutil.Process] = None
        self._count = max(len(self._cores), 1)  # the cores read

    def read(self) -> Optional[CpuReading]:
        try:
            per_cpu = psutil.cpu_times(percpu=True)
            if self._me is None or self._me.pid != os.getpid():  # a forked process reads its own tree
                self._me = psutil.Process()
            ours = _process_tree_s(self._me)
        except (psutil.Error, OSError, NotImplementedError):
            return None
        cores = self._cores if self._cores and max(self._cores) < len(per_cpu) else list(range(len(per_cpu)))
        self._count = len(cores)
        busy = sum(_busy_s(per_cpu[i]) for i in cores)
        return CpuReading(time.perf_counter(), busy, ours)

    def between(self, start: Optional[CpuReading], end: Optional[CpuReading]) -> Optional[CpuShare]:
        """Others' CPUs and the cores' busy share from ``start`` to ``end`` (``None``: unknown, or too short to say:
        the host counts CPU time in ticks of 10 ms)."""
        if start is None or end is None:
            return None
        elapsed = end.at - start.at
        if elapsed < 0.1:
            return None
        busy = max(0.0, end.busy_s - start.busy_s) / elapsed
        ours = max(0.0, end.ours_s - start.ours_s) / elapsed
        return CpuShare(others=max(0.0, busy - ours), busy=min(1.0, busy / max(self._count, 1)))
