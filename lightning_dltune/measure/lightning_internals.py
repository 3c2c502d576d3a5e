"""The private Lightning attributes the tuner relies on: the fit loop's batch iterator and combined loader.

Loaders the tuner did not build cannot report their fetches themselves; for them the callback wraps
the iterator that Lightning's training loop calls ``next()`` on (``trainer.fit_loop._data_fetcher
.iterator``, checked on Lightning 2.5.3 and 2.6). :func:`check_lightning_internals` names what a
Lightning release removed, and a test calls it, so such a release fails loudly instead of silently
reporting no fetch waits.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Iterator, Optional

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
    if "self._mode" not in inspect.getsource(combined_loader.CombinedLoader):
        missing.append("CombinedLoader._mode")
    if missing:
        raise RuntimeError(
            f"lightning-dltune cannot time plain loaders with this Lightning: it lacks {', '.join(missing)}."
        )


def fetches_per_step(trainer: Any, reporting_loaders: int) -> int:
    """How many of the reporting train loaders hand over a batch for every step.

    Several train loaders are combined by Lightning's ``CombinedLoader``: in its ``sequential`` mode a
    step takes one loader's batch, in the others one batch of each.
    """
    if reporting_loaders <= 1:
        return 1
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return 1 if getattr(combined, "_mode", None) == "sequential" else reporting_loaders
