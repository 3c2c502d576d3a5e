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
from typing import Any, Callable, Optional, Sequence

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.model import PipelineModel
from lightning_dltune.core.records import Budget, PolicySettings, WindowRecord
from lightning_dltune.core.stats import WindowStats, pool_windows

POOLED_WINDOWS = 8  # a config is judged on its last this-many windows in a row: noise averages out,
# a real change in the pipeline still shows within a few windows
CONFIRM_WINDOWS = 2  # a change is judged on this many windows of the new config: one noisy window never undoes it
RETRY_AFTER_WINDOWS = 16  # a config undone while the machine was busy (the step slowed: contention) may be tried
# again after this many windows, doubling each time it is undone again; other undos stand until conditions shift
SHIFT_COST = 0.5  # a worker's time per batch that moved by more than this share of its pooled mean ...
SHIFT_STEP = 0.10  # ... or a step time by more than this share (an accelerator's step is steady: a slower one
# means a busier host, whose pooled windows would otherwise read as slack) ...
SHIFT_STARVATION = 0.15  # ... or starvation that moved by more than this (absolute) ...
SHIFT_SIGMAS = 3.0  # ... and by more than this many standard deviations of the pooled windows: new conditions
CONTENTION_STEP = 0.25  # a step this much slower than before a change: the machine got busier (or our workers
# take the training process's CPU); the change is measured again before it is judged


class ChangeKind(str, Enum):
    MORE_WORKERS = "more_workers"
    MORE_PREFETCH = "more_prefetch"
    GIVE_BACK = "give_back"
    OTHER = "other"


@dataclass(frozen=True)
class LastChange:
    """The change that produced the current config: the config before it, its windows, and how it went so far.

    Args:
        before: the config before the change.
        before_stats: ``before``'s windows pooled (the baseline).
        kind: what the change did.
        gain: relative throughput change, the current config's windows since the change vs ``before_stats``.
        stopped_helping: more workers that the model said would clearly pay, and did not.
        windows: windows of the current config since the change (it is judged once ``CONFIRM_WINDOWS``).
        step_ratio: the current config's step time over ``before``'s (above ``1 + CONTENTION_STEP``: contention).
    """

    before: LoaderConfig
    before_stats: WindowStats
    kind: ChangeKind
    gain: float
    stopped_helping: bool = False
    windows: int = 1
    step_ratio: float = 1.0

    @property
    def confirmed(self) -> bool:
        """Measured on enough windows to be judged."""
        return self.windows >= CONFIRM_WINDOWS

    @property
    def contention(self) -> bool:
        """The step itself got slower after the change: throughput fell for a reason the data side may not hold."""
        return self.step_ratio > 1.0 + CONTENTION_STEP


@dataclass(frozen=True)
class Shift:
    """New conditions: the newest window's ``signal`` moved from ``before`` (its pooled windows) to ``now``."""

    signal: str  # "worker time per batch", "batch time", "step time", "starvation"
    before: float
    now: float


@dataclass(frozen=True)
class FitHistory:
    """The fit so far, as the rules need it. Everything learned before the latest :class:`Shift` is dropped."""

    seen: WindowStats  # the current config's recent windows pooled into one (noise averages out)
    windows: int  # how many windows ``seen`` pools
    util_error: float  # standard error of ``seen``'s utilization (0 for a single window)
    rebuilds: int  # changes since conditions last shifted (the rebuild cap counts these)
    rejected: tuple[LoaderConfig, ...]  # configs undone recently: not tried again until they expire
    starved: tuple[tuple[int, int], ...]  # (workers, prefetch) of configs starved under today's conditions
    worker_ceiling: Optional[int]
    prefetch_ceiling: Optional[int]
    last_change: Optional[LastChange]
    best: Optional[LoaderConfig]
    shift: Optional[Shift] = None  # conditions shifted: the newest two windows agree on it
    suspect: Optional[Shift] = None  # the newest window alone left the config's earlier ones: noise or new conditions
    total_rebuilds: int = 0  # every change of the fit


@dataclass
class _Strike:
    """An undone config or a ceiling: when it was set and for how long it stands."""

    value: Any
    at: int
    strikes: int
    busy: bool  # judged while the step itself was slower (contention): the verdict may be the machine's

    def stands(self, now: int) -> bool:
        return not self.busy or now - self.at < RETRY_AFTER_WINDOWS * 2 ** (self.strikes - 1)


@dataclass
class _Run:
    """The windows of one config in a row, and the change that started it (if the policy made one)."""

    start: int
    config: LoaderConfig
    before: Optional[LoaderConfig] = None
    before_stats: Optional[WindowStats] = None
    kind: ChangeKind = ChangeKind.OTHER
    undo: bool = False  # the run is an undo of the run before it: never judged, or undos would ping-pong


