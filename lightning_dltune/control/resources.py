"""What the loaders of this rank may use: CPUs, memory and ``/dev/shm``, as the kernel enforces them.

Containers and schedulers (Docker, Kubernetes, Slurm) cap a job below what the machine has: CPU
affinity (cpuset) and CFS quota limit CPUs, the memory cgroup limits RAM. ``os.cpu_count()`` and
total RAM see none of that, so they are never used alone here.

Example::

    budget = rank_budget()  # Budget(max_workers=7, memory_bytes=..., shm_bytes=..., cpus=8.0)
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Iterator, Optional

from lightning_dltune.core import validation
from lightning_dltune.core.records import Budget

__all__ = ["usable_cpus", "memory_budget_bytes", "shm_free_bytes", "local_world_size", "rank_budget"]

CGROUP_ROOT = "/sys/fs/cgroup"
SHM_PATH = "/dev/shm"
MEMORY_FRACTION = 0.5  # default share of available RAM that prefetched batches may hold
SHM_FRACTION = 0.5  # default share of free /dev/shm that they may hold
# Where this process's cgroup is named; a module constant so tests can point it elsewhere.
PROC_SELF_CGROUP = "/proc/self/cgroup"
# cgroup v1 writes "no limit" as a page-rounded LLONG_MAX; anything this large is no limit.
_NO_LIMIT = 2**60


# -- cgroup discovery -----------------------------------------------------------------------------
def _self_cgroups() -> dict[str, str]:
    """Controller -> path of this process's cgroup; ``""`` is the cgroup v2 (unified) path."""
    paths: dict[str, str] = {}
    try:
        with open(PROC_SELF_CGROUP) as fh:
            for line in fh:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                _, controllers, path = parts
                if not controllers:
                    paths[""] = path
                for name in controllers.split(","):
                    if name:
                        paths[name] = path
    except OSError:
        pass
    return paths


def _is_v2(cgroup_root: str) -> bool:
    return os.path.isfile(os.path.join(cgroup_root, "cgroup.controllers"))


def _v1_mount(cgroup_root: str, controller: str) -> Optional[str]:
    """The v1 hierarchy holding ``controller`` (``cpu`` may be mounted as ``cpu,cpuacct``)."""
    direct = os.path.join(cgroup_root, controller)
    if os.path.isdir(direct):
        return direct
    try:
        names = sorted(os.listdir(cgroup_root))
    except OSError:
        return None
    for name in names:
        if controller in name.split(",") and os.path.isdir(os.path.join(cgroup_root, name)):
            return os.path.join(cgroup_root, name)
    return None


def _chain(mount: str, path: Optional[str]) -> Iterator[str]:
    """This process's cgroup directory under ``mount`` and its ancestors, up to ``mount``.

    Limits are hierarchical (the tightest ancestor wins), so callers take the minimum. Where the
    process's path does not exist under the mount (a container sees its own cgroup as the root),
    only existing directories are visited.
    """
    parts = [p for p in (path or "").split("/") if p and p not in (".", "..")]
    for depth in range(len(parts), -1, -1):
        candidate = os.path.join(mount, *parts[:depth])
        if os.path.isdir(candidate):
            yield candidate


def _cgroup_dirs(cgroup_root: str, controller: str) -> list[str]:
    """Directories to read for ``controller`` (``"cpu"`` or ``"memory"``), innermost first."""
    own = _self_cgroups()
    if _is_v2(cgroup_root):
        return list(_chain(cgroup_root, own.get("")))
    mount = _v1_mount(cgroup_root, controller)
    if mount is None:
        return []
    return list(_chain(mount, own.get(controller)))


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> Optional[int]:
    text = _read(path)
    if text is None or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    text = _read(path) or ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


# -- CPUs -----------------------------------------------------------------------------------------
def _affinity_cpus() -> int:
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        try:
            return max(1, len(getaffinity(0)))
        except OSError:
            pass
    return os.cpu_count() or 1


