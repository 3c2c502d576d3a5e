"""The fit's recommended loader config: which window to cite, and how it reaches the user's own arguments.

Where the loaders' owner (the datamodule, else the LightningModule) takes the loader settings as
constructor arguments of the same names, the recommendation is a LightningCLI fragment to pass with
``--config``; otherwise no file is written (one that ``--config`` refuses helps nobody) and the console
says which ``DataLoader`` arguments to set, with the numbers.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, NamedTuple, Optional, Sequence

import yaml

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.history import best_config, median_rate
from lightning_dltune.core.records import WindowRecord
from lightning_dltune.measure.lightning_internals import loader_owner
from lightning_dltune.measure.val_loaders import ValLoaderRun
from lightning_dltune.report.console import say
from lightning_dltune.report.timeline import fit_timeline
from lightning_dltune.report.validation import val_table
from lightning_dltune.report.words import VERBOSE_LINE, summary_table

RECOMMENDATION_FILE = "dltune_recommendation.yaml"
_SETTINGS = tuple(field.name for field in dataclasses.fields(LoaderConfig))
_VAL_SETTINGS = ("val_num_workers", "val_prefetch_factor")  # TunableDataModule's own validation config


class Target(NamedTuple):
    """Where a recommendation goes: the LightningCLI section and the settings its class takes by name."""

    section: str  # "data" or "model"
    keys: tuple[str, ...]  # the loader settings its constructor takes; () when none
    owner: str  # the owner in words, e.g. "the LightningModule (Model)"
    val_keys: tuple[str, ...] = ()  # the validation loader's own settings its constructor takes


def target_of(trainer: Any) -> Target:
    """The loaders' owner in this fit (the datamodule, else the LightningModule) and the settings it takes.

    Loaders passed to ``fit()`` have no owner a config could reach: ``Target("", (), "fit()")``.
    """
    if loader_owner(trainer) == "fit":
        return Target("", (), "fit()")
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None:
        owner, section, kind = datamodule, "data", "the datamodule"
    else:
        owner, section, kind = trainer.lightning_module, "model", "the LightningModule"
    from lightning_dltune.datamodule import TunableDataModule  # its subclasses take them through **kwargs

    keys = _SETTINGS if isinstance(owner, TunableDataModule) else _named_arguments(type(owner))
    val_keys = _VAL_SETTINGS if isinstance(owner, TunableDataModule) else _named_arguments(type(owner), _VAL_SETTINGS)
    return Target(section, keys if "num_workers" in keys else (), f"{kind} ({type(owner).__name__})", val_keys)


def _named_arguments(cls: type, settings: Sequence[str] = _SETTINGS) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(name for name in settings if name in parameters)


def _as_arguments(config: LoaderConfig, keys: Sequence[str]) -> str:
    values = config.as_dict()
    return ", ".join(f"{key}={values[key]}" for key in keys)


def recommend(history: Sequence[WindowRecord], min_gain: float = 0.05) -> Optional[WindowRecord]:
    """The window to cite: the median window of :func:`~lightning_dltune.core.history.best_config`."""
    best = best_config(history, min_gain)
    return None if best is None else median_rate(history, best)


def recommendation_yaml(
    config: LoaderConfig,
    note: str = "",
    path: str = RECOMMENDATION_FILE,
    section: str = "data",
    keys: Sequence[str] = _SETTINGS,
    extra: Optional[dict[str, Any]] = None,
) -> str:
    """A LightningCLI config fragment: ``--config`` it after your own config to use the recommendation.

    The values sit directly under ``section`` (``data:`` or ``model:``), the form that both ``dltune fit``
    (classes given as ``class_path``/``init_args``) and a user's own ``LightningCLI(Model, DataModule)``
    accept; only ``keys``, the settings that class takes, are written.
    """
    header = "# lightning-dltune recommendation: pass it after your own config, e.g.\n"
    header += f"#   python train.py fit --config my.yaml --config {path}\n"
    header += "# (dltune fit takes it the same way)\n"
    if note:
        header += f"# {note}\n"
    values = config.as_dict()
    body = {section: {key: values[key] for key in keys}}
    body[section].update(extra or {})
    return header + yaml.safe_dump(body, sort_keys=False)


def write_recommendation(
    directory: str,
    config: LoaderConfig,
    note: str = "",
    section: str = "data",
    keys: Sequence[str] = _SETTINGS,
    extra: Optional[dict[str, Any]] = None,
) -> str:
    """Write :func:`recommendation_yaml` to ``directory/dltune_recommendation.yaml``; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RECOMMENDATION_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(recommendation_yaml(config, note, path, section, keys, extra))
    return path


