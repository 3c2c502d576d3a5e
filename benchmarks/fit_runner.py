"""One benchmark fit, in this process: the workload under one loader config, timed and recorded by the tuner.

The parent (:mod:`fit_launcher`) runs each fit as ``tuning.py --run-one <spec>`` in its own process, so
that fits cannot leak workers or memory into each other; :func:`run_one` is what that child runs. The
spec names the workload, the start config, whether the tuner tunes (``tune=False``: it only measures,
so every strategy is measured by the same clocks), who builds the loaders (``own_loaders``: the
LightningModule's hooks, :mod:`own_loaders`; otherwise the workload's ``TunableDataModule``), the epochs
and the seed.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Optional

from strategies import BAND, MB

from lightning_dltune.report.words import reason_text


def _per_epoch(history):
    """(last record, merged stats) per epoch: an early decision splits the first epoch into two windows."""
    from lightning_dltune.core.stats import pool_windows  # merged as the fields declare, as the policy pools

    merged = []
    for record in history:
        if merged and merged[-1][0].epoch == record.epoch:
            merged[-1] = (record, pool_windows([merged[-1][1], record.stats]))
        else:
            merged.append((record, record.stats))
    return merged


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One fit, in this process: the workload under one loader config, timed and recorded by the tuner."""
    import lightning.pytorch as pl
    from phases import BatchClock, CpuHog, clock_summary
    from workloads import WORKLOADS

    from lightning_dltune import DataLoaderTuner

    _quiet_single_threaded()
    pl.seed_everything(spec.get("seed", 0), verbose=False)
    workload = WORKLOADS[spec["workload"]].scaled(spec["train_batches"])
    if spec.get("slowed_throughout"):
        workload = workload.slowed_throughout()  # a grid point of a phased workload: the judged phase alone
    memory_fraction = _memory_fraction(workload)

    tuner = DataLoaderTuner(
        tune=spec["tune"],
        band=BAND,
        util_source="estimate",
        memory_fraction=memory_fraction,
        verbose=False,
        recommendation_file=False,
    )
    clock = _epoch_clock(memory_fraction)
    batch_clock = BatchClock()
    hog = CpuHog(workload.hog_epoch) if workload.hog_epoch is not None else None
    callbacks = [tuner, clock, batch_clock] + ([hog] if hog else [])
    fit_s, fit_started, fit_ended, t1 = _timed_fit(spec, workload, callbacks)
    phase_start = 0 if spec.get("slowed_throughout") else workload.phase_start()
    clocked = clock_summary(batch_clock, t1, phase_start, BAND[0])
    if hog is not None:
        clocked["hog_s"] = None if hog.started_at is None else (hog.ended_at or t1) - hog.started_at

    return {
        "fit_s": fit_s,
        "fit_started_at": fit_started,
        "fit_ended_at": fit_ended,
        "train_started_at": clock.marks[0] if clock.marks else fit_started,
        "epochs": _epoch_rows(tuner.history, clock),
        "loader_rebuilds": tuner.rebuilds,  # config changes applied (an early first-epoch switch included)
        "memory_fraction": memory_fraction,
        "recommended": None if tuner.recommended_config is None else tuner.recommended_config.as_dict(),
        "phase_start": phase_start,
        **clocked,
        "windows": _window_rows(tuner.history),
    }


def _quiet_single_threaded() -> None:
    """Lightning's info lines and warnings off; torch on one intra-op thread."""
    import logging
    import warnings

    import torch

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    # one intra-op thread, as in DataLoader workers: on 2 cores, OpenMP threads of a 0-worker loader's tensor
    # ops spin against any other busy process and slowed such fits ~20x in trials, an artefact of the CPU host
    torch.set_num_threads(1)


def _memory_fraction(workload) -> float:
    """The tuner's ``memory_fraction``: its default, or the workload's stated budget as a share of available RAM."""
    from lightning_dltune.control.resources import memory_budget_bytes

    memory_fraction = 0.5  # the tuner's default
    if workload.memory_budget_mb is not None:
        available = memory_budget_bytes() or float(workload.memory_budget_mb * MB)
        memory_fraction = min(1.0, workload.memory_budget_mb * MB / available)
    return memory_fraction


