"""Where the tuner's console lines go: through the active progress bar, so that bars stay whole."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info


def say(trainer: Any, text: str) -> None:
    """Print ``text`` on rank zero, through the progress bar's own ``print`` while one is enabled.

    TQDM writes it above the live bar and Rich above its live display; without a bar (or with it
    disabled) the line goes to Lightning's logger as ``rank_zero_info`` does.
    """
    bar = getattr(trainer, "progress_bar_callback", None) if trainer is not None else None
    if bar is not None and getattr(bar, "is_enabled", False):
        if trainer.is_global_zero:
            bar.print(text)
        return
    rank_zero_info(text)
