"""A project's own DataLoaders made tunable in place: from the LightningModule, a plain DataModule or fit()'s arguments.

When the tuner tunes a fit whose loaders it did not build, every DataLoader Lightning receives from the
user's hooks (or from ``fit(train_dataloaders=..., val_dataloaders=...)``) changes class in place, to a
subclass of its own class with :class:`AdoptedLoader` first. It is the same object: its dataset, sampler
or batch sampler, ``collate_fn``, ``generator``, ``drop_last``, ``timeout``, multiprocessing context and a
subclass's own constructor arguments stay as the user set them; a loader Lightning re-creates (DDP's
``DistributedSampler``) is of the same class. At its first ``iter()`` the loader is prepared:

- its batches are timed where they are made: inside each worker (the user's ``worker_init_fn`` runs
  first, then torch's fetcher of that worker process is timed), or around ``next()`` without workers;
- it takes the fit's current config (workers, prefetch, persistence), through a
  :class:`~lightning_dltune.loaders.switch.LoaderSwitch` that rolls back if the machinery fails;
- a training loader resumes where a checkpoint left it (positions kept in the tuner's own state, so a
  checkpoint resumes with or without the tuner).

At the end of the fit every loader goes back to its own class, ``worker_init_fn``, ``timeout`` and
settings. A loader whose class iterates itself (its own ``__iter__``) or keeps its own state
(``state_dict``, e.g. torchdata's ``StatefulDataLoader``) is left alone: measured, not tuned.
"""

from __future__ import annotations

import copyreg
import weakref
from typing import Any, Callable, NamedTuple, Optional

from torch.utils.data import DataLoader, IterableDataset

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.loaders.collection import flatten_loaders
from lightning_dltune.loaders.live import LiveLoaders, runs_with, training_loop_position
from lightning_dltune.loaders.loader import ProductionCounters, TunedLoader, quiet_fd_server_resets, sample_bytes
from lightning_dltune.loaders.switch import loader_config_of, reconfigure
from lightning_dltune.loaders.torch_internals import (
    index_sampler_of,
    order_is_replayable,
    raise_unsent_batches,
    shutdown_workers,
    time_worker_fetches,
)

TRAIN, VAL = "train", "val"
# what preparing a loader adds to its instance; removed when it goes back to the user's class
_ADDED = (
    "production_counters",
    "worker_timeout",
    "loop_position",
    "switch",
    "fetch_recorder",
    "order_state",
    "_resume",
    "_index_override",
    "_index_recorder",
    "_drawn_log",
    "_dltune_user",
)


class TimedWorkerInit:
    """A worker's init function: the user's ``worker_init_fn`` first, then this worker's batches are timed."""

    def __init__(self, worker_init_fn: Optional[Callable[[int], None]], counters: ProductionCounters) -> None:
        self.worker_init_fn = worker_init_fn
        self.counters = counters

    def __call__(self, worker_id: int) -> None:
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)  # the user's errors reach the fit as they are
        quiet_fd_server_resets()
        raise_unsent_batches()
        time_worker_fetches(self.counters.add)


class _UserSettings(NamedTuple):
    """What a prepared loader had before: restored when the fit ends."""

    worker_init_fn: Optional[Callable[[int], None]]
    config: LoaderConfig
    timeout: float
    multiprocessing_context: Any


def why_not_tunable(loader: Any) -> Optional[str]:
    """Why ``loader`` cannot be switched, in words for the console; ``None`` when it can."""
    cls = type(loader)
    if isinstance(loader, TunedLoader):
        return None
    if not isinstance(loader, DataLoader):
        return f"the training loader ({cls.__name__}) is not a torch DataLoader"
    if cls.__iter__ is not DataLoader.__iter__:
        return f"the training DataLoader's class {cls.__name__} defines its own __iter__"
    if callable(getattr(loader, "state_dict", None)):
        return f"the training DataLoader's class {cls.__name__} keeps its own state (state_dict)"
    return None


class AdoptedLoader(TunedLoader):
    """The first base of the class a user's loader takes while the tuner tunes it (see the module docstring)."""

    fleet: UserLoaders  # set on each generated class
    role: str = TRAIN
    user_class: type = DataLoader

    def __iter__(self) -> Any:
        if "_dltune_user" not in self.__dict__:
            self.fleet.prepare(self)
        return super().__iter__()

    def position(self) -> dict[str, Any]:
        if not order_is_replayable(index_sampler_of(self)):
            return {}  # a sampler whose order the tuner cannot replay: Lightning's own resume
        return super().position()

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled and copied as the user's own loader: a generated class cannot be found by name."""
        state = {k: v for k, v in self.__dict__.items() if k not in _ADDED}
        settings = self.__dict__.get("_dltune_user")
        if settings is not None:
            state["worker_init_fn"] = settings.worker_init_fn
        state["_iterator"] = None
        return (copyreg.__newobj__, (self.user_class,), state)


