"""What the policy remembers of a fit, replayed from its window records (the policy keeps no state).

Also the one notion of the **best config**: the leanest config (fewest workers, then the shallowest
prefetch) whose median window throughput is within ``min_gain`` of the best median. The decision, the
end-of-fit table and the recommendation all use :func:`best_config`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence

from lightning_dltune.config import LoaderConfig
from lightning_dltune.model import PipelineModel
from lightning_dltune.records import Budget, PolicySettings, WindowRecord
from lightning_dltune.stats import WindowStats, pool_windows

POOLED_WINDOWS = 8  # a config is judged on its last this-many windows in a row: noise averages out,
# a real change in the pipeline still shows within a few windows


class ChangeKind(str, Enum):
    MORE_WORKERS = "more_workers"
    MORE_PREFETCH = "more_prefetch"
    GIVE_BACK = "give_back"
    OTHER = "other"


@dataclass(frozen=True)
class LastChange:
    """The change that produced the current config: the config before it, its window, and how it went."""

    before: LoaderConfig
    before_stats: WindowStats
    kind: ChangeKind
    gain: float  # relative throughput change, this window vs the one before
    stopped_helping: bool = False  # more workers that the model said would pay, and did not


@dataclass(frozen=True)
class FitHistory:
    """The fit so far, as the rules need it."""

    seen: WindowStats  # the current config's recent windows pooled into one (noise averages out)
    windows: int  # how many windows ``seen`` pools
    util_error: float  # standard error of ``seen``'s utilization (0 for a single window)
    rebuilds: int
    rejected: tuple[LoaderConfig, ...]  # configs that were undone: never tried again
    starved: tuple[tuple[int, int], ...]  # (workers, prefetch) of configs that were starved
    worker_ceiling: Optional[int]
    prefetch_ceiling: Optional[int]
    last_change: Optional[LastChange]
    best: Optional[LoaderConfig]


def recall(
    history: Sequence[WindowRecord],
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    settings: PolicySettings,
) -> FitHistory:
    """Replay ``history`` plus the window just measured (``current``, ``stats``)."""
    windows = [(r.config, r.stats, r.next_config) for r in history] + [(current, stats, None)]
    pooled: list[WindowStats] = []
    runs: list[int] = []
    rejected: list[LoaderConfig] = []
    starved: list[tuple[int, int]] = []
    worker_ceiling: Optional[int] = None
    prefetch_ceiling: Optional[int] = None
    last_change: Optional[LastChange] = None
    for i, (config, window, next_config) in enumerate(windows):
        run = runs[-1] + 1 if i and windows[i - 1][0] == config else 1
        runs.append(run)
        pooled.append(pool_windows([w for _, w, _ in windows[max(i - run + 1, i + 1 - POOLED_WINDOWS) : i + 1]]))
        if is_starved(pooled[i], settings):
            starved.append(resources(config))
        if i == 0:
            continue
        before, _, planned = windows[i - 1]
        if planned != config or before == config:
            continue  # not a change the policy made (or none at all)
        if next_config == before:
            rejected.append(config)  # A -> B -> A: B was undone
        if i >= 2 and windows[i - 2][0] == config and windows[i - 2][2] == before:
            continue  # this window is the undo itself: never judged again, or undos would ping-pong
        kind = change_kind(before, config)
        gain = throughput_gain(pooled[i - 1], window)
        slower = gain < -settings.min_gain
        # more workers that did not pay although the model said they clearly would: no more of them
        # (a small expected gain that does not show proves nothing: windows differ by a few percent)
        stopped_helping = (
            kind is ChangeKind.MORE_WORKERS
            and not slower
            and gain < settings.min_gain
            and _expected_gain(before, config, pooled[i - 1], budget, settings) >= 2 * settings.min_gain
        )
        if kind is ChangeKind.MORE_WORKERS and (slower or stopped_helping):
            worker_ceiling = _min(worker_ceiling, before.num_workers if slower else config.num_workers)
        if kind is ChangeKind.MORE_PREFETCH and gain < settings.min_gain:
            kept = before if gain < -settings.min_gain else config
            prefetch_ceiling = _min(prefetch_ceiling, kept.prefetch_factor)
        if i == len(windows) - 1:
            last_change = LastChange(before, pooled[i - 1], kind, gain, stopped_helping)
    count = min(runs[-1], POOLED_WINDOWS)
    return FitHistory(
        seen=pooled[-1],
        windows=count,
        util_error=_standard_error([w.utilization for _, w, _ in windows[-count:]]),
        rebuilds=sum(r.changed for r in history),
        rejected=tuple(rejected),
        starved=tuple(starved),
        worker_ceiling=worker_ceiling,
        prefetch_ceiling=prefetch_ceiling,
        last_change=last_change,
        best=_best([(c, w) for c, w, _ in windows], settings.min_gain),
    )


def best_config(history: Sequence[WindowRecord], min_gain: float = 0.05) -> Optional[LoaderConfig]:
    """The leanest config whose median window throughput is within ``min_gain`` of the best median.

    Leanest: fewest workers, then shallowest prefetch; ``None`` for a history with nothing measured.
    """
    return _best([(r.config, r.stats) for r in history], min_gain)


def median_rate(history: Sequence[WindowRecord], config: LoaderConfig) -> Optional[WindowRecord]:
    """The record of ``config`` whose throughput is the median of its windows (the lower one for an even count)."""
    runs = [r for r in history if r.config == config and r.stats.batches > 0]
    if not runs:
        return None
    middle = statistics.median_low([r.samples_per_s for r in runs])
    return next(r for r in runs if r.samples_per_s == middle)


def _best(windows: Sequence[tuple[LoaderConfig, WindowStats]], min_gain: float) -> Optional[LoaderConfig]:
    rates: dict[LoaderConfig, list[float]] = {}
    for config, window in windows:
        if window.batches > 0:
            rates.setdefault(config, []).append(window.samples_per_s)
    if not rates:
        return None
    medians = {config: statistics.median(values) for config, values in rates.items()}
    top = max(medians.values())
    near = [config for config, rate in medians.items() if rate >= (1.0 - min_gain) * top]
    # leanest first; among equally lean configs the faster, then the one seen first
    order = {config: i for i, config in enumerate(medians)}
    return min(near, key=lambda c: (*resources(c), -medians[c], order[c]))


def resources(config: LoaderConfig) -> tuple[int, int]:
    """(workers, prefetch) a config holds; prefetch means nothing without workers."""
    return config.num_workers, config.prefetch_factor if config.num_workers else 0


def change_kind(before: LoaderConfig, after: LoaderConfig) -> ChangeKind:
    (w0, p0), (w1, p1) = resources(before), resources(after)
    if w1 > w0:
        return ChangeKind.MORE_WORKERS
    if w1 == w0 and p1 > p0:
        return ChangeKind.MORE_PREFETCH
    if w1 <= w0 and p1 <= p0 and (w1, p1) != (w0, p0):
        return ChangeKind.GIVE_BACK
    return ChangeKind.OTHER


def throughput_gain(before: WindowStats, after: WindowStats) -> float:
    if before.samples_per_s <= 0:
        return math.inf if after.samples_per_s > 0 else 0.0
    return after.samples_per_s / before.samples_per_s - 1.0


def is_starved(window: WindowStats, settings: PolicySettings) -> bool:
    """Clearly below the band and waiting on data."""
    low = settings.band[0] - settings.hysteresis
    return window.batches > 0 and window.utilization < low and window.starvation_ratio >= settings.min_starvation


def _expected_gain(
    before: LoaderConfig, after: LoaderConfig, seen: WindowStats, budget: Budget, settings: PolicySettings
) -> float:
    """The throughput gain the model of ``before``'s windows predicted for moving to ``after``."""
    if seen.batches <= 0 or seen.step_mean_s <= 0:
        return 0.0
    model = PipelineModel.infer(before.num_workers, seen, budget.cpus, settings.burst_stall_fraction)
    return model.throughput(after.num_workers) / model.throughput(before.num_workers) - 1.0


def _standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of ``values`` (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def _min(a: Optional[int], b: int) -> int:
    return b if a is None else min(a, b)
