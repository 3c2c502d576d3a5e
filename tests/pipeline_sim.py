"""A small input-pipeline simulator: the :class:`WindowStats` one epoch with a loader config would measure.

It is the test bench of the policy and, as importantly, the written-down model of what the policy
assumes. Everything is plain arithmetic on per-batch times, deterministic for a given seed.

The model:

* Making one batch costs ``cpu_s`` seconds of CPU work and ``io_s`` seconds of waiting (storage,
  network). Every ``burst_every``-th batch costs ``burst_factor`` times as much (a slow shard).
* ``W = num_workers`` workers make batches one after the other, batch ``i`` on worker ``i mod W``, and
  the loop takes them in order, as torch's DataLoader does.
* At most ``W x prefetch_factor`` batches are outstanding: batch ``i`` reaches its worker when the loop
  has taken batch ``i - W x prefetch_factor``. Deeper prefetch lets workers run further ahead and so
  absorbs bursts; it does not raise the average rate.
* CPU contention: once the ``W`` workers plus the training process outnumber the cores, CPU work runs
  ``(W + 1) / cores`` times slower; waiting does not.
* ``W = 0``: the training process makes each batch inside the fetch; every fetch stalls for the whole
  production time.
* The loop asks for batch ``i`` when step ``i - 1`` ends; the fetch wait is how long it then blocks.
  The first fetch (pipeline fill) is start-up time, not fetch wait, as in the real measurement.
* In steady state the loop runs at ``min(1 / step_s, W / production)`` batches per second.
* Noise: each window draws one drift for production and one for the step (epochs differ: page cache,
  neighbours), and each batch jitters on top; both uniform within ``+-noise``.

Example::

    stats = simulate(LoaderConfig(num_workers=4), Pipeline(cpu_s=0.002, io_s=0.030, step_s=0.010), cores=8)
    stats.utilization  # ~0.9: four workers make 4 / 32 ms = 125 batches/s, the step eats 100
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from lightning_dltune.config import LoaderConfig
from lightning_dltune.stats import WindowStats


@dataclass(frozen=True)
class Pipeline:
    """What one batch costs to make and to train on.

    Args:
        cpu_s: CPU seconds to make one batch on an idle core (decode, augment, collate).
        io_s: seconds spent waiting per batch (reads), no CPU.
        step_s: the training step per batch.
        batch_size: samples per batch.
        batch_bytes: bytes of one collated batch.
        burst_every: every this many batches one costs ``burst_factor`` times as much; ``0``: no bursts.
        burst_factor: cost multiplier of a burst batch.
        noise: relative jitter (``0.05`` is +-5 %) of every production and step time, per window and per batch.
        measured: whether the loader reports ``worker_batch_s`` / ``worker_cpu_fraction`` (one we built).
    """

    cpu_s: float
    io_s: float = 0.0
    step_s: float = 0.010
    batch_size: int = 32
    batch_bytes: Optional[int] = 4 << 20
    burst_every: int = 0
    burst_factor: float = 1.0
    noise: float = 0.0
    measured: bool = True

    @property
    def cpu_share(self) -> float:
        """CPU work over uncontended production time: ~1 CPU-bound, ~0 I/O-bound."""
        total = self.cpu_s + self.io_s
        return self.cpu_s / total if total > 0 else 0.0

    def production_s(self, workers: int, cores: float) -> float:
        """Mean wall time one worker needs per batch at ``workers`` workers, bursts included, no noise."""
        burst = 1.0 + (self.burst_factor - 1.0) / self.burst_every if self.burst_every else 1.0
        return burst * (self.cpu_s * cpu_inflation(workers, cores) + self.io_s)

    def steady_utilization(self, workers: int, cores: float) -> float:
        """``1 - starvation`` in steady state without noise or bursts (the analytic answer)."""
        if workers == 0:
            production = self.cpu_s + self.io_s
            return self.step_s / (production + self.step_s)
        rate = min(1.0 / self.step_s, workers / (self.cpu_s * cpu_inflation(workers, cores) + self.io_s))
        return rate * self.step_s


def cpu_inflation(workers: int, cores: float) -> float:
    """How much slower CPU work runs when ``workers`` plus the training process share ``cores``."""
    if workers == 0:
        return 1.0
    return max(1.0, (workers + 1) / cores)


def simulate(
    config: LoaderConfig, pipeline: Pipeline, cores: float, *, batches: int = 400, seed: int = 0
) -> WindowStats:
    """Run one window of ``batches`` training batches and measure it as the callback would.

    Args:
        config: the loader config of the window.
        pipeline: what batches cost.
        cores: CPUs the workers and the training process share.
        batches: training batches in the window (plus one start-up fetch).
        seed: noise seed; the same seed gives the same window.

    Returns:
        The window's :class:`WindowStats` with ``util_source="estimate"``.
    """
    rng = random.Random(seed)
    noise = pipeline.noise
    drift_production = 1.0 + noise * rng.uniform(-1.0, 1.0)
    drift_step = 1.0 + noise * rng.uniform(-1.0, 1.0)

    def jitter() -> float:
        return 1.0 + noise * rng.uniform(-1.0, 1.0)

    def burst(i: int) -> float:
        every = pipeline.burst_every
        return pipeline.burst_factor if every and i % every == every - 1 else 1.0

    workers = config.num_workers
    inflation = cpu_inflation(workers, cores)
    total = batches + 1  # batch 0 is the start-up fetch
    cpu_times, wall_times, steps = [], [], []
    for i in range(total):
        cpu = pipeline.cpu_s * burst(i) * drift_production * jitter()
        io = pipeline.io_s * burst(i) * drift_production * jitter()
        cpu_times.append(cpu)
        wall_times.append(cpu * inflation + io)
        steps.append(pipeline.step_s * drift_step * jitter())

    waits: list[float] = []
    if workers == 0:
        waits = list(wall_times)  # made inside the fetch: the loop waits for all of it
    else:
        depth = workers * config.prefetch_factor
        worker_free = [0.0] * workers  # when each worker finishes its previous batch
        taken: list[float] = []  # when the loop took batch i
        now = 0.0  # when the loop asks for the next batch
        for i in range(total):
            handed_out = 0.0 if i < depth else taken[i - depth]
            worker = i % workers
            ready = max(handed_out, worker_free[worker]) + wall_times[i]
            worker_free[worker] = ready
            wait = max(0.0, ready - now)
            waits.append(wait)
            taken.append(now + wait)
            now += wait + steps[i]

    measured_waits, measured_steps = waits[1:], steps[1:]
    stalls = sum(1 for w in measured_waits if w > 0.0)
    production = sum(wall_times)
    return WindowStats(
        batches=batches,
        samples=batches * pipeline.batch_size,
        fetch_wait_s=sum(measured_waits),
        step_s=sum(measured_steps),
        fetch_wait_p50_s=_percentile(measured_waits, 0.50),
        fetch_wait_p95_s=_percentile(measured_waits, 0.95),
        step_p50_s=_percentile(measured_steps, 0.50),
        step_p95_s=_percentile(measured_steps, 0.95),
        stalls=stalls,
        fetches=batches,
        startup_s=waits[0],
        worker_batch_s=production / total if pipeline.measured else None,
        # CPU time over wall time: waiting for a contended CPU is wall time, not CPU time
        worker_cpu_fraction=sum(cpu_times) / production if pipeline.measured and production > 0 else None,
        batch_bytes=pipeline.batch_bytes,
        gpu_util=None,
        util_source="estimate",
    )


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