def recall(
    history: Sequence[WindowRecord],
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    settings: PolicySettings,
) -> FitHistory:
    """Replay ``history`` plus the window just measured (``current``, ``stats``)."""
    windows = [(r.config, r.stats, r.next_config) for r in history] + [(current, stats, None)]
    n = len(windows)
    pooled: list[WindowStats] = []
    rejected: dict[LoaderConfig, _Strike] = {}
    strikes: dict[LoaderConfig, int] = {}  # how often each config was undone (never forgotten: backoff)
    starved: list[tuple[int, int]] = []
    worker_ceiling: Optional[_Strike] = None
    prefetch_ceiling: Optional[_Strike] = None
    last_change: Optional[LastChange] = None
    shift: Optional[Shift] = None
    conditions_from = 0  # first window of today's conditions
    runs: list[_Run] = []
    for i, (config, window, next_config) in enumerate(windows):
        if runs and runs[-1].config == config:
            run = runs[-1]
            # new conditions when the last two windows both left the config's earlier ones the same way (one
            # window is noise: a heavy-tailed cost alone moves it); the new run starts with the first of them
            prior = [w for _, w, _ in windows[max(run.start, i - 1 - POOLED_WINDOWS) : i - 1]]
            moved = _confirmed_shift(prior, windows[i - 1][1], window, config.num_workers)
            if moved is not None:  # what was learned under the old conditions is stale
                conditions_from = i - 1
                shift = moved if i == n - 1 else None
                rejected.clear()
                starved.clear()
                worker_ceiling = prefetch_ceiling = None
                run = _Run(i - 1, config)
                runs.append(run)
                pooled[i - 1] = window_before = windows[i - 1][1]
                if is_starved(window_before, settings) and resources(config) not in starved:
                    starved.append(resources(config))
        else:
            run = _Run(i, config)
            if runs and windows[i - 1][2] == config:  # a change the policy made
                previous = runs[-1]
                run.before, run.before_stats = previous.config, pooled[i - 1]
                run.kind = change_kind(previous.config, config)
                run.undo = previous.before == config and not previous.undo
            runs.append(run)
        start = max(run.start, i + 1 - POOLED_WINDOWS)
        pooled.append(pool_windows([w for _, w, _ in windows[start : i + 1]]))
        if is_starved(pooled[i], settings) and resources(config) not in starved:
            starved.append(resources(config))

        ended = i < n - 1 and windows[i + 1][0] != config
        if run.before is None or run.before_stats is None or run.undo or run.start < conditions_from:
            continue
        length = i - run.start + 1
        gain = throughput_gain(run.before_stats, pooled[i])
        slower = gain < -settings.min_gain
        # more workers that did not pay although the model said they clearly would: no more of them
        # (a small expected gain that does not show proves nothing: windows differ by a few percent)
        stopped_helping = (
            run.kind is ChangeKind.MORE_WORKERS
            and not slower
            and gain < settings.min_gain
            and _expected_gain(run.before, config, run.before_stats, budget, settings) >= 2 * settings.min_gain
        )
        step_ratio = _ratio(pooled[i].step_mean_s, run.before_stats.step_mean_s)
        busy = step_ratio > 1.0 + CONTENTION_STEP
        if i == n - 1 and length <= CONFIRM_WINDOWS:
            last_change = LastChange(run.before, run.before_stats, run.kind, gain, stopped_helping, length, step_ratio)
        if ended and next_config == run.before:  # A -> B -> A: B was undone
            strikes[config] = strikes.get(config, 0) + 1
            rejected[config] = _Strike(config, i, strikes[config], busy)
        if length == CONFIRM_WINDOWS or (ended and length < CONFIRM_WINDOWS):  # the change's verdict, once
            if run.kind is ChangeKind.MORE_WORKERS and (slower or stopped_helping):
                # slower after a step up of several workers: try a smaller step up before calling it the CPUs'
                # limit; never declare it at a count that was not measured against one worker more
                step_up = config.num_workers - run.before.num_workers
                limit = config.num_workers if stopped_helping else (
                    run.before.num_workers if step_up <= 1 else config.num_workers - 1)
                if worker_ceiling is None or not worker_ceiling.stands(i) or limit < worker_ceiling.value:
                    worker_ceiling = _Strike(limit, i, strikes.get(config, 0) + 1, busy)
            if run.kind is ChangeKind.MORE_PREFETCH and gain < settings.min_gain:
                kept = run.before if slower else config
                if prefetch_ceiling is None or not prefetch_ceiling.stands(i) or kept.prefetch_factor < prefetch_ceiling.value:
                    prefetch_ceiling = _Strike(kept.prefetch_factor, i, strikes.get(config, 0) + 1, busy)
    now = n - 1
    run = runs[-1]
    suspect = None
    if shift is None and now - run.start >= 2:  # the newest window against the (at least two) before it
        prior = [w for _, w, _ in windows[max(run.start, now - POOLED_WINDOWS) : now]]
        suspect = detect_shift(prior, windows[now][1], current.num_workers)
    count = min(now - run.start + 1, POOLED_WINDOWS)
    changes = [r.changed for r in history]
    return FitHistory(
        seen=pooled[-1],
        windows=count,
        util_error=_standard_error([w.utilization for _, w, _ in windows[now + 1 - count :]]),
        rebuilds=sum(changes[conditions_from:]),
        rejected=tuple(c for c, strike in rejected.items() if strike.stands(now)),
        starved=tuple(starved),
        worker_ceiling=worker_ceiling.value if worker_ceiling is not None and worker_ceiling.stands(now) else None,
        prefetch_ceiling=prefetch_ceiling.value if prefetch_ceiling is not None and prefetch_ceiling.stands(now) else None,
        last_change=last_change,
        best=_best([(c, w) for c, w, _ in windows[conditions_from:]], settings.min_gain),
        shift=shift,
        suspect=suspect,
        total_rebuilds=sum(changes),
    )


