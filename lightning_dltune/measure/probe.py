"""This rank's measurement of one window: fetch and step timers, worker cost, CPU share, NVML, batch facts.

The per-batch path (:meth:`WindowProbe.batch_started`, :meth:`WindowProbe.batch_ended`) is two clock
reads, a few float adds and stores into preallocated buffers and one comparison for the NVML poll:
no device sync, no tensor, no I/O, no growing container.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.stats import WindowStats
from lightning_dltune.loaders.collection import flatten_loaders
from lightning_dltune.loaders.loader import (
    TunedLoader,
    batch_tensors,
    counters_of,
    histogram_quantile,
    histogram_top,
    tensor_bytes,
)
from lightning_dltune.loaders.switch import loader_config_of
from lightning_dltune.measure.host_cpu import CpuReading, HostCpu
from lightning_dltune.measure.lightning_internals import fetches_per_step, time_fit_loop_fetches
from lightning_dltune.measure.meter import WindowMeter
from lightning_dltune.nvml.sampler import UtilizationSampler


def batch_size_and_bytes(batch: Any) -> tuple[int, int]:
    """Samples and tensor bytes of one batch: the first tensor's leading dimension, all tensors' bytes."""
    tensors = batch_tensors(batch)
    size = next((int(t.shape[0]) for t in tensors if t.ndim > 0), 1)
    return size, tensor_bytes(tensors)


def step_size_and_bytes(batch: Any, loaders_per_step: int) -> tuple[int, int]:
    """Samples and bytes of one step's batch; with several train loaders, of each loader's part together."""
    parts = [batch]
    if loaders_per_step > 1 and isinstance(batch, dict):
        parts = list(batch.values())
    elif loaders_per_step > 1 and isinstance(batch, (list, tuple)):
        parts = list(batch)
    sizes = [batch_size_and_bytes(part) for part in parts]
    return sum(n for n, _ in sizes), sum(b for _, b in sizes)


class WindowProbe:
    """Measures one window of training batches on this rank and hands it over as :class:`WindowStats`.

    Args:
        stall_threshold_s: for loaders that cannot report their queue, a fetch waiting longer than
            this is a stall.
        validation: measure the validation loaders (one window per validation run) instead of the
            training ones; only loaders that report their fetches themselves are measured there.
    """

    def __init__(self, stall_threshold_s: float, validation: bool = False) -> None:
        self.validation = validation
        self.meter = WindowMeter(stall_threshold_s=stall_threshold_s)
        self.meter.on_drained = self._mark  # a switch mid-epoch: the new workers' production from then on
        self.sampler: Optional[UtilizationSampler] = None
        self.config: Optional[LoaderConfig] = None  # the config the window runs
        self.tuned_loaders = False  # every train loader reports its own fetches
        self.switchable = False  # ... and can switch workers in the middle of an epoch (map-style data)
        self.fetcher_missing = False  # a plain loader's fetches could not be timed
        self.batch_unseen = False  # the step hooks got no batch (``training_step(dataloader_iter)``)
        self._bytes_hint: Optional[Callable[[], Optional[int]]] = None
        self._loaders: list = []
        self._per_step = self._parts = 1
        self._marks: list[tuple[Any, tuple[float, float, float], list[float]]] = []
        self._wall0 = self._cpu0 = self._step0 = self._fetched0 = 0.0
        self._first = True
        self._util_paused = False
        self._batch_size = 0
        self._batch_bytes: Optional[int] = None
        self._host = None if validation else HostCpu()  # what else runs on the cores: read at a window's ends
        self._host0: Optional[CpuReading] = None

    # -- the fit ---------------------------------------------------------------------------------
    def open_sampler(self, device: Optional[torch.device], poll_interval_s: float) -> UtilizationSampler:
        """NVML for ``device`` (``None``: never touch NVML, estimate only)."""
        self.close()
        self.sampler = UtilizationSampler(device, poll_interval_s=poll_interval_s)
        return self.sampler

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        self._util_paused = False
        for loader in self._loaders:
            if isinstance(loader, TunedLoader):
                loader.fetch_recorder = None
        self._loaders = []

    # -- windows ---------------------------------------------------------------------------------
    def attach(self, trainer: Any, datamodule: Any = None) -> None:
        """At an epoch start: the train loaders report to this probe and a window of their config starts.

        The config is the datamodule's where there is one (it knows what it rebuilt), else the first
        train loader's. The datamodule also estimates a batch's bytes where no batch reaches the hooks.
        """
        self._loaders = flatten_loaders(trainer.val_dataloaders if self.validation else trainer.train_dataloader)
        plain = [dl for dl in self._loaders if isinstance(dl, DataLoader)]
        owner = "val_config" if self.validation else "loader_config"
        config: Optional[LoaderConfig] = getattr(datamodule, owner, None) if datamodule is not None else None
        if config is None:
            config = loader_config_of(plain[0]) if plain else (LoaderConfig() if self._loaders else None)
        tuned = [dl for dl in self._loaders if isinstance(dl, TunedLoader)]
        self.tuned_loaders = bool(self._loaders) and len(tuned) == len(self._loaders)
        self.switchable = self.tuned_loaders and not any(isinstance(dl.dataset, IterableDataset) for dl in tuned)
        for loader in tuned:
            loader.fetch_recorder = self.meter
        self.meter.drain_over()  # the loaders start their epoch: nothing is left of a switch before it
        # a step takes a batch of each train loader (unless Lightning combines them sequentially); with
        # our loaders each reports its own fetch, plain ones are timed together around the combined fetch
        # validation runs a list of loaders one after another (one fetch per step), a CombinedLoader in its mode
        self._parts = fetches_per_step(trainer, len(self._loaders), self.validation)
        self._per_step = self._parts if self.tuned_loaders else 1
        self._bytes_hint = datamodule.estimate_batch_bytes if datamodule is not None else None
        self._first = True
        self.start(config)

    def start(self, config: Optional[LoaderConfig]) -> None:
        """A new window of ``config`` from now on (its first steps may be warm-up where the loaders just
        started: at an epoch start, or after a switch to another config)."""
        fresh = (self._first or config != self.config) and not self.validation  # a run is judged whole
        self.meter.reset()
        self.meter.fresh = fresh
        self.config = config
        if self._host is not None:
            self._host0 = self._host.read()
        if self.sampler is not None:
            self.sampler.start_window()
            self.pause_util()  # loader start-up is not training: the next batch resumes
        self._mark()

    def _mark(self) -> None:
        """Production and the training process's CPU are counted from now on (a window opens, or a switch's
        old workers delivered all they held: what they made was the config before's)."""
        self._marks = [(c, c.totals(), c.histogram()) for dl in self._loaders if (c := counters_of(dl)) is not None]
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()

    # -- per batch -------------------------------------------------------------------------------
    def batch_started(self, trainer: Any, batch: Any, now: float) -> None:
        if self._first:
            self._first_batch(trainer, batch, now)
        if self._util_paused:
            self._util_paused = False
            self.sampler.resume()  # type: ignore[union-attr]
        self._step0 = now
        self._fetched0 = self.meter.fetch_wait_total_s

    def batch_ended(self, now: float) -> None:
        # a step that fetches its own batches (``dataloader_iter``) waited for them inside the step: that is fetch wait
        inside = self.meter.fetch_wait_total_s - self._fetched0
        self.meter.record_step(now - self._step0 - (inside if inside > 0.0 else 0.0))
        if self.sampler is not None:
            self.sampler.maybe_poll(now)

    def pause_util(self) -> None:
        """Not training until the next batch starts (validation, a checkpoint save, loader start-up)."""
        if self.sampler is not None:
            self.sampler.pause()
            self._util_paused = True

    def _first_batch(self, trainer: Any, batch: Any, now: float) -> None:
        self._first = False
        self.batch_unseen = batch is None
        if batch is None:  # the step fetches its own batches: sizes from the loaders, bytes from a sample
            self._batch_size = sum(getattr(dl, "batch_size", None) or 0 for dl in self._loaders) or 1
            if self._batch_bytes is None and self._bytes_hint is not None:
                self._batch_bytes = self._bytes_hint()
        else:
            self._batch_size, self._batch_bytes = step_size_and_bytes(batch, self._parts)
        if not self.tuned_loaders and not self.validation:  # the loaders cannot report themselves
            self.meter.record_startup(now - self._wall0)
            self.fetcher_missing = not time_fit_loop_fetches(trainer, self.meter)

    @property
    def samples_per_step(self) -> int:
        """Samples of one training step (every train loader's batch together); 0 before the first batch."""
        return self._batch_size

    # -- window end ------------------------------------------------------------------------------
    def local_stats(self, closing: bool = False) -> WindowStats:
        """This rank's stats of the window so far (before any cross-rank reduction); ``closing``: the window
        closes, and what else ran on the cores over it is read too (not at a look: a millisecond of ``/proc``)."""
        batches = wall = cpu = 0.0
        spread: list[float] = []
        for counters, (b0, w0, c0), hist0 in self._marks:
            b1, w1, c1 = counters.totals()
            batches, wall, cpu = batches + b1 - b0, wall + w1 - w0, cpu + c1 - c0
            now = [n1 - n0 for n1, n0 in zip(counters.histogram(), hist0)]
            spread = [a + b for a, b in zip(spread, now)] if spread else now
        worker_batch_s = wall / batches if batches > 0 and wall > 0 else None
        worker_batch_p95_s = histogram_quantile(spread, 0.95, worker_batch_s) if worker_batch_s is not None else None
        worker_cpu_fraction = min(1.0, cpu / wall) if batches > 0 and wall > 0 else None
        # the training process's own CPU share, less the batches it made itself (0 workers)
        elapsed = time.perf_counter() - self._wall0
        main_cpu = time.process_time() - self._cpu0
        if self.config is not None and self.config.num_workers == 0:
            main_cpu -= cpu
        stats = self.meter.window_stats(
            batch_size=self._batch_size,
            worker_batch_s=worker_batch_s,
            worker_batch_p95_s=worker_batch_p95_s,
            worker_batch_max_s=histogram_top(spread) if worker_batch_s is not None else None,
            worker_cpu_fraction=worker_cpu_fraction,
            batch_bytes=self._batch_bytes,
            gpu_util=self.sampler.window_mean() if self.sampler is not None else None,
            main_cpu_fraction=max(0.0, main_cpu) / elapsed if elapsed > 0 else None,
            fetches_per_step=self._per_step,
            workers=self.config.num_workers if self.config is not None else None,
        )
        share = self._host.between(self._host0, self._host.read()) if closing and self._host is not None else None
        if share is None:
            return stats
        return dataclasses.replace(stats, other_cpus=share.others, cpu_busy=share.busy)
