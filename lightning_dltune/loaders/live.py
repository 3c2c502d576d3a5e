"""The live loaders of a fit moved together to one config: rebuilt, switched mid-epoch, rolled back.

:class:`LiveLoaders` is what :class:`~lightning_dltune.TunableDataModule` and
:class:`~lightning_dltune.loaders.adopt.UserLoaders` (a project's own loaders) share: the current config,
the last config that delivered, and a :class:`~lightning_dltune.loaders.switch.LoaderSwitch` for every
loader that must change. A subclass says which loaders are live and which workers must stay.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from torch.utils.data import DataLoader

from lightning_dltune.control.switchable import FailureListener
from lightning_dltune.core import validation
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.loaders.collection import flatten_loaders
from lightning_dltune.loaders.loader import TunedLoader
from lightning_dltune.loaders.switch import LoaderSwitch, loader_config_of
from lightning_dltune.loaders.torch_internals import describe_failure


def training_loop_position(trainer: Any) -> tuple[int, bool]:
    """(batches the fit loop took this epoch, whether its epoch is done), for a training loader's position."""
    taken = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    return taken, taken >= trainer.num_training_batches


def runs_with(loader: DataLoader, config: LoaderConfig) -> bool:
    """Whether ``loader`` runs ``config`` as DataLoader sees it (persistence and prefetch without workers aside)."""
    return loader_config_of(loader).dataloader_kwargs() == config.dataloader_kwargs()


