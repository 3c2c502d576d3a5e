"""The band policy: a pure function from what an epoch looked like to the next loader config.

No torch, no Lightning: every decision is explainable from plain numbers that are also logged.

How :func:`decide` thinks, first rule that applies wins:

1. **Budgets.** A config over ``Budget.max_workers``, the prefetch memory budget or the ``/dev/shm``
   budget is never kept nor picked (prefetch gives way first, then workers). Projected bytes are
   ``workers x prefetch x batch_bytes`` (one batch with 0 workers), twice that with ``pin_memory``
   (pinned copies); ``/dev/shm`` holds the workers' batches only, not the pinned copies.
2. **Rebuild cap.** After ``max_rebuilds`` changes in this fit, nothing changes any more.
3. **Judge the last change.** More workers or deeper prefetch that lowered throughput by more than
   ``min_gain``, or a give-back that left the loop starved below the band, is undone; an undone config
   is never tried again.
4. **Below the band and starved:** add throughput, sized by a model of the pipeline (below) so that one
   rebuild lands near the answer. Bursty stalls (most fetches find a batch ready, the workers make
   enough on average) get deeper prefetch; steady starvation gets workers. Workers stop at the CPU
   saturation point, where the model says more would gain less than ``min_gain``, where the last
   increase gained less than ``min_gain`` although the model expected at least twice that, or at the
   budget; memory may cap them (``memory-capped``).
5. **Below the band, not starved:** compute-bound; workers cannot help.
6. **Above the band:** the data side has slack; give back one notch: at most half the workers, the
   fewest the model says keep utilization at the band's top; then prefetch back to the default of 2
   where the queue never ran dry. Never down to a config that was starved before. On a single epoch's
   evidence only what leaves the workers ``headroom`` ahead of the step; anything closer waits for a
   second epoch (slack costs CPU and RAM, starving costs throughput).
7. **In the band**, or not clearly outside it: hold.

Noise: a config is judged on its last epochs in a row pooled together (up to eight), and "clearly
outside" means beyond the band by ``hysteresis`` plus the standard error of those epochs' utilization
(twice that above the band), so a config sitting at an edge does not flip back and forth.

The pipeline model: a worker needs ``b`` wall seconds per batch, ``c`` of them CPU work, the rest
(``io``) waiting on storage. With ``W`` workers on ``cpus`` CPUs, CPU work runs
``max(1, (W + 1) / cpus)`` slower (the ``+ 1`` is the training process), so the loader makes
``W / (c x inflation + io)`` batches per second and the loop runs at ``min(1 / step, that)``
(Little's law). With 0 workers the training process makes every batch inside the fetch: one batch per
``b + step``. Workers saturate the CPUs once ``W x c / (c + io) > cpus - 1``: a CPU-bound pipeline stops
one short of the core count, an I/O-bound one may go past it up to ``max_workers``. Where the loader
cannot say ``b`` it is inferred from the loop's own clock (``fetch wait`` with 0 workers,
``W x (fetch wait + step)`` with ``W``), and an unknown CPU share counts as CPU work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

from lightning_dltune.config import LoaderConfig
from lightning_dltune.stats import WindowStats

# Verdicts: the tuner's one-line diagnosis of a window. Stable strings: logged and shown to users.
DATA_BOUND_IO = "data-bound (I/O)"
DATA_BOUND_CPU = "data-bound (CPU saturated)"
COMPUTE_BOUND = "compute-bound"
IN_BAND = "in band"
MEMORY_CAPPED = "memory-capped"
VERDICTS = (DATA_BOUND_IO, DATA_BOUND_CPU, COMPUTE_BOUND, IN_BAND, MEMORY_CAPPED)


@dataclass(frozen=True)
class Budget:
    """What the loaders of one rank may use.

    Args:
        max_workers: most loader workers this rank may run (usable CPUs, shared among local ranks,
            one left for the training process).
        memory_bytes: most bytes that prefetched batches (workers x prefetch x batch bytes, plus
            pinned copies) may hold; ``None``: unknown, not enforced.
        shm_bytes: most bytes of ``/dev/shm`` those batches may hold; ``None``: unknown.
        cpus: usable CPUs of this rank (for the CPU-saturation model).
    """

    max_workers: int
    memory_bytes: Optional[float] = None
    shm_bytes: Optional[float] = None
    cpus: float = 1.0


@dataclass(frozen=True)
class PolicySettings:
    """Knobs of the policy; every one is also an argument of the callback.

    Args:
        band: utilization range ``(low, high)`` to hold.
        max_rebuilds: most config changes in one fit.
        min_gain: relative throughput gain a change must bring to count as help.
        max_prefetch_factor: deepest prefetch the policy picks.
        min_starvation: below this starvation ratio a window is not data-bound (workers cannot help).
        headroom: how much more than the step consumes the picked workers should produce (Little's law
            with a margin, so that one rebuild passes the band's low edge).
        hysteresis: how far outside the band utilization must be before the policy reacts.
        burst_stall_fraction: below this fraction of stalled fetches, starvation counts as bursty
            (deeper prefetch helps) rather than steady (more workers help).

    Raises:
        ValueError: for a band not inside ``[0, 1]`` with ``low < high``, or a knob out of range.
    """

    band: tuple[float, float] = (0.85, 0.95)
    max_rebuilds: int = 10
    min_gain: float = 0.05
    max_prefetch_factor: int = 8
    min_starvation: float = 0.05
    headroom: float = 1.2
    hysteresis: float = 0.02
    burst_stall_fraction: float = 0.5

    def __post_init__(self) -> None:
        band = tuple(self.band)
        if len(band) != 2 or not 0 <= band[0] < band[1] <= 1:
            raise ValueError(f"`band` must be (low, high) with 0 <= low < high <= 1, got {self.band!r}.")
        if self.max_rebuilds < 0:
            raise ValueError(f"`max_rebuilds` must be >= 0, got {self.max_rebuilds!r}.")
        if self.max_prefetch_factor < 1:
            raise ValueError(f"`max_prefetch_factor` must be >= 1, got {self.max_prefetch_factor!r}.")
        if self.headroom < 1:
            raise ValueError(f"`headroom` must be >= 1, got {self.headroom!r}.")
        for name in ("min_gain", "min_starvation", "hysteresis", "burst_stall_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"`{name}` must be in [0, 1], got {getattr(self, name)!r}.")


@dataclass(frozen=True)
class EpochRecord:
    """One epoch of the tuner's history: the config it ran, what it measured, what was decided."""

    epoch: int
    config: LoaderConfig
    stats: WindowStats
    verdict: str
    reason: str
    next_config: LoaderConfig
    first_batches: Optional[int] = None  # the window was only this epoch's first batches (an early decision)

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    @property
    def prefetch_factor(self) -> int:
        return self.config.prefetch_factor

    @property
    def starvation_ratio(self) -> float:
        return self.stats.starvation_ratio

    @property
    def gpu_util(self) -> float:
        return self.stats.utilization

    @property
    def util_source(self) -> str:
        return self.stats.util_source

    @property
    def stalls(self) -> int:
        return self.stats.stalls

    @property
    def samples_per_s(self) -> float:
        return self.stats.samples_per_s

    @property
    def changed(self) -> bool:
        return self.next_config != self.config


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one window."""

    config: LoaderConfig
    verdict: str
    reason: str
    best: LoaderConfig = field(default=None)  # type: ignore[assignment]


def decide(
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    history: Sequence[EpochRecord] = (),
    settings: PolicySettings = PolicySettings(),
) -> Decision:
    """Decide the next loader config from the window just measured.

    Deterministic: the same inputs give the same decision, so every DDP rank can run it on the same
    reduced numbers. The rules are listed in the module docstring.

    Args:
        current: the config the window ran with.
        stats: the window just measured.
        budget: what this rank's loaders may use.
        history: earlier epochs of this fit, oldest first.
        settings: the policy's knobs.

    Returns:
        The next config (``current`` itself when nothing changes), the verdict, a one-sentence reason
        with the numbers that drove it, and the best config seen so far (this window included).
    """
    memory = _recall(history, current, stats, budget, settings)
    if stats.batches <= 0 or stats.step_s <= 0:
        config, verdict, reason = current, IN_BAND, "no training batches measured: holding"
    else:
        config, verdict, reason = _decide(current, memory.seen, budget, memory, settings, latest=stats)
    fitted, limit = _fit(config, stats.batch_bytes, budget, settings)
    if fitted != config:  # a last guard: no rule may pick a config over budget
        config, verdict = fitted, MEMORY_CAPPED if limit == "memory" else verdict
        reason = f"{reason}; the budget allows {_short(fitted)}"
    return Decision(config=config, verdict=verdict, reason=reason, best=memory.best)


def best_config(history: Sequence[EpochRecord]) -> Optional[LoaderConfig]:
    """The config with the highest measured throughput so far (``None`` for an empty history).

    A config that ran several windows counts with its mean ``samples_per_s``; ties go to the earlier.
    """
    return _best([(record.config, record.stats) for record in history])


# ------------------------------------------------------------------------------------------------
# What the history says


@dataclass(frozen=True)
class _LastChange:
    """The change that produced ``current``: the config before it, its window, and how it went."""

    before: LoaderConfig
    before_stats: WindowStats
    kind: str  # "more_workers", "more_prefetch", "give_back" or "other"
    gain: float  # relative throughput change, this window vs the one before
    stopped_helping: bool = False  # more workers that the model said would pay, and did not


@dataclass(frozen=True)
class _Recall:
    """What the policy remembers of this fit, replayed from the history (the policy keeps no state)."""

    seen: WindowStats  # the current config's recent windows pooled into one (noise averages out)
    epochs: int  # how many windows ``seen`` pools
    util_error: float  # standard error of ``seen``'s utilization (0 for a single window)
    rebuilds: int
    rejected: tuple[LoaderConfig, ...]
    starved: tuple[tuple[int, int], ...]
    worker_ceiling: Optional[int]
    prefetch_ceiling: Optional[int]
    last_change: Optional[_LastChange]
    best: Optional[LoaderConfig]


_POOLED_WINDOWS = 8  # a config is judged on its last this-many windows in a row: noise averages out,
# a real change in the pipeline still shows within a few epochs


def _recall(
    history: Sequence[EpochRecord],
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    settings: PolicySettings,
) -> _Recall:
    windows = [(r.config, r.stats, r.next_config) for r in history] + [(current, stats, None)]
    pooled: list[WindowStats] = []
    runs: list[int] = []
    rejected: list[LoaderConfig] = []
    starved: list[tuple[int, int]] = []
    worker_ceiling: Optional[int] = None
    prefetch_ceiling: Optional[int] = None
    last_change: Optional[_LastChange] = None
    for i, (config, window, next_config) in enumerate(windows):
        run = runs[-1] + 1 if i and windows[i - 1][0] == config else 1
        runs.append(run)
        pooled.append(_pool([w for _, w, _ in windows[max(i - run + 1, i + 1 - _POOLED_WINDOWS) : i + 1]]))
        if _is_starved(pooled[i], settings):
            starved.append(_resources(config))
        if i == 0:
            continue
        before, _, planned = windows[i - 1]
        if planned != config or before == config:
            continue  # not a change the policy made (or none at all)
        if next_config == before:
            rejected.append(config)  # A -> B -> A: B was undone
        if i >= 2 and windows[i - 2][0] == config and windows[i - 2][2] == before:
            continue  # this window is the undo itself: never judged again, or undos would ping-pong
        kind = _change_kind(before, config)
        gain = _gain(pooled[i - 1], window)
        slower = gain < -settings.min_gain
        # more workers that did not pay although the model said they clearly would: no more of them
        # (a small expected gain that does not show proves nothing: epochs differ by a few percent)
        stopped_helping = (
            kind == "more_workers"
            and not slower
            and gain < settings.min_gain
            and _expected_gain(before, config, pooled[i - 1], budget, settings) >= 2 * settings.min_gain
        )
        if kind == "more_workers" and (slower or stopped_helping):
            worker_ceiling = _min(worker_ceiling, before.num_workers if slower else config.num_workers)
        if kind == "more_prefetch" and gain < settings.min_gain:
            kept = before if gain < -settings.min_gain else config
            prefetch_ceiling = _min(prefetch_ceiling, kept.prefetch_factor)
        if i == len(windows) - 1:
            last_change = _LastChange(before, pooled[i - 1], kind, gain, stopped_helping)
    epochs = min(runs[-1], _POOLED_WINDOWS)
    return _Recall(
        seen=pooled[-1],
        epochs=epochs,
        util_error=_standard_error([w.utilization for _, w, _ in windows[-epochs:]]),
        rebuilds=sum(r.changed for r in history),
        rejected=tuple(rejected),
        starved=tuple(starved),
        worker_ceiling=worker_ceiling,
        prefetch_ceiling=prefetch_ceiling,
        last_change=last_change,
        best=_best([(c, w) for c, w, _ in windows]),
    )


def _standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of ``values`` (0 for fewer than two)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def _expected_gain(
    before: LoaderConfig, after: LoaderConfig, seen: WindowStats, budget: Budget, settings: PolicySettings
) -> float:
    """The throughput gain the model of ``before``'s windows predicted for moving to ``after``."""
    if seen.batches <= 0 or seen.step_mean_s <= 0:
        return 0.0
    model = _Model.infer(before.num_workers, seen, budget.cpus, settings)
    return model.throughput(after.num_workers) / model.throughput(before.num_workers) - 1.0


def _pool(windows: Sequence[WindowStats]) -> WindowStats:
    """Consecutive windows of one config as one: sums add, means weigh by batches, the rest is the latest's."""
    latest = windows[-1]
    if len(windows) == 1:
        return latest

    def weighted(values: list[tuple[Optional[float], int]]) -> Optional[float]:
        known = [(v, n) for v, n in values if v is not None and n > 0]
        total = sum(n for _, n in known)
        return sum(v * n for v, n in known) / total if total else None

    nvml = latest.util_source == "nvml" and latest.gpu_util is not None
    measured = latest.worker_batch_s is not None
    cpu_known = latest.worker_cpu_fraction is not None
    nvml_utils = [(w.gpu_util if w.util_source == "nvml" else None, w.batches) for w in windows]
    gpu_util = weighted(nvml_utils) if nvml else None
    return WindowStats(
        batches=sum(w.batches for w in windows),
        samples=sum(w.samples for w in windows),
        fetch_wait_s=sum(w.fetch_wait_s for w in windows),
        step_s=sum(w.step_s for w in windows),
        fetch_wait_p50_s=latest.fetch_wait_p50_s,
        fetch_wait_p95_s=latest.fetch_wait_p95_s,
        step_p50_s=latest.step_p50_s,
        step_p95_s=latest.step_p95_s,
        stalls=sum(w.stalls for w in windows),
        fetches=sum(w.fetches for w in windows),
        queue_depth=latest.queue_depth,
        startup_s=latest.startup_s,
        worker_batch_s=weighted([(w.worker_batch_s, w.batches) for w in windows]) if measured else None,
        worker_cpu_fraction=weighted([(w.worker_cpu_fraction, w.batches) for w in windows]) if cpu_known else None,
        batch_bytes=latest.batch_bytes,
        gpu_util=gpu_util,
        util_source="nvml" if nvml else "estimate",
    )


def _best(windows: Sequence[tuple[LoaderConfig, WindowStats]]) -> Optional[LoaderConfig]:
    totals: dict[LoaderConfig, list[float]] = {}
    for config, window in windows:
        totals.setdefault(config, []).append(window.samples_per_s)
    best: Optional[LoaderConfig] = None
    best_rate = -math.inf
    for config, rates in totals.items():  # insertion order: ties go to the config seen first
        rate = sum(rates) / len(rates)
        if rate > best_rate:
            best, best_rate = config, rate
    return best


def _resources(config: LoaderConfig) -> tuple[int, int]:
    """(workers, prefetch) a config holds; prefetch means nothing without workers."""
    return config.num_workers, config.prefetch_factor if config.num_workers else 0


def _change_kind(before: LoaderConfig, after: LoaderConfig) -> str:
    (w0, p0), (w1, p1) = _resources(before), _resources(after)
    if w1 > w0:
        return "more_workers"
    if w1 == w0 and p1 > p0:
        return "more_prefetch"
    if w1 <= w0 and p1 <= p0 and (w1, p1) != (w0, p0):
        return "give_back"
    return "other"


def _gain(before: WindowStats, after: WindowStats) -> float:
    if before.samples_per_s <= 0:
        return math.inf if after.samples_per_s > 0 else 0.0
    return after.samples_per_s / before.samples_per_s - 1.0


def _is_starved(window: WindowStats, settings: PolicySettings) -> bool:
    """Clearly below the band and waiting on data."""
    low = settings.band[0] - settings.hysteresis
    return window.batches > 0 and window.utilization < low and window.starvation_ratio >= settings.min_starvation


def _min(a: Optional[int], b: int) -> int:
    return b if a is None else min(a, b)


# ------------------------------------------------------------------------------------------------
# The pipeline model


_WAIT = "slack seen once, giving back after another epoch confirms it"
_UNLIMITED = 1 << 30  # "no limit" for worker counts
_DEFAULT_PREFETCH = 2  # torch's: prefetch is not given back below it (one batch per worker saves little)
_DRY_QUEUE = 0.05  # prefetch is given back only where at most this fraction of fetches found no batch ready
# (and the loop waited at most a fifth of that fraction of its time)


def _inflation(workers: int, cpus: float, main: float = 1.0) -> float:
    """How much slower CPU work runs when workers plus the training process (``main`` CPUs of it) outnumber the CPUs."""
    if workers == 0:
        return 1.0
    return max(1.0, (workers + main) / max(cpus, 1e-9))


@dataclass(frozen=True)
class _Model:
    """Per-batch costs of the pipeline, inferred from one window (see the module docstring)."""

    step_s: float
    batch_s: float  # wall seconds one worker needed per batch at the current worker count
    cpu_s: float  # CPU seconds per batch on an idle CPU
    io_s: float  # wall seconds per batch spent waiting, not computing
    cpus: float
    cpu_known: bool
    main: float = 1.0  # CPUs the training process itself uses (a whole one where unmeasured)
    main_known: bool = False

    @classmethod
    def infer(cls, workers: int, stats: WindowStats, cpus: float, settings: PolicySettings) -> _Model:
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
            elif stats.stall_fraction >= settings.burst_stall_fraction:
                batch = max(measured, delivered)  # delivery overheads the workers' clocks do not see
            else:
                batch = measured
        main = stats.main_cpu_fraction
        main_known = main is not None
        main = min(max(main, 0.05), cpus) if main is not None else 1.0
        inflation = _inflation(workers, cpus, main)
        fraction = stats.worker_cpu_fraction
        if fraction is None:
            cpu = batch / inflation  # unknown: assume CPU work, the cautious side for core counts
        else:
            cpu = batch * min(max(fraction, 0.0), 1.0)  # delivery overheads split like the production
        io = max(0.0, batch - cpu * inflation)
        return cls(step, batch, cpu, io, cpus, fraction is not None, main, main_known)

    @property
    def cpu_share(self) -> float:
        """CPU work per batch over the batch's uncontended wall time: ~1 CPU-bound, ~0 I/O-bound."""
        total = self.cpu_s + self.io_s
        return self.cpu_s / total if total > 0 else 0.0

    @property
    def demand(self) -> float:
        """Batches per second the step consumes."""
        return 1.0 / self.step_s

    def cpu_limit(self) -> int:
        """Most workers before their CPU work (plus the training process) saturates the CPUs."""
        share = self.cpu_share
        limit = max(self.cpus - self.main, 0.0) / share if share > 0 else math.inf
        if limit >= _UNLIMITED:
            return _UNLIMITED
        # measured: the CPUs the training process leaves, a worker's fraction of a core rounds up
        # (the gain check undoes a worker that did not pay); unmeasured: a whole core stays reserved
        rounded = math.ceil(limit - 0.1) if self.main_known else math.floor(limit + 1e-9)
        return max(1, rounded)

    def capacity(self, workers: int) -> float:
        """Batches per second ``workers`` workers make (``workers >= 1``)."""
        per_batch = self.cpu_s * _inflation(workers, self.cpus, self.main) + self.io_s
        return math.inf if per_batch <= 0 else workers / per_batch

    def throughput(self, workers: int) -> float:
        """Batches per second the training loop runs at with ``workers`` workers."""
        if workers == 0:
            return 1.0 / (self.cpu_s + self.io_s + self.step_s)
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
# Budgets


def _prefetch_bytes(config: LoaderConfig, batch_bytes: float) -> tuple[float, float]:
    """Projected (memory, shared memory) bytes of the prefetched batches of ``config``."""
    batches = config.num_workers * config.prefetch_factor if config.num_workers else 1
    memory = batches * batch_bytes * (2 if config.pin_memory else 1)
    shm = batches * batch_bytes if config.num_workers else 0.0  # workers' batches cross /dev/shm
    return memory, shm


def _batches_allowed(config: LoaderConfig, batch_bytes: Optional[int], budget: Budget) -> Optional[int]:
    """Most prefetched worker batches (workers x prefetch) the budgets allow; ``None``: no limit known."""
    if not batch_bytes or batch_bytes <= 0:
        return None
    allowed: Optional[int] = None
    if budget.memory_bytes is not None:
        per_batch = batch_bytes * (2 if config.pin_memory else 1)
        allowed = int(budget.memory_bytes // per_batch)
    if budget.shm_bytes is not None:
        allowed = _min(allowed, int(budget.shm_bytes // batch_bytes))
    return allowed


def _fit(
    config: LoaderConfig, batch_bytes: Optional[int], budget: Budget, settings: PolicySettings
) -> tuple[LoaderConfig, Optional[str]]:
    """The largest config not above ``config`` within budgets: prefetch gives way first, then workers.

    Returns:
        The config and what limited it: ``"workers"``, ``"memory"`` or ``None``.
    """
    workers = min(config.num_workers, max(budget.max_workers, 0))
    prefetch = min(config.prefetch_factor, settings.max_prefetch_factor)
    limit = "workers" if workers < config.num_workers else None
    allowed = _batches_allowed(config, batch_bytes, budget)
    if allowed is not None and workers and workers * prefetch > allowed:
        limit = "memory"
        if allowed >= workers:
            prefetch = allowed // workers
        else:
            workers, prefetch = allowed, 1 if allowed else prefetch
    return config.replace(num_workers=workers, prefetch_factor=prefetch), limit


def _memory_text(config: LoaderConfig, batch_bytes: Optional[int], budget: Budget) -> str:
    memory, shm = _prefetch_bytes(config, batch_bytes or 0)
    if budget.memory_bytes is not None and memory > budget.memory_bytes:
        return f"{_bytes(memory)} of batches, over the {_bytes(budget.memory_bytes)} memory budget"
    if budget.shm_bytes is not None and shm > budget.shm_bytes:
        return f"{_bytes(shm)} of batches, over the {_bytes(budget.shm_bytes)} /dev/shm budget"
    return "more than the memory budget"


# ------------------------------------------------------------------------------------------------
# The rules


def _decide(
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    memory: _Recall,
    settings: PolicySettings,
    latest: Optional[WindowStats] = None,
) -> tuple[LoaderConfig, str, str]:
    low, high = settings.band
    util, starvation = stats.utilization, stats.starvation_ratio
    if stats.batches <= 0 or stats.step_mean_s <= 0:
        return current, IN_BAND, "no training batches measured: holding"

    model = _Model.infer(current.num_workers, stats, budget.cpus, settings)
    # CPU-heavy production is CPU-bound; unknown production counts as I/O until the CPUs are shown saturated
    data_verdict = DATA_BOUND_CPU if model.cpu_known and model.cpu_share >= 0.5 else DATA_BOUND_IO

    # 1. never keep a config over budget, not even after the rebuild cap: an OOM ends the fit
    fitted, limit = _fit(current, stats.batch_bytes, budget, settings)
    if fitted != current:
        if limit == "memory":
            return fitted, MEMORY_CAPPED, (
                f"{_short(current)} would hold {_memory_text(current, stats.batch_bytes, budget)}: {_short(fitted)}"
            )
        if limit == "workers":
            why = f"{current.num_workers} workers pass the budget of {budget.max_workers}"
        else:
            why = f"prefetch {current.prefetch_factor} passes the most allowed, {settings.max_prefetch_factor}"
        return fitted, _verdict_of(stats, settings, data_verdict), f"{why}: {_short(fitted)}"

    # 2. the rebuild cap
    if memory.rebuilds >= settings.max_rebuilds:
        verdict = _verdict_of(stats, settings, data_verdict)
        return current, verdict, (
            f"rebuild cap hit ({memory.rebuilds} changes): holding {_short(current)} at GPU {util:.0%}"
        )

    # 3. judge the last change
    last = memory.last_change
    # going back must itself fit today's budget (a change forced by the budget is not undone)
    can_go_back = (
        last is not None
        and last.before not in memory.rejected
        and _fit(last.before, stats.batch_bytes, budget, settings)[0] == last.before
    )
    if last is not None and can_go_back:
        if last.kind in ("more_workers", "more_prefetch") and last.gain < -settings.min_gain:
            verdict = DATA_BOUND_CPU if last.kind == "more_workers" else _verdict_of(stats, settings, data_verdict)
            return last.before, verdict, (
                f"throughput fell {-last.gain:.0%} ({last.before_stats.samples_per_s:.0f} -> "
                f"{stats.samples_per_s:.0f} samples/s) after {_change_text(last.before, current)}: going back"
            )
        if last.kind == "give_back" and _is_starved(stats, settings):
            return last.before, data_verdict, (
                f"giving back to {_short(current)} dropped GPU to {util:.0%} (band from {low:.0%}), "
                f"starved {starvation:.0%}: back to {_short(last.before)}"
            )

    # 4.-7. where the window sits against the band: clearly outside means by the hysteresis plus the pooled
    # epochs' standard error (twice that above the band: slack costs only CPU and RAM, starving costs
    # throughput), so that a config sitting near an edge does not flip on noise
    if util < low - settings.hysteresis - memory.util_error:
        if starvation < settings.min_starvation:
            return current, COMPUTE_BOUND, (
                f"GPU {util:.0%} busy but starved only {starvation:.1%}: the step is the bottleneck, "
                f"more workers cannot help"
            )
        return _add_throughput(current, stats, budget, memory, settings, model, data_verdict)
    if util > high + settings.hysteresis + 2 * memory.util_error:
        return _give_back(current, stats, memory, settings, model)
    # The estimate (1 - starvation) cannot climb past the band when every fetch pays a fixed hand-over
    # cost (a batch unpickled from a worker): a queue that never ran dry in the last window (the first
    # window of a config also holds its workers' start), fed by workers with twice the needed capacity,
    # is slack all the same.
    latest = latest or stats
    if (
        current.num_workers > 0
        and stats.util_source != "nvml"
        and util >= low
        and latest.fetches > 0
        and latest.stall_fraction <= _DRY_QUEUE
        and model.capacity(current.num_workers) >= 2 * settings.headroom * model.demand
    ):
        return _give_back(current, stats, memory, settings, model)
    where = f"band {low:.0%}-{high:.0%}"
    if not low <= util <= high:
        where = f"not clearly outside the {where}"
    return current, IN_BAND, (
        f"GPU {util:.0%} busy{_over(memory.epochs)} ({where}), starved {starvation:.0%}: holding {_short(current)}"
    )


def _verdict_of(stats: WindowStats, settings: PolicySettings, data_verdict: str) -> str:
    """The diagnosis of a window on its own (for holds that no rule explains better)."""
    low, high = settings.band
    if stats.utilization < low - settings.hysteresis:
        return data_verdict if stats.starvation_ratio >= settings.min_starvation else COMPUTE_BOUND
    if stats.utilization > high + settings.hysteresis and stats.starvation_ratio < settings.min_starvation:
        return COMPUTE_BOUND
    return IN_BAND


def _add_throughput(
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    memory: _Recall,
    settings: PolicySettings,
    model: _Model,
    data_verdict: str,
) -> tuple[LoaderConfig, str, str]:
    workers, prefetch = current.num_workers, current.prefetch_factor
    starved = f"starved {stats.starvation_ratio:.0%}{_over(memory.epochs)}"
    last = memory.last_change
    if last is not None and last.kind == "more_workers" and last.stopped_helping:
        return current, DATA_BOUND_CPU, (
            f"adding workers {last.before.num_workers} -> {workers} gained {last.gain:+.0%} "
            f"(< {settings.min_gain:.0%}): the pipeline is CPU-bound, staying at {workers}"
        )

    # bursty: the workers make enough on average, yet some fetches wait: deeper prefetch absorbs bursts
    capacity_ratio = model.capacity(workers) / model.demand if workers else 0.0
    bursty = (
        workers > 0
        and stats.stall_fraction < settings.burst_stall_fraction
        and (stats.worker_batch_s is None or capacity_ratio >= 1.0)
    )
    prefetch_top = min(settings.max_prefetch_factor, memory.prefetch_ceiling or settings.max_prefetch_factor)
    if bursty and prefetch < prefetch_top:
        stall_s = stats.fetch_wait_s / max(stats.stalls, 1)
        # a batch is handed out ~workers x prefetch steps before it is needed: grow that lead by one stall
        extra = math.ceil(stall_s * settings.headroom / model.step_s / workers)
        deeper = current.replace(prefetch_factor=min(prefetch_top, prefetch + max(1, extra)))
        fitted, _ = _fit(deeper, stats.batch_bytes, budget, settings)
        if fitted.prefetch_factor > prefetch and fitted not in memory.rejected:
            enough = (
                f"{workers} workers make {capacity_ratio:.1f}x what the step eats"
                if stats.worker_batch_s is not None
                else "most fetches find a batch ready"
            )
            return fitted, data_verdict, (
                f"{starved} in bursts ({stats.stall_fraction:.0%} of fetches stall, {_ms(stall_s)} each) though "
                f"{enough}: prefetch {prefetch} -> {fitted.prefetch_factor}"
            )

    # steady: Little's law says how many workers keep up with the step, plus headroom
    cpu_limit = model.cpu_limit()
    ceiling = memory.worker_ceiling if memory.worker_ceiling is not None else _UNLIMITED
    limit = min(budget.max_workers, cpu_limit, ceiling)
    cost = f"a worker needs {_ms(model.batch_s)} per batch vs {_ms(model.step_s)} step"
    if workers >= limit:
        if limit == ceiling:
            return current, DATA_BOUND_CPU, (
                f"{starved} with {workers} workers, but adding workers stopped helping at "
                f"{memory.worker_ceiling}: the pipeline is CPU-bound"
            )
        if limit == cpu_limit:
            fewer = current.replace(num_workers=cpu_limit)
            if workers > cpu_limit and fewer not in memory.rejected:
                # past saturation extra workers only hold memory and fight over the cores
                return fewer, DATA_BOUND_CPU, (
                    f"{starved}; {workers} workers oversubscribe the {budget.cpus:g} CPUs "
                    f"({model.cpu_share:.0%} CPU per batch): the pipeline is CPU-bound, {workers} -> {cpu_limit}"
                )
            return current, DATA_BOUND_CPU, (
                f"{starved}, but {workers} workers already keep the {budget.cpus:g} CPUs busy "
                f"({model.cpu_share:.0%} CPU per batch): the pipeline is CPU-bound"
            )
        return current, data_verdict, (
            f"{starved}; {cost}, but {workers} workers is the budget's most"
        )
    wanted = model.workers_for(settings.headroom * model.demand, workers + 1, limit) or limit
    wanted = max(wanted, workers + 1)
    gain = model.throughput(wanted) / model.throughput(workers) - 1.0
    if gain < settings.min_gain:
        # contention eats what more workers would add: the model already says they cannot help
        return current, DATA_BOUND_CPU, (
            f"{starved}; {cost}, and {wanted} workers would gain only {gain:+.0%} on "
            f"{budget.cpus:g} CPUs: the pipeline is CPU-bound"
        )
    target, why = _fit(current.replace(num_workers=wanted), stats.batch_bytes, budget, settings)
    while target in memory.rejected and target.num_workers > workers:
        target = target.replace(num_workers=target.num_workers - 1)
    if target.num_workers <= workers:
        if why == "memory":
            one_more = current.replace(num_workers=workers + 1, prefetch_factor=1)
            return current, MEMORY_CAPPED, (
                f"{starved} with {workers} workers and wants {wanted}, but even {_short(one_more)} "
                f"would hold {_memory_text(one_more, stats.batch_bytes, budget)}: holding"
            )
        return current, data_verdict, f"{starved}; {cost}, but more workers were tried and undone: holding"
    if why == "memory" and target.num_workers < wanted:
        return target, MEMORY_CAPPED, (
            f"{starved} with {workers} workers and wants {wanted}, but {wanted} workers would hold "
            f"{_memory_text(current.replace(num_workers=wanted, prefetch_factor=1), stats.batch_bytes, budget)}: "
            f"{_short(target)}"
        )
    verdict = data_verdict
    if target.num_workers == cpu_limit and model.capacity(target.num_workers) < model.demand:
        verdict = DATA_BOUND_CPU  # the most the CPUs carry still falls short
    note = ""
    if target.prefetch_factor != prefetch:
        note = f", prefetch {prefetch} -> {target.prefetch_factor} to fit memory"
    return target, verdict, f"{starved} with {workers} workers; {cost}: {target.num_workers} workers{note}"


def _give_back(
    current: LoaderConfig, stats: WindowStats, memory: _Recall, settings: PolicySettings, model: _Model
) -> tuple[LoaderConfig, str, str]:
    high = settings.band[1]
    util, starvation = stats.utilization, stats.starvation_ratio
    workers, prefetch = current.num_workers, current.prefetch_factor
    verdict = COMPUTE_BOUND if starvation < settings.min_starvation else IN_BAND
    head = f"GPU {util:.0%} busy{_over(memory.epochs)}, starved {starvation:.1%}"
    # slack costs only CPU and RAM, starving costs throughput: on one epoch's evidence give back only what
    # the model says leaves the workers ahead of the step with headroom; near the band's top, wait for a second
    confirmed = memory.epochs >= 2

    def allowed(config: LoaderConfig) -> bool:
        # never back to a config that was undone, nor down to one that was starved before
        w, p = _resources(config)
        return config not in memory.rejected and not any(w <= sw and p <= sp for sw, sp in memory.starved)

    def keeps_band(fewer: int, predicted: float) -> bool:
        if confirmed:
            return predicted >= high  # the top of the band: a model a few points off still keeps it
        return fewer > 0 and model.capacity(fewer) >= settings.headroom * model.demand

    # fewer workers first: at most half of them in one notch, the fewest the model says keep the band
    now = model.throughput(workers)
    for fewer in range(workers // 2, workers):
        candidate = current.replace(num_workers=fewer)
        predicted = util * model.throughput(fewer) / now
        if keeps_band(fewer, predicted) and allowed(candidate):
            return candidate, verdict, (
                f"{head}: the data side has slack, {fewer} workers should keep ~{min(predicted, 1.0):.0%}: "
                f"giving back {workers} -> {fewer} workers"
            )
    # then shallower prefetch, back to the DataLoader's default in one notch: depth beyond it only absorbs
    # bursts, and there is no model for those, so only where the queue hardly ever ran dry and the loop
    # hardly waited, on confirmed slack (it saves memory only: no hurry)
    shallower = current.replace(prefetch_factor=_DEFAULT_PREFETCH)
    queue_idle = stats.stall_fraction <= _DRY_QUEUE and starvation <= _DRY_QUEUE / 5
    if workers and prefetch > _DEFAULT_PREFETCH and queue_idle and allowed(shallower):
        if confirmed:
            return shallower, verdict, f"{head}: the data side has slack: prefetch {prefetch} -> {_DEFAULT_PREFETCH}"
        return current, verdict, f"{head}: {_WAIT}"
    if not confirmed and workers and allowed(current.replace(num_workers=workers - 1)):
        return current, verdict, f"{head}: {_WAIT}"
    return current, verdict, f"{head}: {_short(current)} is the least that keeps the band, holding"


# ------------------------------------------------------------------------------------------------
# Wording


def _over(epochs: int) -> str:
    return f" over {epochs} epochs" if epochs > 1 else ""


def _short(config: LoaderConfig) -> str:
    if config.num_workers == 0:
        return "0 workers"
    return f"{config.num_workers} workers x prefetch {config.prefetch_factor}"


def _change_text(before: LoaderConfig, after: LoaderConfig) -> str:
    parts = []
    if before.num_workers != after.num_workers:
        parts.append(f"workers {before.num_workers} -> {after.num_workers}")
    if before.prefetch_factor != after.prefetch_factor and after.num_workers:
        parts.append(f"prefetch {before.prefetch_factor} -> {after.prefetch_factor}")
    return ", ".join(parts) or "the change"


def _ms(seconds: float) -> str:
    ms = seconds * 1000.0
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} GB"
