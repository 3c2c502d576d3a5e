"""Time-weighted mean utilization over the training part of a window: the arithmetic, no NVML.

A reading (a driver sample, or one polled rate) is a value in ``[0, 1]`` that covers an interval of
time. The window's mean weighs each reading by how much of its interval lies inside training: after
the window's start and outside its pauses (validation, checkpointing). Time no reading covers is not
guessed at, except where the driver is known to have gone quiet: on some platforms NVML stops adding
samples while the GPU is idle, so a gap much longer than the sample period is idle time, not missing
data. Times are microseconds on one clock.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

__all__ = [
    "GAP_PERIODS",
    "TimeWeightedMean",
    "TrainingSpans",
    "UtilizationWindow",
    "idle_tail_us",
    "sample_intervals",
    "sample_period_us",
]

GAP_PERIODS = 2.5
"""A gap between two driver samples longer than this many sample periods is idle beyond one period."""

Interval = tuple[float, float, float]  # (start_us, end_us, value): the value covers (start, end]


class TrainingSpans:
    """The training part of a window: from ``start_us`` on, less the paused intervals.

    Args:
        start_us: when the window began.
    """

    __slots__ = ("start_us", "pauses")

    def __init__(self, start_us: float) -> None:
        self.start_us = float(start_us)
        self.pauses: list[list[float]] = []  # [pause_us, resume_us or inf]

    @property
    def paused(self) -> bool:
        return bool(self.pauses) and math.isinf(self.pauses[-1][1])

    def pause(self, now_us: float) -> None:
        if not self.paused:
            self.pauses.append([float(now_us), math.inf])

    def resume(self, now_us: float) -> None:
        if self.paused:
            self.pauses[-1][1] = float(now_us)

    def overlap(self, start_us: float, end_us: float) -> float:
        """Microseconds of ``(start_us, end_us]`` that were training."""
        lo = max(start_us, self.start_us)
        if end_us <= lo:
            return 0.0
        total = end_us - lo
        for p, r in self.pauses:
            total -= max(0.0, min(end_us, r) - max(lo, p))
        return max(0.0, total)


class TimeWeightedMean:
    """Σ value x training time / Σ training time over the readings added; ``count`` readings took part."""

    __slots__ = ("weighted", "weight", "count")

    def __init__(self) -> None:
        self.weighted = 0.0
        self.weight = 0.0
        self.count = 0

    def add(
        self, spans: Optional[TrainingSpans], start_us: float, end_us: float, value: float, is_sample: bool = True
    ) -> None:
        """Add ``value`` over ``(start_us, end_us]``; ``spans=None``: all of it counts (clocks not comparable)."""
        w = (end_us - start_us) if spans is None else spans.overlap(start_us, end_us)
        if w <= 0:
            return
        self.weighted += value * w
        self.weight += w
        if is_sample:
            self.count += 1

    def mean(self, idle_us: float = 0.0) -> Optional[float]:
        """The mean, with ``idle_us`` more of idle time (an uncovered tail known to be idle); ``None`` if empty."""
        if self.weight <= 0:
            return None
        return min(1.0, max(0.0, self.weighted / (self.weight + max(0.0, idle_us))))


def sample_period_us(timestamps: Sequence[int], current: Optional[float]) -> Optional[float]:
    """The driver's sample period from a run of sample timestamps (the median step), else ``current``.

    The median ignores the long steps of idle gaps; fewer than three steps say too little.
    """
    steps = sorted(b - a for a, b in zip(timestamps, timestamps[1:]) if b > a)
    if len(steps) < 3:
        return current
    return float(steps[len(steps) // 2])


def sample_intervals(
    samples: Iterable[tuple[int, float]], previous_us: Optional[float], period_us: Optional[float]
) -> list[Interval]:
    """The intervals driver samples cover, idle gaps included as value ``0``.

    A sample ``(timestamp, value)`` reports the utilization over the time since the sample before
    it. Where that step is longer than :data:`GAP_PERIODS` periods, the sample covers one period and
    the rest of the gap is idle (the driver stopped sampling an idle GPU). ``previous_us=None`` (no
    earlier sample, or the time since it is unknown) makes the first sample cover one period only.

    Args:
        samples: ``(timestamp_us, value)`` pairs in time order, values in ``[0, 1]``.
        previous_us: timestamp of the sample read before these, or ``None``.
        period_us: the driver's sample period, ``None`` while unknown (no gap is called idle then).
    """
    out: list[Interval] = []
    prev = previous_us
    for ts, value in samples:
        if prev is None:
            if period_us is not None:
                out.append((ts - period_us, ts, value))
        elif period_us is not None and ts - prev > GAP_PERIODS * period_us:
            out.append((prev, ts - period_us, 0.0))
            out.append((ts - period_us, ts, value))
        elif ts > prev:
            out.append((prev, ts, value))
        prev = ts
    return out


def idle_tail_us(
    spans: Optional[TrainingSpans], last_sample_us: Optional[float], now_us: float, period_us: Optional[float]
) -> float:
    """Training time after the newest sample that the driver left unsampled for longer than a gap: idle."""
    if spans is None or last_sample_us is None or period_us is None:
        return 0.0
    if now_us - last_sample_us <= GAP_PERIODS * period_us:
        return 0.0  # the next sample is merely not published yet
    return spans.overlap(last_sample_us, now_us)


class UtilizationWindow:
    """The readings of the current window, and what is known of the driver's samples across windows.

    Driver samples and polled rates are kept apart (:attr:`samples`, :attr:`rates`) so that either
    can serve the window. Times are microseconds of the wall clock, which NVML sample timestamps
    share; where they turn out not to (:meth:`check_clock`), samples are attributed by when they
    were read instead: read while training, they count whole; read while paused, not at all.
    """

    CLOCK_SKEW_LIMIT_US = 60e6
    """A newest sample further than this from the wall clock means the clocks are not comparable."""

    def __init__(self) -> None:
        self.previous_us: Optional[float] = None  # newest sample read; None: the time since it is unknown
        self.period_us: Optional[float] = None  # the driver's sample period, learnt from its samples
        self.clock_ok = True
        self.spans = TrainingSpans(0.0)
        self.samples = TimeWeightedMean()
        self.rates = TimeWeightedMean()
        self._last_rate_us = 0.0

    @property
    def paused(self) -> bool:
        return self.spans.paused

    def start(self, now_us: float) -> None:
        """A new window from ``now_us``: every older reading is forgotten."""
        self.spans = TrainingSpans(now_us)
        self.samples = TimeWeightedMean()
        self.rates = TimeWeightedMean()
        self._last_rate_us = now_us

    def pause(self, now_us: float) -> None:
        self.spans.pause(now_us)

    def resume(self, now_us: float) -> None:
        self.spans.resume(now_us)
        self._last_rate_us = now_us
        if not self.clock_ok:
            self.previous_us = None  # the step over the pause is not an idle gap

    def check_clock(self, newest_us: float, now_us: float) -> None:
        if abs(newest_us - now_us) > self.CLOCK_SKEW_LIMIT_US:
            self.clock_ok = False

    def skip_samples(self, samples: Sequence[tuple[int, float]]) -> None:
        """Samples older than the window: they only move the clock of the next one on."""
        if samples:
            self.previous_us = float(samples[-1][0])
            self.period_us = sample_period_us([ts for ts, _ in samples], self.period_us)

    def add_samples(self, samples: Sequence[tuple[int, float]]) -> None:
        """Driver samples ``(timestamp_us, value)`` in time order, newer than any added before."""
        if not samples:
            return
        self.period_us = sample_period_us([ts for ts, _ in samples], self.period_us)
        intervals = sample_intervals(samples, self.previous_us, self.period_us)
        self.previous_us = float(samples[-1][0])
        spans = self.spans if self.clock_ok else None
        if spans is None and self.paused:
            return
        stamps = {ts for ts, _ in samples}
        for a, b, value in intervals:
            self.samples.add(spans, a, b, value, is_sample=b in stamps)

    def add_rate(self, value: float, now_us: float, whole_window: bool = False) -> None:
        """A polled reading: it stands for the time since the last one (or, ``whole_window``, all of it)."""
        start = self.spans.start_us if whole_window else self._last_rate_us
        self.rates.add(self.spans, start, max(now_us, start + 1.0), value)
        self._last_rate_us = now_us

    def serving(self, samples_confirmed: bool) -> Optional[TimeWeightedMean]:
        """Samples where confirmed and covering at least half of what rates cover, else rates."""
        if samples_confirmed and self.samples.count and self.samples.weight >= 0.5 * self.rates.weight:
            return self.samples
        if self.rates.count:
            return self.rates
        return self.samples if self.samples.count else None

    def mean_of_samples(self, now_us: float) -> Optional[float]:
        """The samples' mean, with the driver's silence since the newest sample as idle time."""
        end_us = self.spans.pauses[-1][0] if self.paused else now_us  # training ended at the pause
        spans = self.spans if self.clock_ok else None
        return self.samples.mean(idle_tail_us(spans, self.previous_us, end_us, self.period_us))
