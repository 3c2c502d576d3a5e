"""The ladder test, done right: time the train loader alone at each workers x prefetch point.

``dltune sweep`` (see :mod:`lightning_dltune.cli.command`) measures the training step once, then iterates the
train loader of a :class:`~lightning_dltune.TunableDataModule` for a bounded time per grid point, each
point in a fresh loader built by the datamodule itself, and reports per point:

- ``samples_per_s``: steady-state throughput (after every worker delivered its first batch);
- ``startup_s``: iterator creation to the first batch (workers starting, first batch made);
- ``worker_cpu_cores``: CPU seconds of the worker processes (of the training process at 0 workers)
  per wall second;
- ``peak_memory_bytes``: peak Σ PSS (RSS where PSS is unreadable) of the process tree, plus the
  growth of ``/dev/shm`` (``shm_bytes``), where workers hand batches over;
- ``predicted_starvation``: the starvation ratio a fit would see with the measured step;
- ``fit_samples_per_s``: the training samples/s a fit would reach with it (the step bounds it).

The recommendation is the leanest point within ``min_gain`` of the best predicted training speed.

Pure parts (grid, budget, starvation, the choice) take plain numbers; they are tested on their own.
"""

from __future__ import annotations

import math
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from lightning_dltune.control.resources import SHM_PATH
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.history import leanest_near_best
from lightning_dltune.core.model import PipelineModel
from lightning_dltune.core.policy import memory_over_budget
from lightning_dltune.core.records import Budget
from lightning_dltune.report.words import over_memory_text

_MEMORY_EVERY_S = 0.25  # process-tree memory sampling period inside a point
_MIN_BATCHES = 3  # timed batches a point measures even past its time bound


# -- pure logic -----------------------------------------------------------------------------------
def default_workers(max_workers: int) -> list[int]:
    """The ladder users climb by hand: 0, 1, 2, 4, 8, ... up to ``max_workers`` (which is included)."""
    ladder, n = [0], 1
    while n < max_workers:
        ladder.append(n)
        n *= 2
    if max_workers > 0:
        ladder.append(max_workers)
    return ladder


def over_budget(config: LoaderConfig, batch_bytes: float, budget: Budget) -> Optional[str]:
    """Why ``config`` is outside ``budget`` (workers, memory, /dev/shm), or ``None`` when it fits."""
    if config.num_workers > budget.max_workers:
        return f"{config.num_workers} workers, over the budget of {budget.max_workers}"
    over = memory_over_budget(config, batch_bytes, budget)
    if over is None:
        return None
    which, used, allowed = over
    return over_memory_text(used, allowed, which)


def build_grid(
    base: LoaderConfig,
    budget: Budget,
    batch_bytes: float,
    workers: Optional[Sequence[int]] = None,
    prefetch: Sequence[int] = (1, 2, 4),
    pin: Sequence[bool] = (False,),
) -> tuple[list[LoaderConfig], list[tuple[LoaderConfig, str]]]:
    """The grid points to measure and those the budget rules out (with the reason).

    ``workers=None`` climbs :func:`default_workers` to the budget. At 0 workers prefetch does not
    apply, so that row has one point per ``pin`` value. Other fields come from ``base``.
    """
    ladder = sorted(set(workers if workers is not None else default_workers(budget.max_workers)))
    points: list[LoaderConfig] = []
    skipped: list[tuple[LoaderConfig, str]] = []
    for w in ladder:
        for p in sorted(set(prefetch)) if w else [base.prefetch_factor]:
            for pinned in pin:
                config = base.replace(num_workers=w, prefetch_factor=p, pin_memory=pinned)
                reason = over_budget(config, batch_bytes, budget)
                if reason is None:
                    points.append(config)
                else:
                    skipped.append((config, reason))
    return points, skipped


def predicted_wait_s(loader_s_per_batch: float, step_s: float, num_workers: int) -> float:
    """Fetch wait per batch a fit would see with this loader and step.

    Workers make batches while the step runs, so the loop waits only for what the step does not
    hide (``max(0, loader - step)``); at 0 workers the training process loads every batch itself.
    """
    return loader_s_per_batch if num_workers == 0 else max(0.0, loader_s_per_batch - step_s)


