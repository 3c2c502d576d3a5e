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

    The validation loaders follow the training loaders' config until :meth:`switch_val_loaders` gives
    them one of their own (a validation step is shorter than a training step: it may starve where
    training does not). A subclass sets ``_loader_config``, ``_last_good_config = None`` and
    ``_on_failure = None`` and provides :meth:`live_loaders` and :meth:`held_workers`.
    """

    _loader_config: Optional[LoaderConfig]
    _last_good_config: Optional[LoaderConfig]
    _on_failure: Optional[FailureListener]
    _val_config: Optional[LoaderConfig] = None  # the validation loaders' own config; None: the training one
    _last_good_val: Optional[LoaderConfig] = None
    owner_name = "the loaders"  # in warnings: whose loaders went back

    # -- what a subclass provides ----------------------------------------------------------------
    def live_loaders(self) -> list[TunedLoader]:
        """The tunable loaders Lightning currently iterates (train and val)."""
        raise NotImplementedError

    def train_loaders(self) -> list[DataLoader]:
        """The loaders of the fit loop (tunable or not)."""
        trainer = getattr(self, "trainer", None)
        return flatten_loaders(trainer.train_dataloader) if trainer is not None else []

    def val_loaders(self) -> list[TunedLoader]:
        """The tunable validation loaders Lightning currently iterates."""
        trainer = getattr(self, "trainer", None)
        found = flatten_loaders(trainer.val_dataloaders) if trainer is not None else []
        return [dl for dl in found if isinstance(dl, TunedLoader)]

    @property
    def val_config(self) -> Optional[LoaderConfig]:
        """The validation loaders' config: their own once the tuner gave them one, else the training one."""
        self._resolve_config()
        return self._val_config if self._val_config is not None else self._loader_config

    def _target_of(self, loader: DataLoader) -> Optional[LoaderConfig]:
        """The config ``loader`` should run: the validation config for a validation loader."""
        if self._val_config is not None and any(loader is v for v in self.val_loaders()):
            return self._val_config
        return self._loader_config

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
        if self._loader_config is None:
            return 0
        rebuilt = 0
        for loader in self.live_loaders():
            target = self._target_of(loader)
            if target is None or runs_with(loader, target):
                continue
            good = self._last_good_val if target is self._val_config else self._last_good_config
            # a loader's own config forgets persistence at 0 workers: keep the chosen one
            fallback = good or loader_config_of(loader).replace(persistent_workers=target.persistent_workers)
            self._start_switch(loader, target, fallback if fallback != target else None, pending=False)
            rebuilt += 1
        return rebuilt

    def switch_train_loaders(
        self, config: LoaderConfig, on_failure: Optional[FailureListener] = None, take_over: bool = False
    ) -> int:
        """Move the live training loaders to ``config`` now, in the middle of an epoch; returns how many.

        Each loader stops handing out new work to its workers; once the batches they already hold are
        taken, new workers start on the rest of the epoch's sampler order: no batch is lost or repeated.
        ``take_over`` (a switch to more workers): the old workers stop now and the new ones make the batches
        they held first, where the loader knows them and few were made.
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
            if self._target_of(loader) is not config:
                continue  # a validation loader with a config of its own
            if not runs_with(loader, config):
                self._start_switch(
                    loader, config, self._last_good_config or previous, pending=True, take_over=take_over
                )
                switched += any(loader is t for t in train)
        return switched

    def has_val_config(self) -> bool:
        """Whether the validation loaders run a config of their own (else they follow the training one)."""
        return self._val_config is not None

    def switch_val_loaders(self, config: LoaderConfig, on_failure: Optional[FailureListener] = None) -> int:
        """Give the validation loaders ``config`` of their own, from their next run on; returns how many switch.

        Until its new workers have delivered a few windows' worth of batches, a validation loader that
        fails goes back to the last validation config that delivered (every sample once per run).
        """
        if on_failure is not None or self._on_failure is None:
            self.enable_rollback(on_failure)
        previous = self.val_config
        held = self.held_workers()
        self._val_config = config if held is None else config.replace(num_workers=held)
        switched = 0
        for loader in self.val_loaders():
            if not runs_with(loader, self._val_config):
                self._start_switch(loader, self._val_config, self._last_good_val or previous, pending=True)
                switched += 1
        return switched

    def mark_val_config_good(self) -> None:
        """The validation config ran a validation: it is what a failed validation switch goes back to."""
        self._last_good_val = self.val_config

    def _fallback_for(self, config: LoaderConfig) -> Optional[LoaderConfig]:
        """What a loader starting with ``config`` goes back to if its machinery fails (``None``: nothing)."""
        own_val = self._val_config is not None and config is self._val_config
        good = self._last_good_val if own_val else self._last_good_config
        if self._on_failure is None or config == good:
            return None
        if good is not None:
            return good
        if config.num_workers == 0 or self.held_workers() is not None:
            return None
        return config.replace(num_workers=0)  # the start config: loading in the training process always works

    def _start_switch(
        self,
        loader: TunedLoader,
        config: LoaderConfig,
        fallback: Optional[LoaderConfig],
        pending: bool,
        take_over: bool = False,
    ) -> LoaderSwitch:
        return LoaderSwitch(
            loader,
            config,
            fallback,
            pending=pending,
            on_rollback=self._rolled_back,
            on_confirm=self._confirmed,
            multiprocessing_context=self._multiprocessing_context(),
            take_over=take_over,
        )

    def _confirmed(self, switch: LoaderSwitch) -> None:
        if self._val_config is not None and switch.target == self._val_config:
            self._last_good_val = switch.target
        elif switch.target == self._loader_config:
            self._last_good_config = switch.target

    def _rolled_back(self, switch: LoaderSwitch, exc: BaseException) -> None:
        """One loader went back: so do its side's config and that side's other live loaders.

        The sides are the training loaders (with the validation loaders while they follow them) and
        the validation loaders once they run a config of their own.
        """
        restored = switch.fallback
        assert restored is not None
        own_val = self._val_config is not None and any(switch.loader is v for v in self.val_loaders())
        if own_val:
            self._val_config = self._last_good_val = restored
            side = self.val_loaders()
        else:
            self._loader_config = self._last_good_config = restored
            side = [dl for dl in self.live_loaders() if self._target_of(dl) is self._loader_config]
        for loader in side:
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
