"""DataLoaderTuner: measure data starvation inside the fit, log it, and retune the loaders between windows."""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_dltune.control.budgets import (
    clamp_datamodule_start,
    clamp_notice,
    clamp_start,
    fit_batches_left,
    job_budget,
    less_the_other_side,
)
from lightning_dltune.control.handoff import SpawnHandoff
from lightning_dltune.control.resources import MEMORY_FRACTION, SHM_FRACTION
from lightning_dltune.control.run import TuningRun
from lightning_dltune.control.start_cache import Fingerprint, StartCache, fingerprint
from lightning_dltune.core import validation
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.records import Budget, PolicySettings, WindowRecord
from lightning_dltune.core.stats import UtilSource, WindowStats
from lightning_dltune.core.windows import WindowSchedule
from lightning_dltune.datamodule import TunableDataModule
from lightning_dltune.loaders.adopt import UserLoaders
from lightning_dltune.loaders.torch_internals import describe_failure
from lightning_dltune.measure.distributed import most_run_batches, reduce_across_ranks
from lightning_dltune.measure.lightning_internals import (
    hide_not_resumable_warning,
    intercept_loader_requests,
    loader_owner,
    release_loader_requests,
)
from lightning_dltune.measure.probe import WindowProbe
from lightning_dltune.measure.val_loaders import ValLoaderMeter, ValLoaderRun
from lightning_dltune.nvml.sampler import MODE_SAMPLES
from lightning_dltune.report.console import Notices, say
from lightning_dltune.report.metrics import add_panels, log_interval, log_window, window_scalars
from lightning_dltune.report.recommendation import conclude_fit
from lightning_dltune.report.validation import log_val_run, val_line, val_loader_scalars, val_scalars, val_start_line
from lightning_dltune.report.words import VERBOSE_LINE, VERBOSE_REASON, window_line

UTIL_SOURCE_CHOICES = ("auto", UtilSource.NVML.value, UtilSource.ESTIMATE.value)


def _tuning_notice(trainer: pl.Trainer, loaders: UserLoaders) -> str:
    """What the tuner does with the project's own loaders, said once when training starts."""
    owner = {
        "datamodule": f"the datamodule ({type(trainer.datamodule).__name__})",
        "module": f"the LightningModule ({type(trainer.lightning_module).__name__})",
        "fit": "the arguments of fit()",
    }[loader_owner(trainer)]
    if loaders.train_streams():
        when = "at the next epoch start (a stream cannot be split mid-epoch)"
    else:
        when = "mid-epoch, where a window ends"
    return f"[dltune] tuning the loaders from {owner} in place; the training loader switches {when}"


def _not_tunable_notice(reason: str) -> str:
    """Why the loaders of this fit are only measured, in the words of the user's own set-up."""
    return f"DataLoaderTuner: {reason}, so it cannot be switched; measuring, logging and recommending only."


