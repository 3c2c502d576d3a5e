"""The pipeline performance model: what a loader config costs and how fast it feeds the step.

Kept apart from the rules that use it (:mod:`lightning_dltune.core.policy`), as tf.data keeps its model
apart from its optimizer. Pure arithmetic, no torch.

A worker needs ``b`` wall seconds per batch, ``c`` of them CPU work, the rest (``io``) waiting on
storage. With ``W`` workers on ``cpus`` CPUs, CPU work runs ``max(1, (W + main) / cpus)`` slower
(``main``: the CPUs the training process itself uses, a whole one where unmeasured), so the loader
makes ``W / (c x inflation + io)`` batches per second and the loop runs at ``min(1 / step, that)``
(Little's law). With 0 workers the training process makes every batch inside the fetch: one batch per
``b + step``. Workers saturate the CPUs once ``W x c / (c + io) > cpus - main``: a CPU-bound pipeline
stops short of the core count, an I/O-bound one may go past it. Where the loader cannot say ``b`` it
is inferred from the loop's own clock (``fetch wait`` with 0 workers, ``W x (fetch wait + step)`` with
``W``), and an unknown CPU share counts as CPU work.

Example::

    model = PipelineModel.infer(workers=0, stats=window, cpus=8)
    model.workers_for(1.2 * model.demand, low=1, high=7)  # fewest workers that outrun the step by 20 %
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.stats import WindowStats

UNLIMITED = 1 << 30  # "no limit" for worker counts
BURST_STALL_FRACTION = 0.5  # the default of PolicySettings.burst_stall_fraction: at or past it, fetches stall
# steadily, not in bursts


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
    """

    step_mean_s: float
    batch_mean_s: float
    cpu_s: float
    io_s: float
    cpus: float
    cpu_known: bool
    main: float = 1.0
    main_known: bool = False

    @classmethod
    def infer(
        cls, workers: int, stats: WindowStats, cpus: float, burst_stall_fraction: float = BURST_STALL_FRACTION
    ) -> PipelineModel:
        """The model of a window that ran with ``workers`` workers on ``cpus`` CPUs."""
        step = stats.step_mean_s
        fetch = stats.fetch_wait_mean_s
        measured = stats.worker_batch_s
        if workers == 0:
            # the training process made each batch inside the fetch
            batch = max(measured or 0.0, fetch)
        else:
            # every worker delivered one batch per `workers` loop iterations (exact when steadily starved)
            delivered = workers * (fetch + step)
            if measured is None:
                batch = delivered
            elif stats.stall_fraction >= burst_stall_fraction:
                batch = max(measured, delivered)  # delivery overheads the workers' clocks do not see
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
        return cls(step, batch, cpu, io, cpus, fraction is not None, main, main_known)

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

    def capacity(self, workers: int) -> float:
        """Batches per second ``workers`` workers make (``workers >= 1``)."""
        per_batch = self.cpu_s * cpu_inflation(workers, self.cpus, self.main) + self.io_s
        return math.inf if per_batch <= 0 else workers / per_batch

    def throughput(self, workers: int) -> float:
        """Batches per second the training loop runs at with ``workers`` workers."""
        if workers == 0:
            return 1.0 / (self.cpu_s + self.io_s + self.step_mean_s)
        return min(self.demand, self.capacity(workers))

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
