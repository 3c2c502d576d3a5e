"""The check of extra DataLoader keyword arguments: names torch accepts, none the caller sets itself."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Iterable

from torch.utils.data import DataLoader

from lightning_dltune.core import validation


def check_loader_kwargs(
    name: str, value: Any, owned: Iterable[str] = (), target: Callable[..., Any] | None = None
) -> dict[str, Any]:
    """A mapping of :class:`~torch.utils.data.DataLoader` keyword arguments (``None``: none).

    Names are checked against ``inspect.signature(DataLoader)``; ``owned`` names are set elsewhere and
    refused here; a negative ``timeout`` is refused as DataLoader would only refuse it at the first epoch.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise validation.type_error(name, value, "a mapping of DataLoader arguments, e.g. {'timeout': 5}")
    if target is None:
        target = DataLoader
    accepted = set(inspect.signature(target).parameters) - {"self"}
    clash = sorted(set(owned).intersection(value))
    if clash:
        raise ValueError(f"`{name}` must not set {clash}: pass them as TunableDataModule arguments instead.")
    unknown = sorted(k for k in value if k not in accepted)
    if unknown:
        allowed = sorted(accepted - set(owned))
        raise ValueError(f"`{name}` names {unknown}, which DataLoader does not accept; allowed: {allowed}.")
    if "timeout" in value:
        validation.number(f"{name}['timeout']", value["timeout"], 0.0)
    return dict(value)
