"""Runs one benchmark fit in a child process and samples the memory of its process tree meanwhile.

The child is ``tuning.py --run-one <spec> --result <file>`` (:func:`fit_runner.run_one`), in its own
session so that a fit past its time limit is killed with its loader workers; its output goes to a log
file per fit. The parent adds the process's wall time, the load average at its start and the tree's
memory (the whole fit, and its last two epochs) to what the child recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

from tree_memory import TreeMemorySampler

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
TUNING_SCRIPT = os.path.join(HERE, "tuning.py")
"""The benchmark's entry point; its ``--run-one`` runs one fit in the child."""


def launch(spec: dict[str, Any], log_dir: str, timeout_s: float) -> dict[str, Any]:
    """Run one fit in a child process, sampling its tree's memory; returns the child's result plus memory."""
    name = f"{spec['workload']}-{spec['label']}-{spec['num_workers']}x{spec['prefetch_factor']}-{spec['run_id']}"
    result_path = os.path.join(log_dir, name + ".json")
    log_path = os.path.join(log_dir, name + ".log")
    cmd = [sys.executable, TUNING_SCRIPT, "--run-one", json.dumps(spec), "--result", result_path]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    load = os.getloadavg()[0]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env, start_new_session=True
        )
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
