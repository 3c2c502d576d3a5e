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


def test_own_loaders_are_judged_against_the_oracle_and_the_mixins_tuned_time_of_their_start():
    own = {
        "from_default": {"own_over_oracle_time": 1.04, "own_over_mixin_time": 1.05},
        "from_bad": {"own_over_oracle_time": 1.26, "own_over_mixin_time": None},
    }
    workload = {
        "epochs": 8,
        "judged": "epochs 3-7 (after the slowdown)",
        "tuned": {"from_default": _tuned(1.0), "from_bad": _tuned(1.0)},
        "own_loaders": own,
    }
    all_checks = targets.evaluate_targets({"slow-at-epoch": workload})
    assert len(all_checks) == 8  # 4 of the mixin's tuned runs, 4 of the own loaders'
    checks = _by(all_checks)
    to_oracle = checks[("own loaders", "slow-at-epoch", "from_default")]
    assert to_oracle["met"] and to_oracle["threshold"] == targets.TARGET_TIME_RATIO
    assert to_oracle["judged"] == "epochs 3-7 (after the slowdown)"  # the part the mixin's runs are judged on
    late = checks[("own loaders", "slow-at-epoch", "from_bad")]
    assert not late["met"] and late["miss_by"] == pytest.approx(1.26 / 1.05 - 1)
    to_mixin = checks[("own loaders/mixin tuned fit time", "slow-at-epoch", "from_default")]
    assert to_mixin["threshold"] == targets.TARGET_OWN_RATIO == 1.03
    assert not to_mixin["met"] and to_mixin["miss_by"] == pytest.approx(1.05 / 1.03 - 1)
    failed = checks[("own loaders/mixin tuned fit time", "slow-at-epoch", "from_bad")]
    assert not failed["met"] and failed["miss_by"] is None  # a failed run is a miss without an amount
