"""The loader strategies the tuning benchmark compares, and the configs they run, in the results' forms.

- ``default``: ``num_workers=0``, what a new user gets;
- ``rule``: :func:`rule_of_thumb_workers` workers, prefetch 2;
- ``oracle``: the best static config of a grid (:mod:`oracle`);
- ``tuned_default`` and ``tuned_bad``: the tuner from the default start and from :data:`BAD_START`.

A config travels as a ``(num_workers, prefetch_factor)`` pair (grid keys, per-epoch lists) or as a
``{"num_workers": ..., "prefetch_factor": ...}`` dict (the JSON's start, final and oracle configs).
"""

from __future__ import annotations

from typing import Any, Optional

BAND = (0.85, 0.95)
"""The tuner's band, passed to every fit; the band checks of the results use it too."""

BAD_START = (16, 8)
"""The bad start of ``tuned_bad``: workers x prefetch."""

STRATEGIES = ("default", "rule", "oracle", "tuned_default", "tuned_bad")
LABELS = {
    "default": "default (0 workers)",
    "rule": "rule of thumb",
    "oracle": "oracle (best static)",
    "tuned_default": "tuned, default start",
    "tuned_bad": "tuned, bad start (16x8)",
}

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