class LiveLoaders:
    """The config of a fit's train and val loaders, and the switches that bring the live loaders to it.

    A subclass sets ``_loader_config``, ``_last_good_config = None`` and ``_on_failure = None`` and
    provides :meth:`live_loaders` and :meth:`held_workers`.
    """

    _loader_config: Optional[LoaderConfig]
    _last_good_config: Optional[LoaderConfig]
    _on_failure: Optional[FailureListener]
    owner_name = "the loaders"  # in warnings: whose loaders went back

    # -- what a subclass provides ----------------------------------------------------------------
    def live_loaders(self) -> list[TunedLoader]:
        """The tunable loaders Lightning currently iterates (train and val)."""
        raise NotImplementedError

    def train_loaders(self) -> list[DataLoader]:
        """The loaders of the fit loop (tunable or not)."""
        trainer = getattr(self, "trainer", None)
        return flatten_loaders(trainer.train_dataloader) if trainer is not None else []

    def held_workers(self) -> Optional[int]:
        """The worker count the loaders must keep (an iterable dataset that may not shard), or ``None``."""
        raise NotImplementedError

    def _multiprocessing_context(self) -> Any:
        """The context to start workers with where a loader had none (no workers before)."""
        return None

    def _resolve_config(self) -> None:
        """Settle what the config leaves open (the mixin's ``pin_memory=None``) before it is used."""

    # -- config ----------------------------------------------------------------------------------
    def set_loader_config(self, config: LoaderConfig) -> None:
        """Use ``config`` from now on; live loaders follow at :meth:`rebuild_loaders`.

        With an iterable dataset that does not shard by worker, the worker count stays as it started.

        Raises:
            TypeError: if ``config`` is not a :class:`~lightning_dltune.LoaderConfig`.
        """
        validation.instance("config", config, LoaderConfig, "a LoaderConfig, e.g. LoaderConfig(num_workers=4)")
        self._resolve_config()
        held = self.held_workers()
        self._loader_config = config if held is None else config.replace(num_workers=held)

    def mark_config_good(self) -> None:
        """The current config ran a window: it is what a failed rebuild goes back to."""
        self._resolve_config()
        self._last_good_config = self._loader_config

    def enable_rollback(self, on_failure: Optional[FailureListener] = None) -> None:
        """From now on, a loader change the machinery cannot run goes back instead of failing the fit.

        Loaders built afterwards with a config not yet proven (the start config included, which then
        falls back to ``num_workers=0``) are protected too. ``on_failure(failed, restored, exception)``
        is called after each rollback; without it, a warning says what happened.
        """
        self._on_failure = on_failure if on_failure is not None else self._warn_rollback

    # -- switches --------------------------------------------------------------------------------
    def rebuild_loaders(self, on_failure: Optional[FailureListener] = None) -> int:
        """Bring the live loaders (train and val) to the current config; returns how many were rebuilt.

        Each rebuilt loader keeps the last good config as its fallback until its new workers have
        delivered a few windows' worth of batches (see :class:`~lightning_dltune.loaders.switch.LoaderSwitch`).
        """
        if on_failure is not None or self._on_failure is None:
            self.enable_rollback(on_failure)
        self._resolve_config()
        target = self._loader_config
        if target is None:
            return 0
        rebuilt = 0
        for loader in self.live_loaders():
            if runs_with(loader, target):
                continue
            # a loader's own config forgets persistence at 0 workers: keep the chosen one
            fallback = self._last_good_config or loader_config_of(loader).replace(
                persistent_workers=target.persistent_workers
            )
            self._start_switch(loader, target, fallback if fallback != target else None, pending=False)
            rebuilt += 1
        return rebuilt

    def switch_train_loaders(self, config: LoaderConfig, on_failure: Optional[FailureListener] = None) -> int:
        """Move the live training loaders to ``config`` now, in the middle of an epoch; returns how many.

        Each loader stops handing out new work to its workers; once the batches they already hold are
        taken, new workers start on the rest of the epoch's sampler order: no batch is lost or repeated.
        Validation loaders switch at their next iteration. An iterable dataset's loader switches at its
        next epoch (a stream cannot be split).
        """
        if on_failure is not None or self._on_failure is None:
            self.enable_rollback(on_failure)
        self._resolve_config()
        previous = self._loader_config
        self.set_loader_config(config)
        config = self._loader_config  # type: ignore[assignment]
        train = self.train_loaders()
        switched = 0
        for loader in self.live_loaders():
            if not runs_with(loader, config):
                self._start_switch(loader, config, self._last_good_config or previous, pending=True)
                switched += any(loader is t for t in train)
        return switched

    def _fallback_for(self, config: LoaderConfig) -> Optional[LoaderConfig]:
        """What a loader starting with ``config`` goes back to if its machinery fails (``None``: nothing)."""
        if self._on_failure is None or config == self._last_good_config:
            return None
        if self._last_good_config is not None:
            return self._last_good_config
        if config.num_workers == 0 or self.held_workers() is not None:
            return None
        return config.replace(num_workers=0)  # the start config: loading in the training process always works

    def _start_switch(
        self, loader: TunedLoader, config: LoaderConfig, fallback: Optional[LoaderConfig], pending: bool
    ) -> LoaderSwitch:
        return LoaderSwitch(
            loader,
            config,
            fallback,
            pending=pending,
            on_rollback=self._rolled_back,
            on_confirm=self._confirmed,
            multiprocessing_context=self._multiprocessing_context(),
        )

    def _confirmed(self, switch: LoaderSwitch) -> None:
        if switch.target == self._loader_config:
            self._last_good_config = switch.target

    def _rolled_back(self, switch: LoaderSwitch, exc: BaseException) -> None:
        """One loader went back: so do the config and every other live loader (train and val)."""
        restored = switch.fallback
        assert restored is not None
        self._loader_config = restored
        self._last_good_config = restored
        for loader in self.live_loaders():
            if loader is not switch.loader and (loader.switch is not None or not runs_with(loader, restored)):
                self._start_switch(loader, restored, None, pending=True)  # drains cleanly if mid-epoch
        listener = self._on_failure or self._warn_rollback
        listener(switch.target, restored, exc)

    def _warn_rollback(self, failed: LoaderConfig, restored: LoaderConfig, exc: BaseException) -> None:
        warnings.warn(
            f"{self.owner_name}: the loaders could not run {failed.short()} ({describe_failure(exc)});"
            f" went back to {restored.short()}.",
            stacklevel=2,
        )