def predicted_starvation(loader_s_per_batch: float, step_s: float, num_workers: int) -> float:
    """Starvation ratio a fit would see: Σ fetch wait / Σ (fetch wait + step), per batch."""
    wait = predicted_wait_s(loader_s_per_batch, step_s, num_workers)
    if math.isinf(wait):
        return 1.0
    total = wait + step_s
    return wait / total if total > 0 else 0.0


def predicted_fit_rate(loader_s_per_batch: float, step_s: float, num_workers: int, batch_size: int) -> float:
    """Training samples/s a fit would reach: the model's throughput of the loader timed alone, the step bounding it."""
    if loader_s_per_batch <= 0 and step_s <= 0:
        return 0.0  # nothing timed
    return batch_size * PipelineModel.timed_alone(num_workers, loader_s_per_batch, step_s).throughput(num_workers)


def leanest_within(points: Sequence[SweepPoint], min_gain: float) -> Optional[SweepPoint]:
    """The leanest point whose predicted training samples/s is within ``min_gain`` of the best.

    The fit's speed is what counts, not the loader's alone: a loader faster than the step buys
    nothing, so the lean configs that already hide behind the step tie with the fastest one (with a
    step of 0 this is the loader's own samples/s). Leanest: fewest worker processes, then fewest
    prefetched batches, then no pinned copies.
    """
    rated = [(p, p.fit_samples_per_s) for p in points if p.fit_samples_per_s > 0]
    return leanest_near_best(rated, min_gain, _leanest_point_first)


def _leanest_point_first(point: SweepPoint, fit_samples_per_s: float) -> tuple:
    """The sweep's order: fewest workers, fewest prefetched batches, no pinned copies, then the faster loader.

    Not the fit's order (:func:`lightning_dltune.core.history.best_config`): the sweep also tries ``pin_memory``.
    """
    c = point.config
    return (c.num_workers, c.num_workers * c.prefetch_factor, c.pin_memory, -point.samples_per_s)


def steady_rate(stamps: Sequence[float], skip: int) -> float:
    """Batches per second from batch arrival times, leaving out the first ``skip`` batches.

    Workers start together, so the first round of batches arrives at once; counting it would
    overstate the rate of a short measurement. With too few batches, every one counts.
    """
    if len(stamps) - skip < 2:
        skip = 0
    if len(stamps) < 2 or stamps[-1] <= stamps[skip]:
        return 0.0
    return (len(stamps) - 1 - skip) / (stamps[-1] - stamps[skip])


# -- measurement ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepPoint:
    """What one grid point measured (see the module docstring for each field)."""

    config: LoaderConfig
    samples_per_s: float
    batches: int
    loader_ms_per_batch: float
    startup_s: float
    worker_cpu_cores: float
    peak_memory_bytes: float
    shm_bytes: float
    predicted_starvation: float
    fit_samples_per_s: float

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record.update(record.pop("config"))
        # a point too slow to time has no rate: null in JSON, not Infinity
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


@dataclass
class SweepResult:
    """The whole sweep: its inputs, every point, what the budget ruled out, and the recommendation."""

    step_ms: float
    step_source: str  # "measured" (median of real steps of the model) or "--step_ms"
    batch_size: int
    batch_bytes: float
    seconds_per_point: float
    min_gain: float
    budget: Budget
    step_samples_ms: list[float] = field(default_factory=list)  # every timed step, to show its spread
    points: list[SweepPoint] = field(default_factory=list)
    skipped: list[tuple[LoaderConfig, str]] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def recommended(self) -> Optional[SweepPoint]:
        return leanest_within(self.points, self.min_gain)

    def as_dict(self) -> dict[str, Any]:
        rec = self.recommended
        return {
            "step_ms": self.step_ms,
            "step_source": self.step_source,
            "step_samples_ms": self.step_samples_ms,
            "batch_size": self.batch_size,
            "batch_bytes": self.batch_bytes,
            "seconds_per_point": self.seconds_per_point,
            "min_gain": self.min_gain,
            "budget": asdict(self.budget),
            "elapsed_s": self.elapsed_s,
            "points": [p.as_dict() for p in self.points],
            "skipped": [{**c.as_dict(), "reason": why} for c, why in self.skipped],
            "recommended": rec.as_dict() if rec is not None else None,
        }


