"""Where the tuner's console lines go: through the active progress bar, so that bars stay whole; once each."""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


def say(trainer: Any, text: str) -> None:
    """Print ``text`` on rank zero so that it reaches the terminal and the progress bar stays whole.

    With a TQDM bar the text goes through TQDM's own ``write``: above the live bar while one runs, and
    plainly when none does (``TQDMProgressBar.print`` drops text before the first bar, in ``setup``, and
    after the last one closed, in ``on_fit_end``). Any other bar's ``print`` is used (Rich writes above
    its live display); without a bar (or with it disabled) the line goes to Lightning's logger as
    ``rank_zero_info`` does.
    """
    bar = getattr(trainer, "progress_bar_callback", None) if trainer is not None else None
    if bar is not None and getattr(bar, "is_enabled", False):
        if trainer.is_global_zero:
            if isinstance(bar, TQDMProgressBar):
                Tqdm.write(text)
            else:
                bar.print(text)
        return
    rank_zero_info(text)


class Notices:
    """Messages said once per fit, by key: information through :func:`say`, warnings as warnings."""

    def __init__(self) -> None:
        self._said: set[str] = set()

    def reset(self) -> None:
        """A new fit: every message may be said again."""
        self._said.clear()

    def once(self, trainer: Any, key: str, text: str, warn: bool = False, all_ranks: bool = False) -> None:
        """Say ``text`` unless ``key`` was said in this fit; ``all_ranks``: a warning every rank gives."""
        if key in self._said:
            return
        self._said.add(key)
        if warn and all_ranks:
            warnings.warn(text, stacklevel=3)
        elif warn:
            rank_zero_warn(text)
        else:
            say(trainer, text)
