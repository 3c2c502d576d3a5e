"""What the control loop needs of the loaders it tunes: a small protocol, so it depends on no DataModule."""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from lightning_dltune.core.config import LoaderConfig

FailureListener = Callable[[LoaderConfig, LoaderConfig, BaseException], None]
"""Called as ``on_failure(failed config, config gone back to, exception)`` after a switch rolled back."""


class SwitchableLoaders(Protocol):
    """The train and val loaders of a fit, switchable to a new config (:class:`~lightning_dltune.TunableDataModule`)."""

    def held_workers(self) -> Optional[int]:
        """Workers that must stay as they are (a stream that does not shard by worker), else ``None``."""

    def set_loader_config(self, config: LoaderConfig) -> None:
        """The config the next loaders are built with."""

    def mark_config_good(self) -> None:
        """The running config delivered a window: a later failure goes back to it."""

    def enable_rollback(self, on_failure: Optional[FailureListener] = None) -> None:
        """Roll back a failing switch to the last good config, telling ``on_failure``."""

    def rebuild_loaders(self, on_failure: Optional[FailureListener] = None) -> int:
        """Rebuild the live loaders with the current config; the number rebuilt."""

    def switch_train_loaders(
        self, config: LoaderConfig, on_failure: Optional[FailureListener] = None, take_over: bool = False
    ) -> int:
        """Switch the live training loaders to ``config`` where they stand (``take_over``: the new workers make
        what the old ones held, rather than wait for them to deliver it); the number switched."""

    def has_val_config(self) -> bool:
        """Whether the validation loaders run a config of their own (else they follow the training one)."""

    def switch_val_loaders(self, config: LoaderConfig, on_failure: Optional[FailureListener] = None) -> int:
        """Give the validation loaders ``config`` of their own from their next run; the number switched."""

    def mark_val_config_good(self) -> None:
        """The validation config ran a validation: a later failure goes back to it."""