def batch_nbytes(batch: Any) -> int:
    """Bytes of the tensors in a batch (:func:`lightning_dltune.loaders.loader.tensor_bytes`)."""
    from lightning_dltune.loaders.loader import tensor_bytes

    return tensor_bytes(batch)


def _shm_used() -> float:
    try:
        return float(shutil.disk_usage(SHM_PATH).used)
    except (OSError, ValueError):
        return 0.0


def _tree_memory(me: Any, children: list) -> float:
    total = 0.0
    for proc in [me, *children]:
        try:
            info = proc.memory_full_info()
            total += getattr(info, "pss", info.rss)
        except Exception:  # a worker that just exited, or PSS not readable: its RSS, else nothing
            try:
                total += proc.memory_info().rss
            except Exception:
                pass
    return total


def _never_stop() -> None:
    return None


def _cpu_seconds(children: list) -> float:
    total = 0.0
    for proc in children:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except Exception:  # exited already
            pass
    return total


def _close(iterator: Any) -> None:
    """Stop an iterator's workers now: a tuned loader's iterator stops the torch iterator it wraps."""
    from lightning_dltune.loaders.torch_internals import shutdown_iterator

    if callable(getattr(iterator, "shutdown", None)):
        iterator.shutdown()
    else:
        shutdown_iterator(iterator)


@dataclass
class _Timing:
    """What a point timed so far, and the iterator it reads (the one to shut down)."""

    iterator: Any = None
    stamps: list[float] = field(default_factory=list)  # arrival time of every batch
    peak_memory: float = 0.0
    peak_shm: float = 0.0


def measure_point(
    make_loader: Callable[[LoaderConfig], Any],
    config: LoaderConfig,
    seconds: float,
    step_s: float,
    batch_size: int,
    stop: Callable[[], None] = _never_stop,
) -> SweepPoint:
    """Iterate a fresh loader of ``config`` alone for about ``seconds`` after its first batch.

    ``stop`` is called between batches and raises to end the point early
    (:meth:`~lightning_dltune.cli.interrupt.StopRequest.check`).
    The loader's workers are shut down before this returns or raises (Ctrl-C included).
    """
    import psutil

    from lightning_dltune.loaders.torch_internals import shutdown_workers

    me = psutil.Process()
    shm_before = _shm_used()
    loader = make_loader(config)
    timing = _Timing()
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        timing.iterator = iter(loader)
        next(timing.iterator)
        timing.stamps.append(time.perf_counter())
        _time_batches(loader, timing, me, shm_before, seconds, stop)
        wall = time.perf_counter() - t0
        if config.num_workers:
            cpu = _cpu_seconds(me.children(recursive=True))
        else:
            cpu = time.process_time() - cpu0
    except Exception:
        stop()  # a terminal's Ctrl-C also reaches the workers: their exit is then the interrupt's, not an error
        raise
    finally:
        _close(timing.iterator)
        shutdown_workers(loader)
    return _point(config, timing, timing.stamps[0] - t0, cpu / wall if wall > 0 else 0.0, step_s, batch_size)


def _time_batches(
    loader: Any, timing: _Timing, me: Any, shm_before: float, seconds: float, stop: Callable[[], None]
) -> None:
    """Take batches for ``seconds`` after the first (at least ``_MIN_BATCHES``, at most three times as long).

    An epoch that ends goes on with the next one (persistent workers stay); the process tree's memory is
    sampled every ``_MEMORY_EVERY_S``.
    """
    stamps = timing.stamps
    deadline, hard_stop = stamps[0] + seconds, stamps[0] + 3 * seconds
    next_sample = 0.0
    while True:
        now = time.perf_counter()
        if now >= next_sample:
            _sample_memory(timing, me, shm_before)
            next_sample = now + _MEMORY_EVERY_S
        if (now >= deadline and len(stamps) > _MIN_BATCHES) or now >= hard_stop:
            break
        stop()
        try:
            next(timing.iterator)
        except StopIteration:  # the epoch ended: the next one goes on (persistent workers stay)
            timing.iterator = iter(loader)
            continue
        stamps.append(time.perf_counter())


