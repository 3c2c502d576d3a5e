"""An input-pipeline simulator, independent of the policy's model: the :class:`WindowStats` a window would measure.

The policy believes a closed formula (every worker contends for the CPUs all the time, CPU work runs
``(W + main) / cpus`` slower). This simulator does not share that belief: it is a small discrete-event
simulation of what a DataLoader does, so the property tests check the policy against something it
does not already assume.

* Making one batch is ``io_s`` of waiting (storage: no CPU) followed by ``cpu_s`` of CPU work (decode,
  collate). Every ``burst_every``-th batch costs ``burst_factor`` times as much (a slow shard).
* ``W = num_workers`` worker processes; batch ``i`` goes to worker ``i mod W`` (torch's round robin),
  each worker makes its batches one after the other.
* At most ``W x prefetch_factor`` batches are outstanding: batch ``i + W x prefetch_factor`` is handed
  out when the loop takes batch ``i``. The loop takes batches in order.
* **CPU sharing**: the CPUs are processor-shared among the workers that are in their CPU phase *at that
  moment*, the training process while it steps (``main_cpu`` of a core) and ``busy_cores`` other
  processes that never rest (a neighbour's job); with ``n`` runnable workers on ``C`` cores each runs at
  ``min(1, C / (n + main + busy))`` of a core. Workers waiting on storage or for room in the queue take no CPU.
* The training step takes ``step_s`` (an accelerator step: CPU contention does not slow it) times
  ``step_slowdown`` (a scenario's way to say that a busy host slows the training process's own step too).
* ``W = 0``: the training process makes each batch inside the fetch, sharing the cores with ``busy_cores``.
* **Hand-over**: with workers the training process spends ``handover_s`` taking each batch from the
  worker's queue (unpickling it out of shared memory) before the step, a wait even for a batch that was
  ready when asked; with 0 workers there is none (the batch never leaves the process).
* Noise: each window draws one drift for production and one for the step, and each batch jitters on
  top; both uniform within ``+-noise``. ``spread`` gives a batch's production cost a spread of its own
  (log-normal, mean 1, ``spread`` its coefficient of variation, from its own random stream): storage
  latency that varies batch to batch, which the loop meets in order (it waits for the slowest
  outstanding batch while the workers' other batches sit ready). ``step_jitter`` adds a per-batch step
  jitter of its own (uniform within ``+-step_jitter``, from its own random stream: the other draws do
  not move).

It measures the window as the callback does: per-batch fetch waits (the first fetch is start-up, not
wait), step times, stalls (the batch was not ready when asked), queue depth (ready batches not yet
taken), and, inside the workers, wall and CPU time per batch.

Example::

    stats = simulate(LoaderConfig(num_workers=4), Pipeline(cpu_s=0.002, io_s=0.030, step_s=0.010), cores=8)
    stats.utilization  # ~0.9: four workers make ~4 / 32 ms = 125 batches/s, the step eats 100
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from dataclasses import dataclass, replace
from typing import Optional

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.stats import UtilSource, WindowStats, tail_wait  # what the meter reports


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
        burst_random: bursts fall at random, each batch one with chance ``1 / burst_every`` (a heavy tail),
            rather than on every ``burst_every``-th batch.
        noise: relative jitter (``0.05`` is +-5 %) of every production and step time, per window and per batch.
        measured: whether the loader reports ``worker_batch_s`` / ``worker_cpu_fraction`` (one we built).
        main_cpu: cores the training process uses while it steps.
        main_measured: whether the window reports the training process's CPU share.
        step_jitter: relative per-batch jitter of the step alone (``0.3`` is +-30 %), independent of ``noise``.
        busy_cores: other processes competing for the cores all the time (a CPU hog is ``1.0``).
        step_slowdown: factor on every step (contention slowing the training process itself).
        spread: coefficient of variation of each batch's production cost (``0.4``: a log-normal factor of
            mean 1 and standard deviation 0.4), independent of ``noise``; ``0``: none.
        handover_s: seconds the training process needs to take a batch from a worker (with workers only).
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
    main_cpu: float = 1.0
    main_measured: bool = False
    burst_random: bool = False
    step_jitter: float = 0.0
    busy_cores: float = 0.0
    step_slowdown: float = 1.0
    spread: float = 0.0
    handover_s: float = 0.0

    @property
    def cpu_share(self) -> float:
        """CPU work over uncontended production time: ~1 CPU-bound, ~0 I/O-bound."""
        total = self.cpu_s + self.io_s
        return self.cpu_s / total if total > 0 else 0.0

    def steady_utilization(self, workers: int, cores: float, prefetch_factor: int = 2) -> float:
        """``1 - starvation`` of a long noise-free window at ``workers`` workers (the simulator's own answer)."""
        return _steady(replace(self, noise=0.0, step_jitter=0.0), workers, float(cores), prefetch_factor)

    def steady_samples_per_s(self, config: LoaderConfig, cores: float) -> float:
        """Training samples per second of a long noise-free window at ``config`` (bursts and contention kept)."""
        return _steady_rate(
            replace(self, noise=0.0, step_jitter=0.0), config.num_workers, config.prefetch_factor, float(cores)
        )

    def running_samples_per_s(self, config: LoaderConfig, cores: float, batches: int = 2000) -> float:
        """Training samples per second of ``config`` running on (a warm loader, no start-up), noise-free.

        What a config delivers in the long run, the spread and in-order delivery kept: the yardstick of the
        best static config at many workers, where a window that starts the loader is mostly pipeline fill.
        """
        return _running_rate(
            replace(self, noise=0.0, step_jitter=0.0), config.num_workers, config.prefetch_factor, float(cores), batches
        )

    def best_static(self, cores: float, max_workers: int, prefetch: tuple[int, ...] = (1, 2, 4, 8)) -> float:
        """The highest :meth:`running_samples_per_s` of a config of at most ``max_workers`` workers.

        Searched on a grid of at most 17 worker counts (every ``max_workers / 16``, and ``max_workers`` itself)
        at each of ``prefetch``: throughput changes slowly with the worker count near its best.
        """
        every = max(1, -(-max_workers // 16))
        counts = sorted({*range(0, max_workers + 1, every), max_workers})
        configs = [LoaderConfig(num_workers=w, prefetch_factor=p) for w in counts for p in prefetch]
        return max(self.running_samples_per_s(c, cores) for c in configs)


@functools.lru_cache(maxsize=4096)
def _running_rate(pipeline: Pipeline, workers: int, prefetch_factor: int, cores: float, batches: int) -> float:
    config = LoaderConfig(num_workers=workers, prefetch_factor=prefetch_factor)
    return simulate(config, pipeline, cores, batches=batches, warm=2 * workers * prefetch_factor).samples_per_s


@functools.lru_cache(maxsize=4096)
def _steady(pipeline: Pipeline, workers: int, cores: float, prefetch_factor: int = 2) -> float:
    config = LoaderConfig(num_workers=workers, prefetch_factor=prefetch_factor)
    return simulate(config, pipeline, cores, batches=300).utilization


@functools.lru_cache(maxsize=4096)
def _steady_rate(pipeline: Pipeline, workers: int, prefetch_factor: int, cores: float) -> float:
    config = LoaderConfig(num_workers=workers, prefetch_factor=prefetch_factor)
    return simulate(config, pipeline, cores, batches=600).samples_per_s


def simulate(
    config: LoaderConfig, pipeline: Pipeline, cores: float, *, batches: int = 400, seed: int = 0, warm: int = 0
) -> WindowStats:
    """Run one window of ``batches`` training batches and measure it as the callback would.

    Args:
        config: the loader config of the window.
        pipeline: what batches cost.
        cores: CPUs the workers and the training process share.
        batches: training batches in the window (plus one start-up fetch).
        seed: noise seed; the same seed gives the same window.
        warm: batches the loader ran before the window opened (a window that goes on with the loader
            already running: its workers are neither starting nor in step, and the window has no start-up
            fetch); ``0``: the loader starts with the window.

    Returns:
        The window's :class:`WindowStats` with ``util_source="estimate"``.
    """
    rng = random.Random(seed)
    noise = pipeline.noise
    drift_production = 1.0 + noise * rng.uniform(-1.0, 1.0)
    drift_step = 1.0 + noise * rng.uniform(-1.0, 1.0)
    # their own streams (seeded by strings: stable across runs), so that they leave the other draws alone
    jitter = random.Random(f"{seed}-step-jitter")
    bursts = random.Random(f"{seed}-bursts")
    spreads = random.Random(f"{seed}-spread")
    sigma = math.sqrt(math.log1p(pipeline.spread**2))  # a log-normal factor of mean 1 and that CV
    total = warm + batches + 1  # batch 0 is the start-up fetch
    step_s = pipeline.step_s * pipeline.step_slowdown
    every = pipeline.burst_every
    io, cpu, steps = [], [], []
    for i in range(total):
        if pipeline.burst_random:
            is_burst = every > 0 and bursts.random() < 1.0 / every
        else:
            is_burst = every > 0 and i % every == every - 1
        burst = pipeline.burst_factor if is_burst else 1.0
        if pipeline.spread:
            burst *= spreads.lognormvariate(-sigma * sigma / 2, sigma)
        io.append(pipeline.io_s * burst * drift_production * (1.0 + noise * rng.uniform(-1.0, 1.0)))
        cpu.append(pipeline.cpu_s * burst * drift_production * (1.0 + noise * rng.uniform(-1.0, 1.0)))
        step = step_s * drift_step * (1.0 + noise * rng.uniform(-1.0, 1.0))
        if pipeline.step_jitter:
            step *= 1.0 + pipeline.step_jitter * jitter.uniform(-1.0, 1.0)
        steps.append(step)
    if config.num_workers == 0:
        # made inside the fetch by the training process, which shares the cores with the busy neighbours
        slower = max(1.0, (1.0 + pipeline.busy_cores) / float(cores))
        waits = [a + b * slower for a, b in zip(io, cpu)]
        run = _Run(waits, steps, [False] * total, [0] * total, waits, cpu, sum(waits) + sum(steps))
    else:
        run = _run_workers(config, pipeline, float(cores), io, cpu, steps)
    return _measure(run, pipeline, batches, warm)


@dataclass
class _Run:
    waits: list[float]
    steps: list[float]
    ready_when_asked: list[bool]
    depth_when_asked: list[int]
    worker_wall: list[float]
    worker_cpu: list[float]
    elapsed: float
    workers: int = 0


def _run_workers(
    config: LoaderConfig, pipeline: Pipeline, cores: float, io: list[float], cpu: list[float], steps: list[float]
) -> _Run:
    """The event loop: workers (storage, then shared CPUs), the bounded queue, and the training loop."""
    total, workers = len(io), config.num_workers
    queues: list[list[int]] = [[] for _ in range(workers)]  # batches handed to each worker, in order
    busy: list[Optional[int]] = [None] * workers  # the batch each worker is making
    started = [0.0] * total
    finished: list[Optional[float]] = [None] * total
    io_done: list[tuple[float, int]] = []  # (time, worker) heap of storage waits ending
    cpu_done: list[tuple[float, int]] = []  # (service level, worker) heap of CPU work ending
    service = 0.0  # CPU seconds each runnable worker has received so far (processor sharing)
    now = 0.0
    taken = 0  # batches the loop has taken
    ready = 0  # batches made and not yet taken: the queue depth
    step_end: Optional[float] = None  # when the running step ends; None: the loop waits for a batch
    asked_at = 0.0
    waits, ready_when_asked, depth_when_asked = [0.0] * total, [False] * total, [0] * total

    def start_next(w: int) -> None:
        if busy[w] is None and queues[w]:
            i = queues[w].pop(0)
            busy[w], started[i] = i, now
            heapq.heappush(io_done, (now + io[i], w))

    def hand_out(i: int) -> None:
        if i < total:
            queues[i % workers].append(i)
            start_next(i % workers)

    def take() -> None:
        nonlocal taken, step_end, ready
        i = taken
        ready -= 1
        waits[i] = now - asked_at + pipeline.handover_s
        taken += 1
        hand_out(i + workers * config.prefetch_factor)
        step_end = now + pipeline.handover_s + steps[i]

    def ask() -> None:
        nonlocal asked_at, step_end
        asked_at, step_end = now, None
        if taken < total:
            ready_when_asked[taken] = finished[taken] is not None
            depth_when_asked[taken] = ready
            if ready_when_asked[taken]:
                take()

    for i in range(min(total, workers * config.prefetch_factor)):
        hand_out(i)
    ask()
    while taken < total or step_end is not None:
        runnable = len(cpu_done) + (pipeline.main_cpu if step_end is not None else 0.0) + pipeline.busy_cores
        rate = min(1.0, cores / runnable) if runnable > 0 else 1.0
        candidates = [step_end if step_end is not None else float("inf")]
        if io_done:
            candidates.append(io_done[0][0])
        if cpu_done:
            candidates.append(now + (cpu_done[0][0] - service) / rate)
        later = max(min(candidates), now)
        if cpu_done:
            service += (later - now) * rate
        now = later
        while io_done and io_done[0][0] <= now + 1e-9:  # storage done: on to the CPUs
            _, w = heapq.heappop(io_done)
            heapq.heappush(cpu_done, (service + cpu[busy[w]], w))
        while cpu_done and cpu_done[0][0] <= service + 1e-9:  # batch made
            _, w = heapq.heappop(cpu_done)
            i, busy[w] = busy[w], None
            finished[i] = now
            ready += 1
            start_next(w)
            if step_end is None and i == taken:
                take()
        if step_end is not None and step_end <= now + 1e-9:
            ask()
    wall = [(finished[i] or now) - started[i] for i in range(total)]
    return _Run(waits, steps, ready_when_asked, depth_when_asked, wall, cpu, now, workers)


def _measure(run: _Run, pipeline: Pipeline, batches: int, warm: int = 0) -> WindowStats:
    first = warm + 1  # the window's first batch
    waits, steps = run.waits[first:], run.steps[first:]
    made = slice(first if warm else 0, None)  # a cold window's workers also made the start-up batch
    worker_wall, worker_cpu = run.worker_wall[made], run.worker_cpu[made]
    production = sum(worker_wall)
    main_cpu = pipeline.main_cpu * sum(run.steps) / run.elapsed if run.elapsed > 0 else 0.0
    stalled = [w for w, ready in zip(waits, run.ready_when_asked[first:]) if not ready]
    # what a batch's making takes: the workers' p95 where they say it, else the loop's clock (as the meter reads it)
    making = _percentile(worker_wall, 0.95) if pipeline.measured and worker_wall else None
    if making is None and run.workers and batches:
        making = run.workers * (sum(waits) + sum(steps)) / batches
    tail = tail_wait(stalled, making)
    return WindowStats(
        batches=batches,
        samples=batches * pipeline.batch_size,
        fetch_wait_total_s=sum(waits),
        step_total_s=sum(steps),
        fetch_wait_p50_s=_percentile(waits, 0.50),
        fetch_wait_p95_s=_percentile(waits, 0.95),
        tail_wait_s=tail,
        step_p50_s=_percentile(steps, 0.50),
        step_p95_s=_percentile(steps, 0.95),
        stalls=sum(1 for ready in run.ready_when_asked[first:] if not ready),
        fetches=batches,
        queue_depth=sum(run.depth_when_asked[first:]) / batches if batches else None,
        startup_s=0.0 if warm else run.waits[0],
        worker_batch_s=production / len(worker_wall) if pipeline.measured else None,
        worker_batch_p95_s=_percentile(worker_wall, 0.95) if pipeline.measured else None,
        worker_batch_max_s=max(worker_wall) if pipeline.measured and worker_wall else None,
        # CPU time over wall time: waiting for a contended CPU is wall time, not CPU time
        worker_cpu_fraction=min(1.0, sum(worker_cpu) / production) if pipeline.measured and production > 0 else None,
        batch_bytes=pipeline.batch_bytes,
        gpu_util=None,
        util_source=UtilSource.ESTIMATE,
        main_cpu_fraction=main_cpu if pipeline.main_measured else None,
    )


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