def conclude_fit(
    trainer: Any,
    history: Sequence[WindowRecord],
    min_gain: float,
    write_file: bool,
    verbose: int,
    val_history: Sequence[WindowRecord] = (),
    val_loaders: Sequence[ValLoaderRun] = (),
) -> tuple[Optional[LoaderConfig], Optional[str]]:
    """At the end of a fit: the recommended config and, on rank zero, the tables (``val_loaders``: each
    validation loader's part of the runs, where there are several), the fragment's file and
    the timeline picture (:mod:`~lightning_dltune.report.timeline`; drawn with or without a recommendation).

    No file without a logger (no log dir) nor under ``fast_dev_run`` (Lightning suppresses logging):
    the recommendation then lives in the table and the returned config only. Every rank must call it
    (asking for the log dir is a collective under DDP). Returns the config and the written file's path.
    """
    best = recommend(history, min_gain)
    logs = bool(trainer.loggers) and not trainer.fast_dev_run
    directory = trainer.log_dir if logs else None
    if not trainer.is_global_zero:
        return (None if best is None else best.config), None
    path = None
    if best is not None:
        val = _val_recommendation(best, val_history, min_gain)
        path = _say_recommendation(trainer, history, best, directory if write_file else None, verbose, val)
    if val_history and verbose >= VERBOSE_LINE:
        say(trainer, val_table(val_history, val_loaders))
    if directory and history:
        fit_timeline(trainer, history, directory, verbose, val_history)
    return (None if best is None else best.config), path


def _val_recommendation(
    best: WindowRecord, val_history: Sequence[WindowRecord], min_gain: float
) -> Optional[WindowRecord]:
    """The validation runs' own recommendation, where it differs from the training one (else ``None``)."""
    val = recommend(val_history, min_gain)
    if val is None:
        return None
    same = (val.config.num_workers, val.config.prefetch_factor) == (
        best.config.num_workers,
        best.config.prefetch_factor,
    )
    return None if same else val


def _say_recommendation(
    trainer: Any,
    history: Sequence[WindowRecord],
    best: WindowRecord,
    directory: Optional[str],
    verbose: int,
    val: Optional[WindowRecord] = None,
) -> Optional[str]:
    """The table, the fragment's file in ``directory`` (``None``: no file) and how to apply it; the file's path.

    ``val``: the validation loaders' own recommendation, carried by the fragment where the owner takes it.
    """
    if verbose >= VERBOSE_LINE:
        say(trainer, summary_table(history, best))
    target = target_of(trainer)
    extra = None
    if val is not None and target.val_keys:
        values = {"val_num_workers": val.config.num_workers, "val_prefetch_factor": val.config.prefetch_factor}
        extra = {key: values[key] for key in target.val_keys}
    path = None
    if directory and target.keys:
        note = f"measured {best.samples_per_s:,.0f} samples/s, the median of its windows ({best.verdict})"
        path = write_recommendation(directory, best.config, note, target.section, target.keys, extra)
    if verbose >= VERBOSE_LINE:
        say(trainer, _how_to_apply(best.config, target, path))
        if val is not None:
            say(trainer, _how_to_apply_val(val, target, path is not None and extra is not None))
    return path


def _how_to_apply_val(val: WindowRecord, target: Target, in_file: bool) -> str:
    """The validation loaders' own recommendation in words: in the file, or the DataLoader arguments to set."""
    text = (
        f"[dltune] validation loaders: recommended {val.config.short()} ({val.samples_per_s:,.0f} samples/s,"
        f" its median run: step {val.step})"
    )
    if in_file:
        return text + f"; in the file as {', '.join(target.val_keys)}"
    where = f"of {target.owner}" if target.section else "passed to fit()"
    values = f"num_workers={val.config.num_workers}, prefetch_factor={val.config.prefetch_factor}"
    return text + f"; set {values} on the validation DataLoader {where}"


def _how_to_apply(config: LoaderConfig, target: Target, path: Optional[str]) -> str:
    """The console's last word: the file to pass with ``--config``, or the DataLoader arguments to set."""
    rest = [key for key in _SETTINGS if key not in target.keys]
    if path is not None:
        text = f"[dltune] recommendation written to {path} (for `{target.section}:`, {target.owner})"
        if rest:
            text += f"; {target.owner} takes no {', '.join(rest)}: set {_as_arguments(config, rest)} on its DataLoader"
        return text
    where = f"of {target.owner}" if target.section else "passed to fit()"
    why = (
        ""
        if target.keys or not target.section
        else f" ({target.owner} takes no num_workers argument a config could set)"
    )
    return (
        f"[dltune] to use the recommendation, set {_as_arguments(config, _SETTINGS)} on the training"
        f" DataLoader {where}{why}"
    )