class DataLoaderTuner(Callback):
    r"""Measure how long training waits for data and keep the accelerator fed by retuning the loaders.

    Every training batch is timed with a few clock reads: the **fetch wait** (the loop blocked in
    ``next()`` on the train loader; never validation, checkpointing or logging) and the **step time**
    (``on_train_batch_start`` to ``on_train_batch_end``). Batches are measured in **windows** of at
    least ``window_batches`` batches and ``window_seconds`` seconds (the fit's first window: the first
    ``first_decision_after`` batches, or 6 from 0 workers plainly starved). A window closes anywhere in an
    epoch, and at every epoch end: the callback reduces it across ranks, logs it, and asks the band policy
    for the next loader config; the training loaders switch to it right there (no batch lost or repeated;
    validation loaders follow at their next run). Under DDP every rank closes the same window at the same
    batch index and applies the same config.

    The loaders tuned are the fit's own, wherever they come from: a
    :class:`~lightning_dltune.TunableDataModule`, or the project's ``DataLoader`` objects from its
    LightningModule, a plain DataModule or ``fit()``'s arguments, taken over in place as Lightning
    receives them and given back (class, ``worker_init_fn``, settings) when the fit ends
    (:mod:`lightning_dltune.loaders.adopt`).

    The policy judges a config on its recent windows pooled, drops them when the newest window shows
    new conditions (storage, step or starvation moved by more than their noise), measures a change that
    looks worse a second time before undoing it, and gives back all modelled slack in one step.

    Logged per window under ``dltune/``, at the step where the window closed, on the x Lightning logs
    that batch's own metrics at (TensorBoard gets ready ``dltune: headline`` and ``dltune: detail``
    custom-scalars sections; TensorBoard alone also gets ``dltune_panels/*``, the series those charts draw
    (each window over its steps, axis constants); any other Lightning logger gets the same scalars):

    - ``starvation_ratio``: Σ fetch wait / Σ (fetch wait + step time), of the most starved rank (its
      waits and step times are the job's: the others wait for it at the gradient all-reduce).
    - ``gpu_util``: NVML utilization of this rank's device over the training part of the epoch, min
      over ranks; where NVML cannot serve it, the estimate ``1 - starvation_ratio``.
      ``util_from_nvml`` is 1 or 0 accordingly; where it is 1, ``util_from_samples`` is 1 when the
      driver's sample buffer served the window and 0 when polled utilization rates did (a device
      whose driver keeps no samples). Validation, checkpoint saving and loader start-up are not
      training: NVML time from a pause until the next training batch starts is left out.
      ``gpu_util_judged`` is the utilization the verdict judged (this window pooled with the config's
      recent windows); ``band_low`` / ``band_high`` draw the band.
    - ``fetch_wait_ms``, ``fetch_wait_p50_ms``, ``fetch_wait_p95_ms``, ``step_ms``, ``step_p50_ms``,
      ``step_p95_ms``: per-batch mean and percentiles; a step is measured hook to hook.
    - ``stalls``, ``stall_fraction``: fetches that found no ready batch. Exact for the loaders the tuner
      switches (their workers' finished batches are counted); for loaders it only measures, a fetch that
      waited longer than ``stall_threshold_ms`` and than the loop's own hand-over time (three times the
      window's fastest fetch, at most what moving the batch's bytes takes).
    - ``queue_depth``: mean ready batches at request time (tuned loaders only).
    - ``samples_per_s``, ``startup_ms`` (loader start-up and pipeline fill, never counted as fetch
      wait), ``worker_batch_ms`` (a worker's time to make one batch, tuned loaders only).
    - ``other_cpus``: the CPUs' worth of time other processes (not the training process nor its
      workers) took on the cores the training process may run on over the window: a neighbour. A
      neighbour that arrives or leaves on busy cores is new conditions, as a slower storage is.
    - ``num_workers``, ``prefetch_factor``, ``rebuilds``; and, in TensorBoard, the verdict and reason
      as text (``dltune/decision``).
    - With ``log_every_n_steps``: ``dltune/recent/starvation_ratio``, ``dltune/recent/samples_per_s``,
      ``dltune/recent/fetch_wait_ms``, ``dltune/recent/step_ms``, ``dltune/recent/stalls`` over the last
      ``n`` steps of rank zero.
    - Per validation run (sanity checks left out), at the step it ended: the same names under
      ``dltune/val/`` (less the GPU and band ones), the run pooled over every validation loader (the
      validation side's window, one config for them all; :attr:`val_history`), and the decision as
      text (``dltune/val/decision``). Where ``val_dataloader()`` gives several loaders, each one's own
      part of the run too, as ``dltune/val/<dataloader_idx>/starvation_ratio``, ``fetch_wait_ms``,
      ``step_ms``, ``samples_per_s``, ``stalls``, ``batches``, ``startup_ms``, ``queue_depth``
      (:attr:`val_loader_history`).

    The console gets one short line per window and per validation run (through the progress bar when
    one is shown; with several validation loaders, the run's line names each one's starvation) and, at
    the end of fit, a table of every window, a table of the validation runs (a row for each loader's
    part under its run's, where there are several) and the recommended config, also written to
    ``dltune_recommendation.yaml`` in the log dir as a LightningCLI config fragment (where the loaders'
    owner takes their settings as arguments; otherwise the console names the DataLoader arguments to
    set). Beside it, ``dltune_timeline.png`` draws the fit's story (also in TensorBoard's Images tab;
    needs matplotlib). :attr:`history` holds this fit's windows; a tuner used for a second fit starts
    afresh (the earlier fits' windows move to :attr:`previous_fits`).

    Args:
        tune: switch the fit's loaders (a :class:`~lightning_dltune.TunableDataModule`'s, or the project's
            own). ``False``: measure, log and recommend only; the project's loaders are not touched.
        band: GPU utilization range ``(low, high)`` to hold, ``0 < low < high <= 1``.
        util_source: ``"auto"`` (NVML where it serves this device, else the estimate), ``"nvml"``
            (warn once if NVML cannot serve, then estimate) or ``"estimate"`` (never touch NVML).
        stall_threshold_ms: for loaders that cannot report their queue, a fetch waiting longer than
            this (and than the loop's hand-over time) is a stall.
        log_every_n_steps: also log step-granularity metrics every ``n`` optimizer steps; ``0``: off.
        max_workers: most worker processes per rank; ``None``: 4 per usable CPU (affinity and
            cgroup quota, shared among the node's ranks) minus one, room for I/O-bound workers. The
            CPU rule is the policy's: CPU-bound workers stop where their measured CPU demand fills
            the CPUs the training process leaves.
        memory_fraction: share of available RAM (and cgroup headroom) prefetched batches may hold.
        shm_fraction: share of free ``/dev/shm`` prefetched batches may hold.
        max_rebuilds: most config changes in one fit under the same conditions (new conditions, such as
            slower storage, start a new count), among its latest 256 windows (what a decision replays).
        min_gain: relative throughput gain that makes a change worth keeping.
        max_prefetch_factor: deepest prefetch the tuner picks.
        nvml_poll_interval_s: seconds between NVML reads during training.
        first_decision_after: the fit's first window closes after this many batches (the start config is
            judged early, and the loaders switch right away); ``0``: the first window is a regular one.
            From 0 workers a longer one already closes after 4 (or 6) where the loop waited for its
            batches longer than it computed (and the steps settled).
        window_batches: fewest batches in a window. The default suits a ~100 ms accelerator step: 50
            batches, 5 s, about 30 NVML samples. A window also looks for new conditions every 12 % of
            ``window_batches`` batches (at least 6, and a 24th of the window's time) and closes there
            when it finds them.
        window_seconds: shortest window, in seconds at the last window's pace (fast steps get more
            batches per window, so that a window averages over noise and NVML samples); ``0``: batches only.
        verbose: ``0``/``False``: print nothing; ``1``/``True``: one short line per window and the final
            table; ``2``: also each window's throughput, fetch wait, step time and reason.
        recommendation_file: write ``dltune_recommendation.yaml`` in the logger's log dir at the end of
            fit (not without a logger nor under ``fast_dev_run``, where Lightning suppresses logging).
        tune_validation: give the validation loaders a config of their own, decided from their own
            validation runs (each run is the validation side's window). ``False``: they follow the
            training loaders' config; their runs are still measured and logged.
        start_tuned: start the training loaders from the last recommendation saved for the same machine
            (usable CPUs, memory, world size) and data (dataset class and length, batch bytes, batch
            size), and save this fit's recommendation for the next one. The tuner still measures and may
            move from there; the console says when a saved start is used or does not fit this machine.
            Off under multi-node training (nodes may differ).
        start_cache_dir: where those starts are kept; ``None``: ``$XDG_CACHE_HOME/lightning-dltune``,
            else ``~/.cache/lightning-dltune`` (delete it to clear).

    Raises:
        ValueError: for a band other than two numbers with ``0 < low < high <= 1``, an unknown
            ``util_source``, a negative threshold, interval or count, fractions outside ``(0, 1]``,
            ``min_gain`` outside ``[0, 1)``, ``verbose`` outside ``0..2``. A wrong type (a string for a
            bool, a float for a count) raises :class:`~lightning_dltune.core.validation.ArgumentTypeError`, a
            ``TypeError`` that is also a ``ValueError``. Every message names the argument, the value and what is
            allowed.

    Example::

        from lightning import Trainer
        from lightning.pytorch.loggers import TensorBoardLogger

        from lightning_dltune import DataLoaderTuner

        tuner = DataLoaderTuner(band=(0.85, 0.95))
        trainer = Trainer(callbacks=[tuner], logger=TensorBoardLogger("logs"))
        trainer.fit(model)  # the loaders of model.train_dataloader() / val_dataloader(), tuned in place
        print(tuner.history[-1].next_config)
    """

    def __init__(
        self,
        tune: bool = True,
        band: tuple[float, float] = (0.85, 0.95),
        util_source: str = "auto",
        stall_threshold_ms: float = 1.0,
        log_every_n_steps: int = 0,
        max_workers: Optional[int] = None,
        memory_fraction: float = MEMORY_FRACTION,
        shm_fraction: float = SHM_FRACTION,
        max_rebuilds: int = 10,
        min_gain: float = 0.05,
        max_prefetch_factor: int = 8,
        nvml_poll_interval_s: float = 5.0,
        first_decision_after: int = 10,
        window_batches: int = 50,
        window_seconds: float = 3.0,
        verbose: Union[bool, int] = True,
        recommendation_file: bool = True,
        tune_validation: bool = True,
        start_tuned: bool = False,
        start_cache_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.band = validation.band("band", band)
        self.tune = validation.flag("tune", tune)
        self.util_source = validation.choice("util_source", util_source, UTIL_SOURCE_CHOICES)
        validation.number("stall_threshold_ms", stall_threshold_ms, 0.0)
        self.nvml_poll_interval_s = validation.number(
            "nvml_poll_interval_s", nvml_poll_interval_s, 0.0, math.inf, low_open=True, high_open=True
        )
        self.log_every_n_steps = validation.count("log_every_n_steps", log_every_n_steps, 0)
        self.first_decision_after = validation.count("first_decision_after", first_decision_after, 0)
        self.window_batches = validation.count("window_batches", window_batches, 1)
        self.window_seconds = validation.number("window_seconds", window_seconds, 0.0)
        self.max_workers = validation.count("max_workers", max_workers, 0, optional=True)
        self.memory_fraction = validation.fraction("memory_fraction", memory_fraction, zero=False)
        self.shm_fraction = validation.fraction("shm_fraction", shm_fraction, zero=False)
        self.verbose = validation.level("verbose", verbose, VERBOSE_REASON)
        self.recommendation_file = validation.flag("recommendation_file", recommendation_file)
        self.tune_validation = validation.flag("tune_validation", tune_validation)
        self.start_tuned = validation.flag("start_tuned", start_tuned)
        if start_cache_dir is not None and not isinstance(start_cache_dir, (str, os.PathLike)):
            raise validation.type_error("start_cache_dir", start_cache_dir, "a directory path or None")
        self.start_cache_dir = None if start_cache_dir is None else os.fspath(start_cache_dir)
        # max_rebuilds, min_gain and max_prefetch_factor are checked by PolicySettings
        self.settings = PolicySettings(
            band=self.band, max_rebuilds=max_rebuilds, min_gain=min_gain, max_prefetch_factor=max_prefetch_factor
        )
        self.previous_fits: list[list[WindowRecord]] = []
        """The windows of earlier fits with this tuner, one list per fit."""
        self._probe = WindowProbe(stall_threshold_s=stall_threshold_ms / 1000.0)
        self._val_probe = WindowProbe(stall_threshold_s=stall_threshold_ms / 1000.0, validation=True)
        self._val_loaders = ValLoaderMeter()  # each validation loader's part of a run, where there are several
        self._val_measuring = False
        self._notices = Notices()
        self._handoff = SpawnHandoff()
        self._start_fit()

    def _start_fit(self, datamodule: Union[TunableDataModule, UserLoaders, None] = None) -> None:
        """Everything that belongs to one fit, fresh (``load_state_dict`` then restores a resumed fit's)."""
        previous = getattr(self, "_run", None)
        if previous is not None and previous.history:
            self.previous_fits.append(previous.history)
        # only a tuned fit judges its start early: a monitor's first window is a regular one
        first = self.first_decision_after if self.tune and datamodule is not None else 0
        self._run = TuningRun(
            self.settings, WindowSchedule(self.window_batches, self.window_seconds, first), datamodule, self.tune
        )
        self._run.on_rollback = self._said_rollback
        self._run.tune_validation = self.tune_validation
        self._recommended: Optional[LoaderConfig] = None
        self._val_loader_runs: list[ValLoaderRun] = []
        self.recommendation_path: Optional[str] = None
        self._measuring = False  # the probe measures this epoch (set at its start, or at its first batch)
        self._show_not_resumable: Optional[Callable[[], None]] = None
        self._resumed_at: Optional[int] = None  # the batch a resumed epoch continues at
        self._start_budget: Optional[Budget] = None
        self._fingerprint: Optional[Fingerprint] = None  # this fit's machine and data (start_tuned)
        self._start_note: Optional[str] = None
        self._last_step_logged = -1
        self._notices.reset()

    @property
    def history(self) -> list[WindowRecord]:
        """This fit's windows, a :class:`~lightning_dltune.core.records.WindowRecord` each (config, stats, verdict)."""
        self._take_handoff()
        return self._run.history

    @property
    def val_history(self) -> list[WindowRecord]:
        """This fit's validation runs, one :class:`~lightning_dltune.core.records.WindowRecord` each (sanity
        checks left out): the validation side's windows, judged on their own."""
        self._take_handoff()
        return self._run.val_history

    @property
    def val_loader_history(self) -> list[ValLoaderRun]:
        """Where validation has several loaders: each one's part of each run of this fit, a
        :class:`~lightning_dltune.measure.val_loaders.ValLoaderRun` each (its own batches, fetch wait, step
        time, stalls, samples/s), in run order; empty with one validation loader. The run itself (pooled
        over the loaders, one config for them all) is ``val_history[part.run]``.

        Example::

            for part in tuner.val_loader_history:
                print(part.step, part.dataloader_idx, f"{part.stats.starvation_ratio:.0%}")
        """
        self._take_handoff()
        return self._val_loader_runs

    @property
    def rebuilds(self) -> int:
        """Loader config changes in this fit: the training loaders' and the validation loaders' own."""
        self._take_handoff()
        return self._run.rebuilds

    @property
    def recommended_config(self) -> Optional[LoaderConfig]:
        """The config recommended at the end of this fit (``None`` before it ends or without evidence)."""
        self._take_handoff()
        return self._recommended

    def _take_handoff(self) -> None:
        """After a fit in spawned processes, their rank zero's state replaces this process's (once)."""
        handed = self._handoff.receive()
        if handed is not None:
            self._start_fit()
            self.load_state_dict(handed["state"])
            recommended = handed.get("recommended")
            self._recommended = LoaderConfig(**recommended) if recommended else None

    # ------------------------------------------------------------------ set-up and tear-down
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._start_fit(self._loaders_of(trainer))
        device = trainer.strategy.root_device
        sampler = self._probe.open_sampler(
            None if self.util_source == UtilSource.ESTIMATE else device, self.nvml_poll_interval_s
        )
        if not sampler.available and (self.util_source == UtilSource.NVML or device.type == "cuda"):
            self._say_once(
                trainer,
                "estimate",
                f"DataLoaderTuner: NVML cannot serve {device}"
                f" ({sampler.unavailable_reason}); GPU utilization is the estimate 1 - starvation_ratio.",
                warn=self.util_source == UtilSource.NVML,
            )

    def _loaders_of(self, trainer: pl.Trainer) -> Union[TunableDataModule, UserLoaders, None]:
        """What the tuner switches in this fit: a TunableDataModule, else the project's own loaders (adopted)."""
        if isinstance(trainer.datamodule, TunableDataModule):
            return trainer.datamodule
        if not self.tune:
            return None
        loaders = UserLoaders(trainer)
        if not intercept_loader_requests(trainer, loaders.received):
            release_loader_requests(trainer)
            self._say_once(trainer, "no-source", _not_tunable_notice("this Lightning does not hand the loaders over"))
            return None
        return loaders

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        datamodule = self._run.datamodule
        if self._run.tuning and datamodule is not None:
            self._run.start_fit()
        if isinstance(datamodule, UserLoaders) and self._run.tuning:
            budget = self._start_budget = self._budget(trainer, pl_module)  # a collective: here, on every rank
            datamodule.clamp_start = partial(clamp_start, budget=budget, settings=self.settings, earn=True)
            datamodule.start_from = partial(self._cached_start, trainer)
        if isinstance(datamodule, TunableDataModule):
            self._say_held_workers(trainer)
            if self._run.tuning and datamodule.train_dataset is not None:
                cached = self._cached_start(
                    trainer, datamodule.train_dataset, datamodule.batch_size, datamodule.estimate_batch_bytes
                )
                if cached is not None and self._run.restored_config is None:
                    datamodule.set_loader_config(cached)
                if self._start_note is not None:
                    self._say_once(trainer, "start-cache", self._start_note)
            clamped = clamp_datamodule_start(
                datamodule, self._budget(trainer, pl_module), self.settings, earn=self._run.tuning
            )
            if clamped is not None:
                self._say_once(trainer, "clamped", clamped)
        if trainer.is_global_zero:
            estimate = self._probe.sampler is None or not self._probe.sampler.available
            add_panels(trainer, estimate, recent=self.log_every_n_steps > 0)

    def _resume_positions(self) -> None:
        """A resumed fit: the project's own training loaders continue their epoch where the checkpoint left them.

        Lightning's warning that such a loader is not resumable is hidden until training starts (then the
        console says where the epoch resumes instead).
        """
        loaders = self._run.datamodule
        if not isinstance(loaders, UserLoaders) or not self._run.tuning:
            return
        loaders.resume_positions = list(self._run.restored_positions)
        unfinished = [p for p in loaders.resume_positions if p and not p.get("epoch_done", True)]
        if unfinished and self._resumed_at is None:
            self._resumed_at = int(unfinished[0]["batches_taken"])
            self._show_not_resumable = hide_not_resumable_warning()

    def _show_lightnings_warnings(self) -> None:
        if self._show_not_resumable is not None:
            self._show_not_resumable()
            self._show_not_resumable = None

    def _said_resume(self, trainer: pl.Trainer) -> None:
        if self._resumed_at is not None:
            self._say_once(
                trainer,
                "resume",
                f"[dltune] the training loader resumes epoch {trainer.current_epoch} at batch {self._resumed_at}:"
                " the rest of the epoch's sample order, every sample once",
            )
        self._resumed_at = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._said_resume(trainer)
        self._count_val_run_batches(trainer, pl_module)  # Lightning set up the validation loaders for its bar
        loaders = self._run.datamodule
        if isinstance(loaders, UserLoaders):  # the training loaders arrived: say what the tuner can do with them
            if loaders.refused is not None:
                self._say_once(trainer, "no-switch", _not_tunable_notice(loaders.refused))
            elif self._run.tuning:
                self._say_once(trainer, "adopted", _tuning_notice(trainer, loaders))
                self._say_held_workers(trainer)
                if self._start_note is not None:
                    self._say_once(trainer, "start-cache", self._start_note)
                if loaders.clamped is not None:
                    asked, started, nbytes = loaders.clamped
                    notice = clamp_notice(asked, started, self._start_budget, nbytes, self.settings)
                    self._say_once(trainer, "clamped", notice)

    def _cached_start(
        self, trainer: pl.Trainer, dataset: Any, batch_size: Optional[int], batch_bytes: Any
    ) -> Optional[LoaderConfig]:
        """The saved start for this machine and data (``start_tuned``), the note to say in ``_start_note``."""
        if not self.start_tuned or self._fingerprint is not None:
            return None
        if trainer.num_nodes > 1:
            self._start_note = "[dltune] start_tuned is off under multi-node training: the nodes may differ"
            return None
        nbytes = batch_bytes() if callable(batch_bytes) else batch_bytes
        self._fingerprint = fingerprint(dataset, batch_size, nbytes, trainer.world_size)
        config, self._start_note = StartCache(self.start_cache_dir).lookup(self._fingerprint)
        if config is None and self._start_note is None:
            self._start_note = (
                f"[dltune] no saved start for this machine and data yet; this fit's recommendation will be"
                f" saved in {StartCache(self.start_cache_dir).root}"
            )
        return config

    def _say_held_workers(self, trainer: pl.Trainer) -> None:
        held = self._run.datamodule.held_workers_reason()  # type: ignore[union-attr]
        if held is not None:
            self._say_once(trainer, "held-workers", f"[dltune] {held}")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._probe.close()
        self._show_lightnings_warnings()  # restored, but no training batch followed
        if stage == "fit":
            self._give_loaders_back(trainer)
        if stage == "fit" and trainer.is_global_zero and self._handoff.in_spawned_process():
            recommended = self._recommended.as_dict() if self._recommended is not None else None
            self._handoff.send({"state": self.state_dict(), "recommended": recommended})

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._show_lightnings_warnings()
        self._give_loaders_back(trainer)  # Lightning calls no teardown after an exception

    def _give_loaders_back(self, trainer: pl.Trainer) -> None:
        """The project's own loaders go back to their class and settings; Lightning asks the hooks directly."""
        if isinstance(self._run.datamodule, UserLoaders):
            release_loader_requests(trainer)
            self._run.datamodule.release()

    # ------------------------------------------------------------------ measurement
    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._run.start_epoch()
        self._measure_epoch(trainer)

    def _measure_epoch(self, trainer: pl.Trainer, first_batch: int = 0) -> None:
        self._probe.attach(trainer, self._run.datamodule)
        self._measuring = True
        self._open_window(trainer, first_batch)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._measuring:  # resumed mid-epoch: Lightning skipped the epoch start (and warned before it)
            self._show_lightnings_warnings()
            self._measure_epoch(trainer, batch_idx)
        self._probe.batch_started(trainer, batch, time.perf_counter())

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._probe.batch_ended(time.perf_counter())
        if self.log_every_n_steps and trainer.global_step % self.log_every_n_steps == 0:
            self._log_interval(trainer)
        windows = self._run.windows
        if batch_idx == windows.end:
            self._close_window(trainer, pl_module, end_batch=batch_idx + 1)
        elif batch_idx == windows.look:  # part-way through a window: close it now if there is enough to judge
            if self._run.closes_at_look(self._probe.config, self._job_stats(trainer, pl_module)):
                self._close_window(trainer, pl_module, end_batch=batch_idx + 1)
            else:
                self._run.looked(batch_idx)

    # ------------------------------------------------------------------ validation runs
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe.pause_util()  # resumed by the next training batch: a checkpoint saved after stays out
        self._val_measuring = not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING
        if self._val_measuring:
            self._count_val_run_batches(trainer, pl_module)  # reloaded loaders may be longer or shorter
            self._val_probe.attach(trainer, self._run.datamodule)
            self._val_loaders.attach(trainer, self._val_probe.meter)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._val_measuring:
            now = time.perf_counter()
            self._val_probe.batch_started(trainer, batch, now)
            self._val_loaders.batch_started(now)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._val_measuring:
            now = time.perf_counter()
            self._val_probe.batch_ended(now)
            self._val_loaders.batch_ended(batch, dataloader_idx, now)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._val_measuring:
            return
        self._val_measuring = False
        config = self._val_probe.config
        stats = reduce_across_ranks(
            trainer.strategy, self._val_probe.local_stats(), trainer.world_size, pl_module.device
        )
        loaders = self._val_loaders.job_stats(trainer.strategy, trainer.world_size, pl_module.device)
        self._val_probe.close()
        self._val_loaders.close()
        if config is None:
            return
        train = self._run.history[-1] if self._run.history else None
        budget = less_the_other_side(
            self._budget(trainer, pl_module),
            None if train is None else self._run.running_config(train),
            None if train is None else train.stats.batch_bytes,
        )
        broadcast = partial(trainer.strategy.broadcast, src=0)
        record = self._run.close_val_run(config, stats, budget, trainer.current_epoch, trainer.global_step, broadcast)
        if record is None:
            return
        run = len(self._run.val_history) - 1
        parts = [ValLoaderRun(run, record.step, record.epoch, i, s) for i, s in enumerate(loaders)]
        self._val_loader_runs.extend(parts)
        if trainer.is_global_zero:
            tuning = self._run.tuning and self.tune_validation
            scalars = {**val_scalars(record, self.band, self._run.rebuilds), **val_loader_scalars(parts)}
            log_val_run(trainer, record, scalars, tuning=tuning)
            if self.verbose >= VERBOSE_LINE:
                say(trainer, val_line(record, tuning=tuning, parts=parts))

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._probe.pause_util()  # the file is written after this hook

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._measuring = False
        self._close_window(trainer, pl_module)

    # ------------------------------------------------------------------ decisions
    def _close_window(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, end_batch: Optional[int] = None
    ) -> None:
        """Judge the window (every rank at once), log it, and mid-epoch (``end_batch``) open the next one."""
        config = self._probe.config
        if config is None:
            return
        if self._probe.fetcher_missing:
            self._say_once(trainer, "no-fetcher", "DataLoaderTuner: cannot time fetches with this Lightning version.")
        stats = self._job_stats(trainer, pl_module, closing=True)
        val = self._run.val_history[-1] if self._run.val_history else None
        budget = less_the_other_side(  # the validation loaders' own idle persistent workers hold memory
            self._budget(trainer, pl_module),
            getattr(self._run.datamodule, "_val_config", None),
            None if val is None else val.stats.batch_bytes,
        )
        budget = replace(budget, batches_left=fit_batches_left(trainer, end_batch))
        record = self._run.close_window(
            config,
            stats,
            budget,
            trainer.current_epoch,
            trainer.global_step,
            end_batch,
            partial(trainer.strategy.broadcast, src=0),
        )
        if record is None and stats.batches and not stats.fetches:
            self._say_once(
                trainer,
                "no-fetch",
                f"[dltune] a window of {stats.batches} batch(es) had no fetch"
                " after the loader's start-up: no verdict; epochs need a few batches to be judged",
            )
        if record is not None and trainer.is_global_zero:
            self._log_window(trainer, record)
            if self._run.val_start is not None and self.verbose >= VERBOSE_LINE:
                self._say_once(
                    trainer, "val-start", val_start_line(self._run.val_start, record, self._run.val_run_batches)
                )
        if end_batch is not None:  # the rest of the epoch is measured in windows of the config it runs
            if record is not None:
                self._probe.start(self._run.running_config(record))
            self._open_window(trainer, end_batch)

    def _open_window(self, trainer: pl.Trainer, first_batch: int) -> None:
        self._run.open_window(first_batch, trainer.num_training_batches, trainer.world_size, self._probe.switchable)

    def _job_stats(self, trainer: pl.Trainer, pl_module: pl.LightningModule, closing: bool = False) -> WindowStats:
        """The window so far, across ranks (a collective: every rank calls it at the same batch); ``closing``: the
        whole window."""
        local = self._probe.local_stats(closing=closing)
        return reduce_across_ranks(trainer.strategy, local, trainer.world_size, pl_module.device)

    def _count_val_run_batches(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """How many batches a validation run takes at most (a collective): no more validation workers get work."""
        self._run.val_run_batches = most_run_batches(
            trainer.strategy, trainer.num_val_batches, trainer.world_size, pl_module.device
        )

    def _budget(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Budget:
        return job_budget(
            trainer,
            pl_module.device,
            self.max_workers,
            self.memory_fraction,
            self.shm_fraction,
            self._run.worker_cap,
            self._run.held_workers(),
        )

    def _said_rollback(self, failed: LoaderConfig, restored: LoaderConfig, exc: BaseException) -> None:
        """A loader switch rolled back (the run capped the workers): measure ``restored`` and say why."""
        self._probe.config = restored
        self._say_once(
            None,
            "rebuild-failed",
            f"DataLoaderTuner: the new loader config failed ({describe_failure(exc)});"
            f" went back to {restored.short()} and the fit goes on.",
            warn=True,
            all_ranks=True,
        )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recommended, self.recommendation_path = conclude_fit(
            trainer,
            self._run.history,
            self.settings.min_gain,
            self.recommendation_file,
            self.verbose,
            self._run.val_history,
            self._val_loader_runs,
        )
        if self._fingerprint is not None and self._recommended is not None and trainer.is_global_zero:
            rate = max((r.samples_per_s for r in self._run.history if r.config == self._recommended), default=0.0)
            path = StartCache(self.start_cache_dir).save(self._fingerprint, self._recommended, rate)
            if self.verbose >= VERBOSE_LINE:
                say(trainer, f"[dltune] saved as the next fit's start (start_tuned=True): {path}")

    # ------------------------------------------------------------------ logging
    def _log_window(self, trainer: pl.Trainer, record: WindowRecord) -> None:
        mode = self._probe.sampler.window_mode if self._probe.sampler is not None else None
        scalars = window_scalars(record, self.band, self._run.rebuilds, None if mode is None else mode == MODE_SAMPLES)
        log_window(trainer, record, scalars, tuning=self.tune)
        if self.verbose >= VERBOSE_LINE:
            say(trainer, window_line(record, tuning=self._run.tuning, verbose=self.verbose))

    def _log_interval(self, trainer: pl.Trainer) -> None:
        if trainer.global_step == self._last_step_logged or self._probe.meter.interval_batches == 0:
            return
        self._last_step_logged = trainer.global_step
        if trainer.is_global_zero:
            log_interval(trainer, self._probe.meter, self._probe.samples_per_step)
        self._probe.meter.reset_interval()

    def _say_once(self, trainer: Any, key: str, text: str, warn: bool = False, all_ranks: bool = False) -> None:
        self._notices.once(trainer, key, text, warn=warn, all_ranks=all_ranks)

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        state = self._run.state_dict(current=self._probe.config)
        state["val_loader_history"] = [part.to_dict() for part in self._val_loader_runs]
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._run.load_state_dict(state_dict)
        self._val_loader_runs = [ValLoaderRun.from_dict(d) for d in state_dict.get("val_loader_history", [])]
        self._resume_positions()
