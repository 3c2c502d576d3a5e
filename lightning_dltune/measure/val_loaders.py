"""Each validation loader of a run measured on its own, beside the pooled run that the decision judges.

Where ``val_dataloader()`` gives several loaders, the validation side still runs one config and is
judged on the run pooled over all of them (:class:`~lightning_dltune.measure.probe.WindowProbe`); this
module keeps each loader's own fetch wait, step time, stalls and samples, so that the one that starves
shows. Each tuned loader reports its fetches to a recorder of its own, which hands them on to the
pooled meter; the validation hooks add each step to the loader it came from (``dataloader_idx``), or,
in a ``CombinedLoader`` mode other than ``sequential`` (every step takes a batch of each loader), to
every loader with a batch in it.

The per-batch path is a few float adds into arrays preallocated at the run's start, one per loader:
no device sync, no tensor, no I/O, no growing container. The run's end packs the loaders' stats into
one tensor for one gather across ranks.
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any, Optional

import torch

from lightning_dltune.core.stats import WindowStats, from_dict, from_row, reduce_ranks, to_dict, to_row
from lightning_dltune.loaders.collection import flatten_loaders
from lightning_dltune.loaders.loader import TunedLoader
from lightning_dltune.measure.distributed import gather_rows
from lightning_dltune.measure.lightning_internals import fetches_per_step
from lightning_dltune.measure.meter import UNKNOWN_READY, WindowMeter
from lightning_dltune.measure.probe import batch_size_and_bytes


@dataclasses.dataclass(frozen=True)
class ValLoaderRun:
    """One validation loader's part of one validation run (kept only where validation has several loaders).

    Args:
        run: the run's place in ``tuner.val_history`` (its pooled record: config, verdict).
        step: the global step the run ended at, as its record's.
        epoch: the epoch it ran in.
        dataloader_idx: the loader's index, as Lightning's validation hooks get it (the order of the
            list, dict or ``CombinedLoader`` that ``val_dataloader()`` returned).
        stats: its batches, samples, fetch wait, step time, stalls, fetches, queue depth and start-up,
            across ranks as the pooled run's (the most starved rank's, samples summed). Under a
            ``CombinedLoader`` mode other than ``sequential`` the step is shared: each loader's
            starvation is its own wait against the steps its batches went into.
    """

    run: int
    step: int
    epoch: int
    dataloader_idx: int
    stats: WindowStats

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "stats": to_dict(self.stats)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> ValLoaderRun:
        return cls(**{**saved, "stats": from_dict(WindowStats, saved["stats"])})


class _LoaderRecorder:
    """One loader's fetches, tallied for it and handed on to the run's pooled meter."""

    __slots__ = ("_tally", "_index", "_meter")

    def __init__(self, tally: ValLoaderMeter, index: int, meter: WindowMeter) -> None:
        self._tally, self._index, self._meter = tally, index, meter

    def record_fetch(self, wait_s: float, ready: int = UNKNOWN_READY) -> None:
        tally, i = self._tally, self._index
        tally.fetch_wait_s[i] += wait_s
        tally.fetches[i] += 1
        if ready >= 0:
            tally.depth_sum[i] += ready
            tally.depth_known[i] += 1
            if ready == 0:
                tally.stalls[i] += 1
        self._meter.record_fetch(wait_s, ready)

    def record_startup(self, seconds: float) -> None:
        self._tally.startup_s[self._index] += seconds
        self._meter.record_startup(seconds)

    def record_drain(self) -> None:
        self._meter.record_drain()

    def record_drained(self) -> None:
        self._meter.record_drained()


def _zeros(kind: str, n: int) -> array:
    return array(kind, bytes(array(kind).itemsize * n))


class ValLoaderMeter:
    """This rank's tallies of one validation run, one per validation loader.

    :meth:`attach` at the run's start (after the pooled probe attached); :attr:`count` is 0 where the
    run has fewer than two loaders, and every other call is then a no-op.
    """

    def __init__(self) -> None:
        self.count = 0
        self._attach(0, True, None)

    def _attach(self, n: int, sequential: bool, meter: Optional[WindowMeter]) -> None:
        self.count, self.sequential, self._meter = n, sequential, meter
        self.fetch_wait_s, self.step_s, self.startup_s = _zeros("d", n), _zeros("d", n), _zeros("d", n)
        self.fetches, self.stalls, self.steps = _zeros("q", n), _zeros("q", n), _zeros("q", n)
        self.depth_sum, self.depth_known, self.batch_size = _zeros("q", n), _zeros("q", n), _zeros("q", n)
        self._step0 = self._fetched0 = 0.0

    def attach(self, trainer: Any, meter: WindowMeter) -> None:
        """A validation run starts; ``meter``: the pooled probe's, already attached to the run's loaders.

        Each tuned loader that reports to ``meter`` then reports through a recorder of its own. A step
        takes one loader's batch where Lightning combines them ``sequential``-ly (a list or dict of
        loaders), else one batch of each.
        """
        loaders = flatten_loaders(trainer.val_dataloaders)
        n = len(loaders) if len(loaders) > 1 else 0
        self._attach(n, fetches_per_step(trainer, n, validation=True) == 1, meter)
        for i, loader in enumerate(loaders if n else ()):
            if isinstance(loader, TunedLoader) and loader.fetch_recorder is meter:
                loader.fetch_recorder = _LoaderRecorder(self, i, meter)
            self.batch_size[i] = getattr(loader, "batch_size", None) or 1  # until its first batch says

    # -- per batch -------------------------------------------------------------------------------
    def batch_started(self, now: float) -> None:
        if self.count:
            self._step0 = now
            self._fetched0 = self._meter.fetch_wait_total_s  # type: ignore[union-attr]

    def batch_ended(self, batch: Any, dataloader_idx: int, now: float) -> None:
        """The step of ``batch`` (from loader ``dataloader_idx``, or of each loader where not sequential) ended."""
        if not self.count:
            return
        inside = self._meter.fetch_wait_total_s - self._fetched0  # type: ignore[union-attr]
        step = now - self._step0 - (inside if inside > 0.0 else 0.0)  # a step fetching its own batches waited
        if self.sequential:
            self._add_step(dataloader_idx, batch, step)
        elif isinstance(batch, (list, tuple, dict)):
            for i, part in enumerate(batch.values() if isinstance(batch, dict) else batch):
                if part is not None and i < self.count:  # max_size: a loader that ran out gives None
                    self._add_step(i, part, step)

    def _add_step(self, i: int, batch: Any, step_s: float) -> None:
        if 0 <= i < self.count:
            if self.steps[i] == 0 and batch is not None:
                self.batch_size[i] = batch_size_and_bytes(batch)[0]
            self.steps[i] += 1
            self.step_s[i] += step_s

    # -- run end ---------------------------------------------------------------------------------
    def local_stats(self) -> list[WindowStats]:
        """This rank's stats of each loader (before any cross-rank reduction)."""
        return [
            WindowStats(
                batches=self.steps[i],
                samples=self.steps[i] * self.batch_size[i],
                fetch_wait_total_s=self.fetch_wait_s[i],
                step_total_s=self.step_s[i],
                stalls=self.stalls[i],
                fetches=self.fetches[i],
                queue_depth=self.depth_sum[i] / self.depth_known[i] if self.depth_known[i] else None,
                startup_s=self.startup_s[i],
            )
            for i in range(self.count)
        ]

    def job_stats(self, strategy: Any, world_size: int, device: Any = "cpu") -> list[WindowStats]:
        """Each loader's stats across ranks, reduced as the pooled run's; one gather, on every rank at once."""
        local = self.local_stats()
        if world_size <= 1 or not local:
            return local
        rows = torch.tensor([to_row(s) for s in local], dtype=torch.float64, device=device)
        gathered = gather_rows(strategy, rows, world_size).detach().cpu().tolist()
        return [reduce_ranks([from_row(WindowStats, rank[i]) for rank in gathered]) for i in range(len(local))]

    def close(self) -> None:
        """The run ended (the pooled probe's close takes the recorders off the loaders)."""
        self._attach(0, True, None)
