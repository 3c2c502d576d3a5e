"""DataLoaderTuner: measure data starvation inside the fit, log it, and retune the loaders between epochs."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Iterator, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dltune import validation
from lightning_dltune.config import LoaderConfig
from lightning_dltune.console import say
from lightning_dltune.datamodule import TunableDataModule, _flatten
from lightning_dltune.distributed import reduce_across_ranks
from lightning_dltune.gpu import MODE_SAMPLES, UtilizationSampler
from lightning_dltune.loader import TunedDataLoader, counters_of, loader_config_of
from lightning_dltune.measurement import WindowMeter
from lightning_dltune.policy import decide
from lightning_dltune.records import Budget, PolicySettings, Reason, Verdict, WindowRecord
from lightning_dltune.report import epoch_line, recommend, summary_table, write_recommendation
from lightning_dltune.resources import rank_budget
from lightning_dltune.stats import UtilSource, WindowStats, from_dict, to_dict
from lightning_dltune.tensorboard import custom_scalars_layout, tag
from lightning_dltune.torch_internals import describe_failure

UTIL_SOURCE_CHOICES = ("auto", UtilSource.NVML.value, UtilSource.ESTIMATE.value)


class _TimedFetches(Iterator):
    """Times ``next()`` on the fit loop's batch iterator, for loaders that cannot report themselves."""

    def __init__(self, iterator: Iterator, meter: WindowMeter) -> None:
        self._it = iterator
        self._meter = meter

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        batch = next(self._it)
        self._meter.record_fetch(time.perf_counter() - t0)
        return batch


def _batch_size_and_bytes(batch: Any) -> tuple[int, int]:
    """Size and tensor bytes of one batch (read once per epoch, never per batch)."""
    from lightning_utilities.core.apply_func import apply_to_collection

    tensors: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, tensors.append)
    size = next((int(t.shape[0]) for t in tensors if t.ndim > 0), 1)
    return size, sum(t.nelement() * t.element_size() for t in tensors)


