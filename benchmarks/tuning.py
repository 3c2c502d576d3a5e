"""Does the tuner pay? Every workload under every loader strategy, in one run, on this machine.

For each workload of :mod:`workloads` (I/O-bound, CPU-bound, step-bound, memory-heavy, bursty, and three
whose conditions change during the fit: drift-epoch, slow-at-epoch, noisy-neighbour) the harness runs, in
the same session so that ratios hold on a noisy machine:

- ``default``: ``num_workers=0``, what a new user gets;
- ``rule``: a common rule of thumb, Lightning's ``suggested_max_num_workers(1)`` workers, prefetch 2;
- ``oracle``: the best static config of a grid over workers x prefetch, measured in this run (every
  grid point runs a few epochs; the winner then runs the full fit);
- ``tuned_default``: :class:`~lightning_dltune.DataLoaderTuner` from the default start;
- ``tuned_bad``: the tuner from a bad start, 16 workers x prefetch 8.

A workload that slows down during the fit (:mod:`phases`) is judged on the part after the change: its
grid runs the slow cost throughout, so the oracle is the best static config *of that phase*, and the
ratio compares the phase's wall time in the tuned and oracle fits (from the fits' own batch clocks).

Every fit runs in its own process (``--run-one``); the parent samples the memory of the whole
process tree (training process and loader workers) while it runs. Static strategies carry a
``DataLoaderTuner(tune=False)`` so that every strategy is measured by the same clocks.

    python benchmarks/tuning.py                  # full: 5 workloads, 8 epochs (~17 min on 2 cores)
    python benchmarks/tuning.py --quick          # 2 workloads, 3 epochs, tiny grid (~2 min)
    python benchmarks/tuning.py --smoke          # step-bound, 2 short epochs: does the harness work (~30 s)
    python benchmarks/tuning.py --workloads io-bound bursty --out /tmp/bench

Writes ``tuning.json``, ``tuning.md`` and ``tuning.png`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
for _path in (REPO_ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

BAND = (0.85, 0.95)
BAD_START = (16, 8)
STRATEGIES = ("default", "rule", "oracle", "tuned_default", "tuned_bad")
LABELS = {
    "default": "default (0 workers)",
    "rule": "rule of thumb",
    "oracle": "oracle (best static)",
    "tuned_default": "tuned, default start",
    "tuned_bad": "tuned, bad start (16x8)",
}
BAND_SPAN = 20  # phases.BAND_SPAN: batches in a row at the band's low edge that count as in band
STABLE_VERDICTS = ("compute-bound", "data-bound (CPU saturated)", "memory-capped")
ORACLE_TIE = 0.02  # grid points within this of the fastest count as tied; the leanest of them is the oracle
TARGET_TIME_RATIO = 1.05
TARGET_BAND_FRACTION = 0.05  # single-epoch fits reach the band within this fraction of the epoch
TARGET_IO_SPEEDUP = 3.0
TARGET_MEMORY_RATIO = 1.15
MB = 2**20


# =========================================================================================== child

def _per_epoch(history):
    """(last record, merged stats) per epoch: an early decision splits the first epoch into two windows."""
    from lightning_dltune.stats import pool_windows  # merged as the fields declare, as the policy pools

    merged = []
    for record in history:
        if merged and merged[-1][0].epoch == record.epoch:
            merged[-1] = (record, pool_windows([merged[-1][1], record.stats]))
        else:
            merged.append((record, record.stats))
    return merged


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One fit, in this process: the workload under one loader config, timed and recorded by the tuner."""
    import logging
    import warnings

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_dltune import DataLoaderTuner
    from lightning_dltune.resources import memory_budget_bytes, rank_budget
    from phases import BatchClock, CpuHog, EpochFlag, clock_summary
    from workloads import EPOCH_FILE_ENV, WORKLOADS, build

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    # one intra-op thread, as in DataLoader workers: on 2 cores, OpenMP threads of a 0-worker loader's tensor
    # ops spin against any other busy process and slowed such fits ~20x in trials, an artefact of the CPU host
    torch.set_num_threads(1)
    pl.seed_everything(spec.get("seed", 0), verbose=False)
    workload = WORKLOADS[spec["workload"]].scaled(spec["train_batches"])
    if spec.get("slowed_throughout"):
        workload = workload.slowed_throughout()  # a grid point of a phased workload: the judged phase alone

    memory_fraction = 0.5  # the tuner's default
    if workload.memory_budget_mb is not None:
        available = memory_budget_bytes() or float(workload.memory_budget_mb * MB)
        memory_fraction = min(1.0, workload.memory_budget_mb * MB / available)

    class EpochClock(Callback):
        """Wall-clock marks of the fit (unix time, to line up with the parent's memory samples)."""

        def __init__(self) -> None:
            self.marks: list[float] = []
            self.budget_mb: list[Optional[float]] = []

        def on_train_start(self, trainer, pl_module) -> None:
            self.marks = [time.time()]

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.marks.append(time.time())
            budget = rank_budget(memory_fraction=memory_fraction)
            self.budget_mb.append(None if budget.memory_bytes is None else budget.memory_bytes / MB)

    tuner = DataLoaderTuner(tune=spec["tune"], band=BAND, util_source="estimate", memory_fraction=memory_fraction,
                            verbose=False, recommendation_file=False)
    clock = EpochClock()
    batch_clock = BatchClock()
    hog = CpuHog(workload.hog_epoch) if workload.hog_epoch is not None else None
    with tempfile.TemporaryDirectory(prefix="dltune-bench-") as root:
        callbacks = [tuner, clock, batch_clock] + ([hog] if hog else [])
        if workload.slow_from_epoch is not None:
            os.environ[EPOCH_FILE_ENV] = os.path.join(root, "epoch")  # read by the dataset in every worker
            callbacks.append(EpochFlag(os.environ[EPOCH_FILE_ENV]))
        trainer = pl.Trainer(
            max_epochs=spec["epochs"], accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            default_root_dir=root, callbacks=callbacks,
        )
        model, data = build(workload, spec["num_workers"], spec["prefetch_factor"])
        fit_started = time.time()
        t0 = time.perf_counter()
        trainer.fit(model, datamodule=data)
        t1 = time.perf_counter()
        fit_s = t1 - t0
        fit_ended = time.time()
    phase_start = 0 if spec.get("slowed_throughout") else workload.phase_start()
    clocked = clock_summary(batch_clock, t1, phase_start, BAND[0])
    if hog is not None:
        clocked["hog_s"] = None if hog.started_at is None else (hog.ended_at or t1) - hog.started_at

    epochs = []
    for i, (record, s) in enumerate(_per_epoch(tuner.history)):
        wall = clock.marks[i + 1] - clock.marks[i] if i + 1 < len(clock.marks) else None
        epochs.append({
            "epoch": record.epoch,
            "num_workers": record.config.num_workers,
            "prefetch_factor": record.config.prefetch_factor,
            "samples_per_s": s.samples_per_s,
            "utilization": s.utilization,
            "starvation_ratio": s.starvation_ratio,
            "stall_fraction": s.stall_fraction,
            "fetch_wait_ms": 1e3 * s.fetch_wait_mean_s,
            "step_ms": 1e3 * s.step_mean_s,
            "startup_ms": 1e3 * s.startup_s,
            "worker_batch_ms": None if s.worker_batch_s is None else 1e3 * s.worker_batch_s,
            "worker_cpu_fraction": s.worker_cpu_fraction,
            "batch_bytes": s.batch_bytes,
            "samples": s.samples,
            "verdict": str(record.verdict),
            "reason": str(record.reason),
            "changed": record.changed,
            "next_num_workers": record.next_config.num_workers,
            "next_prefetch_factor": record.next_config.prefetch_factor,
            "wall_s": wall,
            "ended_at": clock.marks[i + 1] if i + 1 < len(clock.marks) else None,
            "memory_budget_mb": clock.budget_mb[i] if i < len(clock.budget_mb) else None,
        })
    return {
        "fit_s": fit_s,
        "fit_started_at": fit_started,
        "fit_ended_at": fit_ended,
        "train_started_at": clock.marks[0] if clock.marks else fit_started,
        "epochs": epochs,
        "loader_rebuilds": tuner.rebuilds,  # config changes applied (an early first-epoch switch included)
        "memory_fraction": memory_fraction,
        "recommended": None if tuner.recommended_config is None else tuner.recommended_config.as_dict(),
        "phase_start": phase_start,
        **clocked,
        "windows": [{  # every decision, where it closed: the trail of a fit whose epochs are few and long
            "epoch": r.epoch, "end_batch": r.end_batch, "step": r.step,
            "config": [r.config.num_workers, r.config.prefetch_factor],
            "next_config": [r.next_config.num_workers, r.next_config.prefetch_factor],
            "utilization": r.stats.utilization, "verdict": str(r.verdict), "reason": str(r.reason),
        } for r in tuner.history],
    }


