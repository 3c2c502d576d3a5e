"""The DataModule mixin whose train and val loaders the tuner switches to a new config, mid-epoch or between epochs."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset, IterableDataset

from lightning_dltune.control.switchable import FailureListener
from lightning_dltune.core import validation
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.loaders.arguments import check_loader_kwargs
from lightning_dltune.loaders.collection import flatten_loaders
from lightning_dltune.loaders.live import LiveLoaders, training_loop_position
from lightning_dltune.loaders.loader import TunedDataLoader, TunedLoader, build_loader, sample_bytes
from lightning_dltune.loaders.torch_internals import shutdown_workers

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


class TunableDataModule(LiveLoaders):
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
        val_num_workers: the validation loader's own initial workers; ``None``: it follows the
            training config until the tuner gives it its own (from its own validation runs).
        val_prefetch_factor: the validation loader's own initial prefetch; ``None``: as for workers.

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
    owner_name = "TunableDataModule"

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
        val_num_workers: Optional[int] = None,
        val_prefetch_factor: Optional[int] = None,
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
        validation.count("val_num_workers", val_num_workers, 0, optional=True)
        validation.count("val_prefetch_factor", val_prefetch_factor, 1, optional=True)
        self._val_config: Optional[LoaderConfig] = None
        if val_num_workers is not None or val_prefetch_factor is not None:
            self._val_config = self._loader_config.replace(
                num_workers=num_workers if val_num_workers is None else val_num_workers,
                prefetch_factor=prefetch_factor if val_prefetch_factor is None else val_prefetch_factor,
            )
        self._last_good_val: Optional[LoaderConfig] = None
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

    def _resolve_config(self) -> None:
        self._resolve_pin_memory()

    def _multiprocessing_context(self) -> Any:
        return self.loader_kwargs.get("multiprocessing_context")

    def _resolve_pin_memory(self) -> None:
        if self._pin_resolved:
            return
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            on_cuda = trainer.strategy.root_device.type == "cuda"
        else:
            on_cuda = torch.cuda.is_available()
        self._loader_config = self._loader_config.replace(pin_memory=on_cuda)
        if self._val_config is not None:
            self._val_config = self._val_config.replace(pin_memory=on_cuda)
        self._pin_resolved = trainer is not None

    # -- loaders --------------------------------------------------------------------------------
    def train_loader_kwargs(self) -> dict[str, Any]:
        """Extra DataLoader arguments of the training loader (default: ``loader_kwargs``)."""
        return dict(self.loader_kwargs)

    def val_loader_kwargs(self) -> dict[str, Any]:
        """Extra DataLoader arguments of the validation loader (default: ``loader_kwargs``)."""
        return dict(self.loader_kwargs)

    def build_loader(self, dataset: Dataset, train: bool, **kwargs: Any) -> TunedDataLoader:
        """A loader for ``dataset`` from the current config (``drop_last`` = ``train``; validation: its own config)."""
        config = self.loader_config if train else self.val_config
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
        return training_loop_position(self.trainer)

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
            if isinstance(loader, TunedLoader):
                shutdown_workers(loader)
                loader.switch = None

    def live_loaders(self) -> list[TunedLoader]:
        """The tunable loaders Lightning currently iterates (train and val)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return []
        loaders = flatten_loaders(trainer.train_dataloader) + flatten_loaders(trainer.val_dataloaders)
        return [dl for dl in loaders if isinstance(dl, TunedLoader)]

    def teardown(self, stage: str) -> None:
        for loader in self.live_loaders() + self._built:
            shutdown_workers(loader)
        parent = getattr(super(), "teardown", None)
        if parent is not None:
            parent(stage)
