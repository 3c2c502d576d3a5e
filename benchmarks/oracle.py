"""The oracle: the best static config of a workload's grid of workers x prefetch, measured in the same run.

Every grid point runs a few epochs; its fit time is carried to the full fit with its steady epochs
(:func:`projected_fit_s`). The oracle is the leanest point (fewest workers, then shallowest prefetch)
within :data:`ORACLE_TIE` of the fastest, among points whose prefetched batches (workers x prefetch x
batch bytes) fit the workload's memory budget where it states one (:func:`pick_oracle`).
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from strategies import MB

ORACLE_TIE = 0.02  # grid points within this of the fastest count as tied; the leanest of them is the oracle


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
    """Bytes of one batch as the fits measured it, else as the workload states it."""
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


def grid_rows(
    grid_runs: dict[tuple[int, int], dict[str, Any]], epochs: int, batch_bytes: float, budget_mb: Optional[float]
) -> list[dict[str, Any]]:
    """One row per grid point, by config: its fit time carried to ``epochs``, its speed, memory and budget."""
    grid = []
    for (w, p), r in sorted(grid_runs.items()):
        batches_held = w * p if w else 1
        steady = [e["samples_per_s"] for e in r.get("epochs", [])[1:]] or [
            e["samples_per_s"] for e in r.get("epochs", [])
        ]
        grid.append(
            {
                "num_workers": w,
                "prefetch_factor": p,
                "epochs": len(r.get("epochs", [])),
                "fit_s": r.get("fit_s"),
                "projected_fit_s": projected_fit_s(r, epochs),
                "steady_samples_per_s": statistics.mean(steady) if steady else None,
                "peak_memory_mb": r["memory"].get("peak_mb"),
                "prefetch_mb": batches_held * batch_bytes / MB,
                "within_budget": budget_mb is None or batches_held * batch_bytes <= budget_mb * MB,
                "source": "grid" if r["spec"]["label"] == "grid" else f"{r['spec']['label']} run",
                "load_avg_1m": r.get("load_avg_1m"),
                "error": r.get("error"),
            }
        )
    return grid


def oracle_rule(epochs: int, phased: bool, budget_mb: Optional[float]) -> str:
    """How the oracle was picked, in words (for the results)."""
    return (
        f"leanest grid point within {ORACLE_TIE:.0%} of the fastest projected {epochs}-epoch fit time"
        + (" with the slow cost throughout (the judged phase's oracle)" if phased else "")
        + (f", among those whose prefetched batches fit the {budget_mb:.0f} MB budget" if budget_mb else "")
    )
