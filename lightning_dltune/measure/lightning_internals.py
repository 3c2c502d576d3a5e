"""The private Lightning attributes the tuner relies on: the fit's loader sources, batch iterator, combined loader.

- To tune the loaders a project builds itself (in its LightningModule, a plain DataModule, or passed to
  ``fit``), the callback sees them the moment Lightning receives them: the fit loop's and its validation
  loop's ``_data_source`` (a ``_DataLoaderSource`` whose ``dataloader()`` calls the user's hook or
  returns fit's argument) get an instance-level ``dataloader`` that hands the result on first.
- Loaders that cannot report their fetches themselves are timed around the iterator that Lightning's
  training loop calls ``next()`` on (``trainer.fit_loop._data_fetcher.iterator``).

Checked on Lightning 2.5.3 and 2.6. :func:`check_lightning_internals` names what a Lightning release
removed, and a test calls it, so such a release fails loudly instead of silently tuning nothing.
"""

from __future__ import annotations

import inspect
import re
import time
import warnings
from typing import Any, Callable, Iterator, Optional

from lightning_dltune.measure.meter import WindowMeter


class TimedFetches(Iterator):
    """Times ``next()`` on the fit loop's batch iterator, for loaders that cannot report themselves."""

    def __init__(self, iterator: Iterator, meter: WindowMeter) -> None:
        self._it = iterator
        self._meter = meter

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        batch = next(self._it)
        self._meter.record_fetch(time.perf_counter() - t0)
        return batch


def time_fit_loop_fetches(trainer: Any, meter: WindowMeter) -> bool:
    """Wrap the training loop's batch iterator so that every fetch is timed into ``meter``.

    Returns:
        ``False`` where this Lightning has no such iterator (the caller says so once).
    """
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    iterator: Optional[Iterator] = getattr(fetcher, "iterator", None)
    if iterator is None:
        return False
    if not isinstance(iterator, TimedFetches):
        fetcher.iterator = TimedFetches(iterator, meter)
    return True


def _fit_sources(trainer: Any) -> list[tuple[str, Any]]:
    """The fit's loader sources that have ``dataloader()``: ("train", ...) and ("val", ...)."""
    fit_loop = trainer.fit_loop
    found = [("train", getattr(fit_loop, "_data_source", None))]
    found.append(("val", getattr(getattr(fit_loop.epoch_loop, "val_loop", None), "_data_source", None)))
    return [(stage, source) for stage, source in found if callable(getattr(type(source), "dataloader", None))]


def loader_owner(trainer: Any) -> str:
    """Who hands Lightning the fit's training loaders: ``"datamodule"``, ``"module"`` or ``"fit"`` (its arguments)."""
    from lightning.pytorch import LightningDataModule, LightningModule

    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    instance = getattr(source, "instance", None)
    if isinstance(instance, LightningDataModule):
        return "datamodule"
    if isinstance(instance, LightningModule) or instance is None:
        return "module"
    return "fit"


def intercept_loader_requests(trainer: Any, received: Callable[[str, Any], Any]) -> bool:
    """From now on, what the fit's train and val sources give Lightning passes through ``received(stage, loaders)``.

    ``received`` returns what Lightning gets (the same loaders, adopted in place). Undone by
    :func:`release_loader_requests`. ``False`` where this Lightning has no such sources.
    """
    sources = _fit_sources(trainer)
    for stage, source in sources:
        request = type(source).dataloader

        def intercepted(_source: Any = source, _stage: str = stage, _request: Callable = request) -> Any:
            return received(_stage, _request(_source))

        source.dataloader = intercepted
    return len(sources) == 2


def release_loader_requests(trainer: Any) -> None:
    """Lightning's sources ask the user's hooks directly again."""
    for _, source in _fit_sources(trainer):
        vars(source).pop("dataloader", None)


_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended and your dataloader is"


def hide_not_resumable_warning() -> Callable[[], None]:
    """Hide Lightning's warning that a mid-epoch resume is not exact (the tuner resumes its loaders itself).

    Returns the function that shows it again.
    """
    warnings.filterwarnings("ignore", message=re.escape(_NOT_RESUMABLE))
    entry = warnings.filters[0]

    def show_again() -> None:
        if entry in warnings.filters:
            warnings.filters.remove(entry)

    return show_again


def check_lightning_internals() -> None:
    """Raise ``RuntimeError`` naming what this Lightning lacks of the fit loop's batch iterator."""
    from lightning.pytorch.loops import fetchers, fit_loop
    from lightning.pytorch.utilities import combined_loader

    missing = []
    if "self._data_fetcher" not in inspect.getsource(fit_loop._FitLoop):
        missing.append("_FitLoop._data_fetcher")
    if "self.iterator = iter(" not in inspect.getsource(fetchers._DataFetcher):
        missing.append("_DataFetcher.iterator")
    if "self._combined_loader" not in inspect.getsource(fit_loop._FitLoop):
        missing.append("_FitLoop._combined_loader")
    from lightning.pytorch.loops import evaluation_loop

    if "self._combined_loader" not in inspect.getsource(evaluation_loop._EvaluationLoop):
        missing.append("_EvaluationLoop._combined_loader")
    if "self._mode" not in inspect.getsource(combined_loader.CombinedLoader):
        missing.append("CombinedLoader._mode")
    from lightning.pytorch.trainer.connectors import data_connector

    for loop, name in ((fit_loop._FitLoop, "_FitLoop"), (evaluation_loop._EvaluationLoop, "_EvaluationLoop")):
        if "self._data_source = _DataLoaderSource(" not in inspect.getsource(loop):
            missing.append(f"{name}._data_source")
    from lightning.pytorch.loops import training_epoch_loop

    if _NOT_RESUMABLE not in inspect.getsource(training_epoch_loop._TrainingEpochLoop.reset):
        missing.append("the 'not resumable' warning of _TrainingEpochLoop.reset")
    if "data_source.dataloader()" not in inspect.getsource(data_connector._request_dataloader):
        missing.append("_request_dataloader calling _DataLoaderSource.dataloader()")
    if missing:
        raise RuntimeError(
            f"lightning-dltune cannot time plain loaders with this Lightning: it lacks {', '.join(missing)}."
        )


def fetches_per_step(trainer: Any, reporting_loaders: int, validation: bool = False) -> int:
    """How many of the reporting train (``validation``: val) loaders hand over a batch for every step.

    Several loaders are combined by Lightning's ``CombinedLoader``: in its ``sequential`` mode a step
    takes one loader's batch, in the others one batch of each. Validation combines a list or dict of
    loaders sequentially; a ``CombinedLoader`` returned by ``val_dataloader()`` keeps its own mode.
    """
    if reporting_loaders <= 1:
        return 1
    loop = getattr(trainer.fit_loop.epoch_loop, "val_loop", None) if validation else trainer.fit_loop
    combined = getattr(loop, "_combined_loader", None)
    mode = getattr(combined, "_mode", "sequential" if validation else None)  # validation's default
    return 1 if mode == "sequential" else reporting_loaders