def detect_shift(prior: Sequence[WindowStats], new: WindowStats, workers: int) -> Optional[Shift]:
    """Whether ``new`` differs from the same config's ``prior`` windows by more than their noise explains.

    Compared: the data side's cost per batch (a worker's time per batch where the loader says it; the
    fetch wait with 0 workers, where the training process makes the batch inside the fetch), the step
    time, and, where the cost is unknown, starvation. A signal moved when it left its pooled mean by more than ``SHIFT_COST`` of it
    (``SHIFT_STEP`` for the step, ``SHIFT_STARVATION`` points for starvation) and by more than
    ``SHIFT_SIGMAS`` standard deviations of the prior windows, and lies outside all of them.
    ``None``: same conditions.
    """
    prior = [w for w in prior if w.batches > 0]
    if not prior or new.batches <= 0:
        return None
    costed = False  # starvation speaks only where the batch's cost cannot: it also moves with bursts and stalls
    for name, signal, floor in _signals(workers):
        values = [v for v in (signal(w) for w in prior) if v is not None]
        now = signal(new)
        if not values or now is None or (name == "starvation" and costed):
            continue
        costed = costed or name == "batch time"
        mean = sum(values) / len(values)
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        absolute = name == "starvation"  # a share: it moves by points (from 0, too); costs move by their share
        if not absolute and mean <= 0:
            continue
        margin = max(floor if absolute else floor * mean, SHIFT_SIGMAS * spread)
        # and outside every earlier window: a heavy-tailed cost makes lucky windows that earlier ones also had
        if abs(now - mean) > margin and (now > max(values) or now < min(values)):
            return Shift(name, mean, now)
    return None


def same_conditions(history: Sequence[WindowRecord], config: LoaderConfig) -> list[WindowStats]:
    """The latest windows that ran ``config`` in a row, up to ``POOLED_WINDOWS``, if the next window runs it too.

    What a window of ``config`` opening now is compared with to spot new conditions (:func:`detect_shift`).
    """
    if not history or history[-1].next_config != config:
        return []
    run: list[WindowStats] = []
    for record in reversed(history):
        if record.config != config or len(run) == POOLED_WINDOWS:
            break
        run.append(record.stats)
    return run[::-1]


def _confirmed_shift(
    prior: Sequence[WindowStats], first: WindowStats, second: WindowStats, workers: int
) -> Optional[Shift]:
    """A shift both ``first`` and ``second`` show against ``prior`` (at least two windows), in the same direction."""
    if len(prior) < 2:
        return None
    a, b = detect_shift(prior, first, workers), detect_shift(prior, second, workers)
    if a is None or b is None or a.signal != b.signal or (a.now > a.before) != (b.now > b.before):
        return None
    return Shift(b.signal, b.before, (a.now + b.now) / 2)


def _signals(workers: int) -> list[tuple[str, Callable[[WindowStats], Optional[float]], float]]:
    def cost(w: WindowStats) -> Optional[float]:
        if w.worker_batch_s is not None:
            return w.worker_batch_s
        return w.fetch_wait_mean_s if workers == 0 else None

    return [
        ("batch time", cost, SHIFT_COST),
        ("step time", lambda w: w.step_mean_s, SHIFT_STEP),
        ("starvation", lambda w: w.starvation_ratio, SHIFT_STARVATION),
    ]


def _ratio(now: float, before: float) -> float:
    return now / before if before > 0 else 1.0


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
