"""Resource discovery against fake cgroup trees (v1 and v2), and once against this machine."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest

from lightning_dltune.control import resources
from lightning_dltune.control.resources import (
    local_world_size,
    memory_budget_bytes,
    rank_budget,
    shm_free_bytes,
    usable_cpus,
)
from lightning_dltune.core.policy import Budget

GiB = 1024**3
V1_UNLIMITED = "9223372036854771712"


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture
def proc_cgroup(tmp_path, monkeypatch):
    """Point ``/proc/self/cgroup`` at a file the test writes; returns a setter."""
    target = tmp_path / "proc_self_cgroup"
    target.write_text("0::/\n")
    monkeypatch.setattr(resources, "PROC_SELF_CGROUP", str(target))
    return lambda text: target.write_text(text)


@pytest.fixture
def affinity(monkeypatch):
    """Set how many CPUs the affinity mask holds."""

    def set_(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    set_(8)
    return set_


@pytest.fixture
def ram(monkeypatch):
    """Set psutil's available RAM."""
    import psutil

    vm = namedtuple("vm", "available total")

    def set_(available: float) -> None:
        monkeypatch.setattr(psutil, "virtual_memory", lambda: vm(available, 4 * available))

    set_(64 * GiB)
    return set_


def v2_root(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpuset cpu io memory pids")
    return root


# -- CPUs ------------------------------------------------------------------------------------------


def test_v2_quota_caps_affinity(tmp_path, proc_cgroup, affinity):
    root = v2_root(tmp_path)
    write(root / "cpu.max", "200000 100000")
    assert usable_cpus(str(root)) == 2.0


def test_v2_quota_above_affinity_is_capped_by_affinity(tmp_path, proc_cgroup, affinity):
    affinity(3)
    root = v2_root(tmp_path)
    write(root / "cpu.max", "800000 100000")
    assert usable_cpus(str(root)) == 3.0


def test_v2_max_means_affinity(tmp_path, proc_cgroup, affinity):
    root = v2_root(tmp_path)
    write(root / "cpu.max", "max 100000")
    assert usable_cpus(str(root)) == 8.0


def test_v2_fractional_quota(tmp_path, proc_cgroup, affinity):
    root = v2_root(tmp_path)
    write(root / "cpu.max", "150000 100000")
    assert usable_cpus(str(root)) == 1.5


def test_v2_tightest_quota_along_the_process_cgroup_wins(tmp_path, proc_cgroup, affinity):
    # a Slurm-like tree: the job's cgroup is deep, its parent holds the tighter quota
    root = v2_root(tmp_path)
    write(root / "system.slice" / "cpu.max", "max 100000")
    write(root / "system.slice" / "job_7" / "cpu.max", "300000 100000")
    write(root / "system.slice" / "job_7" / "step_0" / "cpu.max", "600000 100000")
    proc_cgroup("0::/system.slice/job_7/step_0\n")
    assert usable_cpus(str(root)) == 3.0


def test_v1_cfs_quota(tmp_path, proc_cgroup, affinity):
    root = tmp_path / "cgroup"
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "250000")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000")
    assert usable_cpus(str(root)) == 2.5


def test_v1_no_quota_means_affinity(tmp_path, proc_cgroup, affinity):
    root = tmp_path / "cgroup"
    write(root / "cpu" / "cpu.cfs_quota_us", "-1")
    write(root / "cpu" / "cpu.cfs_period_us", "100000")
    assert usable_cpus(str(root)) == 8.0


def test_v1_process_cgroup_path_is_followed(tmp_path, proc_cgroup, affinity):
    root = tmp_path / "cgroup"
    write(root / "cpu" / "cpu.cfs_quota_us", "-1")
    write(root / "cpu" / "cpu.cfs_period_us", "100000")
    write(root / "cpu" / "docker" / "abc" / "cpu.cfs_quota_us", "400000")
    write(root / "cpu" / "docker" / "abc" / "cpu.cfs_period_us", "100000")
    proc_cgroup("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n")
    assert usable_cpus(str(root)) == 4.0


def test_no_cgroup_files_means_affinity(tmp_path, proc_cgroup, affinity):
    affinity(5)
    assert usable_cpus(str(tmp_path / "missing")) == 5.0


