"""The tuning benchmark's oracle: grid points carried to the full fit, the budget, the leanest of the fastest."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark_module

MB = 2**20

oracle = load_benchmark_module("oracle", "strategies")


def _run(fit_s: float, walls: list[float], label: str = "grid") -> dict:
    return {
        "fit_s": fit_s,
        "spec": {"label": label},
        "memory": {"peak_mb": 400.0},
        "load_avg_1m": 0.5,
        "epochs": [{"wall_s": w, "samples_per_s": 1000.0 / w} for w in walls],
    }


def test_a_short_grid_run_is_carried_to_the_full_fit_with_its_steady_epochs():
    run = _run(fit_s=10.0, walls=[4.0, 2.0, 3.0])  # epoch 0 pays the workers' start
    assert oracle.projected_fit_s(run, epochs=8) == pytest.approx(10.0 + 5 * 2.5)
    assert oracle.projected_fit_s(run, epochs=3) == 10.0
    assert oracle.projected_fit_s({"error": "exit 1", "epochs": []}, epochs=8) is None


def test_oracle_is_the_leanest_point_within_two_percent_of_the_fastest():
    grid = oracle.grid_rows(
        {(0, 2): _run(100.0, [12.0]), (2, 2): _run(60.0, [7.0]), (4, 2): _run(59.0, [7.0]), (4, 4): _run(58.9, [7.0])},
        epochs=1,
        batch_bytes=MB,
        budget_mb=None,
    )
    best = oracle.pick_oracle(grid)
    assert (best["num_workers"], best["prefetch_factor"]) == (2, 2)  # 60.0 s is within 2 % of 58.9 s


def test_points_whose_prefetched_batches_break_the_budget_cannot_be_the_oracle():
    runs = {(4, 2): _run(70.0, [8.0]), (8, 4): _run(50.0, [6.0])}
    grid = oracle.grid_rows(runs, epochs=1, batch_bytes=12 * MB, budget_mb=256.0)
    by = {(g["num_workers"], g["prefetch_factor"]): g for g in grid}
    assert by[(8, 4)]["prefetch_mb"] == 384.0 and not by[(8, 4)]["within_budget"]
    assert by[(4, 2)]["within_budget"]
    best = oracle.pick_oracle(grid)
    assert (best["num_workers"], best["prefetch_factor"]) == (4, 2)
    assert "256 MB budget" in oracle.oracle_rule(8, phased=False, budget_mb=256.0)


def test_no_oracle_when_no_grid_point_finished():
    grid = oracle.grid_rows(
        {(2, 2): {"error": "timeout", "spec": {"label": "grid"}, "memory": {}}},
        epochs=8,
        batch_bytes=MB,
        budget_mb=None,
    )
    assert grid[0]["projected_fit_s"] is None and oracle.pick_oracle(grid) is None
