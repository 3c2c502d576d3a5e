"""The memory of a fit's process tree (training process and loader workers), sampled while it runs.

The footprint is Σ PSS without shared-memory pages, plus every ``/dev/shm`` object the tree holds open
or maps, counted once by inode: a batch a worker has prefetched sits in ``/dev/shm``, held by the
worker's file descriptor, and is in no process's PSS until the training process receives it. Linux only
(``/proc``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

from strategies import MB


def _rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields = value.split()
            if len(fields) == 2 and fields[1] == "kB":
                out[key] = int(fields[0]) * 1024
    return out


def _shm_held(pid: int, objects: dict[tuple[int, int], int], maps: bool) -> None:
    """Shared-memory files a process holds open (batches in flight) or maps (batches received), by inode."""
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            if not os.readlink(f"{fd_dir}/{fd}").startswith("/dev/shm/"):
                continue
            st = os.stat(f"{fd_dir}/{fd}")
        except OSError:
            continue
        objects[(st.st_dev, st.st_ino)] = max(objects.get((st.st_dev, st.st_ino), 0), st.st_blocks * 512)
    if not maps:
        return
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/dev/shm/" not in line:
                continue
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            key = (os.makedev(major, minor), int(parts[4]))
            objects[key] = max(objects.get(key, 0), end - start)


def tree_memory(pid: int) -> Optional[dict[str, float]]:
    """Memory of ``pid`` and all its descendants, in bytes.

    ``footprint`` = Σ PSS (shared pages split among the processes that map them) without shared-memory
    pages, plus every ``/dev/shm`` object the tree holds or maps, counted once: the batches prefetched
    by DataLoader workers live there, in no process's PSS until the training process receives them.
    """
    import psutil
    from workloads import HOG_MARK

    try:
        root = psutil.Process(pid)
        procs = [root] + [p for p in root.children(recursive=True) if not _is_hog(p, HOG_MARK)]
    except psutil.Error:
        return None
    pss = pss_shmem = uss = 0
    objects: dict[tuple[int, int], int] = {}
    counted = 0
    for i, proc in enumerate(procs):
        try:
            r = _rollup(proc.pid)
            _shm_held(proc.pid, objects, maps=(i == 0))  # workers keep their batches' files open (fds)
        except (OSError, ValueError):
            continue  # a worker that just exited
        counted += 1
        pss += r.get("Pss", 0)
        pss_shmem += r.get("Pss_Shmem", 0)
        uss += r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)
    if counted == 0:
        return None
    shm = float(sum(objects.values()))
    return {"footprint": pss - pss_shmem + shm, "pss": float(pss), "uss": float(uss), "shm": shm, "procs": counted}


def _is_hog(proc, mark: str) -> bool:
    """Whether ``proc`` is the noisy neighbour a workload started (its memory is not the fit's)."""
    import psutil

    try:
        return mark in proc.cmdline()
    except psutil.Error:
        return False


class TreeMemorySampler(threading.Thread):
    """Samples :func:`tree_memory` of a process every ``interval_s`` (longer where one sample is costly).

    Reading ``/proc`` of a few dozen processes costs tens of milliseconds of CPU on this machine, so
    the pause after each sample is at least ``9 x`` its cost: the sampler takes at most ~10 % of a core.
    """

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.cost_s = 0.0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            t0 = time.perf_counter()
            sample = tree_memory(self.pid)
            cost = time.perf_counter() - t0
            self.cost_s += cost
            if sample is not None:
                self.samples.append((time.time(), sample))
            self._halt.wait(max(self.interval_s, 9 * cost))

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def summary(self, since: Optional[float] = None) -> dict[str, Any]:
        window = [(t, s) for t, s in self.samples if since is None or t >= since]
        if not window:
            return {"peak_mb": None}
        t, peak = max(window, key=lambda ts: ts[1]["footprint"])
        return {
            "peak_mb": peak["footprint"] / MB,
            "peak_pss_mb": max(s["pss"] for _, s in window) / MB,
            "peak_uss_mb": max(s["uss"] for _, s in window) / MB,
            "peak_shm_mb": max(s["shm"] for _, s in window) / MB,
            "peak_procs": max(s["procs"] for _, s in window),
            "peak_at": t,
            "samples": len(window),
        }
