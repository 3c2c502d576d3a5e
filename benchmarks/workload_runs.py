"""Every run of one workload, in the benchmark's order: the static strategies and the grid, then the rest.

Within a workload, the ``default`` and ``rule`` runs and the grid points run first in a shuffled order
(seeded); the oracle is picked from the grid (:mod:`oracle`); then the oracle and the tuned fits run
in an order rotated per workload and per repeat. The tuned fits come in pairs of one start, the mixin's
and the project's own loaders (:data:`~strategies.MIXIN_OF`), run one after the other in an order that
alternates per workload and repeat, so the pair's ratio compares fits under the same load. All
strategies of a workload run within a few minutes of each other, so load from other jobs on a shared
machine hits them alike.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from fit_launcher import launch
from oracle import batch_bytes_of, grid_rows, oracle_rule, pick_oracle
from strategies import BAD_START, MB, MIXIN_OF, OWN_LOADERS, STRATEGIES, grid_config


def run_workload(
    workload, index: int, args: argparse.Namespace, rule_workers: int, log_dir: str, rng: random.Random
) -> dict[str, Any]:
    """Runs every strategy and grid point of ``workload``; the runs, the grid and the oracle, unanalysed."""
    from workloads import prepare

    prepare(workload)
    epochs = workload.epochs or args.epochs
    grid_epochs = epochs if workload.full_grid_epochs else min(args.grid_epochs, epochs)
    workers = args.grid_workers or list(workload.grid_workers)
    prefetch = args.grid_prefetch or list(workload.grid_prefetch)
    grid_configs = sorted({grid_config(w, p) for w in workers for p in prefetch})
    launcher = _Launcher(workload, args, log_dir)
    started = time.perf_counter()
    starts = {
        "default": (0, 2, False),
        "rule": (rule_workers, 2, False),
        "tuned_default": (0, 2, True),
        "tuned_bad": (BAD_START[0], BAD_START[1], True),
    }
    starts.update({own: starts[mixin] for own, mixin in MIXIN_OF.items()})  # the same starts, own loaders
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    grid_runs = _run_static_and_grid(launcher, starts, grid_configs, runs, epochs, grid_epochs, rng)

    budget_mb = workload.memory_budget_mb
    bbytes = batch_bytes_of(list(grid_runs.values()), workload)
    grid = grid_rows(grid_runs, epochs, bbytes, budget_mb)
    oracle = _oracle_config(workload.name, grid)
    starts["oracle"] = (oracle["num_workers"], oracle["prefetch_factor"], False)
    _run_oracle_and_tuned(launcher, starts, runs, epochs, index, args.repeats)

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
        "oracle_config": oracle,
        "oracle_rule": oracle_rule(epochs, workload.phased, budget_mb),
        "raw_runs": runs,
        "wall_s": time.perf_counter() - started,
    }


class _Launcher:
    """Launches the fits of one workload, each with the next run id, and prints a line for each."""

    def __init__(self, workload, args: argparse.Namespace, log_dir: str) -> None:
        self.workload, self.args, self.log_dir = workload, args, log_dir
        self.run_counter = iter(range(10_000))

    def spec(self, label: str, w: int, p: int, tune: bool, n_epochs: int) -> dict[str, Any]:
        """What the child runs (``tuning.py --run-one``)."""
        workload = self.workload
        return {
            "workload": workload.name,
            "label": label,
            "num_workers": w,
            "prefetch_factor": p,
            "tune": tune,
            "epochs": n_epochs,
            "train_batches": workload.train_batches,
            "seed": self.args.seed,
            "own_loaders": label in OWN_LOADERS,  # plain DataLoaders in the LightningModule, no datamodule
            # a phased workload's grid runs the judged phase alone: its oracle is that phase's
            "slowed_throughout": label == "grid" and workload.phased,
            "run_id": next(self.run_counter),
        }

    def run(self, label: str, w: int, p: int, tune: bool, n_epochs: int) -> dict[str, Any]:
        """One fit in a child process, its fit time and peak memory printed."""
        s = self.spec(label, w, p, tune, n_epochs)
        tag = ("own-tuned" if s["own_loaders"] else "tuned") if s["tune"] else "static"
        print(
            f"  [{self.workload.name}] {label:<14} {tag} start {s['num_workers']}x{s['prefetch_factor']}, "
            f"{s['epochs']} epochs ...",
            end="",
            flush=True,
        )
        r = launch(s, self.log_dir, self.args.run_timeout)
        fit = f"{r['fit_s']:.1f}s" if "fit_s" in r else "failed"
        peak = r["memory"].get("peak_mb")
        print(f" {fit}, peak {peak:.0f} MB" if peak else f" {fit}", flush=True)
        return r


def _run_static_and_grid(
    launcher: _Launcher,
    starts: dict[str, tuple[int, int, bool]],
    grid_configs: list[tuple[int, int]],
    runs: dict[str, list[dict[str, Any]]],
    epochs: int,
    grid_epochs: int,
    rng: random.Random,
) -> dict[tuple[int, int], dict[str, Any]]:
    """Phase 1: the static strategies that are also grid points, and the rest of the grid, shuffled.

    Appends the ``default`` and ``rule`` runs to ``runs``; returns the grid's runs by config.
    """
    phased = launcher.workload.phased
    grid_runs: dict[tuple[int, int], dict[str, Any]] = {}
    phase1: list[tuple[str, Any]] = [("default", None), ("rule", None)]
    # the full default and rule runs stand in for their grid points, except where the grid runs another cost
    reused = set() if phased else {grid_config(*starts["default"][:2]), grid_config(*starts["rule"][:2])}
    phase1 += [("grid", c) for c in grid_configs if c not in reused]
    rng.shuffle(phase1)
    for kind, config in phase1:
        if kind == "grid":
            r = launcher.run("grid", config[0], config[1], False, grid_epochs)
            grid_runs[config] = r
        else:
            w, p, tune = starts[kind]
            r = launcher.run(kind, w, p, tune, epochs)
            runs[kind].append(r)
            if grid_config(w, p) in grid_configs and not phased:
                grid_runs[grid_config(w, p)] = r
    return grid_runs


def _oracle_config(name: str, grid: list[dict[str, Any]]) -> dict[str, int]:
    """The oracle's config picked from the grid (0 workers where no grid point finished), printed."""
    oracle = pick_oracle(grid)
    if oracle is None:
        oracle = {"num_workers": 0, "prefetch_factor": 2}
        print(f"  [{name}] no grid point finished: the oracle falls back to 0 workers", flush=True)
    print(f"  [{name}] oracle: {oracle['num_workers']} workers x prefetch {oracle['prefetch_factor']}", flush=True)
    return {"num_workers": oracle["num_workers"], "prefetch_factor": oracle["prefetch_factor"]}