# ================================================================================ memory of a tree
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


# =========================================================================================== parent
def launch(spec: dict[str, Any], log_dir: str, timeout_s: float) -> dict[str, Any]:
    """Run one fit in a child process, sampling its tree's memory; returns the child's result plus memory."""
    name = f"{spec['workload']}-{spec['label']}-{spec['num_workers']}x{spec['prefetch_factor']}-{spec['run_id']}"
    result_path = os.path.join(log_dir, name + ".json")
    log_path = os.path.join(log_dir, name + ".log")
    cmd = [sys.executable, os.path.abspath(__file__), "--run-one", json.dumps(spec), "--result", result_path]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env,
                                start_new_session=True)
        sampler = TreeMemorySampler(proc.pid)
        sampler.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and its loader workers
            proc.wait()
            rc = "timeout"
        finally:
            sampler.stop()
    wall_s = time.perf_counter() - started
    result: dict[str, Any] = {"spec": spec, "process_wall_s": wall_s, "load_avg_1m": load, "log": log_path}
    if rc == 0 and os.path.exists(result_path):
        with open(result_path) as f:
            result.update(json.load(f))
    else:
        with open(log_path) as f:
            tail = f.read()[-2000:]
        result["error"] = f"exit {rc}: {tail}"
        print(f"    ! run failed ({rc}); log: {log_path}", flush=True)
    result["memory"] = sampler.summary()
    ends = [e["ended_at"] for e in result.get("epochs", []) if e.get("ended_at")]
    steady_from = ends[-3] if len(ends) >= 3 else result.get("train_started_at")
    result["memory_steady"] = sampler.summary(since=steady_from)  # the last two epochs
    result["memory"]["sampler_cpu_s"] = sampler.cost_s
    result["memory"]["peak_epoch"] = _epoch_at(result, result["memory"].get("peak_at"))
    return result


def _epoch_at(result: dict[str, Any], t: Optional[float]) -> Optional[int]:
    if t is None:
        return None
    for e in result.get("epochs", []):
        if e.get("ended_at") and t <= e["ended_at"]:
            return e["epoch"]
    return None


def _config(w: int, p: int) -> tuple[int, int]:
    return (w, 2 if w == 0 else p)  # prefetch means nothing without workers


def machine_info() -> dict[str, Any]:
    import lightning
    import psutil
    import torch

    from lightning_dltune.resources import usable_cpus

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    digest = hashlib.sha256()
    package = os.path.join(REPO_ROOT, "lightning_dltune")
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            with open(os.path.join(package, name), "rb") as f:
                digest.update(name.encode() + f.read())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "usable_cpus": usable_cpus(),
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "git_commit": commit,
        "package_sha256": digest.hexdigest()[:16],
    }


def rule_of_thumb_workers() -> int:
    from lightning.pytorch.utilities import suggested_max_num_workers

    return suggested_max_num_workers(1)


def projected_fit_s(run: dict[str, Any], epochs: int) -> Optional[float]:
    """A short grid run's fit time carried to ``epochs``: its steady epochs stand in for the missing ones."""
    if "error" in run or not run.get("epochs"):
        return None
    done = len(run["epochs"])
    if done >= epochs:
        return run["fit_s"]
    steady = [e["wall_s"] for e in run["epochs"][1:] if e["wall_s"]] or [run["epochs"][-1]["wall_s"]]
    return run["fit_s"] + (epochs - done) * statistics.mean(steady)


def batch_bytes_of(runs: list[dict[str, Any]], workload) -> float:
    for run in runs:
        for e in run.get("epochs", []):
            if e.get("batch_bytes"):
                return float(e["batch_bytes"])
    return float(workload.batch_size * workload.sample_bytes)