def _epoch_clock(memory_fraction: float):
    """A callback keeping the fit's wall-clock marks and, at every epoch end, the tuner's memory budget."""
    from lightning.pytorch.callbacks import Callback

    from lightning_dltune.control.resources import rank_budget

    class EpochClock(Callback):
        """Wall-clock marks of the fit (unix time, to line up with the parent's memory samples)."""

        def __init__(self) -> None:
            self.marks: list[float] = []
            self.budget_mb: list[Optional[float]] = []

        def on_train_start(self, trainer, pl_module) -> None:
            self.marks = [time.time()]

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            self.marks.append(time.time())
            budget = rank_budget(memory_fraction=memory_fraction)
            self.budget_mb.append(None if budget.memory_bytes is None else budget.memory_bytes / MB)

    return EpochClock()


def _timed_fit(spec: dict[str, Any], workload, callbacks: list) -> tuple[float, float, float, float]:
    """``trainer.fit`` of the workload at the spec's config: ``(fit_s, started_at, ended_at, perf_counter at end)``."""
    import lightning.pytorch as pl
    from own_loaders import build_own
    from phases import EpochFlag
    from workloads import EPOCH_FILE_ENV, build

    with tempfile.TemporaryDirectory(prefix="dltune-bench-") as root:
        callbacks = list(callbacks)
        if workload.slow_from_epoch is not None:
            os.environ[EPOCH_FILE_ENV] = os.path.join(root, "epoch")  # read by the dataset in every worker
            callbacks.append(EpochFlag(os.environ[EPOCH_FILE_ENV]))
        trainer = pl.Trainer(
            max_epochs=spec["epochs"],
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=root,
            callbacks=callbacks,
        )
        if spec.get("own_loaders"):  # plain DataLoaders in the LightningModule, no datamodule
            model, data = build_own(workload, spec["num_workers"], spec["prefetch_factor"]), None
        else:
            model, data = build(workload, spec["num_workers"], spec["prefetch_factor"])
        fit_started = time.time()
        t0 = time.perf_counter()
        trainer.fit(model, datamodule=data)
        t1 = time.perf_counter()
        fit_ended = time.time()
    return t1 - t0, fit_started, fit_ended, t1


def _epoch_rows(history, clock) -> list[dict[str, Any]]:
    """One row per epoch: its config, the tuner's merged stats and verdict, its wall time and memory budget."""
    epochs = []
    for i, (record, s) in enumerate(_per_epoch(history)):
        wall = clock.marks[i + 1] - clock.marks[i] if i + 1 < len(clock.marks) else None
        epochs.append(
            {
                "epoch": record.epoch,
                "num_workers": record.config.num_workers,
                "prefetch_factor": record.config.prefetch_factor,
                "samples_per_s": s.samples_per_s,
                "utilization": s.utilization,
                "starvation_ratio": s.starvation_ratio,
                "stall_fraction": s.stall_fraction,
                "fetch_wait_ms": 1e3 * s.fetch_wait_mean_s,
                "step_ms": 1e3 * s.step_mean_s,
                "startup_ms": 1e3 * s.startup_s,
                "worker_batch_ms": None if s.worker_batch_s is None else 1e3 * s.worker_batch_s,
                "worker_cpu_fraction": s.worker_cpu_fraction,
                "batch_bytes": s.batch_bytes,
                "samples": s.samples,
                "verdict": str(record.verdict),
                "reason": reason_text(record.reason),
                "changed": record.changed,
                "next_num_workers": record.next_config.num_workers,
                "next_prefetch_factor": record.next_config.prefetch_factor,
                "wall_s": wall,
                "ended_at": clock.marks[i + 1] if i + 1 < len(clock.marks) else None,
                "memory_budget_mb": clock.budget_mb[i] if i < len(clock.budget_mb) else None,
            }
        )
    return epochs


def _window_rows(history) -> list[dict[str, Any]]:
    """Every decision, where it closed: the trail of a fit whose epochs are few and long."""
    return [
        {
            "epoch": r.epoch,
            "end_batch": r.end_batch,
            "step": r.step,
            "config": [r.config.num_workers, r.config.prefetch_factor],
            "next_config": [r.next_config.num_workers, r.next_config.prefetch_factor],
            "utilization": r.stats.utilization,
            "other_cpus": r.stats.other_cpus,
            "verdict": str(r.verdict),
            "reason": reason_text(r.reason),
        }
        for r in history
    ]