def _quota_cpus(cgroup_root: str) -> Optional[float]:
    """The tightest CFS quota over this process's cgroup and its ancestors, in CPUs (``None``: none)."""
    v2 = _is_v2(cgroup_root)
    tightest: Optional[float] = None
    for d in _cgroup_dirs(cgroup_root, "cpu"):
        if v2:
            fields = (_read(os.path.join(d, "cpu.max")) or "").split()
            if len(fields) < 1 or fields[0] == "max":
                continue
            try:
                quota = float(fields[0])
                period = float(fields[1]) if len(fields) > 1 else 100000.0
            except ValueError:
                continue
        else:
            q = _read_int(os.path.join(d, "cpu.cfs_quota_us"))
            p = _read_int(os.path.join(d, "cpu.cfs_period_us"))
            if q is None or p is None:
                continue
            quota, period = float(q), float(p)
        if quota <= 0 or period <= 0:  # v1 writes -1 for no quota
            continue
        cpus = quota / period
        tightest = cpus if tightest is None else min(tightest, cpus)
    return tightest


def usable_cpus(cgroup_root: str = CGROUP_ROOT) -> float:
    """CPUs this process may use: its affinity (cpuset) capped by the cgroup CPU quota.

    May be fractional (a quota of 1.5 CPUs gives ``1.5``). ``os.cpu_count()`` only stands in for
    the affinity where the platform has no ``sched_getaffinity``.

    Args:
        cgroup_root: where the cgroup filesystem is mounted (v2 unified, or the v1 hierarchies).
    """
    cpus = float(_affinity_cpus())
    quota = _quota_cpus(cgroup_root)
    if quota is not None:
        cpus = min(cpus, quota)
    return cpus


# -- memory ---------------------------------------------------------------------------------------
def _cgroup_memory_headroom(cgroup_root: str) -> Optional[float]:
    """Bytes this cgroup may still grow by before its limit (``None``: no limit).

    The page cache the kernel would reclaim first (``inactive_file``) is not counted as used, the
    way kubelet computes the working set: a loader reading files fills the cache, and counting it
    would shrink the budget each epoch for nothing.
    """
    v2 = _is_v2(cgroup_root)
    tightest: Optional[float] = None
    for d in _cgroup_dirs(cgroup_root, "memory"):
        if v2:
            limit = _read_int(os.path.join(d, "memory.max"))
            usage = _read_int(os.path.join(d, "memory.current"))
            reclaimable = _stat_value(os.path.join(d, "memory.stat"), "inactive_file")
        else:
            limit = _read_int(os.path.join(d, "memory.limit_in_bytes"))
            usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
            reclaimable = _stat_value(os.path.join(d, "memory.stat"), "total_inactive_file")
        if limit is None or limit >= _NO_LIMIT or usage is None:
            continue
        working_set = max(0, usage - min(reclaimable, usage))
        headroom = float(max(0, limit - working_set))
        tightest = headroom if tightest is None else min(tightest, headroom)
    return tightest


def memory_budget_bytes(cgroup_root: str = CGROUP_ROOT) -> Optional[float]:
    """Bytes of RAM this process may still take: the least of available RAM and cgroup headroom.

    ``None`` only where neither is known.

    Args:
        cgroup_root: where the cgroup filesystem is mounted.
    """
    available: Optional[float] = None
    try:
        import psutil

        available = float(psutil.virtual_memory().available)
    except Exception:
        pass
    headroom = _cgroup_memory_headroom(cgroup_root)
    known = [x for x in (available, headroom) if x is not None]
    return min(known) if known else None


def shm_free_bytes(path: str = SHM_PATH) -> Optional[float]:
    """Free bytes of ``/dev/shm``, where worker processes hand batches over; ``None`` where missing.

    Docker's default is 64 MiB: a few prefetched image batches fill it and workers die with a bus
    error, so the budget keeps prefetch below it.

    Args:
        path: the shared-memory mount.
    """
    try:
        return float(shutil.disk_usage(path).free)
    except (OSError, ValueError):
        return None


