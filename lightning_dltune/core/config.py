"""The loader settings the tuner owns, as one immutable value."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from lightning_dltune.core import validation


@dataclass(frozen=True)
class LoaderConfig:
    """The DataLoader settings that lightning-dltune measures and tunes.

    Field names are the :class:`torch.utils.data.DataLoader` argument names, so a config reads the
    same in code, logs and LightningCLI YAML.

    Args:
        num_workers: worker processes; ``0`` loads in the training process.
        prefetch_factor: batches each worker keeps ready. Ignored (and passed as ``None``) when
            ``num_workers == 0``.
        pin_memory: copy batches into page-locked memory (only useful when training on CUDA).
        persistent_workers: keep workers alive between epochs. Only takes effect when
            ``num_workers > 0``; it stays recorded so that a later move to workers keeps it.

    Raises:
        ValueError: if ``num_workers < 0`` or ``prefetch_factor < 1``.
        TypeError: for a count that is not an integer or a switch that is not a ``bool`` (also a
            ``ValueError``, see :class:`~lightning_dltune.core.validation.ArgumentTypeError`).

    Example::

        cfg = LoaderConfig(num_workers=4, prefetch_factor=2)
        DataLoader(dataset, batch_size=64, **cfg.dataloader_kwargs())
    """

    num_workers: int = 0
    prefetch_factor: int = 2
    pin_memory: bool = False
    persistent_workers: bool = True

    def __post_init__(self) -> None:
        validation.count("num_workers", self.num_workers, 0)
        validation.count("prefetch_factor", self.prefetch_factor, 1)
        validation.flag("pin_memory", self.pin_memory)
        validation.flag("persistent_workers", self.persistent_workers)

    def replace(self, **changes: Any) -> LoaderConfig:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)

    def dataloader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`~torch.utils.data.DataLoader` that DataLoader accepts as given."""
        multiprocess = self.num_workers > 0
        return {
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor if multiprocess else None,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers and multiprocess,
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def short(self) -> str:
        """A compact form for console lines: ``workers=4 prefetch=2 pin=off persistent=on``."""
        onoff = {True: "on", False: "off"}
        return (
            f"workers={self.num_workers} prefetch={self.prefetch_factor} "
            f"pin={onoff[self.pin_memory]} persistent={onoff[self.persistent_workers]}"
        )