def _run_oracle_and_tuned(
    launcher: _Launcher,
    starts: dict[str, tuple[int, int, bool]],
    runs: dict[str, list[dict[str, Any]]],
    epochs: int,
    index: int,
    repeats: int,
) -> None:
    """Phase 2: the oracle and the tuned pairs (mixin, own loaders) of both starts, rotated per workload and
    repeat (plus static repeats); within a pair, who runs first alternates."""
    for repeat in range(repeats):
        turn = index + repeat
        pairs = [[mixin, own] if turn % 2 == 0 else [own, mixin] for own, mixin in MIXIN_OF.items()]
        groups = [["oracle"], *pairs] + ([["default"], ["rule"]] if repeat else [])
        shift = turn % len(groups)
        for kind in [k for group in groups[shift:] + groups[:shift] for k in group]:
            w, p, tune = starts[kind]
            runs[kind].append(launcher.run(kind, w, p, tune, epochs))


def judged_part(workload, epochs: int) -> str:
    """Which part of the fit the time ratio judges, in words."""
    if workload.slow_from_fraction is not None:
        return f"batches {workload.phase_start()}-{workload.train_batches * epochs - 1} (after the slowdown)"
    if workload.slow_from_epoch is not None:
        return f"epochs {workload.slow_from_epoch}-{epochs - 1} (after the slowdown)"
    return "the whole fit"
