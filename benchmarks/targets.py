"""The benchmark's targets, checked against the analysed workloads: one record per target, workload and start.

- tuned / oracle fit time <= :data:`TARGET_TIME_RATIO` on every workload, from both starts (a workload
  whose conditions change: the phase after the change against that phase's oracle);
- single-epoch fits in band within the first :data:`TARGET_BAND_FRACTION` of the epoch;
- on the I/O-bound workload, the tuned run's steady samples/s >= :data:`TARGET_IO_SPEEDUP` x the default's;
- the tuned runs' peak memory <= :data:`TARGET_MEMORY_RATIO` x the oracle run's;
- with the project's own loaders (no mixin), tuned / oracle time <= :data:`TARGET_TIME_RATIO` as with the
  mixin (judged on the same part of the fit), and own-loaders / mixin tuned time of the same start
  <= :data:`TARGET_OWN_RATIO` (where a run has them: results from before the own-loaders strategies
  have no such checks).
"""

from __future__ import annotations

from typing import Any, Optional

TARGET_TIME_RATIO = 1.05
TARGET_BAND_FRACTION = 0.05  # single-epoch fits reach the band within this fraction of the epoch
TARGET_IO_SPEEDUP = 3.0
TARGET_MEMORY_RATIO = 1.15
TARGET_OWN_RATIO = 1.03  # own loaders' tuned time against the mixin's tuned time, same start, same run


def _check(
    target: str,
    workload: str,
    start: str,
    value: Optional[float],
    threshold: float,
    at_least: bool = False,
    **notes: Any,
) -> dict[str, Any]:
    """One target's record: met, and by how much it was missed (a fraction of the threshold)."""
    if value is None:
        met, miss_by = False, None
    elif at_least:
        met, miss_by = value >= threshold, max(0.0, 1.0 - value / threshold)
    else:
        met, miss_by = value <= threshold, max(0.0, value / threshold - 1.0)
    return {
        "target": target,
        "workload": workload,
        "start": start,
        "value": value,
        "threshold": threshold,
        "met": met,
        "miss_by": miss_by,
        **notes,
    }


def evaluate_targets(workloads: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target check of the analysed ``workloads`` (``analysis.analyse``), in the report's order."""
    targets = []
    for name, w in workloads.items():
        for start in ("from_default", "from_bad"):
            t = w["tuned"].get(start, {})
            targets.append(
                _check(
                    f"tuned/oracle fit time <= {TARGET_TIME_RATIO:.2f}",
                    name,
                    start,
                    t.get("tuned_over_oracle_time"),
                    TARGET_TIME_RATIO,
                    judged=w.get("judged", "the whole fit"),
                )
            )
            if w.get("epochs") == 1:
                targets.append(
                    _check(
                        f"single epoch: in band within the first {TARGET_BAND_FRACTION:.0%}",
                        name,
                        start,
                        t.get("band_reached_fraction"),
                        TARGET_BAND_FRACTION,
                        band_reached_after_change=t.get("band_reached_after_change"),
                    )
                )
        for start in ("from_default", "from_bad"):
            t = w["tuned"].get(start, {})
            targets.append(
                _check(
                    f"tuned peak memory <= {TARGET_MEMORY_RATIO:.2f} x oracle's",
                    name,
                    start,
                    t.get("peak_memory_over_oracle"),
                    TARGET_MEMORY_RATIO,
                    steady_value=t.get("steady_peak_memory_over_oracle"),
                )
            )
        for start, o in w.get("own_loaders", {}).items():
            judged = w.get("judged", "the whole fit")
            targets.append(
                _check(
                    f"own loaders: tuned/oracle fit time <= {TARGET_TIME_RATIO:.2f}",
                    name,
                    start,
                    o.get("own_over_oracle_time"),
                    TARGET_TIME_RATIO,
                    judged=judged,
                )
            )
            targets.append(
                _check(
                    f"own loaders/mixin tuned fit time <= {TARGET_OWN_RATIO:.2f}",
                    name,
                    start,
                    o.get("own_over_mixin_time"),
                    TARGET_OWN_RATIO,
                    judged=judged,
                )
            )
    if "io-bound" in workloads:
        for start in ("from_default", "from_bad"):
            t = workloads["io-bound"]["tuned"].get(start, {})
            targets.append(
                _check(
                    f"I/O-bound: tuned samples/s >= {TARGET_IO_SPEEDUP:.0f}x default's",
                    "io-bound",
                    start,
                    t.get("tuned_over_default_steady_samples_per_s"),
                    TARGET_IO_SPEEDUP,
                    at_least=True,
                    whole_fit_value=t.get("default_over_tuned_time"),
                )
            )
    return targets
