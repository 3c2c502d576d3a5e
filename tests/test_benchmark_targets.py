"""The tuning benchmark's target checks: met or missed, and by how much, per workload and start."""

from __future__ import annotations

import pytest
from benchmark_modules import load_benchmark_module

targets = load_benchmark_module("targets")


def _tuned(time_ratio, memory_ratio=1.0, **more) -> dict:
    return {
        "tuned_over_oracle_time": time_ratio,
        "peak_memory_over_oracle": memory_ratio,
        "steady_peak_memory_over_oracle": memory_ratio,
        **more,
    }


def _by(checks: list[dict]) -> dict:
    return {(c["target"].split(":")[0].split(" <=")[0], c["workload"], c["start"]): c for c in checks}


def test_time_and_memory_ratios_are_met_up_to_their_thresholds_and_missed_by_the_excess():
    workloads = {
        "bursty": {
            "epochs": 8,
            "judged": "the whole fit",
            "tuned": {"from_default": _tuned(1.05), "from_bad": _tuned(1.10, memory_ratio=1.38)},
        }
    }
    checks = _by(targets.evaluate_targets(workloads))
    assert checks[("tuned/oracle fit time", "bursty", "from_default")]["met"]
    late = checks[("tuned/oracle fit time", "bursty", "from_bad")]
    assert not late["met"] and late["miss_by"] == pytest.approx(1.10 / 1.05 - 1)
    heavy = checks[("tuned peak memory", "bursty", "from_bad")]
    assert not heavy["met"] and heavy["miss_by"] == pytest.approx(0.2) and heavy["steady_value"] == 1.38
    assert len(checks) == 4  # no band check for a fit of many epochs, no I/O check without io-bound


def test_a_missing_ratio_is_a_miss_without_an_amount():
    checks = targets.evaluate_targets(
        {"step-bound": {"epochs": 8, "tuned": {"from_default": _tuned(None), "from_bad": _tuned(1.0)}}}
    )
    missing = checks[0]
    assert (missing["start"], missing["met"], missing["miss_by"], missing["judged"]) == (
        "from_default",
        False,
        None,
        "the whole fit",
    )


def test_io_bound_speedup_is_a_floor_and_single_epoch_fits_get_a_band_check():
    io = _tuned(1.0, tuned_over_default_steady_samples_per_s=2.7, default_over_tuned_time=2.5)
    drift = _tuned(1.02, band_reached_fraction=0.08, band_reached_after_change=30)
    checks = _by(
        targets.evaluate_targets(
            {
                "io-bound": {
                    "epochs": 8,
                    "tuned": {"from_default": io, "from_bad": _tuned(1.0, tuned_over_default_steady_samples_per_s=4.7)},
                },
                "drift-epoch": {"epochs": 1, "tuned": {"from_default": drift, "from_bad": drift}},
            }
        )
    )
    slow = checks[("I/O-bound", "io-bound", "from_default")]
    assert not slow["met"] and slow["miss_by"] == pytest.approx(0.1) and slow["whole_fit_value"] == 2.5
    assert checks[("I/O-bound", "io-bound", "from_bad")]["met"]
    band = checks[("single epoch", "drift-epoch", "from_default")]
    assert not band["met"] and band["miss_by"] == pytest.approx(0.6) and band["band_reached_after_change"] == 30
