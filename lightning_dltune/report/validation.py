"""What the tuner says about validation runs: the ``dltune/val/*`` scalars, the console line, the table.

A validation run is the validation side's window: its loaders are measured from
``on_validation_batch_start`` to ``on_validation_batch_end`` (sanity checking left out) and judged on
their own history, so the validation loaders get a config of their own where they starve and training
does not. Where validation has several loaders, each one's part of a run is shown too
(``dltune/val/<dataloader_idx>/*``, the console line's ``loaders`` part, rows of its own in the table).
"""

from __future__ import annotations

import io
from typing import Any, Optional, Sequence

from lightning.pytorch.loggers import TensorBoardLogger

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.records import ReasonKind, WindowRecord
from lightning_dltune.core.stats import WindowStats
from lightning_dltune.core.windows import VAL_FEWEST_BATCHES
from lightning_dltune.measure.val_loaders import ValLoaderRun
from lightning_dltune.report.metrics import lightning_step, window_scalars
from lightning_dltune.report.tensorboard import PREFIX
from lightning_dltune.report.words import config_change, console_text, decision_markdown

VAL_PREFIX = PREFIX + "val/"
VAL_DECISION_TAG = VAL_PREFIX + "decision"
# the training side's chart helpers, not measurements of a validation run
_NOT_VAL = ("band_low", "band_high", "rebuilds", "util_from_nvml", "util_from_samples", "gpu_util", "gpu_util_judged")


def val_scalars(record: WindowRecord, band: tuple[float, float], rebuilds: int) -> dict[str, float]:
    """One validation run's scalars as ``dltune/val/<name>`` (the training names, less the GPU and band ones)."""
    scalars = {}
    for key, value in window_scalars(record, band, rebuilds).items():
        name = key[len(PREFIX) :] if key.startswith(PREFIX) else None
        if name is not None and "/" not in name and name not in _NOT_VAL:
            scalars[VAL_PREFIX + name] = value
    return scalars


def val_loader_scalars(parts: Sequence[ValLoaderRun]) -> dict[str, float]:
    """Each loader's part of a run as ``dltune/val/<dataloader_idx>/<name>`` (several loaders only)."""
    scalars = {}
    for part in parts:
        s, name = part.stats, f"{VAL_PREFIX}{part.dataloader_idx}/"
        scalars[name + "starvation_ratio"] = s.starvation_ratio
        scalars[name + "fetch_wait_ms"] = 1e3 * s.fetch_wait_mean_s
        scalars[name + "step_ms"] = 1e3 * s.step_mean_s
        scalars[name + "samples_per_s"] = s.samples_per_s
        scalars[name + "stalls"] = float(s.stalls)
        scalars[name + "batches"] = float(s.batches)
        scalars[name + "startup_ms"] = 1e3 * s.startup_s
        if s.queue_depth is not None:
            scalars[name + "queue_depth"] = s.queue_depth
    return scalars


def log_val_run(trainer: Any, record: WindowRecord, scalars: dict[str, float], tuning: bool) -> None:
    """A validation run's scalars to every logger at the step it ended, and its decision as TensorBoard text."""
    x = lightning_step(trainer.global_step if record.step is None else record.step)
    for logger in trainer.loggers:
        logger.log_metrics(scalars, step=x)
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(VAL_DECISION_TAG, decision_markdown(record, tuning), x)


def val_line(record: WindowRecord, tuning: bool, parts: Sequence[ValLoaderRun] = ()) -> str:
    """``[dltune] validation at step 120 | workers 0 -> 2, prefetch 2 | starved 60% | data-bound (I/O)``.

    With several loaders (``parts``), each one's starvation follows: ``| loaders 0: 93%, 1: 4% starved``; a run
    held for too few batches says how many its config has of those a decision needs: ``| 4 of 8 batches to judge``.
    """
    change = "" if tuning or not record.changed else " (would try)"
    loaders = ", ".join(f"{p.dataloader_idx}: {p.stats.starvation_ratio:.0%}" for p in parts)
    few = getattr(record.reason, "kind", None) is ReasonKind.FEW_BATCHES
    pooled = f" | {record.reason['batches']} of {record.reason['fewest']} batches to judge" if few else ""
    return (
        f"[dltune] validation at step {record.step} | {config_change(record)}{change}"
        f" | starved {record.stats.starvation_ratio:.0%}{f' | loaders {loaders} starved' if parts else ''}"
        f" | {record.verdict}{pooled}"
    )


def val_start_line(start: LoaderConfig, record: WindowRecord, run_batches: Optional[int] = None) -> str:
    """The console's note on the validation side's first config, sized from the training window ``record``
    (or cut to the ``run_batches`` workers a validation run gives work to)."""
    if run_batches is not None and start.num_workers == run_batches < record.next_config.num_workers:
        workers = f"{start.num_workers} worker{'' if start.num_workers == 1 else 's'}"
        batches = f"{run_batches} batch{'' if run_batches == 1 else 'es'}"
        return (
            f"[dltune] validation starts at {workers} x prefetch {start.prefetch_factor} of its own: a validation"
            f" run of {batches} gives work to no more (training runs {record.next_config.num_workers}); its own"
            f" runs decide from the first that holds {VAL_FEWEST_BATCHES} batches"
        )
    s = record.stats
    cost = f", a batch takes {1e3 * s.worker_batch_s:.0f} ms to make" if s.worker_batch_s is not None else ""
    return (
        f"[dltune] validation starts at {start.num_workers} workers x prefetch {start.prefetch_factor} of its own:"
        " its step (no backward pass) is taken as a third"
        f" of the training step's {1e3 * s.step_mean_s:.0f} ms{cost}; its own runs decide from the first that holds"
        f" {VAL_FEWEST_BATCHES} batches"
    )


def val_table(history: Sequence[WindowRecord], parts: Sequence[ValLoaderRun] = ()) -> str:
    """The end-of-fit table of the validation runs, one row per run; with several loaders (``parts``) a
    ``loader`` column, the run's row (``all``) followed by a row for each loader's part of it."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="lightning-dltune: validation loaders", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False
    )
    columns = ["step", "epoch", "batches", "workers", "prefetch", "starved", "step ms", "samples/s", "verdict"]
    if parts:
        columns.insert(2, "loader")
    for column in columns:
        table.add_column(column, justify="left" if column == "verdict" else "right")
    by_run: dict[int, list[ValLoaderRun]] = {}
    for part in parts:
        by_run.setdefault(part.run, []).append(part)
    for run, r in enumerate(history):
        head = [str(r.step), str(r.epoch)] + (["all"] if parts else [])
        table.add_row(*head, *_row(r.stats, r), str(r.verdict))
        for part in by_run.get(run, ()):
            table.add_row("", "", str(part.dataloader_idx), *_row(part.stats, r), "")
    buffer = io.StringIO()
    Console(file=buffer, width=120, force_terminal=False, color_system=None).print(table)
    return console_text(buffer)


def _row(s: WindowStats, r: WindowRecord) -> list[str]:
    """A table row's measured cells: batches, the run's config, starvation, step time, throughput."""
    return [
        str(s.batches),
        str(r.config.num_workers),
        str(r.config.prefetch_factor),
        f"{s.starvation_ratio:.0%}",
        f"{1e3 * s.step_mean_s:,.1f}",
        f"{s.samples_per_s:,.0f}",
    ]