def test_without_sched_getaffinity_cpu_count_stands_in(tmp_path, proc_cgroup, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    root = v2_root(tmp_path)
    write(root / "cpu.max", "200000 100000")
    assert usable_cpus(str(root)) == 2.0


# -- memory and shm --------------------------------------------------------------------------------


def test_v2_memory_headroom_below_available_ram(tmp_path, proc_cgroup, ram):
    root = v2_root(tmp_path)
    write(root / "memory.max", str(16 * GiB))
    write(root / "memory.current", str(10 * GiB))
    write(root / "memory.stat", f"anon {8 * GiB}\ninactive_file {2 * GiB}\nactive_file 0")
    # working set = 10 - 2 (reclaimable page cache) = 8 GiB; headroom = 16 - 8
    assert memory_budget_bytes(str(root)) == 8 * GiB


def test_v2_memory_max_means_available_ram(tmp_path, proc_cgroup, ram):
    root = v2_root(tmp_path)
    write(root / "memory.max", "max")
    write(root / "memory.current", str(10 * GiB))
    assert memory_budget_bytes(str(root)) == 64 * GiB


def test_available_ram_below_headroom_wins(tmp_path, proc_cgroup, ram):
    ram(3 * GiB)
    root = v2_root(tmp_path)
    write(root / "memory.max", str(16 * GiB))
    write(root / "memory.current", str(1 * GiB))
    assert memory_budget_bytes(str(root)) == 3 * GiB


def test_v1_memory_headroom(tmp_path, proc_cgroup, ram):
    root = tmp_path / "cgroup"
    write(root / "memory" / "memory.limit_in_bytes", str(32 * GiB))
    write(root / "memory" / "memory.usage_in_bytes", str(30 * GiB))
    write(root / "memory" / "memory.stat", f"inactive_file 0\ntotal_inactive_file {4 * GiB}")
    assert memory_budget_bytes(str(root)) == 6 * GiB


def test_v1_unlimited_memory_means_available_ram(tmp_path, proc_cgroup, ram):
    root = tmp_path / "cgroup"
    write(root / "memory" / "memory.limit_in_bytes", V1_UNLIMITED)
    write(root / "memory" / "memory.usage_in_bytes", str(30 * GiB))
    assert memory_budget_bytes(str(root)) == 64 * GiB


def test_memory_over_limit_gives_zero_headroom(tmp_path, proc_cgroup, ram):
    root = v2_root(tmp_path)
    write(root / "memory.max", str(1 * GiB))
    write(root / "memory.current", str(2 * GiB))
    assert memory_budget_bytes(str(root)) == 0.0


def test_shm_free_bytes(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda path: usage(64 * 2**20, 0, 64 * 2**20))
    assert shm_free_bytes() == 64 * 2**20


def test_shm_missing_is_none(tmp_path):
    assert shm_free_bytes(str(tmp_path / "no-shm")) is None


# -- ranks and budget ------------------------------------------------------------------------------


def test_local_world_size_from_env(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_world_size() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_world_size() == 4


@pytest.mark.parametrize("raw", ["0", "-2", "four"])
def test_bad_local_world_size_raises(monkeypatch, raw):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", raw)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        local_world_size()


@pytest.fixture
def node(tmp_path, proc_cgroup, affinity, ram, monkeypatch):
    """16 CPUs by affinity, a 12-CPU quota, 64 GiB RAM under a 40 GiB cgroup limit, 8 GiB shm."""
    affinity(16)
    root = v2_root(tmp_path)
    write(root / "cpu.max", "1200000 100000")
    write(root / "memory.max", str(40 * GiB))
    write(root / "memory.current", str(8 * GiB))
    shm = tmp_path / "shm"
    shm.mkdir()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(resources.shutil, "disk_usage", lambda path: usage(8 * GiB, 0, 8 * GiB))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return dict(cgroup_root=str(root), shm_path=str(shm))


def test_rank_budget_single_rank(node):
    budget = rank_budget(**node)
    assert budget == Budget(max_workers=47, memory_bytes=16 * GiB, shm_bytes=4 * GiB, cpus=12.0)


def test_rank_budget_divides_among_local_ranks(node):
    budget = rank_budget(local_ranks=4, **node)
    assert budget == Budget(max_workers=11, memory_bytes=4 * GiB, shm_bytes=1 * GiB, cpus=3.0)


def test_rank_budget_reads_local_world_size(node, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert rank_budget(**node).cpus == 4.0


def test_rank_budget_fractions(node):
    budget = rank_budget(memory_fraction=0.25, shm_fraction=1.0, **node)
    assert budget.memory_bytes == 8 * GiB and budget.shm_bytes == 8 * GiB


def test_rank_budget_max_workers_override(node):
    assert rank_budget(local_ranks=8, max_workers=6, **node).max_workers == 6
    assert rank_budget(max_workers=0, **node).max_workers == 0


@pytest.mark.parametrize(
    ("cpus_per_rank", "workers"), [(0.2, 0), (0.5, 1), (1.0, 3), (2.0, 7), (3.0, 11), (12.0, 47), (32.0, 64)]
)
def test_worker_cap_leaves_room_for_io_bound_workers_and_the_training_process(cpus_per_rank, workers):
    assert resources._workers_for(cpus_per_rank) == workers


def test_rank_budget_without_shm_or_memory_is_none(node, monkeypatch):
    monkeypatch.setattr(resources, "memory_budget_bytes", lambda cgroup_root=None: None)
    monkeypatch.setattr(resources, "shm_free_bytes", lambda path=None: None)
    budget = rank_budget(**node)
    assert budget.memory_bytes is None and budget.shm_bytes is None


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(local_ranks=0), "local_ranks"),
        (dict(local_ranks=1.5), "local_ranks"),
        (dict(max_workers=-1), "max_workers"),
        (dict(memory_fraction=0.0), "memory_fraction"),
        (dict(memory_fraction=1.5), "memory_fraction"),
        (dict(shm_fraction=-0.1), "shm_fraction"),
        (dict(shm_fraction=float("nan")), "shm_fraction"),
    ],
)
def test_rank_budget_bad_arguments_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        rank_budget(**kwargs)


# -- this machine ----------------------------------------------------------------------------------


def test_real_machine_values_are_sane(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cpus = usable_cpus()
    assert 0 < cpus <= (os.cpu_count() or 1)
    memory = memory_budget_bytes()
    assert memory is not None and memory > 0
    shm = shm_free_bytes()
    assert shm is None or shm >= 0
    budget = rank_budget()
    assert budget.cpus == cpus and 0 <= budget.max_workers <= 4 * cpus - 1
    assert budget.memory_bytes == pytest.approx(0.5 * memory, rel=0.2)
