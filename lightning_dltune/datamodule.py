"""The DataModule mixin whose train and val loaders the tuner can rebuild between epochs."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader, Dataset

from lightning_dltune import validation
from lightning_dltune.config import LoaderConfig
from lightning_dltune.loader import TunedDataLoader, build_loader, loader_config_of, reconfigure, shutdown_workers

# set by the mixin's own arguments, never through `loader_kwargs`
_OWNED = ("batch_size", "num_workers", "prefetch_factor", "pin_memory", "persistent_workers", "drop_last",
          "shuffle", "dataset")


def _flatten(loaders: Any) -> list:
    if loaders is None:
        return []
    if isinstance(loaders, DataLoader):
        return [loaders]
    if isinstance(loaders, CombinedLoader):
        return list(loaders.flattened)
    if isinstance(loaders, dict):
        return [x for v in loaders.values() for x in _flatten(v)]
    if isinstance(loaders, (list, tuple)):
        return [x for v in loaders for x in _flatten(v)]
    return []


def _runs_with(loader: DataLoader, config: LoaderConfig) -> bool:
    return loader_config_of(loader).dataloader_kwargs() == config.dataloader_kwargs()


class TunableDataModule:
    """Mixin for a :class:`~lightning.pytorch.LightningDataModule` whose loaders lightning-dltune tunes.

    Set ``self.train_dataset`` and ``self.val_dataset`` in ``setup()``; the mixin builds the loaders
    from the current :attr:`loader_config`: ``drop_last=True`` for training (every step sees a full
    batch), ``drop_last=False`` for validation (every sample is seen once). When the
    :class:`~lightning_dltune.DataLoaderTuner` picks a new config, the live loaders are rebuilt in
    place at the next epoch start (old workers shut down first), keeping Lightning's sampler,
    ``DistributedSampler`` included.

    Args:
        batch_size: samples per batch (train and val).
        num_workers: initial worker processes.
        prefetch_factor: initial batches prefetched per worker.
        pin_memory: page-locked batches; ``None``: on when training on CUDA.
        persistent_workers: keep workers between epochs; ``None``: on (takes effect when ``num_workers > 0``).
        shuffle: shuffle the training set (ignored when a ``sampler`` is given).
        loader_kwargs: any other :class:`~torch.utils.data.DataLoader` argument for both loaders
            (``collate_fn``, ``sampler``, ``worker_init_fn``, ``generator``, ``multiprocessing_context``,
            ``timeout``, ...). Override :meth:`train_loader_kwargs` / :meth:`val_loader_kwargs` for
            per-stage values.

    Raises:
        ValueError: for a negative ``num_workers``, ``batch_size < 1``, ``prefetch_factor < 1``, a
            negative ``timeout`` in ``loader_kwargs``, or ``loader_kwargs`` naming an argument the mixin
            owns (``batch_size``, ``num_workers``, ...) or one DataLoader does not accept.
        TypeError: for a count that is not an integer, a switch that is not a ``bool``, or
            ``loader_kwargs`` that is not a mapping (also a ``ValueError``).

    Example::

        class MyData(TunableDataModule, L.LightningDataModule):
            def setup(self, stage):
                self.train_dataset = MyDataset("train")
                self.val_dataset = MyDataset("val")

        trainer = L.Trainer(callbacks=[DataLoaderTuner()])
        trainer.fit(model, datamodule=MyData(batch_size=64, num_workers=0))
    """

    train_dataset: Optional[Dataset] = None
    val_dataset: Optional[Dataset] = None

    def __init__(
        self,
        *args: Any,
        batch_size: int = 32,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: Optional[bool] = None,
        persistent_workers: Optional[bool] = None,
        shuffle: bool = True,
        loader_kwargs: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        validation.count("batch_size", batch_size, 1)
        validation.flag("pin_memory", pin_memory, optional=True)
        validation.flag("persistent_workers", persistent_workers, optional=True)
        validation.flag("shuffle", shuffle)
        loader_kwargs = validation.dataloader_kwargs("loader_kwargs", loader_kwargs, owned=_OWNED)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.loader_kwargs = loader_kwargs
        self._pin_memory_arg = pin_memory
        # validated here so a bad value fails at construction, not at the first epoch
        self._loader_config = LoaderConfig(
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            pin_memory=bool(pin_memory),
            persistent_workers=True if persistent_workers is None else persistent_workers,
        )
        self._pin_resolved = pin_memory is not None
        self._built: list[TunedDataLoader] = []
        self._last_good_config: Optional[LoaderConfig] = None

    # -- config ---------------------------------------------------------------------------------
    @property
    def loader_config(self) -> LoaderConfig:
        """The config the loaders run with (or will, from the next epoch start)."""
        self._resolve_pin_memory()
        return self._loader_config

    def set_loader_config(self, config: LoaderConfig) -> None:
        """Use ``config`` from now on; live loaders follow at :meth:`rebuild_loaders`.

        Raises:
            TypeError: if ``config`` is not a :class:`~lightning_dltune.LoaderConfig`.
        """
        validation.instance("config", config, LoaderConfig, "a LoaderConfig, e.g. LoaderConfig(num_workers=4)")
        self._resolve_pin_memory()
        self._loader_config = config

    def _resolve_pin_memory(self) -> None:
        if self._pin_resolved:
            return
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            on_cuda = trainer.strategy.root_device.type == "cuda"
        else:
            on_cuda = torch.cuda.is_available()
        self._loader_config = self._loader_config.replace(pin_memory=on_cuda)
        self._pin_resolved = trainer is not None

    # -- loaders --------------------------------------------------------------------------------
    def train_loader_kwargs(self) -> dict[str, Any]:
        """Extra DataLoader arguments of the training loader (default: ``loader_kwargs``)."""
        return dict(self.loader_kwargs)

    def val_loader_kwargs(self) -> dict[str, Any]:
        """Extra DataLoader arguments of the validation loader (default: ``loader_kwargs``)."""
        return dict(self.loader_kwargs)

    def build_loader(self, dataset: Dataset, train: bool, **kwargs: Any) -> TunedDataLoader:
        """A loader for ``dataset`` from the current config (``drop_last`` = ``train``)."""
        loader = build_loader(
            dataset,
            self.loader_config,
            batch_size=self.batch_size,
            shuffle=self.shuffle and train,
            drop_last=train,
            **kwargs,
        )
        self._built = self._built[-3:] + [loader]
        return loader

    def train_dataloader(self) -> TunedDataLoader:
        if self.train_dataset is None:
            raise RuntimeError(
                f"{type(self).__name__}.setup() must set `self.train_dataset` before training"
                " (TunableDataModule builds the loader from it)."
            )
        self._shut_down_live(lambda trainer: trainer.train_dataloader)
        return self.build_loader(self.train_dataset, train=True, **self.train_loader_kwargs())

    def val_dataloader(self) -> Any:
        if self.val_dataset is None:
            return []
        self._shut_down_live(lambda trainer: trainer.val_dataloaders)
        return self.build_loader(self.val_dataset, train=False, **self.val_loader_kwargs())

    def _shut_down_live(self, live: Callable[[Any], Any]) -> None:
        """On a reload, stop the previous loaders' persistent workers before new ones start."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return
        for loader in _flatten(live(trainer)):
            if isinstance(loader, TunedDataLoader):
                shutdown_workers(loader)

    def live_loaders(self) -> list[TunedDataLoader]:
        """The tunable loaders Lightning currently iterates (train and val)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return []
        loaders = _flatten(trainer.train_dataloader) + _flatten(trainer.val_dataloaders)
        return [dl for dl in loaders if isinstance(dl, TunedDataLoader)]

    def mark_config_good(self) -> None:
        """The current config ran an epoch: it is what a failed rebuild goes back to."""
        self._last_good_config = self.loader_config

    def rebuild_loaders(
        self, on_failure: Optional[Callable[[LoaderConfig, BaseException], None]] = None
    ) -> int:
        """Bring the live loaders to :attr:`loader_config`; returns how many were rebuilt.

        Each rebuilt loader keeps its previous config as a fallback until its new workers deliver
        their first batch: if they die or cannot start (out of memory, ``/dev/shm`` full), the loader
        goes back to it and ``on_failure(previous_config, exception)`` is called.
        """
        target = self.loader_config
        mp_context = self.loader_kwargs.get("multiprocessing_context")
        rebuilt = 0
        for loader in self.live_loaders():
            if _runs_with(loader, target):
                continue
            previous = self._last_good_config or loader_config_of(loader)
            reconfigure(loader, target, mp_context)
            loader.dltune_fallback = (previous, self._fallback_notifier(on_failure))
            rebuilt += 1
        return rebuilt

    def switch_train_loaders(
        self, config: LoaderConfig, on_failure: Optional[Callable[[LoaderConfig, BaseException], None]] = None
    ) -> int:
        """Move the live training loaders to ``config`` now, in the middle of an epoch; returns how many.

        Each loader stops handing out new work to its workers; once the batches they already hold are
        taken, new workers start on the rest of the epoch's sampler order: no batch is lost or repeated.
        Validation loaders follow at the next :meth:`rebuild_loaders`.
        """
        previous = self.loader_config
        self.set_loader_config(config)
        trainer = getattr(self, "trainer", None)
        switched = 0
        for loader in _flatten(trainer.train_dataloader if trainer is not None else None):
            if isinstance(loader, TunedDataLoader) and not _runs_with(loader, config):
                loader.dltune_mp_context = self.loader_kwargs.get("multiprocessing_context")
                loader.dltune_fallback = (previous, self._fallback_notifier(on_failure))
                loader.dltune_mid_epoch = True
                loader.dltune_switch = config
                switched += 1
        return switched

    def _fallback_notifier(
        self, on_failure: Optional[Callable[[LoaderConfig, BaseException], None]]
    ) -> Callable[[LoaderConfig, BaseException], None]:
        def notify(previous: LoaderConfig, exc: BaseException) -> None:
            self.set_loader_config(previous)
            for loader in self.live_loaders():  # the other live loaders go back too
                if not _runs_with(loader, previous):
                    reconfigure(loader, previous)
                    loader.dltune_fallback = None
            if on_failure is not None:
                on_failure(previous, exc)

        return notify

    def teardown(self, stage: str) -> None:
        for loader in self.live_loaders() + self._built:
            shutdown_workers(loader)
        parent = getattr(super(), "teardown", None)
        if parent is not None:
            parent(stage)
