"""The fit's recommended loader config: which window to cite, and the LightningCLI fragment that carries it."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import yaml

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.history import best_config, median_rate
from lightning_dltune.core.records import WindowRecord
from lightning_dltune.report.console import say
from lightning_dltune.report.words import VERBOSE_LINE, summary_table

RECOMMENDATION_FILE = "dltune_recommendation.yaml"


def recommend(history: Sequence[WindowRecord], min_gain: float = 0.05) -> Optional[WindowRecord]:
    """The window to cite: the median window of :func:`~lightning_dltune.core.history.best_config`."""
    best = best_config(history, min_gain)
    return None if best is None else median_rate(history, best)


def recommendation_yaml(config: LoaderConfig, note: str = "") -> str:
    """A LightningCLI config fragment: ``--config`` it after your own config to use the recommendation.

    The values sit directly under ``data:``, the form that both ``dltune fit`` (the datamodule given
    as ``class_path``/``init_args``) and a user's own ``LightningCLI(Model, DataModule)`` accept.
    """
    header = "# lightning-dltune recommendation: pass it after your config, e.g.\n"
    header += "#   dltune fit --config configs/demo.yaml --config dltune_recommendation.yaml\n"
    header += "#   python train.py fit --config my.yaml --config dltune_recommendation.yaml   (your own LightningCLI)\n"
    if note:
        header += f"# {note}\n"
    body = {"data": config.as_dict()}
    return header + yaml.safe_dump(body, sort_keys=False)


def write_recommendation(directory: str, config: LoaderConfig, note: str = "") -> str:
    """Write :func:`recommendation_yaml` to ``directory/dltune_recommendation.yaml``; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RECOMMENDATION_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(recommendation_yaml(config, note))
    return path


def conclude_fit(
    trainer: Any, history: Sequence[WindowRecord], min_gain: float, write_file: bool, verbose: int
) -> tuple[Optional[LoaderConfig], Optional[str]]:
    """At the end of a fit: the recommended config and, on rank zero, the table and the fragment's file.

    No file without a logger (no log dir) nor under ``fast_dev_run`` (Lightning suppresses logging):
    the recommendation then lives in the table and the returned config only. Every rank must call it
    (asking for the log dir is a collective under DDP). Returns the config and the written file's path.
    """
    best = recommend(history, min_gain)
    if best is None:
        return None, None
    writes = write_file and bool(trainer.loggers) and not trainer.fast_dev_run
    directory = trainer.log_dir if writes else None
    if not trainer.is_global_zero:
        return best.config, None
    if verbose >= VERBOSE_LINE:
        say(trainer, summary_table(history, best))
    path = None
    if writes and directory:
        note = f"measured {best.samples_per_s:,.0f} samples/s, the median of its windows ({best.verdict})"
        path = write_recommendation(directory, best.config, note)
        if verbose >= VERBOSE_LINE:
            say(trainer, f"[dltune] recommendation written to {path}")
    return best.config, path