def _sample_memory(timing: _Timing, me: Any, shm_before: float) -> None:
    """Raise the peaks to now: ``/dev/shm``'s growth, and the process tree's memory plus that growth."""
    children = me.children(recursive=True)
    shm = max(0.0, _shm_used() - shm_before)
    timing.peak_shm = max(timing.peak_shm, shm)
    timing.peak_memory = max(timing.peak_memory, _tree_memory(me, children) + shm)


def _point(
    config: LoaderConfig, timing: _Timing, startup_s: float, cpu_cores: float, step_s: float, batch_size: int
) -> SweepPoint:
    """The point of what ``timing`` holds: the steady rate, and what a fit with ``step_s`` would see."""
    stamps = timing.stamps
    rate = steady_rate(stamps, skip=config.num_workers)
    per_batch = 1.0 / rate if rate > 0 else math.inf  # too slow to time: no rate, fully starved
    return SweepPoint(
        config=config,
        samples_per_s=rate * batch_size,
        batches=len(stamps),
        loader_ms_per_batch=1e3 * per_batch,
        startup_s=startup_s,
        worker_cpu_cores=cpu_cores,
        peak_memory_bytes=timing.peak_memory,
        shm_bytes=timing.peak_shm,
        predicted_starvation=predicted_starvation(per_batch, step_s, config.num_workers),
        fit_samples_per_s=predicted_fit_rate(per_batch, step_s, config.num_workers, batch_size),
    )


def datamodule_loaders(datamodule: Any) -> Callable[[LoaderConfig], Any]:
    """A function from config to a fresh train loader, built by the datamodule as a fit builds it."""

    def make(config: LoaderConfig) -> Any:
        datamodule.set_loader_config(config)
        return datamodule.build_loader(datamodule.train_dataset, train=True, **datamodule.train_loader_kwargs())

    return make


def run_grid(
    make_loader: Callable[[LoaderConfig], Any],
    result: SweepResult,
    configs: Sequence[LoaderConfig],
    on_point: Optional[Callable[[SweepPoint], None]] = None,
    stop: Callable[[], None] = _never_stop,
) -> SweepResult:
    """Measure every config in order into ``result`` (which keeps what finished if interrupted by ``stop``)."""
    for config in configs:
        stop()
        with warnings.catch_warnings():  # the budget allows more workers than cores (I/O-bound workers)
            warnings.filterwarnings("ignore", message=".*worker processes in total.*")
            point = measure_point(
                make_loader, config, result.seconds_per_point, result.step_ms / 1e3, result.batch_size, stop
            )
        result.points.append(point)
        if on_point is not None:
            on_point(point)
    return result


def measure_steps_s(
    model: Any, datamodule: Any, trainer_kwargs: dict[str, Any], steps: int = 10, warmup: int = 3
) -> list[float]:
    """Wall times of ``steps`` real training steps (hook to hook, as the tuner measures them).

    A throw-away Trainer (no logger, no checkpoints, no validation) runs ``warmup + steps`` steps on
    the device of ``trainer_kwargs``; on CUDA each step ends with a synchronize, so the time is the
    device's, not only the launch's.
    """
    import lightning as L
    import torch

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.started = 0.0
            self.steps: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            if trainer.global_step > warmup:  # counts steps across epochs, unlike batch_idx
                self.steps.append(time.perf_counter() - self.started)

    clock = StepClock()
    trainer = L.Trainer(
        max_steps=warmup + steps,
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
        **trainer_kwargs,
    )
    try:
        trainer.fit(model, datamodule=datamodule)
    except SystemExit:
        if trainer.interrupted:  # Lightning turns Ctrl-C into exit(1) after its teardown: say it was Ctrl-C
            raise KeyboardInterrupt from None
        raise
    if not clock.steps:
        raise RuntimeError(f"the train loader ran out before {warmup + steps} steps: use a smaller --steps.")
    return clock.steps
