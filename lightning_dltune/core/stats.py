"""What one measurement window looked like: plain numbers, no torch, each declaring how it combines.

Every field of :class:`WindowStats` declares once (in its ``dataclasses.field`` metadata) how it
**pools** over consecutive windows of one config and how it **reduces** across DDP ranks, the way
torchmetrics declares ``dist_reduce_fx`` with each state. Pooling (:func:`pool_windows`), the
cross-rank rows (:func:`to_row`, :func:`from_row`, :func:`reduce_ranks`) and the checkpoint dicts
(:func:`to_dict`, :func:`from_dict`) are derived from those declarations, never written field by field:
a field added to :class:`WindowStats` (or to a subclass) is pooled, reduced and saved with no other change.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from enum import Enum
from typing import Any, Optional, Sequence, TypeVar


class _StrEnum(str, Enum):
    """A ``str`` enum that prints, formats and logs as its value on every Python version."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


TAIL_STALL = 5.0  # a stall this many times the window's typical one is a rare slow batch's, not its conditions'


def tail_wait(stall_waits: Sequence[float], batch_s: Optional[float] = None) -> float:
    """Σ the stalls that only a rare slow batch explains: a heavy tail's.

    A stall waits for one batch being made: none outlasts a batch's making (``batch_s``: a worker's p95 time
    per batch, or what the loop's clock implies where the workers cannot say), and workers in step deliver in
    bunches whose stalls are alike, however long. A heavy tail's slow batch stalls the loop far longer: a
    stall counts where it is over ``batch_s`` and over ``TAIL_STALL`` times the typical stall (the lower
    median of ``stall_waits``; a lone stall is judged by ``batch_s`` alone, and is no tail without it).
    """
    ordered = sorted(stall_waits)
    if not ordered or (len(ordered) < 2 and not batch_s):
        return 0.0
    typical = ordered[(len(ordered) - 1) // 2] if len(ordered) >= 2 else 0.0
    bar = max(TAIL_STALL * typical, batch_s or 0.0)
    return sum(w for w in ordered if w > bar)


class UtilSource(_StrEnum):
    """Where a window's utilization comes from. Ordered: a rank without NVML makes the job's an estimate."""

    ESTIMATE = "estimate"  # 1 - starvation_ratio
    NVML = "nvml"  # NVML utilization.gpu of the rank's device


class Pool(_StrEnum):
    """How a field pools over consecutive windows of one config."""

    SUM = "sum"  # totals and counts add up
    MEAN = "batch-weighted mean"  # per-batch means, weighted by each window's batches; unknown if the latest is
    LATEST = "latest"  # the newest window's value (percentiles, sizes, states)
    MAX = "max"  # the largest of the windows' (the slowest batch seen); unknown if the latest is


class Reduce(_StrEnum):
    """How a field reduces across DDP ranks into the job's window."""

    WORST = "most starved rank"  # that rank's value: it holds the others at the gradient all-reduce
    # the rank whose workers take the longest per batch (ties: the most starved): one config must keep every rank
    # fed, and a cost from a rank whose data is free (most starved only on its hand-over) would size for it alone
    COSTLIEST = "costliest rank"
    SUM = "sum"
    MIN = "min"  # unknown if any rank does not know it
    MAX = "max"  # unknown if any rank does not know it


def stat(default: Any, pool: Pool, reduce: Reduce, renamed_from: tuple[str, ...] = ()) -> Any:
    """A :class:`WindowStats` field with its pooling and reduction (``renamed_from``: older checkpoint keys)."""
    return dataclasses.field(default=default, metadata={"pool": pool, "reduce": reduce, "renamed_from": renamed_from})


@dataclasses.dataclass(frozen=True)
class WindowStats:
    """Training-batch measurements of one window, already reduced across DDP ranks.

    Totals are over the window's training batches. The first fetch of a window (pipeline fill after
    the loader's iterator starts) is in ``startup_s``, not in ``fetch_wait_total_s``.

    Args:
        batches: training batches measured (fetch and step both seen).
        samples: samples in those batches.
        fetch_wait_total_s: Σ fetch wait (loop blocked in ``next()`` on the train loader).
        step_total_s: Σ step time (``on_train_batch_start`` to ``on_train_batch_end``).
        fetch_wait_p50_s, fetch_wait_p95_s, step_p50_s, step_p95_s: per-batch percentiles.
        tail_wait_s: Σ the stalls only a rare slow batch explains (:func:`tail_wait`: longer than a batch's
            making and than five typical stalls): a heavy tail's slow batch holds the loop for most of its
            time, and whether a window met one is luck. Part of ``fetch_wait_total_s``.
        stalls: fetches that found no ready batch and had to block.
        fetches: fetches measured (the denominator of :attr:`stall_fraction`).
        queue_depth: mean ready batches at request time; ``None`` where the loader cannot say.
        startup_s: time spent starting loader iterators/workers and filling the pipeline.
        worker_batch_s: mean wall time a loader worker took to produce one batch (fetch samples and
            collate), measured inside the workers; ``None`` where the loader cannot say.
        worker_batch_p95_s: the 95th percentile of that wall time per batch (its spread: the loop takes
            batches in order, so it waits for the slowest one outstanding); ``None`` where unknown.
        worker_batch_max_s: the slowest batch's wall time (the top of its histogram bin: up to 19 % over);
            a batch slower than the lead the loop has on it (workers x prefetch batches) stalls the loop.
        worker_cpu_fraction: CPU time / wall time of that production (near 1: CPU-bound decode;
            near 0: waiting on storage); ``None`` where unknown.
        batch_bytes: bytes of one collated batch (tensors only); ``None`` where unknown.
        gpu_util: mean NVML ``utilization.gpu`` in [0, 1] over the training part; ``None`` without NVML.
        util_source: :class:`UtilSource`: ``"nvml"`` or ``"estimate"`` (``1 - starvation_ratio``).
        main_cpu_fraction: CPU time of the training process / wall time (batches it made itself not
            counted); the CPUs it leaves are the workers'. ``None`` where unknown.
        warmup_batches: the window's leading warm-up steps, left out of every other field (see
            :func:`~lightning_dltune.core.windows.warmup_steps`).
        settling: 1 where the step time was still falling at the window's end (more warm-up to come).
        drained_batches: the window's leading batches that a mid-epoch switch's old workers delivered (made
            by the config before it), left out of every other field.
        other_cpus: CPUs' worth of time that other processes (not the training process nor its
            descendants, the loaders' workers) took on the cores the training process may run on, over the
            whole window (:mod:`~lightning_dltune.measure.host_cpu`): a neighbour. ``None`` where unknown,
            and in a window so far (a look).
        cpu_busy: the share of those cores busy with anything over the window; ``None`` likewise.
    """

    batches: int = stat(0, Pool.SUM, Reduce.WORST)
    samples: int = stat(0, Pool.SUM, Reduce.SUM)  # every rank's samples are the job's
    fetch_wait_total_s: float = stat(0.0, Pool.SUM, Reduce.WORST, renamed_from=("fetch_wait_s",))
    step_total_s: float = stat(0.0, Pool.SUM, Reduce.WORST, renamed_from=("step_s",))
    fetch_wait_p50_s: float = stat(0.0, Pool.LATEST, Reduce.WORST)
    fetch_wait_p95_s: float = stat(0.0, Pool.LATEST, Reduce.WORST)
    step_p50_s: float = stat(0.0, Pool.LATEST, Reduce.WORST)
    step_p95_s: float = stat(0.0, Pool.LATEST, Reduce.WORST)
    stalls: int = stat(0, Pool.SUM, Reduce.WORST)
    fetches: int = stat(0, Pool.SUM, Reduce.WORST)
    queue_depth: Optional[float] = stat(None, Pool.LATEST, Reduce.WORST)
    startup_s: float = stat(0.0, Pool.SUM, Reduce.WORST)
    worker_batch_s: Optional[float] = stat(None, Pool.MEAN, Reduce.COSTLIEST)
    worker_cpu_fraction: Optional[float] = stat(None, Pool.MEAN, Reduce.COSTLIEST)
    batch_bytes: Optional[int] = stat(None, Pool.LATEST, Reduce.WORST)
    gpu_util: Optional[float] = stat(None, Pool.MEAN, Reduce.MIN)  # the least busy device is the job's
    util_source: UtilSource = stat(UtilSource.ESTIMATE, Pool.LATEST, Reduce.MIN)
    main_cpu_fraction: Optional[float] = stat(None, Pool.MEAN, Reduce.MAX)  # the busiest training process
    worker_batch_p95_s: Optional[float] = stat(None, Pool.MEAN, Reduce.COSTLIEST)  # same conditions: p95s average
    worker_batch_max_s: Optional[float] = stat(None, Pool.MAX, Reduce.MAX)  # the slowest batch any rank saw
    warmup_batches: int = stat(0, Pool.SUM, Reduce.MAX)
    settling: int = stat(0, Pool.LATEST, Reduce.MAX)  # any rank still warming up
    drained_batches: int = stat(0, Pool.SUM, Reduce.MAX)
    tail_wait_s: float = stat(0.0, Pool.SUM, Reduce.WORST)  # the most starved rank's, as its total
    other_cpus: Optional[float] = stat(None, Pool.MEAN, Reduce.MAX)  # the busiest neighbour any rank saw
    cpu_busy: Optional[float] = stat(None, Pool.MEAN, Reduce.MAX)

    def __post_init__(self) -> None:
        object.__setattr__(self, "util_source", UtilSource(self.util_source))

    @property
    def fetch_wait_s(self) -> float:
        """Σ fetch wait; the same as :attr:`fetch_wait_total_s` (the name of releases up to 0.1)."""
        return self.fetch_wait_total_s

    @property
    def step_s(self) -> float:
        """Σ step time; the same as :attr:`step_total_s` (the name of releases up to 0.1)."""
        return self.step_total_s

    @property
    def all_batches(self) -> int:
        """The window's batches, its warm-up and the batches drained from the config before included."""
        return self.batches + self.warmup_batches + self.drained_batches

    @property
    def busy_s(self) -> float:
        """Σ (fetch wait + step time): the training loop's time on these batches."""
        return self.fetch_wait_total_s + self.step_total_s

    @property
    def starvation_ratio(self) -> float:
        """Σ fetch wait / Σ (fetch wait + step time); 0 when nothing was measured."""
        busy = self.busy_s
        return self.fetch_wait_total_s / busy if busy > 0 else 0.0

    @property
    def typical_starvation(self) -> float:
        """:attr:`starvation_ratio` without the window's :attr:`tail_wait_s` (the loop's time less it, too)."""
        tail = min(self.tail_wait_s, self.fetch_wait_total_s)
        busy = self.busy_s - tail
        return (self.fetch_wait_total_s - tail) / busy if busy > 0 else 0.0

    @property
    def utilization(self) -> float:
        """GPU utilization in [0, 1]: NVML where available, else ``1 - starvation_ratio``."""
        if self.util_source == UtilSource.NVML and self.gpu_util is not None:
            return self.gpu_util
        return 1.0 - self.starvation_ratio

    @property
    def fetch_wait_mean_s(self) -> float:
        return self.fetch_wait_total_s / self.batches if self.batches else 0.0

    @property
    def step_mean_s(self) -> float:
        return self.step_total_s / self.batches if self.batches else 0.0

    @property
    def stall_fraction(self) -> float:
        return self.stalls / self.fetches if self.fetches else 0.0

    @property
    def samples_per_s(self) -> float:
        """Training throughput over the loop's fetch and step time."""
        busy = self.busy_s
        return self.samples / busy if busy > 0 else 0.0


S = TypeVar("S", bound=WindowStats)


# ------------------------------------------------------------------------------------------------
# Derived from the declarations


@functools.cache
def _pooling(cls: type) -> tuple[tuple[str, Pool], ...]:
    """Each field of ``cls`` with how it pools (a decision pools windows hundreds of times: read once)."""
    return tuple((f.name, f.metadata.get("pool", Pool.LATEST)) for f in dataclasses.fields(cls))


def pool_windows(windows: Sequence[S]) -> S:
    """Consecutive windows of one config as one, each field as it declares (:class:`Pool`)."""
    if len(windows) == 1:
        return windows[0]
    return _pooled(tuple(windows))


# A decision replays the fit's windows, so the next decision pools the same runs of windows again: the
# windows are frozen, the pool is a pure function of them, and a replay pools a few hundred runs.
@functools.lru_cache(maxsize=4096)
def _pooled(windows: tuple[S, ...]) -> S:
    latest = windows[-1]
    values = {}
    for name, pool in _pooling(type(latest)):
        if pool is Pool.SUM:
            values[name] = sum(getattr(w, name) for w in windows)
        elif pool is Pool.MEAN:
            values[name] = _batch_weighted(windows, name) if getattr(latest, name) is not None else None
        elif pool is Pool.MAX:
            known = [v for v in (getattr(w, name) for w in windows) if v is not None]
            values[name] = max(known) if getattr(latest, name) is not None else None
        else:
            values[name] = getattr(latest, name)
    return type(latest)(**values)


def _batch_weighted(windows: Sequence[WindowStats], name: str) -> Optional[float]:
    known = [(getattr(w, name), w.batches) for w in windows if getattr(w, name) is not None and w.batches > 0]
    total = sum(n for _, n in known)
    return sum(v * n for v, n in known) / total if total else None


def reduce_ranks(per_rank: Sequence[S]) -> S:
    """The job's window from every rank's, each field as it declares (:class:`Reduce`)."""
    if len(per_rank) == 1:
        return per_rank[0]
    # the most starved rank; ties go to the lowest rank
    worst = max(range(len(per_rank)), key=lambda i: (per_rank[i].starvation_ratio, -i))
    # the rank whose workers take the longest per batch (where none can say, the most starved)
    cost = lambda i: per_rank[i].worker_batch_s if per_rank[i].worker_batch_s is not None else -1.0  # noqa: E731
    costliest = max(range(len(per_rank)), key=lambda i: (cost(i), per_rank[i].starvation_ratio, -i))
    values = {}
    for f in dataclasses.fields(per_rank[0]):
        reduce, name = f.metadata.get("reduce", Reduce.WORST), f.name
        column = [getattr(s, name) for s in per_rank]
        if reduce is Reduce.SUM:
            values[name] = sum(column)
        elif reduce in (Reduce.MIN, Reduce.MAX):
            values[name] = None if any(v is None for v in column) else (min if reduce is Reduce.MIN else max)(column)
        else:
            values[name] = column[costliest if reduce is Reduce.COSTLIEST else worst]
    return type(per_rank[0])(**values)


def _kind(cls: type, name: str) -> type:
    """The base type of a field (``Optional[X]`` -> ``X``)."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def to_row(stats: WindowStats) -> list[float]:
    """The fields as floats in declaration order (``nan`` for unknown, an enum's position for an enum)."""
    row = []
    for f in dataclasses.fields(stats):
        value = getattr(stats, f.name)
        if value is None:
            row.append(math.nan)
        elif isinstance(value, Enum):
            row.append(float(list(type(value)).index(value)))
        else:
            row.append(float(value))
    return row


def from_row(cls: type[S], row: Sequence[float]) -> S:
    """The inverse of :func:`to_row`."""
    values = {}
    for f, value in zip(dataclasses.fields(cls), row):
        kind = _kind(cls, f.name)
        if math.isnan(value):
            values[f.name] = None
        elif isinstance(kind, type) and issubclass(kind, Enum):
            values[f.name] = list(kind)[int(round(value))]
        elif kind is int:
            values[f.name] = int(round(value))
        else:
            values[f.name] = float(value)
    return cls(**values)


def to_dict(stats: WindowStats) -> dict[str, Any]:
    """Plain values by field name (enums as their strings): loadable without unpickling classes."""
    return {f.name: _plain(getattr(stats, f.name)) for f in dataclasses.fields(stats)}


def from_dict(cls: type[S], saved: dict[str, Any]) -> S:
    """The inverse of :func:`to_dict`, tolerant of older keys (``renamed_from``) and of unknown ones."""
    values = {}
    for f in dataclasses.fields(cls):
        for key in (f.name, *f.metadata.get("renamed_from", ())):
            if key in saved:
                values[f.name] = saved[key]
                break
    return cls(**values)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value
