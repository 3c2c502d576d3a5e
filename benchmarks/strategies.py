"""The loader strategies the tuning benchmark compares, and the configs they run, in the results' forms.

- ``default``: ``num_workers=0``, what a new user gets;
- ``rule``: :func:`rule_of_thumb_workers` workers, prefetch 2;
- ``oracle``: the best static config of a grid (:mod:`oracle`);
- ``tuned_default`` and ``tuned_bad``: the tuner from the default start and from :data:`BAD_START`,
  switching the loaders of :class:`~lightning_dltune.TunableDataModule` (the mixin);
- ``own_default`` and ``own_bad``: the same two tuned fits with the project's own loaders, plain
  ``DataLoader`` calls in the LightningModule's hooks and no datamodule (:mod:`own_loaders`), which the
  tuner takes over in place; each is compared with the oracle and with its start's mixin fit
  (:data:`MIXIN_OF`).

A config travels as a ``(num_workers, prefetch_factor)`` pair (grid keys, per-epoch lists) or as a
``{"num_workers": ..., "prefetch_factor": ...}`` dict (the JSON's start, final and oracle configs).
"""

from __future__ import annotations

from typing import Any, Optional

BAND = (0.85, 0.95)
"""The tuner's band, passed to every fit; the band checks of the results use it too."""

BAD_START = (16, 8)
"""The bad start of ``tuned_bad``: workers x prefetch."""

STRATEGIES = ("default", "rule", "oracle", "tuned_default", "tuned_bad", "own_default", "own_bad")
LABELS = {
    "default": "default (0 workers)",
    "rule": "rule of thumb",
    "oracle": "oracle (best static)",
    "tuned_default": "tuned, default start",
    "tuned_bad": "tuned, bad start (16x8)",
    "own_default": "own loaders, tuned, default start",
    "own_bad": "own loaders, tuned, bad start (16x8)",
}

START_OF = {
    "tuned_default": "from_default",
    "tuned_bad": "from_bad",
    "own_default": "from_default",
    "own_bad": "from_bad",
}
"""The start (a key of the results' ``tuned`` and ``own_loaders``) of every tuned strategy."""

MIXIN_OF = {"own_default": "tuned_default", "own_bad": "tuned_bad"}
"""The mixin's tuned strategy of the same start, for each own-loaders strategy."""

OWN_LOADERS = tuple(MIXIN_OF)
"""The strategies whose loaders the LightningModule builds (no datamodule)."""

MB = 2**20
"""Bytes in the megabytes the results report."""


def rule_of_thumb_workers() -> int:
    """Workers of the ``rule`` strategy: Lightning's ``suggested_max_num_workers(1)`` (CPUs - 1)."""
    from lightning.pytorch.utilities import suggested_max_num_workers

    return suggested_max_num_workers(1)


def grid_config(w: int, p: int) -> tuple[int, int]:
    """The grid's key for ``w`` workers x prefetch ``p``."""
    return (w, 2 if w == 0 else p)  # prefetch means nothing without workers


def config_dict(pair: list[int]) -> dict[str, int]:
    """A ``[workers, prefetch]`` pair as the JSON's config dict."""
    return {"num_workers": pair[0], "prefetch_factor": pair[1]}


def config_text(c: Optional[dict[str, Any]]) -> str:
    """A config dict in a table cell: ``0 workers`` or ``4w x 2``."""
    if not c:
        return "?"
    return "0 workers" if c["num_workers"] == 0 else f"{c['num_workers']}w x {c['prefetch_factor']}"