def pick_oracle(grid: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The leanest grid point (fewest workers, then shallowest prefetch) within ``ORACLE_TIE`` of the fastest."""
    ok = [g for g in grid if g["projected_fit_s"] is not None and g["within_budget"]]
    if not ok:
        return None
    fastest = min(g["projected_fit_s"] for g in ok)
    tied = [g for g in ok if g["projected_fit_s"] <= (1 + ORACLE_TIE) * fastest]
    return min(tied, key=lambda g: (g["num_workers"], g["prefetch_factor"]))


def run_workload(workload, index: int, args: argparse.Namespace, rule_workers: int, log_dir: str,
                 rng: random.Random) -> dict[str, Any]:
    from workloads import prepare

    prepare(workload)
    epochs = workload.epochs or args.epochs
    grid_epochs = epochs if workload.full_grid_epochs else min(args.grid_epochs, epochs)
    workers = args.grid_workers or list(workload.grid_workers)
    prefetch = args.grid_prefetch or list(workload.grid_prefetch)
    grid_configs = sorted({_config(w, p) for w in workers for p in prefetch})
    run_counter = iter(range(10_000))
    started = time.perf_counter()

    def spec(label: str, w: int, p: int, tune: bool, n_epochs: int) -> dict[str, Any]:
        return {"workload": workload.name, "label": label, "num_workers": w, "prefetch_factor": p, "tune": tune,
                "epochs": n_epochs, "train_batches": workload.train_batches, "seed": args.seed,
                # a phased workload's grid runs the judged phase alone: its oracle is that phase's
                "slowed_throughout": label == "grid" and workload.phased,
                "run_id": next(run_counter)}

    starts = {
        "default": (0, 2, False),
        "rule": (rule_workers, 2, False),
        "tuned_default": (0, 2, True),
        "tuned_bad": (BAD_START[0], BAD_START[1], True),
    }
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    grid_runs: dict[tuple[int, int], dict[str, Any]] = {}

    def go(label: str, s: dict[str, Any]) -> dict[str, Any]:
        tag = "tuned" if s["tune"] else "static"
        print(f"  [{workload.name}] {label:<14} {tag} start {s['num_workers']}x{s['prefetch_factor']}, "
              f"{s['epochs']} epochs ...", end="", flush=True)
        r = launch(s, log_dir, args.run_timeout)
        fit = f"{r['fit_s']:.1f}s" if "fit_s" in r else "failed"
        peak = r["memory"].get("peak_mb")
        print(f" {fit}, peak {peak:.0f} MB" if peak else f" {fit}", flush=True)
        return r

    # phase 1: the static strategies that are also grid points, and the rest of the grid, shuffled
    phase1: list[tuple[str, Any]] = [("default", None), ("rule", None)]
    # the full default and rule runs stand in for their grid points, except where the grid runs another cost
    reused = set() if workload.phased else {_config(*starts["default"][:2]), _config(*starts["rule"][:2])}
    phase1 += [("grid", c) for c in grid_configs if c not in reused]
    rng.shuffle(phase1)
    for kind, config in phase1:
        if kind == "grid":
            r = go("grid", spec("grid", config[0], config[1], False, grid_epochs))
            grid_runs[config] = r
        else:
            w, p, tune = starts[kind]
            r = go(kind, spec(kind, w, p, tune, epochs))
            runs[kind].append(r)
            if _config(w, p) in grid_configs and not workload.phased:
                grid_runs[_config(w, p)] = r

    budget_mb = workload.memory_budget_mb
    bbytes = batch_bytes_of(list(grid_runs.values()), workload)
    grid = []
    for (w, p), r in sorted(grid_runs.items()):
        batches_held = w * p if w else 1
        steady = [e["samples_per_s"] for e in r.get("epochs", [])[1:]] or [e["samples_per_s"] for e in r.get("epochs", [])]
        grid.append({
            "num_workers": w, "prefetch_factor": p,
            "epochs": len(r.get("epochs", [])),
            "fit_s": r.get("fit_s"),
            "projected_fit_s": projected_fit_s(r, epochs),
            "steady_samples_per_s": statistics.mean(steady) if steady else None,
            "peak_memory_mb": r["memory"].get("peak_mb"),
            "prefetch_mb": batches_held * bbytes / MB,
            "within_budget": budget_mb is None or batches_held * bbytes <= budget_mb * MB,
            "source": "grid" if r["spec"]["label"] == "grid" else f"{r['spec']['label']} run",
            "load_avg_1m": r.get("load_avg_1m"),
            "error": r.get("error"),
        })
    oracle = pick_oracle(grid)
    if oracle is None:
        oracle = {"num_workers": 0, "prefetch_factor": 2}
        print(f"  [{workload.name}] no grid point finished: the oracle falls back to 0 workers", flush=True)
    print(f"  [{workload.name}] oracle: {oracle['num_workers']} workers x prefetch {oracle['prefetch_factor']}",
          flush=True)
    starts["oracle"] = (oracle["num_workers"], oracle["prefetch_factor"], False)

    # phase 2: the oracle and both tuned starts, rotated per workload and repeat (plus static repeats)
    for repeat in range(args.repeats):
        order = ["oracle", "tuned_default", "tuned_bad"] + (["default", "rule"] if repeat else [])
        shift = (index + repeat) % len(order)
        for kind in order[shift:] + order[:shift]:
            w, p, tune = starts[kind]
            runs[kind].append(go(kind, spec(kind, w, p, tune, epochs)))

    return {
        "name": workload.name,
        "summary": workload.summary,
        "cost": workload.cost,
        "step_ms": workload.step_ms,
        "batch_size": workload.batch_size,
        "train_batches": workload.train_batches,
        "batch_mb": bbytes / MB,
        "memory_budget_mb": budget_mb,
        "epochs": epochs,
        "grid_epochs": grid_epochs,
        "judged": judged_part(workload, epochs),
        "phase_start": workload.phase_start(),
        "hog_epoch": workload.hog_epoch,
        "grid": grid,
        "oracle_config": {"num_workers": oracle["num_workers"], "prefetch_factor": oracle["prefetch_factor"]},
        "oracle_rule": (f"leanest grid point within {ORACLE_TIE:.0%} of the fastest projected {epochs}-epoch fit time"
                        + (" with the slow cost throughout (the judged phase's oracle)" if workload.phased else "")
                        + (f", among those whose prefetched batches fit the {budget_mb:.0f} MB budget"
                           if budget_mb else "")),
        "raw_runs": runs,
        "wall_s": time.perf_counter() - started,
    }


def judged_part(workload, epochs: int) -> str:
    """Which part of the fit the time ratio judges, in words."""
    if workload.slow_from_fraction is not None:
        return f"batches {workload.phase_start()}-{workload.train_batches * epochs - 1} (after the slowdown)"
    if workload.slow_from_epoch is not None:
        return f"epochs {workload.slow_from_epoch}-{epochs - 1} (after the slowdown)"
    return "the whole fit"


# ========================================================================================= analysis
def until_in_band(epochs: list[dict[str, Any]]) -> tuple[Optional[int], str]:
    """First epoch inside the band, else the first epoch of a stable final verdict that holds to the end."""
    for e in epochs:
        if BAND[0] <= e["utilization"] <= BAND[1]:
            return e["epoch"], "in band"
    for i, e in enumerate(epochs):
        if e["verdict"] in STABLE_VERDICTS and not any(x["changed"] for x in epochs[i:]):
            return e["epoch"], e["verdict"]
    if not epochs:
        return None, "no epochs"
    return None, f"last: {epochs[-1]['verdict']}, util {epochs[-1]['utilization']:.0%}"


def summarize_strategy(strategy: str, runs: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r and r.get("epochs")]
    if not ok:
        return {"label": LABELS[strategy], "error": (runs[0].get("error") if runs else "not run")}
    run = sorted(ok, key=lambda r: r["fit_s"])[len(ok) // 2]  # the median run (the upper one of two)
    es = run["epochs"]
    in_band_epoch, how = until_in_band(es)
    changes = sum(1 for a, b in zip(es, es[1:]) if (a["num_workers"], a["prefetch_factor"]) != (b["num_workers"], b["prefetch_factor"]))
    half = es[len(es) // 2:]
    return {
        "label": LABELS[strategy],
        "start_config": {"num_workers": run["spec"]["num_workers"], "prefetch_factor": run["spec"]["prefetch_factor"]},
        "final_config": {"num_workers": es[-1]["num_workers"], "prefetch_factor": es[-1]["prefetch_factor"]},
        "tuned": run["spec"]["tune"],
        "fit_s": run["fit_s"],
        "fit_s_all_runs": [r["fit_s"] for r in ok],
        "samples_per_s": [e["samples_per_s"] for e in es],
        "steady_samples_per_s": statistics.mean(e["samples_per_s"] for e in half),
        "fit_samples_per_s": sum(e["samples"] for e in es) / run["fit_s"],
        "epoch_wall_s": [e["wall_s"] for e in es],
        "configs": [[e["num_workers"], e["prefetch_factor"]] for e in es],
        "utilization": [e["utilization"] for e in es],
        "verdicts": [e["verdict"] for e in es],
        "reasons": [e["reason"] for e in es],
        "worker_batch_ms": [e["worker_batch_ms"] for e in es],
        "in_band_epoch": in_band_epoch,
        "in_band_how": how,
        "until_in_band": f"{in_band_epoch} ({how})" if in_band_epoch is not None else f"never ({how})",
        "final_verdict": es[-1]["verdict"],
        "rebuilds": run["loader_rebuilds"] if run["spec"]["tune"] else changes,  # tuner.rebuilds counts config changes
        "loader_rebuilds": run["loader_rebuilds"],
        "peak_memory_mb": run["memory"].get("peak_mb"),
        "peak_memory_epoch": run["memory"].get("peak_epoch"),
        "peak_pss_mb": run["memory"].get("peak_pss_mb"),
        "peak_uss_mb": run["memory"].get("peak_uss_mb"),
        "peak_shm_mb": run["memory"].get("peak_shm_mb"),
        "peak_procs": run["memory"].get("peak_procs"),
        "steady_peak_memory_mb": run["memory_steady"].get("peak_mb"),
        "memory_fraction": run.get("memory_fraction"),
        "memory_budget_mb": [e["memory_budget_mb"] for e in es],
        "load_avg_1m": run["load_avg_1m"],
        "epochs": len(es),
        "complete": len(es) == epochs,
        "phase_s": run.get("phase_s"),
        "band_reached_batch": run.get("band_reached_batch"),
        "band_reached_after_change": run.get("band_reached_after_change"),
        "util_blocks": run.get("util_blocks", []),
        "next_configs": [[e["next_num_workers"], e["next_prefetch_factor"]] for e in es],
        "hog_s": run.get("hog_s"),
        "windows": run.get("windows", []),
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b not in (None, 0) else None


def excess_breakdown(tuned: dict[str, Any], oracle: dict[str, Any]) -> dict[str, float]:
    """Where a tuned fit's extra time over the oracle went, epoch by epoch.

    Each tuned epoch is compared with the oracle's epoch 0 (for epoch 0: both start their workers) or
    with the oracle's mean steady epoch; epochs are grouped into epoch 0 at the start config, the
    epochs while the config still changed, and the epochs at the final config.
    """
    o_walls = [w for w in oracle["epoch_wall_s"] if w]
    t_walls = tuned["epoch_wall_s"]
    if not o_walls or not t_walls or None in t_walls:
        return {}
    o_first = o_walls[0]
    o_steady = statistics.mean(o_walls[1:]) if len(o_walls) > 1 else o_first
    configs = [tuple(c) for c in tuned["configs"]]
    settled = next(i for i in range(len(configs)) if all(c == configs[-1] for c in configs[i:]))
    excess = [w - (o_first if i == 0 else o_steady) for i, w in enumerate(t_walls)]
    first = 1 if settled > 0 else 0  # an untouched start config is the settled config from epoch 0
    return {
        "total_s": tuned["fit_s"] - oracle["fit_s"],
        "epoch0_s": excess[0] if settled > 0 else 0.0,
        "retuning_s": sum(excess[first:settled]),
        "settled_s": sum(excess[settled:]),
        "outside_epochs_s": (tuned["fit_s"] - sum(t_walls)) - (oracle["fit_s"] - sum(o_walls)),
        "settled_epoch": settled,
    }


def analyse(workload_result: dict[str, Any], epochs: int) -> dict[str, Any]:
    raw = workload_result.pop("raw_runs")
    strategies = {s: summarize_strategy(s, raw[s], epochs) for s in STRATEGIES}
    workload_result["strategies"] = strategies
    workload_result["runs"] = {s: [_slim(r) for r in raw[s]] for s in STRATEGIES}
    default, oracle = strategies["default"], strategies["oracle"]
    tuned = {}
    for start, key in (("from_default", "tuned_default"), ("from_bad", "tuned_bad")):
        t = strategies[key]
        if "error" in t or "error" in oracle:
            tuned[start] = {"tuned_over_oracle_time": None, "error": t.get("error") or oracle.get("error")}
            continue
        judged = bool(workload_result.get("phase_start"))
        tuned[start] = {
            # a phased workload is judged on its phase (from the fits' batch clocks), the others on the whole fit
            "tuned_over_oracle_time": (_ratio(t["phase_s"], oracle["phase_s"]) if judged
                                       else _ratio(t["fit_s"], oracle["fit_s"])),
            "tuned_over_oracle_fit_time": _ratio(t["fit_s"], oracle["fit_s"]),
            "judged": workload_result.get("judged", "the whole fit"),
            "phase_s": t["phase_s"] if judged else None,
            "oracle_phase_s": oracle["phase_s"] if judged else None,
            "band_reached_batch": t["band_reached_batch"],
            "band_reached_after_change": t["band_reached_after_change"],
            "band_reached_fraction": (None if t["band_reached_batch"] is None or workload_result["epochs"] != 1
                                      else t["band_reached_batch"] / workload_result["train_batches"]),
            **_hog_configs(workload_result, t),
            "default_over_tuned_time": _ratio(default.get("fit_s"), t["fit_s"]),
            "tuned_over_default_steady_samples_per_s": _ratio(t["steady_samples_per_s"], default.get("steady_samples_per_s")),
            "peak_memory_over_oracle": _ratio(t["peak_memory_mb"], oracle["peak_memory_mb"]),
            "steady_peak_memory_over_oracle": _ratio(t["steady_peak_memory_mb"], oracle["steady_peak_memory_mb"]),
            "final_config": t["final_config"],
            "oracle_config": oracle["start_config"],
            "excess": excess_breakdown(t, oracle),
        }
    workload_result["tuned"] = tuned
    return workload_result


def _hog_configs(workload_result: dict[str, Any], tuned: dict[str, Any]) -> dict[str, Any]:
    """The config the tuned fit went into the hog's epoch with, and the one it ended on."""
    hog = workload_result.get("hog_epoch")
    configs = tuned.get("next_configs") or []
    if hog is None or not configs or hog < 1 or hog > len(configs):
        return {}
    before, after = configs[hog - 1], configs[-1]
    return {"config_before_hog": _config_dict(before), "config_after_hog": _config_dict(after),
            "hog_s": tuned.get("hog_s")}


def _slim(run: dict[str, Any]) -> dict[str, Any]:
    keep = ("fit_s", "process_wall_s", "load_avg_1m", "memory", "memory_steady", "loader_rebuilds", "error",
            "memory_fraction", "phase_start", "phase_s", "band_reached_batch", "band_reached_after_change", "hog_s")
    out = {k: run[k] for k in keep if k in run}
    out["spec"] = {k: v for k, v in run["spec"].items() if k != "run_id"}
    out["epochs"] = [{k: e[k] for k in ("epoch", "num_workers", "prefetch_factor", "samples_per_s", "utilization",
                                        "starvation_ratio", "stall_fraction", "worker_batch_ms", "verdict",
                                        "changed", "wall_s", "reason")} for e in run.get("epochs", [])]
    return out


def evaluate_targets(workloads: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    targets = []
    for name, w in workloads.items():
        for start, label in (("from_default", "default start"), ("from_bad", "bad start")):
            t = w["tuned"].get(start, {})
            value = t.get("tuned_over_oracle_time")
            judged = w.get("judged", "the whole fit")
            targets.append({
                "target": f"tuned/oracle fit time <= {TARGET_TIME_RATIO:.2f}", "workload": name, "start": start,
                "value": value, "threshold": TARGET_TIME_RATIO,
                "met": value is not None and value <= TARGET_TIME_RATIO,
                "miss_by": None if value is None else max(0.0, value / TARGET_TIME_RATIO - 1.0),
                "judged": judged,
            })
            if w.get("epochs") == 1:
                fraction = t.get("band_reached_fraction")
                targets.append({
                    "target": f"single epoch: in band within the first {TARGET_BAND_FRACTION:.0%}", "workload": name,
                    "start": start, "value": fraction, "threshold": TARGET_BAND_FRACTION,
                    "met": fraction is not None and fraction <= TARGET_BAND_FRACTION,
                    "miss_by": None if fraction is None else max(0.0, fraction / TARGET_BAND_FRACTION - 1.0),
                    "band_reached_after_change": t.get("band_reached_after_change"),
                })
        for start in ("from_default", "from_bad"):
            t = w["tuned"].get(start, {})
            value = t.get("peak_memory_over_oracle")
            targets.append({
                "target": f"tuned peak memory <= {TARGET_MEMORY_RATIO:.2f} x oracle's", "workload": name,
                "start": start, "value": value, "threshold": TARGET_MEMORY_RATIO,
                "met": value is not None and value <= TARGET_MEMORY_RATIO,
                "miss_by": None if value is None else max(0.0, value / TARGET_MEMORY_RATIO - 1.0),
                "steady_value": t.get("steady_peak_memory_over_oracle"),
            })
    if "io-bound" in workloads:
        for start in ("from_default", "from_bad"):
            t = workloads["io-bound"]["tuned"].get(start, {})
            value = t.get("tuned_over_default_steady_samples_per_s")
            targets.append({
                "target": f"I/O-bound: tuned samples/s >= {TARGET_IO_SPEEDUP:.0f}x default's", "workload": "io-bound",
                "start": start, "value": value, "threshold": TARGET_IO_SPEEDUP,
                "met": value is not None and value >= TARGET_IO_SPEEDUP,
                "miss_by": None if value is None else max(0.0, 1.0 - value / TARGET_IO_SPEEDUP),
                "whole_fit_value": t.get("default_over_tuned_time"),
            })
    return targets


# ========================================================================================== reports
def _cfg(c: Optional[dict[str, Any]]) -> str:
    if not c:
        return "?"
    return "0 workers" if c["num_workers"] == 0 else f"{c['num_workers']}w x {c['prefetch_factor']}"


def _num(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def write_markdown(results: dict[str, Any], path: str) -> None:
    meta = results["meta"]
    m = meta["machine"]
    lines = [
        "# lightning-dltune: tuning benchmark",
        "",
        f"Generated by `{meta['command']}` ({meta['mode']} mode) on {meta['finished']}; wall time "
        f"{meta['wall_s'] / 60:.1f} min.",
        "",
        f"- **Machine**: {m['usable_cpus']:g} usable CPUs ({m['cpu_model'] or 'unknown model'}), "
        f"{m['ram_gib']:.1f} GiB RAM, no GPU; {m['platform']}; Python {m['python']}, torch {m['torch']}, "
        f"lightning {m['lightning']}; repo {m['git_commit'] or '?'} (package sha256 {m['package_sha256']}, "
        "uncommitted changes included).",
        "- **The accelerator step is emulated** by a sleep in the training process (the host is idle while a GPU "
        "computes; a sleep is that). GPU utilization is therefore the tuner's estimate 1 - starvation ratio; "
        f"the band is {BAND[0]:.2f}-{BAND[1]:.2f}.",
        f"- **Load**: 1-minute load average {meta['load_avg_min']:.2f}-{meta['load_avg_max']:.2f} at run starts "
        "(2 cores). The machine may be shared with other jobs; every strategy of a workload ran in the same "
        "session, interleaved, so ratios are fairer than absolute numbers.",
        f"- **Protocol**: every fit in its own process; {meta['epochs']} epochs per strategy; oracle grid points "
        f"ran {meta['grid_epochs']} epochs, their fit time carried to {meta['epochs']} epochs with their steady "
        "epochs, and the oracle config then ran the full fit. Rule of thumb = "
        f"`suggested_max_num_workers(1)` = {meta['rule_of_thumb_workers']} worker(s), prefetch 2. Bad start = "
        f"{BAD_START[0]} workers x prefetch {BAD_START[1]}. Tuner defaults otherwise (band, `max_workers` = "
        "4 x CPUs - 1, `memory_fraction` 0.5), except the memory-heavy workload's stated budget.",
        "- **Memory** = peak over the fit of the whole process tree (training process + loader workers): "
        "Σ PSS without shared-memory pages, plus every `/dev/shm` object the tree holds (prefetched batches in "
        f"flight), each once; sampled every >= 50 ms (mean {meta['sampler_interval_ms']:.0f} ms). "
        "\"steady\" = the peak over the last two epochs.",
        "- **samples/s** per epoch = the tuner's measurement: training samples / (fetch wait + step time), "
        "without loader start-up and validation; **fit time** = wall time of `trainer.fit` in the child.",
        "",
        "## Targets",
        "",
        "| target | workload | start | value | met | note |",
        "|---|---|---|---:|:---:|---|",
    ]
    for t in results["targets"]:
        note = ""
        if not t["met"] and t["miss_by"] is not None:
            note = f"missed by {t['miss_by']:.0%}"
        if t.get("steady_value") is not None:
            note += ("; " if note else "") + f"steady (last 2 epochs) {t['steady_value']:.2f}x"
        if t.get("whole_fit_value") is not None:
            note += ("; " if note else "") + f"whole fit {t['whole_fit_value']:.2f}x"
        if t.get("judged") not in (None, "the whole fit"):
            note += ("; " if note else "") + f"judged on {t['judged']}"
        if t.get("band_reached_after_change") is not None:
            note += ("; " if note else "") + f"after the change in band by {t['band_reached_after_change']} batches"
        value = _num(t["value"])
        lines.append(f"| {t['target']} | {t['workload']} | {t['start'].replace('_', ' ')} | {value} | "
                     f"{'yes' if t['met'] else '**no**'} | {note} |")
    met = sum(t["met"] for t in results["targets"])
    lines += ["", f"{met} of {len(results['targets'])} target checks met.", ""]

    for name, w in results["workloads"].items():
        lines += [f"## {name}: {w['summary']}", "", f"Cost: {w['cost']}. Batch {w['batch_size']} "
                  f"({w['batch_mb']:.2f} MB), {w['train_batches']} training batches per epoch."]
        if w["memory_budget_mb"]:
            frac = w["strategies"]["tuned_default"].get("memory_fraction")
            lines.append(f"Memory budget for prefetched batches: {w['memory_budget_mb']:.0f} MB, given to the tuner as "
                         f"`memory_fraction={_num(frac, '{:.4f}')}` of available RAM.")
        lines += [_measured_cost(w), f"Oracle: **{_cfg(w['oracle_config'])}** ({w['oracle_rule']}).", ""]
        lines += [
            "| strategy | config start -> end | fit time (s) | samples/s per epoch | until in band (or verdict) | "
            "rebuilds | peak memory MB (steady) | tuned/oracle time | default/tuned time |",
            "|---|---|---:|---|---|---:|---:|---:|---:|",
        ]
        for key in STRATEGIES:
            s = w["strategies"][key]
            if "error" in s:
                lines.append(f"| {LABELS[key]} | failed: {str(s['error'])[:80]} | | | | | | | |")
                continue
            start = {"tuned_default": "from_default", "tuned_bad": "from_bad"}.get(key)
            tuned = w["tuned"].get(start, {}) if start else {}
            sps = " ".join(f"{x:.0f}" for x in s["samples_per_s"])
            cfg = _cfg(s["start_config"]) + (f" -> {_cfg(s['final_config'])}" if s["tuned"] else "")
            mem = f"{_num(s['peak_memory_mb'], '{:.0f}')} ({_num(s['steady_peak_memory_mb'], '{:.0f}')})"
            lines.append(
                f"| {s['label']} | {cfg} | {s['fit_s']:.1f} | {sps} | {s['until_in_band']} | {s['rebuilds']} | {mem} | "
                f"{_num(tuned.get('tuned_over_oracle_time'), '{:.2f}') if start else ''} | "
                f"{_num(tuned.get('default_over_tuned_time'), '{:.2f}') if start else ''} |"
            )
        lines += _phase_lines(w)
        lines += ["", _grid_table(w), ""]
        lines += _misses(name, w, results["targets"])
    lines += ["## Tuned runs, epoch by epoch", ""]
    for name, w in results["workloads"].items():
        for key in ("tuned_default", "tuned_bad"):
            s = w["strategies"][key]
            if "error" in s:
                continue
            lines.append(f"- **{name}, {s['label']}**:")
            if w.get("epochs") == 1:  # one epoch: every window
                for x in s["windows"]:
                    at = "epoch end" if x["end_batch"] is None else f"batch {x['end_batch']}"
                    c = x["config"]
                    lines.append(f"  - window to {at}: {c[0]}w x {c[1]}, util {x['utilization']:.0%}, {x['verdict']}: "
                                 f"{x['reason']}")
                continue
            for i, (c, u, v, reason) in enumerate(zip(s["configs"], s["utilization"], s["verdicts"], s["reasons"])):
                lines.append(f"  - epoch {i}: {c[0]}w x {c[1]}, util {u:.0%}, {v}: {reason}")
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _trail(s: dict[str, Any]) -> str:
    """The configs a tuned fit ran, window by window, each run of equal ones once: ``0w -> 3w x 2 -> ...``.

    A change decided by the last window, which no batch ran, follows in brackets.
    """
    windows = s.get("windows", [])
    configs = [x["config"] for x in windows]
    runs = [c for i, c in enumerate(configs) if i == 0 or c != configs[i - 1]]
    text = " -> ".join(_cfg(_config_dict(c)) for c in runs) or "n/a"
    if windows and windows[-1]["next_config"] != windows[-1]["config"]:
        text += f" (then decided: {_cfg(_config_dict(windows[-1]['next_config']))})"
    return text


def _phase_lines(w: dict[str, Any]) -> list[str]:
    """For workloads whose conditions change: the judged phase, the band from the batch clocks, the hog."""
    if not w.get("phase_start") and w.get("epochs") != 1 and w.get("hog_epoch") is None:
        return []
    lines = ["", f"Judged on {w.get('judged', 'the whole fit')}. In band = {BAND_SPAN} batches in a row at utilization "
             f">= {BAND[0]:.2f} by the fit's own batch clocks (wait = since the previous batch ended or the epoch "
             "started; step = batch start to end).", "",
             "| strategy | phase time (s) | tuned/oracle phase time | in band by batch | after the change, in band by | "
             "configs, window by window |",
             "|---|---:|---:|---:|---:|---|"]
    oracle = w["strategies"]["oracle"]
    for key in STRATEGIES:
        s = w["strategies"][key]
        if "error" in s:
            continue
        ratio = _ratio(s.get("phase_s"), oracle.get("phase_s")) if w.get("phase_start") else None
        lines.append(f"| {s['label']} | {_num(s.get('phase_s'), '{:.1f}')} | {_num(ratio)} | "
                     f"{_num(s.get('band_reached_batch'), '{:d}')} | {_num(s.get('band_reached_after_change'), '{:d}')} | "
                     f"{_trail(s) if s['tuned'] else ''} |")
    if w.get("hog_epoch") is not None:
        for start in ("from_default", "from_bad"):
            t = w["tuned"].get(start, {})
            if "config_before_hog" in t:
                lines.append(f"\nTuned {start.replace('_', ' ')}: {_cfg(t['config_before_hog'])} into the hog's epoch "
                             f"{w['hog_epoch']}, {_cfg(t['config_after_hog'])} at the end (hog ran "
                             f"{_num(t.get('hog_s'), '{:.1f}')} s).")
    return lines


def _measured_cost(w: dict[str, Any]) -> str:
    """The data cost as the tuner measured it, next to the stated one."""
    def median_ms(key: str) -> Optional[float]:
        values = [v for v in w["strategies"][key].get("worker_batch_ms", []) if v]
        return statistics.median(values) if values else None

    default, oracle = median_ms("default"), median_ms("oracle")
    text = f"Measured: a batch takes {_num(default, '{:.1f}')} ms to make in the training process (0 workers)"
    if w["oracle_config"]["num_workers"]:
        text += f", {_num(oracle, '{:.1f}')} ms in a worker at the oracle config"
    return text + "."


def _grid_table(w: dict[str, Any]) -> str:
    prefetch = sorted({g["prefetch_factor"] for g in w["grid"] if g["num_workers"]})
    workers = sorted({g["num_workers"] for g in w["grid"]})
    by = {(g["num_workers"], g["prefetch_factor"]): g for g in w["grid"]}
    oracle = (w["oracle_config"]["num_workers"], w["oracle_config"]["prefetch_factor"])
    head = (f"Oracle grid: fit time carried to {w['epochs']} epochs, s (steady samples/s, peak MB over the "
            f"point's own {w['grid_epochs']} epochs); **bold** = oracle, ~~struck~~ = prefetched batches over the "
            "memory budget, * = the full default/rule run.")
    rows = [head, "", "| workers \\ prefetch | " + " | ".join(str(p) for p in prefetch) + " |",
            "|---|" + "---:|" * len(prefetch)]
    for wk in workers:
        cells = []
        for p in prefetch:
            g = by.get((wk, 2 if wk == 0 else p))
            if g is None or (wk == 0 and p != prefetch[0]):
                cells.append("")
                continue
            if g["projected_fit_s"] is None:
                cells.append("failed")
                continue
            text = (f"{g['projected_fit_s']:.1f}{'*' if g['source'] != 'grid' else ''} "
                    f"({_num(g['steady_samples_per_s'], '{:.0f}')}, {_num(g['peak_memory_mb'], '{:.0f}')})")
            if (wk, g["prefetch_factor"]) == oracle:
                text = f"**{text}**"
            if not g["within_budget"]:
                text = f"~~{text}~~"
            cells.append(text)
        rows.append(f"| {wk} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _misses(name: str, w: dict[str, Any], targets: list[dict[str, Any]]) -> list[str]:
    """Mechanical 'why' for missed targets of one workload: where the extra time or memory came from."""
    out = []
    for t in targets:
        if t["workload"] != name or t["met"] or t["value"] is None:
            continue
        key = {"from_default": "tuned_default", "from_bad": "tuned_bad"}[t["start"]]
        s, o = w["strategies"][key], w["strategies"]["oracle"]
        if t["target"].startswith("tuned/oracle") and w.get("phase_start"):
            tt = w["tuned"][t["start"]]
            out.append(f"- Missed: {t['target']} ({t['start'].replace('_', ' ')}): on {tt['judged']} "
                       f"{_num(tt['phase_s'], '{:.1f}')} s vs the phase oracle's {_num(tt['oracle_phase_s'], '{:.1f}')} s; "
                       f"configs by window {_trail(s)}, after the change in band by "
                       f"{_num(tt.get('band_reached_after_change'), '{:d}')} batches.")
            continue
        if t["target"].startswith("single epoch"):
            out.append(f"- Missed: {t['target']} ({t['start'].replace('_', ' ')}): in band by batch "
                       f"{_num(s.get('band_reached_batch'), '{:d}')} of {w['train_batches']}.")
            continue
        if t["target"].startswith("tuned/oracle"):
            x = w["tuned"][t["start"]].get("excess") or {}
            if not x:
                continue
            out.append(
                f"- Missed: {t['target']} ({t['start'].replace('_', ' ')}): {s['fit_s']:.1f} s vs {o['fit_s']:.1f} s, "
                f"+{x['total_s']:.1f} s. " + _excess_text(x, s, o) + " " + _excess_hint(x)
            )
        elif "memory" in t["target"]:
            when = ("at the end of the fit" if s["peak_memory_epoch"] is None
                    else f"in epoch {s['peak_memory_epoch']} (at {_cfg(_config_dict(s['configs'][s['peak_memory_epoch']]))})")
            steady = _ratio(s["steady_peak_memory_mb"], o["steady_peak_memory_mb"])
            out.append(
                f"- Missed: {t['target']} ({t['start'].replace('_', ' ')}): peak {s['peak_memory_mb']:.0f} MB {when}, "
                f"up to {s['peak_procs']} processes seen, vs the oracle's {o['peak_memory_mb']:.0f} MB at "
                f"{_cfg(o['start_config'])}; over the last two epochs {_num(s['steady_peak_memory_mb'], '{:.0f}')} MB "
                f"vs {_num(o['steady_peak_memory_mb'], '{:.0f}')} MB ({_num(steady)}x)."
                + (" Mostly the start config's workers: the steady ratio is within the target."
                   if steady is not None and steady <= TARGET_MEMORY_RATIO else
                   f" The tuner settled at {_cfg(s['final_config'])}: more workers (or deeper prefetch) than the oracle.")
            )
        else:
            out.append(f"- Missed: {t['target']} ({t['start'].replace('_', ' ')}): {t['value']:.2f}x.")
    return out + ([""] if out else [])


def _excess_text(x: dict[str, Any], tuned: dict[str, Any], oracle: dict[str, Any]) -> str:
    settled = x["settled_epoch"]
    parts = []
    if settled > 0:
        parts.append(f"epoch 0 at the start config {x['epoch0_s']:+.1f} s")
    if settled > 1:
        span = "epoch 1" if settled == 2 else f"epochs 1-{settled - 1}"
        parts.append(f"{span} while the config changed {x['retuning_s']:+.1f} s")
    parts.append(f"epochs {settled}-{len(tuned['configs']) - 1} at {_cfg(tuned['final_config'])} "
                 f"(oracle {_cfg(oracle['start_config'])}) {x['settled_s']:+.1f} s")
    parts.append(f"set-up and tear-down outside epochs {x['outside_epochs_s']:+.1f} s")
    return "; ".join(parts) + "."


def _excess_hint(x: dict[str, Any]) -> str:
    """Which part of the excess dominates, in a sentence."""
    parts = {"epoch0_s": x["epoch0_s"], "retuning_s": x["retuning_s"], "settled_s": x["settled_s"],
             "outside_epochs_s": x["outside_epochs_s"]}
    top = max(parts, key=parts.get)
    if parts[top] <= 0:
        return ""
    share = parts[top] / x["total_s"] if x["total_s"] > 0 else 0.0
    return {
        "epoch0_s": f"Mostly ({share:.0%}) the first epoch at the start config: the tuner decides between epochs.",
        "retuning_s": f"Mostly ({share:.0%}) the epochs spent at intermediate configs while retuning.",
        "settled_s": f"Mostly ({share:.0%}) the settled config, which is slower than the oracle's.",
        "outside_epochs_s": f"Mostly ({share:.0%}) set-up and tear-down (starting and stopping workers).",
    }[top]


def _config_dict(pair: list[int]) -> dict[str, int]:
    return {"num_workers": pair[0], "prefetch_factor": pair[1]}


def write_plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    names = list(results["workloads"])
    panels = len(names) + 1
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    styles = {"default": ("tab:gray", "o", "-"), "rule": ("tab:brown", "s", "-"), "oracle": ("black", "D", "--"),
              "tuned_default": ("tab:blue", "^", "-"), "tuned_bad": ("tab:red", "v", "-")}
    for ax, name in zip(axes.flat, names):
        w = results["workloads"][name]
        single = w.get("epochs") == 1  # one epoch: utilization along the epoch, from the batch clocks
        for key in STRATEGIES:
            s = w["strategies"][key]
            if "error" in s:
                continue
            color, marker, ls = styles[key]
            label = s["label"] + (f" ({_cfg(s['start_config'])})" if key in ("oracle", "rule") else "")
            ys = s.get("util_blocks") if single else s["samples_per_s"]
            xs = [25 * i for i in range(len(ys))] if single else range(len(ys))
            ax.plot(xs, ys, color=color, marker=marker, linestyle=ls, label=label, markersize=2 if single else 4)
        ax.set_title(f"{name}", fontsize=10)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("batch" if single else "epoch")
        ax.set_ylabel("utilization (per 25 batches)" if single else "samples/s")
        if single:
            ax.axhspan(*BAND, color="tab:green", alpha=0.1)
            if w.get("phase_start"):
                ax.axvline(w["phase_start"], color="gray", linestyle=":", linewidth=1)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    ax = axes.flat[len(names)]
    xs = range(len(names))
    for offset, (start, color) in zip((-0.2, 0.2), (("from_default", "tab:blue"), ("from_bad", "tab:red"))):
        values = [results["workloads"][n]["tuned"].get(start, {}).get("tuned_over_oracle_time") or 0 for n in names]
        ax.bar([x + offset for x in xs], values, width=0.4, color=color, label=f"tuned {start.replace('_', ' ')}")
    ax.axhline(TARGET_TIME_RATIO, color="black", linestyle="--", linewidth=1, label=f"target {TARGET_TIME_RATIO:.2f}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=20, fontsize=8)
    ax.set_ylabel("tuned / oracle fit time (phase)")
    ax.set_title("fit time vs oracle (changing workloads: the phase after the change)", fontsize=9)
    ax.legend(fontsize=7)
    for extra in list(axes.flat)[panels:]:
        extra.axis("off")
    meta = results["meta"]
    fig.suptitle(f"lightning-dltune tuning benchmark ({meta['mode']}): samples/s per epoch, "
                 f"{meta['machine']['usable_cpus']:g} CPUs, accelerator step emulated by a sleep", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tuning.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=False, default=float)
    write_markdown(results, os.path.join(out, "tuning.md"))
    write_plot(results, os.path.join(out, "tuning.png"))


# ============================================================================================= main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="io-bound and step-bound, 3 epochs, half-length epochs, grid 0/2/4 workers x prefetch 2")
    parser.add_argument("--smoke", action="store_true",
                        help="the quickest check that the harness works: step-bound only, 2 epochs of 8 batches, "
                             "grid 0/2 workers x prefetch 2 (~30 s; numbers mean little)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for tuning.json/.md/.png")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), help="which workloads (default: all)")
    parser.add_argument("--epochs", type=int, help="epochs per strategy (default 8; quick 3)")
    parser.add_argument("--grid-epochs", type=int, help="epochs per oracle grid point (default 3; quick 2)")
    parser.add_argument("--grid-workers", type=int, nargs="+", help="override every workload's grid of workers")
    parser.add_argument("--grid-prefetch", type=int, nargs="+", help="override every workload's grid of prefetch")
    parser.add_argument("--train-batches", type=int, help="training batches per epoch for every workload")
    parser.add_argument("--repeats", type=int, default=1, help="runs per strategy (the median run is reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run order and of the fits")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a fit is killed")
    parser.add_argument("--log-dir", help="where child logs go (default: a fresh temporary folder)")
    parser.add_argument("--render", metavar="JSON",
                        help="only re-render tuning.md/.png (and the target checks) from an existing tuning.json")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.quick = True
        args.workloads = args.workloads or ["step-bound"]
        args.epochs = args.epochs or 2
        args.grid_workers = args.grid_workers or [0, 2]
        args.train_batches = args.train_batches or 8
    if args.quick:
        args.workloads = args.workloads or ["io-bound", "step-bound"]
        args.epochs = args.epochs or 3
        args.grid_epochs = args.grid_epochs or 2
        args.grid_workers = args.grid_workers or [0, 2, 4]
        args.grid_prefetch = args.grid_prefetch or [2]
    args.workloads = args.workloads or list(WORKLOADS)
    args.epochs = args.epochs or 8
    args.grid_epochs = min(args.grid_epochs or 3, args.epochs)
    if args.epochs < 2 or args.grid_epochs < 1 or args.repeats < 1:
        parser.error("--epochs must be >= 2, --grid-epochs and --repeats >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.run_one:
        result = run_one(json.loads(args.run_one))
        with open(args.result, "w") as f:
            json.dump(result, f)
        return result
    if args.render:
        with open(args.render) as f:
            results = json.load(f)
        results["targets"] = evaluate_targets(results["workloads"])
        write_outputs(results, args.out)
        print(f"rendered {args.out}/tuning.{{json,md,png}} from {args.render}")
        return results

    from workloads import WORKLOADS

    started = time.perf_counter()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="dltune-bench-logs-")
    os.makedirs(log_dir, exist_ok=True)
    rng = random.Random(args.seed)
    machine = machine_info()
    rule_workers = rule_of_thumb_workers()
    command = "python benchmarks/tuning.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    print(f"lightning-dltune tuning benchmark ({'quick' if args.quick else 'full'}): {args.workloads}, "
          f"{args.epochs} epochs (a one-epoch workload: 1); child logs in {log_dir}", flush=True)
    meta = {
        "mode": "smoke" if args.smoke else "quick" if args.quick else ("full" if not any((args.train_batches, args.grid_workers, args.grid_prefetch))
                                             else "custom"),
        "command": command.strip(),
        "machine": machine,
        "epochs": args.epochs,
        "grid_epochs": args.grid_epochs,
        "repeats": args.repeats,
        "rule_of_thumb_workers": rule_workers,
        "bad_start": {"num_workers": BAD_START[0], "prefetch_factor": BAD_START[1]},
        "band": list(BAND),
        "seed": args.seed,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    results: dict[str, Any] = {"meta": meta, "workloads": {}, "targets": []}
    for index, name in enumerate(args.workloads):
        workload = WORKLOADS[name]
        batches = args.train_batches or (max(8, workload.train_batches // 2) if args.quick else workload.train_batches)
        workload = workload.scaled(batches)
        print(f"[{index + 1}/{len(args.workloads)}] {name}: {workload.cost}", flush=True)
        w = run_workload(workload, index, args, rule_workers, log_dir, rng)
        results["workloads"][name] = analyse(w, w["epochs"])
        _finish_meta(results, started)
        write_outputs(results, args.out)  # after every workload: a crash keeps what ran
    _finish_meta(results, started)
    write_outputs(results, args.out)
    print(f"done in {meta['wall_s'] / 60:.1f} min: {args.out}/tuning.{{json,md,png}}", flush=True)
    for t in results["targets"]:
        value = _num(t["value"])
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']:<44} {t['workload']:<13} {t['start']:<13} {value}")
    return results


def _finish_meta(results: dict[str, Any], started: float) -> None:
    meta = results["meta"]
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["wall_s"] = time.perf_counter() - started
    loads, samples, cost = [], 0, 0.0
    for w in results["workloads"].values():
        loads += [g["load_avg_1m"] for g in w["grid"] if g.get("load_avg_1m") is not None and g["source"] == "grid"]
        for runs in w["runs"].values():
            for r in runs:
                loads.append(r.get("load_avg_1m", 0.0))
                mem = r.get("memory", {})
                samples += mem.get("samples", 0) or 0
                cost += r.get("process_wall_s", 0.0)
    meta["load_avg_min"] = min(loads) if loads else 0.0
    meta["load_avg_max"] = max(loads) if loads else 0.0
    meta["sampler_interval_ms"] = 1e3 * cost / samples if samples else 0.0
    results["targets"] = evaluate_targets(results["workloads"])


if __name__ == "__main__":
    main()
