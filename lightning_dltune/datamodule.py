"""The DataModule mixin whose train and val loaders the tuner switches to a new config, mid-epoch or between epochs."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_dltune.control.switchable import FailureListener
from lightning_dltune.core import validation
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.loaders.arguments import check_loader_kwargs
from lightning_dltune.loaders.collection import flatten_loaders
from lightning_dltune.loaders.loader import TunedDataLoader, build_loader, sample_bytes
from lightning_dltune.loaders.switch import LoaderSwitch, loader_config_of
from lightning_dltune.loaders.torch_internals import describe_failure, shutdown_workers

# set by the mixin's own arguments, never through `loader_kwargs`
_OWNED = (
    "batch_size",
    "num_workers",
    "prefetch_factor",
    "pin_memory",
    "persistent_workers",
    "drop_last",
    "shuffle",
    "dataset",
)


def _runs_with(loader: DataLoader, config: LoaderConfig) -> bool:
    return loader_config_of(loader).dataloader_kwargs() == config.dataloader_kwargs()


class TunableDataModule:
    """Mixin for a :class:`~lightning.pytorch.LightningDataModule` whose loaders lightning-dltune tunes.

    Set ``self.train_dataset`` and ``self.val_dataset`` in ``setup()``; the mixin builds the loaders
    from the current :attr:`loader_config`: ``drop_last=True`` for training (every step sees a full
    batch), ``drop_last=False`` for validation (every sample is seen once). When the
    :class:`~lightning_dltune.DataLoaderTuner` picks a new config, the live loaders switch in place:
    mid-epoch where the sampler allows it (a map-style dataset with torch's samplers: the rest of the
    epoch's indices go to the new workers), otherwise at the next epoch start; the old workers shut
    down first, and Lightning's sampler is kept, ``DistributedSampler`` included. Each change is a
    :class:`~lightning_dltune.loaders.switch.LoaderSwitch`:
    if the loader machinery fails before the new config has delivered a few windows' worth of
    batches, the loader goes back to the last good config and the batches the dead workers held are
    loaded again (every sample once); an error raised by your dataset, collate or
    ``worker_init_fn`` code always reaches you unchanged.

    An :class:`~torch.utils.data.IterableDataset` is kept at the worker count it starts with: a
    stream that does not split itself across workers (by ``get_worker_info()``) would be replayed
    once per worker. Pass ``iterable_shards_by_worker=True`` when it does. With workers, torch batches
    inside each worker, so a training epoch over a stream drops up to ``num_workers x (batch_size - 1)``
    samples (each worker's last partial batch), not fewer than ``batch_size``.

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
        iterable_shards_by_worker: an iterable train or val dataset splits its stream across workers,
            so the tuner may change the worker count. ``False`` (default): the worker count of a
            module with an iterable dataset stays as given; prefetch is still tuned.

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
        iterable_shards_by_worker: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        validation.count("batch_size", batch_size, 1)
        validation.flag("pin_memory", pin_memory, optional=True)
        validation.flag("persistent_workers", persistent_workers, optional=True)
        validation.flag("shuffle", shuffle)
        validation.flag("iterable_shards_by_worker", iterable_shards_by_worker)
        loader_kwargs = check_loader_kwargs("loader_kwargs", loader_kwargs, owned=_OWNED)
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
        self.iterable_shards_by_worker = iterable_shards_by_worker
        self._start_workers = num_workers
        self._pin_resolved = pin_memory is not None
        self._built: list[TunedDataLoader] = []
        self._last_good_config: Optional[LoaderConfig] = None
        self._on_failure: Optional[FailureListener] = None  # set by enable_rollback()

    # -- config ---------------------------------------------------------------------------------
    @property
    def loader_config(self) -> LoaderConfig:
        """The config the loaders run with (or will, once they switch to it)."""
        self._resolve_pin_memory()
        return self._loader_config

    def set_loader_config(self, config: LoaderConfig) -> None:
        """Use ``config`` from now on; live loaders follow at :meth:`rebuild_loaders`.

        With an iterable dataset that does not shard by worker, the worker count stays as it started.

        Raises:
            TypeError: if ``config`` is not a :class:`~lightning_dltune.LoaderConfig`.
        """
        validation.instance("config", config, LoaderConfig, "a LoaderConfig, e.g. LoaderConfig(num_workers=4)")
        self._resolve_pin_memory()
        held = self.held_workers()
        self._loader_config = config if held is None else config.replace(num_workers=held)

    def held_workers(self) -> Optional[int]:
        """The worker count the loaders must keep (an iterable dataset that may not shard), or ``None``."""
        if self.iterable_shards_by_worker:
            return None
        streams = [d for d in (self.train_dataset, self.val_dataset) if isinstance(d, IterableDataset)]
        return self._start_workers if streams else None

    def held_workers_reason(self) -> Optional[str]:
        """Why the worker count is held, in a sentence for the console; ``None`` when it is not."""
        held = self.held_workers()
        if held is None:
            return None
        return (
            f"{type(self).__name__} has an IterableDataset: holding num_workers={held}, since each worker"
            " would replay a stream that does not split itself by worker; prefetch is still tuned. Pass"
            " iterable_shards_by_worker=True if the dataset splits its stream by get_worker_info()."
        )

    def estimate_batch_bytes(self) -> Optional[int]:
        """Tensor bytes of one training batch, from one sample (map-style datasets only; else ``None``).

        The sample is read in a forked child process, so a dataset that opens files or handles lazily
        (HDF5, LMDB) does not open them in the training process before its workers fork.
        """
        dataset = self.train_dataset
        if dataset is None or isinstance(dataset, IterableDataset):
            return None
        nbytes = sample_bytes(dataset)
        return nbytes * self.batch_size if nbytes else None

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
        config = self.loader_config
        loader = build_loader(
            dataset,
            config,
            batch_size=self.batch_size,
            shuffle=self.shuffle and train,
            drop_last=train,
            loop_position=self._training_loop_position if train else None,
            **kwargs,
        )
        fallback = self._fallback_for(config)
        if fallback is not None:  # a config not yet proven: its first batches may still roll back
            self._start_switch(loader, config, fallback, pending=False)
        self._built = self._built[-3:] + [loader]
        return loader

    def _training_loop_position(self) -> tuple[int, bool]:
        """(batches the fit loop took this epoch, whether its epoch is done), for mid-epoch resume."""
        trainer = self.trainer
        taken = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        return taken, taken >= trainer.num_training_batches

    def _fallback_for(self, config: LoaderConfig) -> Optional[LoaderConfig]:
        if self._on_failure is None or config == self._last_good_config:
            return None
        if self._last_good_config is not None:
            return self._last_good_config
        if config.num_workers == 0 or self.held_workers() is not None:
            return None
        return config.replace(num_workers=0)  # the start config: loading in the training process always works

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
        for loader in flatten_loaders(live(trainer)):
            if isinstance(loader, TunedDataLoader):
                shutdown_workers(loader)
                loader.switch = None

    def live_loaders(self) -> list[TunedDataLoader]:
        """The tunable loaders Lightning currently iterates (train and val)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return []
        loaders = flatten_loaders(trainer.train_dataloader) + flatten_loaders(trainer.val_dataloaders)
        return [dl for dl in loaders if isinstance(dl, TunedDataLoader)]

    def mark_config_good(self) -> None:
        """The current config ran an epoch: it is what a failed rebuild goes back to."""
        self._last_good_config = self.loader_config

    def enable_rollback(self, on_failure: Optional[FailureListener] = None) -> None:
        """From now on, a loader change the machinery cannot run goes back instead of failing the fit.

        Loaders built afterwards with a config not yet proven (the start config included, which then
        falls back to ``num_workers=0``) are protected too. ``on_failure(failed, restored, exception)``
        is called after each rollback; without it, the module warns.
        """
        self._on_failure = on_failure if on_failure is not None else _warn_rollback

    def rebuild_loaders(self, on_failure: Optional[FailureListener] = None) -> int:
        """Bring the live loaders (train and val) to :attr:`loader_config`; returns how many were rebuilt.

        Each rebuilt loader keeps the last good config as its fallback until its new workers have
        delivered a few windows' worth of batches (see :class:`~lightning_dltune.loaders.switch.LoaderSwitch`).
        """
        if on_failure is not None or self._on_failure is None:
            self.enable_rollback(on_failure)
        target = self.loader_config
        rebuilt = 0
        for loader in self.live_loaders():
            if _runs_with(loader, target):
                continue
            # a loader's own config forgets persistence at 0 workers: keep the module's choice
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
        previous = self.loader_config
        self.set_loader_config(config)
        config = self.loader_config
        train = flatten_loaders(self.trainer.train_dataloader)
        switched = 0
        for loader in self.live_loaders():
            if not _runs_with(loader, config):
                self._start_switch(loader, config, self._last_good_config or previous, pending=True)
                switched += any(loader is t for t in train)
        return switched

    def _start_switch(
        self, loader: TunedDataLoader, config: LoaderConfig, fallback: Optional[LoaderConfig], pending: bool
    ) -> LoaderSwitch:
        return LoaderSwitch(
            loader,
            config,
            fallback,
            pending=pending,
            on_rollback=self._rolled_back,
            on_confirm=self._confirmed,
            multiprocessing_context=self.loader_kwargs.get("multiprocessing_context"),
        )

    def _confirmed(self, switch: LoaderSwitch) -> None:
        if switch.target == self._loader_config:
            self._last_good_config = switch.target

    def _rolled_back(self, switch: LoaderSwitch, exc: BaseException) -> None:
        """One loader went back: so do the module's config and every other live loader (train and val)."""
        restored = switch.fallback
        assert restored is not None
        self._loader_config = restored
        self._last_good_config = restored
        for loader in self.live_loaders():
            if loader is not switch.loader and (loader.switch is not None or not _runs_with(loader, restored)):
                self._start_switch(loader, restored, None, pending=True)  # drains cleanly if mid-epoch
        listener = self._on_failure or _warn_rollback
        listener(switch.target, restored, exc)

    def teardown(self, stage: str) -> None:
        for loader in self.live_loaders() + self._built:
            shutdown_workers(loader)
        parent = getattr(super(), "teardown", None)
        if parent is not None:
            parent(stage)


def _warn_rollback(failed: LoaderConfig, restored: LoaderConfig, exc: BaseException) -> None:
    warnings.warn(
        f"TunableDataModule: the loaders could not run {failed.short()} ({describe_failure(exc)});"
        f" went back to {restored.short()}.",
        stacklevel=2,
    )
