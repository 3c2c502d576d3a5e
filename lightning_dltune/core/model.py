"""The pipeline performance model: what a loader config costs and how fast it feeds the step.

Kept apart from the rules that use it (:mod:`lightning_dltune.core.policy`), as tf.data keeps its model
apart from its optimizer. Pure arithmetic, no torch.

A worker needs ``b`` wall seconds per batch, ``c`` of them CPU work, the rest (``io``) waiting on
storage. With ``W`` workers on ``cpus`` CPUs, CPU work runs ``max(1, (W + main) / cpus)`` slower
(``main``: the CPUs the training process itself uses, a whole one where unmeasured), so the loader
makes ``W / (c x inflation + io + wait)`` batches per second and the loop runs at ``min(1 / step, that)``
(Little's law). With 0 workers the training process makes every batch inside the fetch: one batch per
``b + step``. Workers saturate the CPUs once ``W x c / (c + io) > cpus - main``: a CPU-bound pipeline
stops short of the core count, an I/O-bound one may go past it. Where the loader cannot say ``b`` it
is inferred from the loop's own clock (``fetch wait`` with 0 workers, ``W x (fetch wait + step)`` with
``W``), and an unknown CPU share counts as CPU work.

``wait`` is what **in-order delivery** costs where a worker's time per batch varies: the loop takes
batch ``i`` before ``i + 1`` and hands out new work only as it takes batches, so it waits for the
slowest of the ``W`` outstanding batches while the others sit ready, and the ``prefetch`` batches each
worker holds absorb part of that. Read the spread as a normal one, ``s = (p95 - mean) / 1.645`` (the
workers' p95 time per batch); the slowest of ``W`` batches then lands ``late = s x z(W)`` after the
mean (``z(W)``: the expected largest of ``W`` standard normal draws, an order statistic), and the loop
loses ``wait = 0.6 x late x sqrt(late / mean) / prefetch`` per batch. The form and the 0.6 are fitted to
a discrete-event simulation of torch's round robin (2 to 128 workers, prefetch 1 to 8, spreads of 10 %
to 80 %), which they follow within about a third of the loss. Near ``capacity = demand`` the loop
still meets late batches, so with a spread the loop's rate is a soft minimum of the two, its knee the
softer the wider the spread (:meth:`PipelineModel.throughput`; within a few points of the same
simulation). Where ``W x prefetch`` steps of lead cover even the window's slowest batch (periodic bursts
of storage, which a p95 reads as several times the mean), the knee is that of a moderate spread
(:meth:`PipelineModel.spread_met`). Without a measured p95, ``wait`` is 0 and the minimum is sharp: the
mean alone.

Example::

    model = PipelineModel.infer(workers=0, stats=window, cpus=8)
    model.workers_for(1.2 * model.demand, low=1, high=7)  # fewest workers that outrun the step by 20 %
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Optional

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.stats import WindowStats

UNLIMITED = 1 << 30  # "no limit" for worker counts
BURST_STALL_FRACTION = 0.5  # the default of PolicySettings.burst_stall_fraction: at or past it, fetches stall
# steadily, not in bursts
_Z95 = 1.6449  # a normal's p95, in standard deviations
_IN_ORDER = 0.6  # the in-order wait's scale (see the module docstring)
_KNEE = 7.5  # the knee's sharpness times the spread (see PipelineModel.throughput)
_COVERED_SPREAD = 0.4  # the spread a lead that covers the slowest batch leaves the loop (see PipelineModel.spread_met)


def slowest_of(count: int) -> float:
    """Expected largest of ``count`` standard normal draws (Blom's approximation); 0 for one."""
    if count <= 1:
        return 0.0
    return NormalDist().inv_cdf((count - 0.375) / (count + 0.25))


def in_order_wait(mean_s: float, spread: float, workers: int, prefetch: int) -> float:
    """Seconds per batch the loop loses to in-order delivery (see the module docstring).

    Args:
        mean_s: a worker's mean time per batch.
        spread: its p95 over its mean, less 1 (``0.7``: the p95 is 1.7 times the mean); 0: no spread.
        workers: workers with batches outstanding.
        prefetch: batches each worker holds.
    """
    if spread <= 0 or workers < 2 or mean_s <= 0:
        return 0.0
    late = spread / _Z95 * slowest_of(workers)  # the slowest outstanding batch, after the mean, in means
    return mean_s * _IN_ORDER * late * math.sqrt(late) / max(prefetch, 1)


def cpu_inflation(workers: int, cpus: float, main: float = 1.0) -> float:
    """How much slower CPU work runs when workers plus the training process (``main`` CPUs) outnumber the CPUs."""
    if workers == 0:
        return 1.0
    return max(1.0, (workers + main) / max(cpus, 1e-9))


@dataclass(frozen=True)
class PipelineModel:
    """Per-batch costs of the pipeline, inferred from one (pooled) window.

    Args:
        step_mean_s: the training step per batch.
        batch_mean_s: wall seconds one worker needed per batch at the window's worker count.
        cpu_s: CPU seconds per batch on an idle CPU.
        io_s: wall seconds per batch spent waiting, not computing.
        cpus: usable CPUs of the rank.
        cpu_known: whether the loader measured its CPU share (else it counts as CPU work).
        main: CPUs the training process itself uses (a whole one where unmeasured).
        main_known: whether ``main`` was measured.
        spread: a worker's p95 time per batch over its mean, less 1 (0: unknown or none).
        prefetch: the window's prefetch factor (the batches each worker holds).
        workers: the window's worker count.
        rate: batches per second the loop ran at in the window (0: unknown).
        slowest: the window's slowest batch over a worker's mean time per batch (0: unknown).
    """

    step_mean_s: float
    batch_mean_s: float
    cpu_s: float
    io_s: float
    cpus: float
    cpu_known: bool
    main: float = 1.0
    main_known: bool = False
    spread: float = 0.0
    prefetch: int = 2
    workers: int = 0
    rate: float = 0.0
    slowest: float = 0.0

    @classmethod
    def infer(
        cls,
        workers: int,
        stats: WindowStats,
        cpus: float,
        burst_stall_fraction: float = BURST_STALL_FRACTION,
        prefetch: int = 2,
    ) -> PipelineModel:
        """The model of a window that ran ``workers`` workers at ``prefetch`` on ``cpus`` CPUs."""
        step, fetch, measured = stats.step_mean_s, stats.fetch_wait_mean_s, stats.worker_batch_s
        spread = _spread(stats)
        if workers == 0:
            # the training process made each batch inside the fetch
            batch = max(measured or 0.0, fetch)
        else:
            # every worker delivered one batch per `workers` loop iterations (exact when steadily starved)
            delivered = workers * (fetch + step)
            if measured is None:
                batch = delivered
            elif stats.stall_fraction >= burst_stall_fraction:
                # delivery overheads the workers' clocks do not see (beyond what in-order delivery explains)
                batch = max(measured, delivered - in_order_wait(measured, spread, workers, prefetch))
            else:
                batch = measured
        main = stats.main_cpu_fraction
        main_known = main is not None
        main = min(max(main, 0.05), cpus) if main is not None else 1.0
        inflation = cpu_inflation(workers, cpus, main)
        fraction = stats.worker_cpu_fraction
        if fraction is None:
            cpu = batch / inflation  # unknown: assume CPU work, the cautious side for core counts
        else:
            cpu = batch * min(max(fraction, 0.0), 1.0)  # delivery overheads split like the production
        io = max(0.0, batch - cpu * inflation)
        rate = stats.batches / stats.busy_s if stats.busy_s > 0 else 0.0
        slowest = stats.worker_batch_max_s / measured if measured and stats.worker_batch_max_s else 0.0
        return cls(
            step, batch, cpu, io, cpus, fraction is not None, main, main_known, spread, prefetch, workers, rate, slowest
        )

    @classmethod
    def timed_alone(cls, workers: int, loader_s_per_batch: float, step_s: float) -> PipelineModel:
        """The model of a loader timed on its own (``dltune sweep``): a batch every ``loader_s_per_batch`` seconds.

        The timing holds the contention already, so it all counts as waiting: each of ``workers`` workers
        needs ``workers x loader_s_per_batch`` per batch (at 0 workers the training process needs the time itself).
        """
        batch = workers * loader_s_per_batch if workers else loader_s_per_batch
        return cls(step_s, batch, 0.0, batch, 1.0, False)

    @property
    def cpu_share(self) -> float:
        """CPU work per batch over the batch's uncontended wall time: ~1 CPU-bound, ~0 I/O-bound."""
        total = self.cpu_s + self.io_s
        return self.cpu_s / total if total > 0 else 0.0

    @property
    def demand(self) -> float:
        """Batches per second the step consumes (no limit for a step of no time)."""
        return 1.0 / self.step_mean_s if self.step_mean_s > 0 else math.inf

    def cpu_limit(self) -> int:
        """Most workers before their CPU work (plus the training process) saturates the CPUs."""
        share = self.cpu_share
        limit = max(self.cpus - self.main, 0.0) / share if share > 0 else math.inf
        if limit >= UNLIMITED:
            return UNLIMITED
        # measured: the CPUs the training process leaves, a worker's fraction of a core rounds up
        # (the gain check undoes a worker that did not pay); unmeasured: a whole core stays reserved
        rounded = math.ceil(limit - 0.1) if self.main_known else math.floor(limit + 1e-9)
        return max(1, rounded)

    def capacity(self, workers: int, prefetch: Optional[int] = None) -> float:
        """Batches per second ``workers`` workers make (``workers >= 1``), delivered in order at ``prefetch``."""
        mean = self.cpu_s * cpu_inflation(workers, self.cpus, self.main) + self.io_s
        wait = in_order_wait(mean, self.spread, workers, self.prefetch if prefetch is None else prefetch)
        per_batch = mean + wait
        return math.inf if per_batch <= 0 else workers / per_batch

    def mean_capacity(self, workers: int) -> float:
        """Batches per second ``workers`` workers make on average, however late some batches are (no in-order wait)."""
        per_batch = self.cpu_s * cpu_inflation(workers, self.cpus, self.main) + self.io_s
        return math.inf if per_batch <= 0 else workers / per_batch

    def throughput(self, workers: int, prefetch: Optional[int] = None) -> float:
        """Batches per second the training loop runs at with ``workers`` workers (at ``prefetch``).

        ``min(demand, capacity)``, with a soft knee where batch times spread: near ``capacity = demand`` the
        loop still meets late batches (``demand x c / (1 + c^n)^(1/n)`` of ``c = capacity / demand``, ``n`` the
        sharper the smaller the spread).
        """
        if workers == 0:
            return 1.0 / (self.cpu_s + self.io_s + self.step_mean_s)
        prefetch = self.prefetch if prefetch is None else prefetch
        capacity, demand, spread = self.capacity(workers, prefetch), self.demand, self.spread_met(workers, prefetch)
        if spread <= 0 or not math.isfinite(demand) or not math.isfinite(capacity):
            return min(demand, capacity)
        n, c = _KNEE / spread, capacity / demand
        return demand / (1.0 + c**-n) ** (1.0 / n) if c >= 1.0 else demand * c / (1.0 + c**n) ** (1.0 / n)

    def spread_met(self, workers: int, prefetch: int) -> float:
        """The spread that softens the knee (:meth:`throughput`) at ``workers`` x ``prefetch``: at most
        ``_COVERED_SPREAD`` where the lead covers the slowest batch.

        A batch is asked for ``workers x prefetch`` steps before the loop takes it: where even the slowest
        batch seen (bursts of storage, a rare slow sample), its worker one batch behind, is made within that
        lead, the loop does not wait for it near the knee, however wide the spread (a spread of bursts, which a
        p95 reads as several times the mean, would otherwise soften the knee for good: one worker 8 batches
        ahead of a 20 ms step absorbs every tenth batch at 80 ms, as the simulator shows). The in-order wait of
        many workers (:func:`in_order_wait`) stays: a window's slowest batch is not the slowest to come.
        """
        if self.spread <= 0 or self.slowest <= 0 or workers <= 0 or not math.isfinite(self.demand):
            return self.spread
        mean = self.cpu_s * cpu_inflation(workers, self.cpus, self.main) + self.io_s
        lead = workers * prefetch / self.demand
        covered = lead >= mean * (1.0 + self.slowest)
        return min(self.spread, _COVERED_SPREAD) if covered else self.spread

    def measured_throughput(self, workers: int) -> float:
        """Batches per second at ``workers`` if each worker went on delivering what it did in the window.

        The loop's own measurement, not the model: what a step up measured for is expected to bring.
        """
        if self.workers <= 0 or self.rate <= 0:
            return self.throughput(workers)
        return min(self.demand, self.rate * workers / self.workers)

    def measured_step(self, headroom: float) -> int:
        """Workers that, each delivering what it did in the window, feed the step with ``headroom``."""
        if self.workers <= 0 or self.rate <= 0 or not math.isfinite(self.demand):
            return self.workers + 1
        return max(self.workers + 1, math.ceil(self.workers * headroom * self.demand / self.rate - 1e-9))

    def workers_for(self, rate: float, low: int, high: int) -> Optional[int]:
        """Fewest workers in ``[low, high]`` that make ``rate`` batches per second, if any."""
        low = max(low, 1)
        if high < low or self.capacity(high) < rate:
            return None
        while low < high:  # capacity grows with workers (contention only slows the CPU part)
            middle = (low + high) // 2
            if self.capacity(middle) >= rate:
                high = middle
            else:
                low = middle + 1
        return low


def cores_used(stats: WindowStats, workers: int) -> Optional[float]:
    """CPUs the window's batch production and the training process kept busy; ``None`` where production's is unknown.

    Production: batches per second of the loop x a worker's wall time per batch x its CPU share (with 0 workers
    the training process's own production). The training process: its measured share; unmeasured, a whole CPU
    beside workers, and with 0 workers the loop's time outside the fetch (one process makes and trains in turn).
    """
    if stats.worker_batch_s is None or stats.worker_cpu_fraction is None or stats.busy_s <= 0:
        return None
    production = stats.batches * stats.worker_batch_s * min(max(stats.worker_cpu_fraction, 0.0), 1.0) / stats.busy_s
    main = stats.main_cpu_fraction
    if main is None:
        main = 1.0 if workers else 1.0 - stats.starvation_ratio
    return production + main


def _spread(stats: WindowStats) -> float:
    """A worker's p95 time per batch over its mean, less 1; 0 where either is unknown."""
    mean, p95 = stats.worker_batch_s, stats.worker_batch_p95_s
    if mean is None or p95 is None or mean <= 0:
        return 0.0
    return max(p95 / mean - 1.0, 0.0)


# ------------------------------------------------------------------------------------------------
# Memory of a config


def prefetch_bytes(config: LoaderConfig, batch_bytes: float) -> tuple[float, float]:
    """Projected (memory, shared memory) bytes of the prefetched batches of ``config``.

    ``workers x prefetch x batch_bytes`` (one batch with 0 workers), twice that with ``pin_memory``
    (pinned copies); ``/dev/shm`` holds the workers' batches only.
    """
    batches = config.num_workers * config.prefetch_factor if config.num_workers else 1
    memory = batches * batch_bytes * (2 if config.pin_memory else 1)
    shm = batches * batch_bytes if config.num_workers else 0.0  # workers' batches cross /dev/shm
    return memory, shm


def batches_allowed(
    config: LoaderConfig, batch_bytes: Optional[int], memory_bytes: Optional[float], shm_bytes: Optional[float]
) -> Optional[int]:
    """Most prefetched worker batches (workers x prefetch) the budgets allow; ``None``: no limit known."""
    if not batch_bytes or batch_bytes <= 0:
        return None
    allowed: Optional[int] = None
    if memory_bytes is not None:
        allowed = int(memory_bytes // (batch_bytes * (2 if config.pin_memory else 1)))
    if shm_bytes is not None:
        by_shm = int(shm_bytes // batch_bytes)
        allowed = by_shm if allowed is None else min(allowed, by_shm)
    return allowed