# -- ranks ----------------------------------------------------------------------------------------
def local_world_size() -> int:
    """Training processes on this node: ``LOCAL_WORLD_SIZE`` (set by torchrun), else 1.

    Raises:
        ValueError: if ``LOCAL_WORLD_SIZE`` is set but not an integer >= 1.
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None or not raw.strip():
        return 1
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"environment variable `LOCAL_WORLD_SIZE` must be an integer >= 1, got {raw!r}.")
    return value


IO_OVERSUBSCRIPTION = 4
"""Worker processes per usable CPU at most: workers waiting on storage use little CPU."""
MAX_WORKERS_PER_RANK = 64


def _workers_for(cpus_per_rank: float) -> int:
    """The most worker processes a rank may run: ``IO_OVERSUBSCRIPTION`` per CPU, minus the training process.

    This caps processes, not CPU: workers that wait on storage barely use a core, so an I/O-bound
    pipeline needs more of them than there are cores. The CPU rule (workers' CPU demand within the
    CPUs left after the training process) is the policy's, from the measured CPU share of a batch.
    """
    return min(MAX_WORKERS_PER_RANK, max(0, int(math.floor(IO_OVERSUBSCRIPTION * cpus_per_rank)) - 1))


def rank_budget(
    local_ranks: Optional[int] = None,
    max_workers: Optional[int] = None,
    memory_fraction: float = MEMORY_FRACTION,
    shm_fraction: float = SHM_FRACTION,
    cgroup_root: str = CGROUP_ROOT,
    shm_path: str = SHM_PATH,
) -> Budget:
    """The :class:`~lightning_dltune.core.records.Budget` of one rank: this node's resources shared by its ranks.

    * ``cpus``: :func:`usable_cpus` / ``local_ranks``.
    * ``max_workers``: worker processes at most, ``floor(4 x cpus) - 1`` (at most 64): room for
      I/O-bound workers past the core count. The policy keeps CPU-bound pipelines within
      ``cpus - 1`` busy workers from their measured CPU share; ``max_workers`` overrides the cap.
    * ``memory_bytes``: ``memory_fraction`` x :func:`memory_budget_bytes` / ``local_ranks``.
    * ``shm_bytes``: ``shm_fraction`` x :func:`shm_free_bytes` / ``local_ranks``.

    Args:
        local_ranks: training processes on this node; ``None`` reads :func:`local_world_size`.
        max_workers: a fixed cap on workers instead of the CPU rule.
        memory_fraction: share of the memory budget prefetched batches may take, in ``(0, 1]``.
        shm_fraction: share of free ``/dev/shm`` they may take, in ``(0, 1]``.
        cgroup_root: where the cgroup filesystem is mounted.
        shm_path: the shared-memory mount.

    Raises:
        ValueError: if ``local_ranks < 1``, ``max_workers < 0``, or a fraction is outside ``(0, 1]``.
    """
    validation.count("local_ranks", local_ranks, 1, optional=True)
    validation.count("max_workers", max_workers, 0, optional=True)
    validation.fraction("memory_fraction", memory_fraction, zero=False)
    validation.fraction("shm_fraction", shm_fraction, zero=False)
    ranks = local_ranks if local_ranks is not None else local_world_size()
    cpus = usable_cpus(cgroup_root) / ranks
    memory = memory_budget_bytes(cgroup_root)
    shm = shm_free_bytes(shm_path)
    return Budget(
        max_workers=max_workers if max_workers is not None else _workers_for(cpus),
        memory_bytes=memory_fraction * memory / ranks if memory is not None else None,
        shm_bytes=shm_fraction * shm / ranks if shm is not None else None,
        cpus=cpus,
    )
