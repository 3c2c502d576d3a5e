"""The scalars the tuner logs, by their stable ``dltune/`` names: one set per window, one per step interval.

:func:`log_window` and :func:`log_interval` hand them to every logger of the trainer (rank zero calls them),
at the x Lightning itself logs that batch's metrics at (:func:`lightning_step`); :func:`add_panels` gives
TensorBoard the layout that charts them, and TensorBoard alone also gets the series those charts draw
(``dltune_panels/*``, :func:`panel_scalars`: each window's values at its first and last step, and the axis
constants), so that the charts are true at TensorBoard's default settings.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from lightning.pytorch.loggers import TensorBoardLogger

from lightning_dltune.core.records import WindowRecord
from lightning_dltune.core.stats import UtilSource
from lightning_dltune.loaders.torch_internals import write_summary
from lightning_dltune.measure.meter import WindowMeter
from lightning_dltune.report.tensorboard import (
    ONE,
    PANEL_NAMES,
    RECENT,
    RECENT_ONE,
    RECENT_PEAKS,
    RECENT_ZERO,
    ZERO,
    custom_scalars_layout,
    layout_summary,
    panel_tag,
    peak_tag,
    tag,
)
from lightning_dltune.report.words import decision_markdown

DECISION_TAG = tag("decision")
"""Each window's decision, as TensorBoard text (``decision_markdown``)."""

_PEAKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # TensorBoard writer -> highest recent values


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
    if s.other_cpus is not None:
        metrics["other_cpus"] = s.other_cpus
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


def window_span(trainer: Any, record: WindowRecord) -> tuple[int, int]:
    """The x of a window's first and last batch (:func:`lightning_step`), both inclusive.

    The first is counted back from the last by the window's batches, warm-up included (in optimizer steps, under
    gradient accumulation): never before the true first, so never before an earlier window's last point
    (TensorBoard keeps a tag's points only while their steps increase).
    """
    last = lightning_step(trainer.global_step if record.step is None else record.step)
    steps = record.stats.all_batches // max(1, trainer.accumulate_grad_batches)  # its warm-up steps included
    return max(last - max(steps, 1) + 1, 0), last


def panel_scalars(scalars: dict[str, float]) -> dict[str, float]:
    """A window's scalars as the panels draw them (``dltune_panels/<name>``, :data:`PANEL_NAMES`) and 0 and 1."""
    drawn = {panel_tag(name): scalars[tag(name)] for name in PANEL_NAMES if tag(name) in scalars}
    return {**drawn, ZERO: 0.0, ONE: 1.0}


def log_window(trainer: Any, record: WindowRecord, scalars: dict[str, float], tuning: bool) -> None:
    """A window's scalars to every logger at the step it closed, and its decision as TensorBoard text.

    A TensorBoard logger also gets :func:`panel_scalars` at the window's first and last step
    (:func:`window_span`): drawn through both, a value is flat over the steps it held.
    """
    first, x = window_span(trainer, record)
    for logger in trainer.loggers:
        logger.log_metrics(scalars, step=x)
        if isinstance(logger, TensorBoardLogger):
            for step in sorted({first, x}):
                logger.log_metrics(panel_scalars(scalars), step=step)
            logger.experiment.add_text(DECISION_TAG, decision_markdown(record, tuning), x)


def log_interval(trainer: Any, meter: WindowMeter, samples_per_step: int) -> None:
    """The last steps' scalars to every logger, beside Lightning's own ``log_every_n_steps`` points.

    A TensorBoard logger also gets, at the same x, what the recent charts draw besides: 0 and 1, which pin
    their axes, and :func:`recent_peaks`.
    """
    scalars = interval_scalars(meter, samples_per_step)
    x = lightning_step(trainer.global_step)
    for logger in trainer.loggers:
        logger.log_metrics(scalars, step=x)
        if isinstance(logger, TensorBoardLogger):
            axis = {RECENT_ZERO: 0.0, RECENT_ONE: 1.0}
            logger.log_metrics({**axis, **recent_peaks(logger.experiment, scalars)}, step=x)


def recent_peaks(writer: Any, scalars: dict[str, float]) -> dict[str, float]:
    """The highest of each :data:`RECENT_PEAKS` series ``writer`` was given so far, ``scalars`` included."""
    peaks = _PEAKS.setdefault(writer, {})
    for name in RECENT_PEAKS:
        value = scalars[tag(RECENT + name)]
        peaks[name] = max(peaks.get(name, value), value)
    return {peak_tag(name): peaks[name] for name in RECENT_PEAKS}


def add_panels(trainer: Any, estimate: bool, recent: bool) -> None:
    """The ``dltune`` custom-scalars layout to every TensorBoard logger (see :func:`custom_scalars_layout`).

    Written as the summary itself, into the writer's event file as torch's own ``add_custom_scalars`` writes
    its layouts (that method takes one series per margin chart; these charts have several).
    """
    summary = layout_summary(custom_scalars_layout(estimate, recent))
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            write_summary(logger.experiment, summary)
