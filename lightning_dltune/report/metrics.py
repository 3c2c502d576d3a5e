"""The scalars the tuner logs, by their stable ``dltune/`` names: one set per window, one per step interval.

:func:`log_window` and :func:`log_interval` hand them to every logger of the trainer (rank zero calls them),
at the x Lightning itself logs that batch's metrics at (:func:`lightning_step`); :func:`add_panels` gives
TensorBoard the layout that charts them.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.loggers import TensorBoardLogger

from lightning_dltune.core.records import WindowRecord
from lightning_dltune.core.stats import UtilSource
from lightning_dltune.measure.meter import WindowMeter
from lightning_dltune.report.tensorboard import RECENT, custom_scalars_layout, tag
from lightning_dltune.report.words import decision_markdown

DECISION_TAG = tag("decision")
"""Each window's decision, as TensorBoard text (``decision_markdown``)."""


def window_scalars(
    record: WindowRecord, band: tuple[float, float], rebuilds: int, from_samples: Optional[bool] = None
) -> dict[str, float]:
    """What one window looked like (see :class:`~lightning_dltune.DataLoaderTuner` for the meanings).

    ``from_samples``: whether NVML's sample buffer (``True``) or polled rates (``False``) served an
    NVML window; logged as ``util_from_samples`` for NVML windows only.
    """
    s = record.stats
    metrics = {
        "starvation_ratio": s.starvation_ratio,
        "gpu_util": s.utilization,
        "gpu_util_judged": s.utilization if record.judged_util is None else record.judged_util,
        "util_from_nvml": 1.0 if s.util_source == UtilSource.NVML else 0.0,
        "band_low": band[0],
        "band_high": band[1],
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
        "rebuilds": float(rebuilds),
    }
    if s.util_source == UtilSource.NVML and from_samples is not None:
        metrics["util_from_samples"] = 1.0 if from_samples else 0.0
    if s.queue_depth is not None:
        metrics["queue_depth"] = s.queue_depth
    if s.worker_batch_s is not None:
        metrics["worker_batch_ms"] = 1e3 * s.worker_batch_s
    return {tag(k): v for k, v in metrics.items()}


def interval_scalars(meter: WindowMeter, samples_per_step: int) -> dict[str, float]:
    """The last steps since the meter's interval was reset (``log_every_n_steps``), as ``dltune/recent/*``."""
    busy = meter.interval_fetch_wait_s + meter.interval_step_s
    n = max(meter.interval_batches, 1)
    return {
        tag(RECENT + "starvation_ratio"): meter.interval_fetch_wait_s / busy if busy > 0 else 0.0,
        tag(RECENT + "samples_per_s"): meter.interval_batches * samples_per_step / busy if busy > 0 else 0.0,
        tag(RECENT + "fetch_wait_ms"): 1e3 * meter.interval_fetch_wait_s / n,
        tag(RECENT + "step_ms"): 1e3 * meter.interval_step_s / n,
        tag(RECENT + "stalls"): float(meter.interval_stalls),
    }


def lightning_step(global_step: int) -> int:
    """The x Lightning logs a training batch's metrics at, given ``trainer.global_step`` after that batch.

    Lightning logs a batch's ``on_step`` values, the validation that follows it and the epoch's
    ``on_epoch`` values at the count of batches stepped *before* the batch finished (its fit loop
    steps back by one for the epoch-end metrics): ``global_step - 1`` once the optimizer stepped.
    """
    return max(global_step - 1, 0)


def log_window(trainer: Any, record: WindowRecord, scalars: dict[str, float], tuning: bool) -> None:
    """A window's scalars to every logger at the step it closed, and its decision as TensorBoard text."""
    x = lightning_step(trainer.global_step if record.step is None else record.step)
    for logger in trainer.loggers:
        logger.log_metrics(scalars, step=x)
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(DECISION_TAG, decision_markdown(record, tuning), x)


def log_interval(trainer: Any, meter: WindowMeter, samples_per_step: int) -> None:
    """The last steps' scalars to every logger, beside Lightning's own ``log_every_n_steps`` points."""
    scalars = interval_scalars(meter, samples_per_step)
    x = lightning_step(trainer.global_step)
    for logger in trainer.loggers:
        logger.log_metrics(scalars, step=x)


def add_panels(trainer: Any, estimate: bool, recent: bool) -> None:
    """The ``dltune`` custom-scalars layout to every TensorBoard logger (see :func:`custom_scalars_layout`)."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_custom_scalars(custom_scalars_layout(estimate, recent))
