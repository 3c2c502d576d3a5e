"""Per-batch timers of one measurement window, aggregated into :class:`~lightning_dltune.core.stats.WindowStats`.

The per-batch path is a few float adds and stores into preallocated buffers: no device sync, no
tensor, no I/O, no growing containers.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Callable, Optional

from lightning_dltune.core.stats import UtilSource, WindowStats, tail_wait
from lightning_dltune.core.windows import warmup_steps

UNKNOWN_READY = -1
HANDOVER_FACTOR = 3.0  # a fetch this many times the window's fastest (a ready batch handed over) waited for one
HANDOVER_FIXED_S = 0.5e-3  # handing over any batch: unpickling, queue and thread switches
HANDOVER_BYTES_PER_S = 2e9  # handing over a batch's tensors from a worker's shared memory, conservatively


def stall_cutoff(threshold_s: float, fastest_s: float, batch_bytes: Optional[int]) -> float:
    """The wait above which a fetch from a loader that cannot report its queue found no batch ready.

    Judged against the loop's own hand-over time: a ready batch still takes the time to move its bytes
    from a worker (several ms for a batch of images), so the cutoff is ``HANDOVER_FACTOR`` times the
    window's fastest fetch, but never above twice what moving ``batch_bytes`` takes (when every fetch
    waited, the fastest is no hand-over), and never below ``threshold_s``.
    """
    if batch_bytes is None or fastest_s <= 0.0:
        return threshold_s
    ceiling = 2.0 * (HANDOVER_FIXED_S + batch_bytes / HANDOVER_BYTES_PER_S)
    return max(threshold_s, min(HANDOVER_FACTOR * fastest_s, ceiling))


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    idx = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[idx]


class WindowMeter:
    """Accumulates fetch waits, step times, stalls and queue depth of one window.

    Args:
        stall_threshold_s: a fetch whose loader cannot report its ready queue counts as a stall
            when it waited longer than this and than the loop's hand-over time (:func:`stall_cutoff`).
        capacity: per-batch samples kept for percentiles (the most recent ``capacity`` batches;
            sums and counts are exact over the whole window).
    """

    def __init__(self, stall_threshold_s: float = 1e-3, capacity: int = 8192) -> None:
        self.stall_threshold_s = stall_threshold_s
        self._cutoff_s = stall_threshold_s  # the last window's stall_cutoff, for the interval's online count
        self._capacity = capacity
        self._fetch_buf = array("d", bytes(8 * capacity))
        self._step_buf = array("d", bytes(8 * capacity))
        self._draining = 0  # loaders whose old workers still deliver what they held (a switch mid-epoch)
        self.on_drained: Optional[Callable[[], None]] = None  # told when the last of them delivered it all
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.fetches = 0
        self.fetch_wait_total_s = 0.0
        self.stalls = 0
        self.depth_sum = 0
        self.depth_known = 0
        self.steps = 0
        self.step_total_s = 0.0
        self.startup_s = 0.0
        self.fresh = True  # the loaders just started: the window's first steps may be warm-up
        self.drained = 0  # leading fetches of the config before a mid-epoch switch (its old workers' batches)
        self.reset_interval()

    def drain_over(self) -> None:
        """The loaders (re)started: no switch is draining (an epoch start)."""
        self._draining = 0

    # -- per-batch path -------------------------------------------------------------------------
    def record_fetch(self, wait_s: float, ready: int = UNKNOWN_READY) -> None:
        """One fetch that waited ``wait_s``; ``ready`` batches were waiting when it was asked (-1: unknown)."""
        self._fetch_buf[self.fetches % self._capacity] = wait_s
        self.fetches += 1
        self.fetch_wait_total_s += wait_s
        self.interval_fetch_wait_s += wait_s
        if ready >= 0:
            self.depth_sum += ready
            self.depth_known += 1
            stalled = ready == 0
        else:
            stalled = wait_s > self._cutoff_s  # recounted at the window's end against its own hand-over time
        if stalled:
            self.stalls += 1
            self.interval_stalls += 1

    def record_startup(self, seconds: float) -> None:
        """Loader start-up (iterator creation, workers starting, pipeline fill): never fetch wait."""
        self.startup_s += seconds

    # -- a switch mid-epoch (once a switch, not per batch) ----------------------------------------
    def record_drain(self) -> None:
        """A loader switching mid-epoch stopped handing out work: its fetches until :meth:`record_drained` are
        the batches its old workers held, made by the config before (left out of the window)."""
        self._draining += 1

    def record_drained(self) -> None:
        """The old workers delivered all they held: the new config's batches start with the next fetch."""
        self._draining = max(0, self._draining - 1)
        self.drained = self.fetches
        if not self._draining and self.on_drained is not None:
            self.on_drained()

    def record_step(self, step_s: float) -> None:
        self._step_buf[self.steps % self._capacity] = step_s
        self.steps += 1
        self.step_total_s += step_s
        self.interval_step_s += step_s
        self.interval_batches += 1

    # -- window end -----------------------------------------------------------------------------
    def reset_interval(self) -> None:
        """Start a new interval: the second, shorter window for step-granularity logging."""
        self.interval_fetch_wait_s = 0.0
        self.interval_step_s = 0.0
        self.interval_stalls = 0
        self.interval_batches = 0

    def window_stats(
        self,
        batch_size: int = 0,
        worker_batch_s: Optional[float] = None,
        worker_batch_p95_s: Optional[float] = None,
        worker_batch_max_s: Optional[float] = None,
        worker_cpu_fraction: Optional[float] = None,
        batch_bytes: Optional[int] = None,
        gpu_util: Optional[float] = None,
        main_cpu_fraction: Optional[float] = None,
        fetches_per_step: int = 1,
        workers: Optional[int] = None,
    ) -> WindowStats:
        """This rank's stats of the window (before any cross-rank reduction).

        Batches are those whose step was measured, less the leading ones a mid-epoch switch's old workers
        delivered (all of them while they still deliver; counted in ``drained_batches``) and less a fresh
        window's warm-up after those (:func:`~lightning_dltune.core.windows.warmup_steps`: its leading slow
        steps, and their fetches, are left out and counted in ``warmup_batches``). A fetch whose batch never
        reached a step (the window ended) does not count. ``samples`` is ``batches * batch_size`` (``batch_size``: the
        samples of one step, every train loader's batch together). ``fetches_per_step``: loaders
        that each report a fetch for every step (several train loaders combined). ``workers``: the train
        loader's workers, where known (what a batch's making takes, where the workers cannot say it, is
        then read from the loop's clock: no stall outlasts it but a heavy tail's).
        """
        per_step = max(1, fetches_per_step)
        unwrapped = self.steps <= self._capacity and self.fetches <= self._capacity
        drained = min((self.fetches if self._draining else self.drained) // per_step, self.steps) if unwrapped else 0
        judged = self.fresh and self.steps <= self._capacity  # warm-up follows a loader start
        warmup, settling = warmup_steps(self._step_buf[drained : self.steps]) if judged else (0, False)
        lead = drained + warmup
        left_out = min(lead * per_step, self.fetches) if self.fetches <= self._capacity else 0
        if not left_out and self.fetches:  # fetches in a ring buffer: nothing left out
            lead = drained = warmup = 0
        n_fetch = min(self.fetches, self._capacity)
        n_step = min(self.steps, self._capacity)
        fetch_sorted = sorted(self._fetch_buf[left_out:n_fetch])
        step_sorted = sorted(self._step_buf[lead:n_step])
        batches = self.steps - lead
        fetches = self.fetches - left_out
        step_total_s = self.step_total_s - sum(self._step_buf[:lead])
        # Without a prefetching fetcher every step has one fetch per loader; if fetches outnumber that,
        # the extra ones were for batches not stepped yet, so sums are scaled to the stepped batches.
        fetch_wait_total_s = raw_total = self.fetch_wait_total_s - sum(self._fetch_buf[:left_out])
        expected = batches * per_step
        if fetches > expected > 0:
            fetch_wait_total_s *= expected / fetches
        stalls = round(self.stalls * fetches / self.fetches) if self.fetches else 0
        if self.depth_known == 0 and fetch_sorted:  # no queue reports: judge the waits against the hand-over time
            self._cutoff_s = stall_cutoff(self.stall_threshold_s, fetch_sorted[0], batch_bytes)
            over = len(fetch_sorted) - bisect.bisect_right(fetch_sorted, self._cutoff_s)
            stalls = round(over * fetches / len(fetch_sorted))
        # the stalls are the longest waits: a heavy tail's among them (scaled as the total is)
        made_s = worker_batch_p95_s or (
            workers * (fetch_wait_total_s + step_total_s) / batches if workers and batches else None
        )
        tail_s = tail_wait(fetch_sorted[len(fetch_sorted) - min(stalls, len(fetch_sorted)) :], made_s)
        return WindowStats(
            batches=batches,
            samples=batches * batch_size,
            fetch_wait_total_s=max(0.0, fetch_wait_total_s),
            step_total_s=max(0.0, step_total_s),
            fetch_wait_p50_s=_percentile(fetch_sorted, 0.50),
            fetch_wait_p95_s=_percentile(fetch_sorted, 0.95),
            step_p50_s=_percentile(step_sorted, 0.50),
            step_p95_s=_percentile(step_sorted, 0.95),
            stalls=stalls,
            fetches=fetches,
            queue_depth=(self.depth_sum / self.depth_known) if self.depth_known else None,
            startup_s=self.startup_s,
            worker_batch_s=worker_batch_s,
            worker_batch_p95_s=worker_batch_p95_s,
            worker_batch_max_s=worker_batch_max_s,
            worker_cpu_fraction=worker_cpu_fraction,
            batch_bytes=batch_bytes,
            gpu_util=gpu_util,
            util_source=UtilSource.NVML if gpu_util is not None else UtilSource.ESTIMATE,
            main_cpu_fraction=main_cpu_fraction,
            tail_wait_s=tail_s * (fetch_wait_total_s / raw_total if raw_total > 0 else 1.0),
            warmup_batches=warmup,
            settling=int(settling),
            drained_batches=drained,
        )
