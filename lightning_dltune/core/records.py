"""The plain records the tuner's parts share: budgets, knobs, verdicts, reasons, decisions, windows."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Union

from lightning_dltune.core import validation
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.model import BURST_STALL_FRACTION
from lightning_dltune.core.stats import WindowStats, _StrEnum, from_dict, to_dict


class Verdict(_StrEnum):
    """The tuner's one-line diagnosis of a window. A ``str`` enum: logged and printed as these strings."""

    DATA_BOUND_IO = "data-bound (I/O)"
    DATA_BOUND_CPU = "data-bound (CPU saturated)"
    COMPUTE_BOUND = "compute-bound"
    IN_BAND = "in band"
    MEMORY_CAPPED = "memory-capped"


class ReasonKind(_StrEnum):
    """Which rule decided, and so which numbers a :class:`Reason` carries."""

    NOTHING_MEASURED = "nothing-measured"
    FEW_BATCHES = "few-batches"  # too few batches measured with this config (short validation runs): hold
    OVER_MEMORY = "over-memory"  # current config over the memory or /dev/shm budget
    OVER_WORKERS = "over-workers"  # current config over the worker budget
    OVER_PREFETCH = "over-prefetch"  # current config over the deepest prefetch allowed
    REBUILD_CAP = "rebuild-cap"
    SHIFT_SUSPECTED = "shift-suspected"  # one window unlike the config's earlier ones: measure again before acting
    UNDO_SLOWER = "undo-slower"  # the last increase lowered throughput (on two windows)
    CONFIRM_SLOWER = "confirm-slower"  # the last increase looks slower on one window: measure again
    CONFIRM_STARVED = "confirm-starved"  # the last give-back looks starved on one window: measure again
    CONFIRM_NO_GAIN = "confirm-no-gain"  # the last increase shows no gain on one window: measure again
    UNDO_GIVE_BACK = "undo-give-back"  # the last give-back starved the loop
    COMPUTE_BOUND = "compute-bound"  # below the band, not waiting on data
    STOPPED_HELPING = "stopped-helping"  # the last increase gained less than min_gain
    DEEPER_PREFETCH = "deeper-prefetch"  # bursty stalls
    AT_WORKER_CEILING = "at-worker-ceiling"  # more workers stopped helping before
    OVERSUBSCRIBED = "oversubscribed"  # past CPU saturation: fewer workers
    CPUS_SATURATED = "cpus-saturated"
    AT_WORKER_BUDGET = "at-worker-budget"
    NO_MODELLED_GAIN = "no-modelled-gain"  # contention eats what more workers would add
    MEMORY_CAPPED_HOLD = "memory-capped-hold"
    HANDED_OVER = "handed-over"  # starved on each batch's hand-over from a worker: 0 workers make it for less
    MORE_WORKERS_UNDONE = "more-workers-undone"  # more workers were tried and undone
    MEMORY_CAPPED_WORKERS = "memory-capped-workers"  # fewer workers than wanted, for memory
    MORE_WORKERS = "more-workers"  # Little's law sizing
    GIVE_BACK_WORKERS = "give-back-workers"
    GIVE_BACK_PREFETCH = "give-back-prefetch"
    SLACK_UNCONFIRMED = "slack-unconfirmed"  # slack seen once: wait for another window
    LEANEST = "leanest"  # slack, but nothing leaner keeps the band
    IN_BAND = "in-band"
    NOTE = "note"  # free text (checkpoints of releases that stored prose)


@dataclass(frozen=True)
class Reason:
    """Why the policy decided what it did: a kind and the numbers behind it.

    Configs appear as ``(workers, prefetch)`` pairs and byte counts as numbers, so a reason is plain
    data (saved in checkpoints as is). :func:`lightning_dltune.report.words.reason_text` renders it
    (the one place reasons are worded: ``core`` knows no words).
    """

    kind: ReasonKind
    values: Mapping[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "values": dict(self.values)}

    @classmethod
    def from_saved(cls, saved: Union[str, Mapping[str, Any], None]) -> Reason:
        """From :meth:`to_dict`'s output, or from the prose older checkpoints stored."""
        if isinstance(saved, Mapping) and saved.get("kind") in {k.value for k in ReasonKind}:
            return cls(ReasonKind(saved["kind"]), dict(saved.get("values", {})))
        return cls(ReasonKind.NOTE, {"text": "" if saved is None else str(saved)})


