"""The DataLoaders inside whatever Lightning holds: one loader, a list or dict of them, a ``CombinedLoader``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader


def flatten_loaders(loaders: Any) -> list[DataLoader]:
    """Every :class:`~torch.utils.data.DataLoader` in ``loaders``, in order (``None`` or anything else: none)."""
    if loaders is None:
        return []
    if isinstance(loaders, DataLoader):
        return [loaders]
    if isinstance(loaders, CombinedLoader):
        return list(loaders.flattened)
    if isinstance(loaders, dict):
        return [x for v in loaders.values() for x in flatten_loaders(v)]
    if isinstance(loaders, (list, tuple)):
        return [x for v in loaders for x in flatten_loaders(v)]
    return []