class UserLoaders(LiveLoaders):
    """The project's own train and val loaders of one fit, tuned in place; built by the tuner.

    Args:
        trainer: the fit's Trainer (its loaders, its fit loop's position).
    """

    owner_name = "DataLoaderTuner"

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._loader_config: Optional[LoaderConfig] = None  # from the first training loader, until tuned
        self._last_good_config: Optional[LoaderConfig] = None
        self._on_failure = None
        self.refused: Optional[str] = None  # why the training loaders stay as they are
        self.resume_positions: list[dict[str, Any]] = []  # from a checkpoint, for the train loaders' first iter
        self._classes: dict[tuple[str, type], type] = {}
        self._adopted: weakref.WeakSet = weakref.WeakSet()
        self._requests = {TRAIN: 0, VAL: 0}
        self._start_workers: Optional[int] = None
        self._streams = False
        self._train_sample: Any = None  # (dataset, batch size) of the first training loader
        # (start config, batch bytes, loaders holding batches) -> the config within the job's budget; set at fit start
        self.clamp_start: Optional[Callable[..., LoaderConfig]] = None
        self.clamped: Optional[tuple[LoaderConfig, LoaderConfig, Optional[int]]] = None  # (asked, started, bytes)
        # (dataset, batch size, batch bytes) -> a saved start for this machine and data (start_tuned), or None
        self.start_from: Optional[Callable[..., Optional[LoaderConfig]]] = None

    @property
    def tunable(self) -> bool:
        """Whether the training loaders can be switched (none was refused)."""
        return self.refused is None

    @property
    def loader_config(self) -> Optional[LoaderConfig]:
        """The config the loaders run with (or will); ``None`` before the first training loader arrived."""
        return self._loader_config

    # -- Lightning's requests --------------------------------------------------------------------
    def received(self, stage: str, loaders: Any) -> Any:
        """The loaders a hook (or fit's arguments) just gave Lightning for ``stage``: adopt them in place."""
        if self._requests[stage]:  # a reload: the previous loaders' persistent workers stop first
            for loader in self._live(stage):
                shutdown_workers(loader)
        self._requests[stage] += 1
        found = flatten_loaders(loaders)
        reasons = [why_not_tunable(dl) for dl in found]
        if stage == TRAIN and any(reasons):
            self.refused = next(r for r in reasons if r)
            return loaders
        for loader, reason in zip(found, reasons):
            if reason is None:
                self._adopt(loader, stage)
        return loaders

    def _adopt(self, loader: DataLoader, stage: str) -> None:
        if isinstance(loader, AdoptedLoader):
            if loader.fleet is self:
                return
            loader.fleet.restore(loader)  # left over from a fit that did not end
        cls = type(loader)
        tuned = self._classes.get((stage, cls))
        if tuned is None:
            namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
            namespace.update(fleet=self, role=stage, user_class=cls)
            tuned = self._classes[(stage, cls)] = type(cls.__name__, (AdoptedLoader, cls), namespace)
        object.__setattr__(loader, "__class__", tuned)  # not recorded by Lightning's re-instantiation hooks
        self._adopted.add(loader)
        self._streams |= isinstance(loader.dataset, IterableDataset)
        if stage == TRAIN and self._start_workers is None:
            self._start_workers = loader.num_workers
            self._train_sample = (loader.dataset, loader.batch_size)
            if self._loader_config is None:  # no workers yet: persistent ones once the tuner adds some
                own = loader_config_of(loader)
                self._loader_config = own if own.num_workers else own.replace(persistent_workers=True)
                saved = self.start_from(*self._train_sample, self.estimate_batch_bytes) if self.start_from else None
                if saved is not None:  # its workers and prefetch; the loader's own pinning and persistence
                    self._loader_config = self._loader_config.replace(
                        num_workers=saved.num_workers, prefetch_factor=saved.prefetch_factor
                    )
                self._clamp(self._loader_config)

    def _clamp(self, start: LoaderConfig) -> None:
        """A start over the job's budget (16 workers on 8 CPUs) is brought within it before any worker starts."""
        if self.clamp_start is None or self._loader_config is None or not start.num_workers:
            return
        batch_bytes = self.estimate_batch_bytes()
        loaders = 2 if start.persistent_workers and self._requests[VAL] else 1  # persistent val workers hold theirs
        clamped = self.clamp_start(self._loader_config, batch_bytes=batch_bytes, loaders=loaders)
        if clamped != self._loader_config:
            self.clamped = (self._loader_config, clamped, batch_bytes)
            self._loader_config = clamped

    def prepare(self, loader: AdoptedLoader) -> None:
        """At a loader's first ``iter()``: time its batches, give it the fit's config, resume a training position."""
        counters = ProductionCounters()
        user_init = loader.worker_init_fn
        if isinstance(user_init, TimedWorkerInit):  # re-created by Lightning from a prepared loader
            user_init = user_init.worker_init_fn
        settings = _UserSettings(user_init, loader_config_of(loader), loader.timeout, loader.multiprocessing_context)
        loader.__dict__["_dltune_user"] = settings
        loader.production_counters = counters
        loader.worker_init_fn = TimedWorkerInit(user_init, counters)
        loader.worker_timeout = loader.timeout  # the user's timeout comes back with workers
        if loader.role == TRAIN:
            loader.loop_position = self._loop_position
            if self.resume_positions:
                loader.resume_at(self.resume_positions.pop(0))
        config = self._loader_config if loader.role == TRAIN else self.val_config
        if config is None and self.clamp_start is not None and loader.num_workers:
            # a validation loader before any training one (the sanity check): its own start, within the budget
            own = loader_config_of(loader)
            config = self.clamp_start(own, batch_bytes=None, loaders=1)
            if config == own:
                return
        if config is None:
            return
        fallback = self._fallback_for(config)
        if fallback is not None or not runs_with(loader, config):
            self._start_switch(loader, config, fallback, pending=False)

    def _loop_position(self) -> tuple[int, bool]:
        return training_loop_position(self.trainer)

    # -- what the control loop asks --------------------------------------------------------------
    def _live(self, stage: Optional[str] = None) -> list[TunedLoader]:
        trainer = self.trainer
        found = []
        if stage in (None, TRAIN):
            found += flatten_loaders(trainer.train_dataloader)
        if stage in (None, VAL):
            found += flatten_loaders(trainer.val_dataloaders)
        return [dl for dl in found if isinstance(dl, AdoptedLoader) and dl.fleet is self]

    def live_loaders(self) -> list[TunedLoader]:
        return self._live()

    def train_streams(self) -> bool:
        """Whether a live training loader reads an ``IterableDataset`` (it switches at epoch starts only)."""
        return any(isinstance(loader.dataset, IterableDataset) for loader in self._live(TRAIN))

    def held_workers(self) -> Optional[int]:
        return self._start_workers if self._streams else None

    def held_workers_reason(self) -> Optional[str]:
        """Why the worker count is held, in a sentence for the console; ``None`` when it is not."""
        held = self.held_workers()
        if held is None:
            return None
        return (
            f"a loader of this fit reads an IterableDataset: holding num_workers={held}, since each worker would"
            " replay a stream that does not split itself by worker; prefetch is still tuned."
        )

    def estimate_batch_bytes(self) -> Optional[int]:
        """Tensor bytes of one training batch, from one sample read in a child process (map-style data only)."""
        if self._train_sample is None:
            return None
        dataset, batch_size = self._train_sample
        if isinstance(dataset, IterableDataset) or not batch_size:
            return None
        nbytes = sample_bytes(dataset)
        return nbytes * batch_size if nbytes else None

    def positions(self) -> list[dict[str, Any]]:
        """Where each training loader stands in its epoch, for a checkpoint (see :meth:`TunedLoader.position`)."""
        return [loader.position() for loader in self._live(TRAIN)]

    # -- the end ---------------------------------------------------------------------------------
    def release(self) -> None:
        """The fit ended: every loader goes back to its own class, worker_init_fn and settings."""
        for loader in list(self._adopted):
            self.restore(loader)

    def restore(self, loader: AdoptedLoader) -> None:
        """One loader back to what the user gave (its workers stopped first)."""
        shutdown_workers(loader)
        settings = loader.__dict__.get("_dltune_user")
        if settings is not None:
            reconfigure(loader, settings.config)
            loader.worker_init_fn = settings.worker_init_fn
            loader.timeout = settings.timeout
            loader.multiprocessing_context = settings.multiprocessing_context
        for name in _ADDED:
            loader.__dict__.pop(name, None)
        object.__setattr__(loader, "__class__", loader.user_class)
        self._adopted.discard(loader)