def pair(config: LoaderConfig) -> tuple[int, int]:
    """``(workers, prefetch)`` of a config, as reasons carry it."""
    return config.num_workers, config.prefetch_factor


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
        run_batches: the most batches one run of the loaders takes (the validation side's: a validation
            run), where that is fewer than ``max_workers`` would be and so lowers it (:meth:`for_runs_of`);
            else ``None``.
        batches_left: the fit's training batches after the window judged, the time a rebuild has to pay for
            itself in (``max_epochs`` and ``max_steps`` bound it); ``None``: unknown (a fit bounded by
            ``max_time`` only, or the validation side).
    """

    max_workers: int
    memory_bytes: Optional[float] = None
    shm_bytes: Optional[float] = None
    cpus: float = 1.0
    run_batches: Optional[int] = None
    batches_left: Optional[int] = None

    def for_runs_of(self, batches: Optional[int]) -> Budget:
        """This budget for loaders whose runs take at most ``batches`` batches (``None``: unknown, unchanged).

        A DataLoader hands a run's batch indices to its workers in turn from the first worker on, every
        epoch (persistent workers included): a run of ``batches`` batches gives work to at most that many
        workers, and any more start, hold memory and sit idle (a validation set of 2 batches under
        7 workers: 5 of them never make a batch). So ``max_workers`` is at most ``batches``.
        """
        if batches is None or batches >= self.max_workers:
            return self
        return replace(self, max_workers=max(0, batches), run_batches=max(0, batches))


@dataclass(frozen=True)
class PolicySettings:
    """Knobs of the policy (``band``, ``max_rebuilds``, ``min_gain``, ``max_prefetch_factor``: callback arguments too).

    Args:
        band: utilization range ``(low, high)`` to hold, ``0 < low < high <= 1``.
        max_rebuilds: most config changes in one fit.
        min_gain: relative throughput gain a change must bring to count as help, in ``[0, 1)``.
        max_prefetch_factor: deepest prefetch the policy picks.
        min_starvation: below this starvation ratio a window is not data-bound (workers cannot help).
        headroom: how much more than the step consumes the picked workers should produce (Little's law
            with a margin, so that one rebuild brings utilization above the band's low edge).
        hysteresis: how far outside the band utilization must be before the policy reacts.
        burst_stall_fraction: below this fraction of stalled fetches, starvation counts as bursty
            (deeper prefetch helps) rather than steady (more workers help).

    Raises:
        ValueError: for a band other than ``0 < low < high <= 1``, or a knob out of range.
    """

    band: tuple[float, float] = (0.85, 0.95)
    max_rebuilds: int = 10
    min_gain: float = 0.05
    max_prefetch_factor: int = 8
    min_starvation: float = 0.05
    headroom: float = 1.2
    hysteresis: float = 0.02
    burst_stall_fraction: float = BURST_STALL_FRACTION

    def __post_init__(self) -> None:
        object.__setattr__(self, "band", validation.band("band", self.band))
        validation.count("max_rebuilds", self.max_rebuilds, 0)
        validation.count("max_prefetch_factor", self.max_prefetch_factor, 1)
        validation.number("headroom", self.headroom, 1.0)
        validation.number("min_gain", self.min_gain, 0.0, 1.0, high_open=True)
        for name in ("min_starvation", "hysteresis", "burst_stall_fraction"):
            validation.fraction(name, getattr(self, name))


@dataclass(frozen=True)
class WindowRecord:
    """One window of the tuner's history: the config it ran, what it measured, what was decided.

    Args:
        epoch: the epoch the window belongs to.
        config: the loader config it ran with.
        stats: what it measured (reduced across ranks).
        verdict: the policy's diagnosis.
        reason: why the policy decided (a :class:`Reason`; prose from older checkpoints becomes a note).
        next_config: the config decided for what follows.
        end_batch: the window closed mid-epoch, after this many batches of its epoch (the training
            loaders switched right there); ``None``: it closed at the epoch end.
        step: the global step at which the window closed (its x in the logs).
        judged_util: the utilization the verdict judged: this window pooled with the current config's
            earlier windows (the raw value is ``stats.utilization``).
    """

    epoch: int
    config: LoaderConfig
    stats: WindowStats
    verdict: Union[Verdict, str]
    reason: Union[Reason, str]
    next_config: LoaderConfig
    end_batch: Optional[int] = None
    step: Optional[int] = None
    judged_util: Optional[float] = None

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

    def to_dict(self) -> dict[str, Any]:
        """Plain values for a checkpoint; :meth:`from_dict` reads them back (and older checkpoints' forms)."""
        reason = self.reason if isinstance(self.reason, Reason) else Reason.from_saved(self.reason)
        return {
            "epoch": self.epoch,
            "config": self.config.as_dict(),
            "stats": to_dict(self.stats),
            "verdict": str(self.verdict),
            "reason": reason.to_dict(),
            "next_config": self.next_config.as_dict(),
            "end_batch": self.end_batch,
            "step": self.step,
            "judged_util": self.judged_util,
        }

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> WindowRecord:
        verdict = saved.get("verdict", "")
        return cls(
            epoch=saved.get("epoch", 0),
            config=LoaderConfig(**saved["config"]),
            stats=from_dict(WindowStats, saved.get("stats", {})),
            verdict=Verdict(verdict) if verdict in {v.value for v in Verdict} else verdict,
            reason=Reason.from_saved(saved.get("reason")),
            next_config=LoaderConfig(**saved.get("next_config", saved["config"])),
            end_batch=saved.get("end_batch", saved.get("first_batches")),  # the name up to 0.2
            step=saved.get("step"),
            judged_util=saved.get("judged_util"),
        )


EpochRecord = WindowRecord  # the name of releases up to 0.1, when every window was an epoch


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one window: the next config, the verdict, why, the best config seen, the
    utilization the verdict judged (the current config's recent windows pooled), and, where the next window
    only confirms what this one suspected (new conditions), the batches that are enough for it (``None``: a
    regular window; see :meth:`~lightning_dltune.core.windows.WindowSchedule.length_after`)."""

    config: LoaderConfig
    verdict: Verdict
    reason: Reason
    best: Optional[LoaderConfig] = None
    judged_util: Optional[float] = None
    confirm_batches: Optional[int] = None