class DataLoaderTuner(Callback):
    r"""Measure how long training waits for data and keep the accelerator fed by retuning the loaders.

    Every training batch is timed with a few clock reads: the **fetch wait** (the loop blocked in
    ``next()`` on the train loader; never validation, checkpointing or logging) and the **step time**
    (``on_train_batch_start`` to ``on_train_batch_end``). At each epoch end (after validation) the
    callback reduces them across ranks, logs them, and asks the band policy for the next loader
    config; with a :class:`~lightning_dltune.TunableDataModule` the train and val loaders are rebuilt
    with it at the next epoch start. The first epoch also decides once after
    ``first_decision_after`` batches and switches the training loaders right away.

    Logged per epoch under ``dltune/`` (TensorBoard gets a ready ``dltune`` custom-scalars section;
    any other Lightning logger gets the same scalars):

    - ``starvation_ratio``: Σ fetch wait / Σ (fetch wait + step time), of the most starved rank (its
      waits and step times are the job's: the others wait for it at the gradient all-reduce).
    - ``gpu_util``: NVML utilization of this rank's device over the training part of the epoch, min
      over ranks; where NVML cannot serve it, the estimate ``1 - starvation_ratio``.
      ``util_from_nvml`` is 1 or 0 accordingly; where it is 1, ``util_from_samples`` is 1 when the
      driver's sample buffer served the window and 0 when polled utilization rates did (a device
      whose driver keeps no samples). Validation, checkpoint saving and loader start-up are not
      training: NVML time from a pause until the next training batch starts is left out.
      ``band_low`` / ``band_high`` draw the band.
    - ``fetch_wait_ms``, ``fetch_wait_p50_ms``, ``fetch_wait_p95_ms``, ``step_ms``, ``step_p50_ms``,
      ``step_p95_ms``: per-batch mean and percentiles.
    - ``stalls``, ``stall_fraction``: fetches that found no ready batch. Exact for loaders built by
      :class:`~lightning_dltune.TunableDataModule`; for other loaders a fetch that waited more than
      ``stall_threshold_ms``.
    - ``queue_depth``: mean ready batches at request time (tunable loaders only).
    - ``samples_per_s``, ``startup_ms`` (loader start-up and pipeline fill, never counted as fetch
      wait), ``worker_batch_ms`` (a worker's time to make one batch, tunable loaders only).
    - ``num_workers``, ``prefetch_factor``, ``rebuilds``; and, in TensorBoard, the verdict and reason
      as text (``dltune/decision``).
    - With ``log_every_n_steps``: ``dltune/step/starvation_ratio``, ``dltune/step/fetch_wait_ms``,
      ``dltune/step/step_ms``, ``dltune/step/stalls`` over the last ``n`` steps of rank zero.

    The console gets one line per epoch and, at the end of fit, a table and the recommended config,
    also written to ``dltune_recommendation.yaml`` in the log dir as a LightningCLI config fragment.

    Args:
        tune: rebuild the loaders of a :class:`~lightning_dltune.TunableDataModule`. ``False``:
            measure, log and recommend only.
        band: GPU utilization range ``(low, high)`` to hold, ``0 < low < high <= 1``.
        util_source: ``"auto"`` (NVML where it serves this device, else the estimate), ``"nvml"``
            (warn once if NVML cannot serve, then estimate) or ``"estimate"`` (never touch NVML).
        stall_threshold_ms: for loaders that cannot report their queue, a fetch waiting longer than
            this is a stall.
        log_every_n_steps: also log step-granularity metrics every ``n`` optimizer steps; ``0``: off.
        max_workers: most worker processes per rank; ``None``: 4 per usable CPU (affinity and
            cgroup quota, shared among the node's ranks) minus one, room for I/O-bound workers. The
            CPU rule is the policy's: CPU-bound workers stop where their measured CPU demand fills
            the CPUs the training process leaves.
        memory_fraction: share of available RAM (and cgroup headroom) prefetched batches may hold.
        shm_fraction: share of free ``/dev/shm`` prefetched batches may hold.
        max_rebuilds: most config changes in one fit.
        min_gain: relative throughput gain that makes a change worth keeping.
        max_prefetch_factor: deepest prefetch the tuner picks.
        nvml_poll_interval_s: seconds between NVML reads during training.
        first_decision_after: in the first epoch of a fit, decide once after this many batches and
            move the training loaders to the new config right away, mid-epoch (no batch is lost or
            repeated); ``0``: decide at epoch ends only. Skipped for epochs shorter than twice this.
        verbose: print the per-epoch line and the final table.
        recommendation_file: write ``dltune_recommendation.yaml`` in the logger's log dir at the end of
            fit (not without a logger nor under ``fast_dev_run``, where Lightning suppresses logging).

    Raises:
        ValueError: for a band other than two numbers with ``0 < low < high <= 1``, an unknown
            ``util_source``, a negative threshold, interval or count, fractions outside ``(0, 1]``,
            ``min_gain`` outside ``[0, 1)``. A wrong type (a string for a bool, a float for a count)
            raises :class:`~lightning_dltune.validation.ArgumentTypeError`, a ``TypeError`` that is
            also a ``ValueError``. Every message names the argument, the value and what is allowed.

    Example::

        from lightning import Trainer
        from lightning.pytorch.loggers import TensorBoardLogger
        from lightning_dltune import DataLoaderTuner

        trainer = Trainer(callbacks=[DataLoaderTuner(band=(0.85, 0.95))], logger=TensorBoardLogger("logs"))
        trainer.fit(model, datamodule=datamodule)
        print(trainer.callbacks[0].history[-1])
    """

    def __init__(
        self,
        tune: bool = True,
        band: tuple[float, float] = (0.85, 0.95),
        util_source: str = "auto",
        stall_threshold_ms: float = 1.0,
        log_every_n_steps: int = 0,
        max_workers: Optional[int] = None,
        memory_fraction: float = 0.5,
        shm_fraction: float = 0.5,
        max_rebuilds: int = 10,
        min_gain: float = 0.05,
        max_prefetch_factor: int = 8,
        nvml_poll_interval_s: float = 5.0,
        first_decision_after: int = 10,
        verbose: bool = True,
        recommendation_file: bool = True,
    ) -> None:
        super().__init__()
        band = validation.band("band", band)
        validation.flag("tune", tune)
        validation.choice("util_source", util_source, UTIL_SOURCE_CHOICES)
        validation.number("stall_threshold_ms", stall_threshold_ms, 0.0)
        validation.number("nvml_poll_interval_s", nvml_poll_interval_s, 0.0)
        validation.count("log_every_n_steps", log_every_n_steps, 0)
        validation.count("first_decision_after", first_decision_after, 0)
        validation.count("max_workers", max_workers, 0, optional=True)
        validation.fraction("memory_fraction", memory_fraction, zero=False)
        validation.fraction("shm_fraction", shm_fraction, zero=False)
        validation.flag("verbose", verbose)
        validation.flag("recommendation_file", recommendation_file)
        # max_rebuilds, min_gain and max_prefetch_factor are checked by PolicySettings, below

        self.tune = tune
        self.band = band
        self.util_source = util_source
        self.log_every_n_steps = log_every_n_steps
        self.max_workers = max_workers
        self.memory_fraction = memory_fraction
        self.shm_fraction = shm_fraction
        self.nvml_poll_interval_s = nvml_poll_interval_s
        self.first_decision_after = first_decision_after
        self.verbose = verbose
        self.recommendation_file = recommendation_file
        self.settings = PolicySettings(
            band=self.band, max_rebuilds=max_rebuilds, min_gain=min_gain, max_prefetch_factor=max_prefetch_factor
        )

        self.history: list[WindowRecord] = []
        """One :class:`~lightning_dltune.records.WindowRecord` per window: config, stats, verdict, reason."""
        self.rebuilds = 0
        self.recommended_config: Optional[LoaderConfig] = None
        self.recommendation_path: Optional[str] = None

        self._meter = WindowMeter(stall_threshold_s=stall_threshold_ms / 1000.0)
        self._sampler: Optional[UtilizationSampler] = None
        self._datamodule: Optional[TunableDataModule] = None
        self._config: Optional[LoaderConfig] = None  # config of the epoch being measured
        self._restored_config: Optional[LoaderConfig] = None
        self._worker_cap: Optional[int] = None  # lowered when a rebuild failed
        self._tuned_loaders = False
        self._epoch_started = 0.0
        self._epoch_cpu_started = 0.0
        self._decide_at_batch = -1  # batch index of the first epoch's early decision (-1: none)
        self._step_started = 0.0
        self._first_batch = True
        self._batch_size = 0
        self._batch_bytes: Optional[int] = None
        self._counter_marks: list[tuple[Any, tuple[float, float, float]]] = []
        self._util_paused = False  # NVML time is not training until the next train batch starts
        self._last_step_logged = -1
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ set-up and tear-down
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        datamodule = trainer.datamodule
        self._datamodule = datamodule if isinstance(datamodule, TunableDataModule) else None
        if self.tune and self._datamodule is None:
            self._say_once(
                "no-mixin",
                "DataLoaderTuner: the datamodule is not a TunableDataModule, so its loaders cannot be rebuilt;"
                " measuring, logging and recommending only.",
            )
        device = trainer.strategy.root_device
        self._sampler = UtilizationSampler(
            None if self.util_source == UtilSource.ESTIMATE else device, poll_interval_s=self.nvml_poll_interval_s
        )
        self._util_paused = False
        if self.util_source == UtilSource.NVML and not self._sampler.available:
            rank_zero_warn(
                f"DataLoaderTuner(util_source='nvml'): NVML cannot serve {device}"
                f" ({self._sampler.unavailable_reason}); using the estimate 1 - starvation_ratio."
            )
        elif self.util_source == "auto" and not self._sampler.available and device.type == "cuda":
            self._say_once("estimate", f"DataLoaderTuner: GPU utilization is estimated ({self._sampler.unavailable_reason}).")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._datamodule is not None and self.tune:
            self._datamodule.enable_rollback(self._on_rebuild_failure)
            if self._restored_config is not None:
                self._datamodule.set_loader_config(self._restored_config)
            held = self._datamodule.held_workers_reason()
            if held is not None:
                self._say_once("held-workers", f"[dltune] {held}")
            self._clamp_to_budget(trainer, pl_module)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_custom_scalars(custom_scalars_layout())

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self._util_paused = False
        for loader in _flatten(trainer.train_dataloader):
            if isinstance(loader, TunedDataLoader):
                loader.fetch_recorder = None

    # ------------------------------------------------------------------ per-epoch measurement
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._datamodule is not None and self.tune:
            self._datamodule.rebuild_loaders(on_failure=self._on_rebuild_failure)
        train_loaders = _flatten(trainer.train_dataloader)
        self._tuned_loaders = bool(train_loaders) and all(isinstance(dl, TunedDataLoader) for dl in train_loaders)
        for loader in train_loaders:
            if isinstance(loader, TunedDataLoader):
                loader.fetch_recorder = self._meter
        self._start_window(trainer, config=self._current_config(train_loaders))
        self._first_batch = True
        self._batch_bytes = None
        self._decide_at_batch = self._early_decision_batch(trainer)

    def _start_window(self, trainer: pl.Trainer, config: Optional[LoaderConfig]) -> None:
        self._meter.reset()
        self._config = config
        self._counter_marks = [
            (counters, counters.totals())
            for loader in _flatten(trainer.train_dataloader)
            if isinstance(loader, TunedDataLoader) and (counters := counters_of(loader)) is not None
        ]
        if self._sampler is not None:
            self._sampler.start_window()
            self._pause_util()  # loader start-up is not training: the first batch resumes
        self._epoch_cpu_started = time.process_time()
        self._epoch_started = time.perf_counter()

    def _early_decision_batch(self, trainer: pl.Trainer) -> int:
        """The batch index after which the first epoch decides, or -1."""
        after = self.first_decision_after
        batches = trainer.num_training_batches
        if (
            not after
            or not self.tune
            or self._datamodule is None
            or not self._tuned_loaders
            or self.history
            or not math.isfinite(batches)
            or batches < 2 * after
        ):
            return -1
        return after - 1

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._first_batch:
            self._on_first_batch(trainer, batch, now)
        if self._util_paused:
            self._resume_util()
        self._step_started = now

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._meter.record_step(now - self._step_started)
        if self._sampler is not None:
            self._sampler.maybe_poll(now)
        if self.log_every_n_steps and trainer.global_step % self.log_every_n_steps == 0:
            self._log_step_metrics(trainer)
        if batch_idx == self._decide_at_batch:
            self._close_window(trainer, pl_module, first_batches=batch_idx + 1)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # resumed by the next training batch, so a checkpoint saved at validation end stays out too
        self._pause_util()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # the file is written after this hook: pausing here leaves all of the save out of the window
        self._pause_util()

    def _pause_util(self) -> None:
        if self._sampler is not None:
            self._sampler.pause()
            self._util_paused = True

    def _resume_util(self) -> None:
        self._util_paused = False
        if self._sampler is not None:
            self._sampler.resume()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_window(trainer, pl_module)

    def _close_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, first_batches: Optional[int] = None) -> None:
        """Reduce the window across ranks, ask the policy, record, log and schedule the next config.

        At an epoch end the new config applies from the next epoch start; early in the first epoch
        (``first_batches``) the training loaders switch to it right away.
        """
        if self._config is None:
            return
        stats = reduce_across_ranks(trainer.strategy, self._local_stats(), trainer.world_size, pl_module.device)
        if stats.batches == 0 or stats.fetches == 0:
            return  # no evidence: a window whose only fetch was the loader's start-up gets no verdict
        budget = self._reduce_budget(trainer, pl_module)
        decision = decide(self._config, stats, budget, self.history, self.settings)
        decision = trainer.strategy.broadcast(decision, src=0)
        record = WindowRecord(
            epoch=trainer.current_epoch,
            config=self._config,
            stats=stats,
            verdict=decision.verdict,
            reason=decision.reason,
            next_config=decision.config,
            first_batches=first_batches,
        )
        self.history.append(record)
        tuning = self._datamodule is not None and self.tune
        if tuning:
            self._datamodule.mark_config_good()
            if record.changed:
                self.rebuilds += 1
                if first_batches is None:
                    self._datamodule.set_loader_config(decision.config)
                else:
                    self._datamodule.switch_train_loaders(decision.config, on_failure=self._on_rebuild_failure)
        if trainer.is_global_zero:
            self._log_epoch(trainer, record)
        if first_batches is not None:
            # the rest of the epoch is a window of its own, measured with the config it runs
            self._start_window(trainer, config=decision.config if tuning else self._config)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        best = recommend(self.history, self.settings.min_gain)
        if best is None:
            return
        self.recommended_config = best.config
        # Lightning suppresses logging under fast_dev_run, and without a logger there is no log dir:
        # the recommendation then lives in the table and `recommended_config` only
        writes = self.recommendation_file and bool(trainer.loggers) and not trainer.fast_dev_run
        directory = trainer.log_dir if writes else None  # a collective under DDP: every rank asks
        if not trainer.is_global_zero:
            return
        if self.verbose:
            say(trainer, summary_table(self.history, best))
        if writes and directory:
            note = f"measured {best.samples_per_s:,.0f} samples/s at epoch {best.epoch} ({best.verdict})"
            self.recommendation_path = write_recommendation(directory, best.config, note)
            if self.verbose:
                say(trainer, f"[dltune] recommendation written to {self.recommendation_path}")

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        current = self.history[-1].next_config if self.history else self._config
        return {
            "config": current.as_dict() if current is not None else None,
            "rebuilds": self.rebuilds,
            "history": [_record_to_dict(r) for r in self.history],
            "worker_cap": self._worker_cap,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        config = state_dict.get("config")
        self._restored_config = LoaderConfig(**config) if config else None
        self.rebuilds = state_dict.get("rebuilds", 0)
        self._worker_cap = state_dict.get("worker_cap")
        self.history = [_record_from_dict(d) for d in state_dict.get("history", [])]

    # ------------------------------------------------------------------ internals
    def _on_first_batch(self, trainer: pl.Trainer, batch: Any, now: float) -> None:
        self._first_batch = False
        size, nbytes = _batch_size_and_bytes(batch)
        self._batch_size, self._batch_bytes = size, nbytes
        if self._tuned_loaders:
            return  # the loaders report start-up and fetches themselves
        self._meter.record_startup(now - self._epoch_started)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        iterator = getattr(fetcher, "iterator", None)
        if iterator is not None and not isinstance(iterator, _TimedFetches):
            fetcher.iterator = _TimedFetches(iterator, self._meter)
        elif iterator is None:
            self._say_once("no-fetcher", "DataLoaderTuner: cannot time fetches with this Lightning version.")

    def _current_config(self, train_loaders: list) -> Optional[LoaderConfig]:
        if self._datamodule is not None:
            return self._datamodule.loader_config
        loaders = [dl for dl in train_loaders if isinstance(dl, torch.utils.data.DataLoader)]
        if loaders:
            return loader_config_of(loaders[0])
        return LoaderConfig() if train_loaders else None

    def _local_stats(self) -> WindowStats:
        worker_batch_s = worker_cpu_fraction = None
        batches = wall = cpu = 0.0
        for counters, (b0, w0, c0) in self._counter_marks:
            b1, w1, c1 = counters.totals()
            batches, wall, cpu = batches + b1 - b0, wall + w1 - w0, cpu + c1 - c0
        if batches > 0:
            worker_batch_s = wall / batches
            worker_cpu_fraction = min(1.0, cpu / wall) if wall > 0 else None
        # the training process's own CPU share, less the batches it made itself (0 workers)
        elapsed = time.perf_counter() - self._epoch_started
        main_cpu = time.process_time() - self._epoch_cpu_started
        if self._config is not None and self._config.num_workers == 0:
            main_cpu -= cpu
        main_cpu_fraction = max(0.0, main_cpu) / elapsed if elapsed > 0 else None
        gpu_util = self._sampler.window_mean() if self._sampler is not None else None
        stats = self._meter.window_stats(
            batch_size=self._batch_size,
            worker_batch_s=worker_batch_s,
            worker_cpu_fraction=worker_cpu_fraction,
            batch_bytes=self._batch_bytes,
            gpu_util=gpu_util,
        )
        return dataclasses.replace(stats, main_cpu_fraction=main_cpu_fraction)

    def _reduce_budget(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Budget:
        local = rank_budget(
            local_ranks=max(1, trainer.num_devices),
            max_workers=self.max_workers,
            memory_fraction=self.memory_fraction,
            shm_fraction=self.shm_fraction,
        )
        max_workers = local.max_workers if self._worker_cap is None else min(local.max_workers, self._worker_cap)
        held = self._datamodule.held_workers() if self._datamodule is not None else None
        if held is not None:  # a stream that does not shard by worker keeps its worker count
            max_workers = held
        if trainer.world_size <= 1:
            return Budget(max_workers, local.memory_bytes, local.shm_bytes, local.cpus)
        values = torch.tensor(
            [max_workers, _or_inf(local.memory_bytes), _or_inf(local.shm_bytes), local.cpus],
            dtype=torch.float64, device=pl_module.device,
        )
        w, mem, shm, cpus = trainer.strategy.reduce(values, reduce_op="min").tolist()
        return Budget(int(w), None if math.isinf(mem) else mem, None if math.isinf(shm) else shm, cpus)

    def _clamp_to_budget(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Never start a fit over the budgets: checked before any loader (train, val, sanity check) starts.

        Prefetched batches are projected from one sample read here (workers x prefetch x batch bytes
        against free ``/dev/shm`` and memory); prefetch gives way first, then workers.
        """
        assert self._datamodule is not None
        config = self._datamodule.loader_config
        budget = self._reduce_budget(trainer, pl_module)
        workers = min(config.num_workers, budget.max_workers)
        prefetch = min(config.prefetch_factor, self.settings.max_prefetch_factor)
        batch_bytes = self._datamodule.estimate_batch_bytes()
        limits = [b for b in (budget.shm_bytes, budget.memory_bytes) if b is not None]
        if workers and batch_bytes and limits:
            # persistent train and val workers hold their batches at once, plus the one each loop holds
            loaders = 2 if self._datamodule.val_dataset is not None and config.persistent_workers else 1
            per_loader = int(min(limits) // (batch_bytes * (2 if config.pin_memory else 1))) // loaders - 1
            if workers * prefetch > per_loader:
                prefetch = max(1, per_loader // workers) if per_loader >= workers else 1
                workers = max(0, min(workers, per_loader))
        clamped = config.replace(num_workers=workers, prefetch_factor=prefetch)
        if clamped != config:
            self._datamodule.set_loader_config(clamped)
            self._say_once(
                "clamped",
                f"[dltune] start: {config.short()} passes the budget (at most {budget.max_workers} workers,"
                f" prefetch {self.settings.max_prefetch_factor}, {_mb(min(limits)) if limits else 'unknown'} for"
                f" prefetched batches of {_mb(batch_bytes) if batch_bytes else 'unknown size'});"
                f" starting with {self._datamodule.loader_config.short()}",
            )

    def _on_rebuild_failure(self, failed: LoaderConfig, previous: LoaderConfig, exc: BaseException) -> None:
        """A loader switch rolled back: cap the workers of the budget (saved in checkpoints) and say why."""
        if failed.num_workers > previous.num_workers:
            # the next attempt may go at most halfway back up to the count that failed
            cap = max(previous.num_workers, (previous.num_workers + failed.num_workers) // 2)
            self._worker_cap = cap if self._worker_cap is None else min(cap, self._worker_cap)
        self._config = previous
        self._say_once(
            "rebuild-failed",
            f"DataLoaderTuner: the rebuilt loader failed to start ({describe_failure(exc)});"
            f" went back to {previous.short()} and the fit goes on.",
            warn=True,
            all_ranks=True,
        )

    def _log_epoch(self, trainer: pl.Trainer, record: WindowRecord) -> None:
        s = record.stats
        metrics = {
            "starvation_ratio": s.starvation_ratio,
            "gpu_util": s.utilization,
            "util_from_nvml": 1.0 if s.util_source == UtilSource.NVML else 0.0,
            "band_low": self.band[0],
            "band_high": self.band[1],
            "fetch_wait_ms": 1e3 * s.fetch_wait_mean_s,
            "fetch_wait_p50_ms": 1e3 * s.fetch_wait_p50_s,
            "fetch_wait_p95_ms": 1e3 * s.fetch_wait_p95_s,
            "step_ms": 1e3 * s.step_mean_s,
            "step_p50_ms": 1e3 * s.step_p50_s,
            "step_p95_ms": 1e3 * s.step_p95_s,
            "stalls": float(s.stalls),
            "stall_fraction": s.stall_fraction,
            "samples_per_s": s.samples_per_s,
            "startup_ms": 1e3 * s.startup_s,
            "num_workers": float(record.config.num_workers),
            "prefetch_factor": float(record.config.prefetch_factor),
            "rebuilds": float(self.rebuilds),
        }
        window_mode = self._sampler.window_mode if self._sampler is not None else None
        if s.util_source == UtilSource.NVML and window_mode is not None:
            metrics["util_from_samples"] = 1.0 if window_mode == MODE_SAMPLES else 0.0
        if s.queue_depth is not None:
            metrics["queue_depth"] = s.queue_depth
        if s.worker_batch_s is not None:
            metrics["worker_batch_ms"] = 1e3 * s.worker_batch_s
        metrics = {tag(k): v for k, v in metrics.items()}
        step = trainer.global_step
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("dltune/decision", _decision_markdown(record, self.tune), step)
        if self.verbose:
            say(trainer, epoch_line(record, tuning=self.tune and self._datamodule is not None))

    def _log_step_metrics(self, trainer: pl.Trainer) -> None:
        meter = self._meter
        step = trainer.global_step
        if step == self._last_step_logged or meter.interval_batches == 0:
            return
        self._last_step_logged = step
        if trainer.is_global_zero:
            busy = meter.interval_fetch_wait_s + meter.interval_step_s
            n = meter.interval_batches
            metrics = {
                tag("step/starvation_ratio"): meter.interval_fetch_wait_s / busy if busy > 0 else 0.0,
                tag("step/fetch_wait_ms"): 1e3 * meter.interval_fetch_wait_s / n,
                tag("step/step_ms"): 1e3 * meter.interval_step_s / n,
                tag("step/stalls"): float(meter.interval_stalls),
            }
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        meter.reset_interval()

    def _say_once(self, key: str, message: str, warn: bool = False, all_ranks: bool = False) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        if all_ranks and warn:
            import warnings

            warnings.warn(message, stacklevel=2)
        elif warn:
            rank_zero_warn(message)
        else:
            rank_zero_info(message)


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MB"


def _or_inf(value: Optional[float]) -> float:
    return math.inf if value is None else float(value)


def _decision_markdown(record: WindowRecord, tuning: bool) -> str:
    action = "keep" if not record.changed else ("rebuild with" if tuning else "would try") + f" {record.next_config.short()}"
    window = f"epoch {record.epoch}" + (f", first {record.first_batches} batches" if record.first_batches else "")
    return (
        f"**{window}**: {record.verdict}, {record.config.short()} → {action}  \n"
        f"{record.reason}"
    )


def _record_to_dict(record: WindowRecord) -> dict[str, Any]:
    reason = record.reason if isinstance(record.reason, Reason) else Reason.from_saved(record.reason)
    return {
        "epoch": record.epoch,
        "config": record.config.as_dict(),
        "stats": to_dict(record.stats),
        "verdict": str(record.verdict),
        "reason": reason.to_dict(),
        "next_config": record.next_config.as_dict(),
        "first_batches": record.first_batches,
    }


def _record_from_dict(d: dict[str, Any]) -> WindowRecord:
    verdict = d.get("verdict", "")
    return WindowRecord(
        epoch=d.get("epoch", 0),
        config=LoaderConfig(**d["config"]),
        stats=from_dict(WindowStats, d.get("stats", {})),
        verdict=Verdict(verdict) if verdict in {v.value for v in Verdict} else verdict,
        reason=Reason.from_saved(d.get("reason")),
        next_config=LoaderConfig(**d.get("next_config", d["config"])),
        first_batches=d.get("first_batches"),
    )
