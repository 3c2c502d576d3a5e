"""DataLoaders that can see inside themselves, and changing a live loader's workers in place.

A :class:`TunedDataLoader` is a plain :class:`~torch.utils.data.DataLoader` (Lightning may re-create
it, e.g. to inject a ``DistributedSampler``) whose iterator reports to a fetch recorder:

- the fetch wait of every batch, and the exact number of ready batches when the loop asked for it
  (batches the workers finished minus batches the loop took), so a stall is exact;
- the start-up of every iterator (workers starting and the first batch), apart from fetch waits;
- inside the workers, the wall and CPU time to produce each batch (samples plus collate), written
  to a small shared-memory array: what a worker costs per batch, measured where it is spent.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any, Callable, Iterator, Optional, Protocol

from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from lightning_dltune.config import LoaderConfig

_SLOTS = 1024  # worker slots in the shared counters (slot 0: the training process)
_FIELDS = 3  # batches, wall seconds, cpu seconds


class FetchRecorder(Protocol):
    def record_fetch(self, wait_s: float, ready: int = -1) -> None: ...

    def record_startup(self, seconds: float) -> None: ...


class ProductionCounters:
    """Cumulative batches, wall and CPU seconds of batch production, per worker, in shared memory.

    Each worker writes only its own slot, so no lock is needed; the training process only reads.
    """

    def __init__(self) -> None:
        self._array = multiprocessing.RawArray("d", _FIELDS * _SLOTS)

    def add(self, wall_s: float, cpu_s: float) -> None:
        info = get_worker_info()
        base = _FIELDS * ((info.id + 1) % _SLOTS if info is not None else 0)
        arr = self._array
        arr[base] += 1.0
        arr[base + 1] += wall_s
        arr[base + 2] += cpu_s

    def produced(self, num_workers: int) -> float:
        """Batches produced so far by the training process and workers ``0..num_workers-1``."""
        arr = self._array
        total = 0.0
        for base in range(0, _FIELDS * (num_workers + 1), _FIELDS):
            total += arr[base]
        return total

    def totals(self) -> tuple[float, float, float]:
        """(batches, wall seconds, cpu seconds) summed over all slots."""
        arr = self._array
        return (sum(arr[0::_FIELDS]), sum(arr[1::_FIELDS]), sum(arr[2::_FIELDS]))


# Start of the batch being produced in this process (workers produce one batch at a time).
_batch_started: Optional[tuple[float, float]] = None


class ProbedDataset(Dataset):
    """Wraps a map-style dataset to time batch production where it happens (in the workers).

    Attribute access falls through to the wrapped dataset, so ``loader.dataset.classes`` still works.
    """

    def __init__(self, dataset: Dataset, counters: Optional[ProductionCounters] = None) -> None:
        self.dataset = dataset
        self.counters = counters if counters is not None else ProductionCounters()

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        global _batch_started
        if _batch_started is None:
            _batch_started = (time.perf_counter(), time.thread_time())
        return self.dataset[index]

    def __getitems__(self, indices: list) -> list:
        global _batch_started
        _batch_started = (time.perf_counter(), time.thread_time())
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            return getitems(indices)
        return [self.dataset[i] for i in indices]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["dataset"], name)


class TimedCollate:
    """Calls the user's collate function and closes the production timer of the batch."""

    def __init__(self, collate_fn: Callable, counters: ProductionCounters) -> None:
        self.collate_fn = collate_fn
        self.counters = counters

    def __call__(self, samples: Any) -> Any:
        global _batch_started
        batch = self.collate_fn(samples)
        if _batch_started is not None:
            wall0, cpu0 = _batch_started
            _batch_started = None
            self.counters.add(time.perf_counter() - wall0, time.thread_time() - cpu0)
        return batch


def counters_of(loader: DataLoader) -> Optional[ProductionCounters]:
    dataset = loader.dataset
    return dataset.counters if isinstance(dataset, ProbedDataset) else None


def _is_worker_failure(exc: BaseException) -> bool:
    """Workers died or could not start (killed, out of memory, /dev/shm full); never a dataset error."""
    message = str(exc)
    if "Original Traceback" in message:  # an exception from the user's dataset, re-raised by torch
        return False
    if isinstance(exc, (MemoryError, OSError)):
        return True
    return isinstance(exc, RuntimeError) and any(
        s in message for s in ("exited unexpectedly", "killed by signal", "shared memory", "shm", "Too many open files")
    )


class _ProbedIterator(Iterator):
    def __init__(self, loader: TunedDataLoader, iterator: Iterator, started: float) -> None:
        self._loader = loader
        self._counters = counters_of(loader)
        self._switch_to: Optional[LoaderConfig] = None
        self._remaining: Optional[Iterator] = None  # the sampler's rest of the epoch, during a switch
        self._use(iterator, started)

    def _use(self, iterator: Iterator, started: float) -> None:
        self._it = iterator
        self._started = started
        self._first = True
        self._workers = self._loader.num_workers
        self._baseline = self._counters.produced(self._workers) if self._counters is not None else 0.0
        self._consumed = 0

    def _ready(self) -> int:
        if self._counters is None:
            return -1
        if self._workers == 0:
            return 0  # the training process makes every batch itself: every fetch stalls
        return max(0, int(self._counters.produced(self._workers) - self._baseline) - self._consumed)

    def __next__(self) -> Any:
        if self._loader.dltune_switch is not None:
            self._begin_switch()
        recorder = self._loader.fetch_recorder
        if self._first:
            batch = self._first_batch()
            if recorder is not None:
                recorder.record_startup(time.perf_counter() - self._started)
            return batch
        ready = self._ready() if recorder is not None else -1
        t0 = time.perf_counter()
        try:
            batch = next(self._it)
        except StopIteration:
            self._start_switched()  # or the epoch really ended
            return self.__next__()  # the new workers' first batch: start-up, not fetch wait
        if recorder is not None:
            recorder.record_fetch(time.perf_counter() - t0, ready)
        self._consumed += 1
        return batch

    def _begin_switch(self) -> None:
        """Stop feeding the old workers; once their queued batches are taken, new ones take over."""
        self._switch_to, self._loader.dltune_switch = self._loader.dltune_switch, None
        sampler_iter = getattr(self._it, "_sampler_iter", None)
        if sampler_iter is None:  # not a torch iterator we can split: switch at the next epoch instead
            self._switch_to = None
            return
        self._remaining = sampler_iter
        self._it._sampler_iter = iter(())

    def _start_switched(self) -> None:
        """The old workers delivered all they were given: new ones take the rest of the epoch."""
        if self._switch_to is None:
            raise StopIteration
        config, remaining = self._switch_to, self._remaining
        self._switch_to = self._remaining = None
        reconfigure(self._loader, config, self._loader.dltune_mp_context)
        started = time.perf_counter()
        self._use(self._loader._iter_remaining(remaining), started)

    def _first_batch(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            self._start_switched()  # or the epoch really ended
            return self._first_batch()
        except Exception as exc:
            fallback = self._loader.dltune_fallback
            if fallback is None or not _is_worker_failure(exc):
                raise
            shutdown = getattr(self._it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            remaining = getattr(self._it, "_sampler_iter", None) if self._loader.dltune_mid_epoch else None
            self._use(self._loader._roll_back(fallback, exc, remaining), self._started)
            batch = next(self._it)
        self._first = False
        self._consumed = 1
        self._loader.dltune_fallback = None  # this config started: it is the new last good one
        self._loader.dltune_mid_epoch = False
        return batch


class _Remaining:
    """Stands in for a sampler: its iteration is what an interrupted iteration had left."""

    def __init__(self, iterator: Iterator) -> None:
        self._iterator = iterator

    def __iter__(self) -> Iterator:
        return self._iterator


class TunedDataLoader(DataLoader):
    """A :class:`~torch.utils.data.DataLoader` that reports fetch waits, exact stalls and worker cost.

    It takes exactly DataLoader's arguments. Build it with :func:`build_loader` to get worker-side
    timing (a map-style dataset is wrapped in :class:`ProbedDataset`). Reports go to
    ``fetch_recorder`` when one is set (the :class:`~lightning_dltune.DataLoaderTuner` sets it on the
    training loaders); otherwise the iterator adds nothing but one attribute read per batch.
    """

    fetch_recorder: Optional[FetchRecorder] = None
    # (last good config, callback) while a rebuilt loader has not yet delivered its first batch
    dltune_fallback: Optional[tuple[LoaderConfig, Callable[[LoaderConfig, BaseException], None]]] = None
    # a config to switch to in the middle of the epoch, without losing or repeating a batch
    dltune_switch: Optional[LoaderConfig] = None
    dltune_mid_epoch: bool = False
    dltune_mp_context: Any = None  # the multiprocessing context to use once workers are added

    @property
    def _index_sampler(self) -> Any:
        resume = self.__dict__.get("_dltune_resume")
        return resume if resume is not None else DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]

    def _iter_remaining(self, remaining: Iterator) -> Iterator:
        """A torch iterator over what is left of ``remaining`` (the sampler's iteration of this epoch)."""
        self._dltune_resume = _Remaining(remaining)
        try:
            iterator = DataLoader.__iter__(self)
        finally:
            self._dltune_resume = None
        # a persistent iterator starts its next epochs from the loader's whole sampler again
        iterator._index_sampler = DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]
        return iterator

    def __iter__(self) -> Iterator:
        started = time.perf_counter()
        try:
            iterator = super().__iter__()
        except Exception as exc:
            if self.dltune_fallback is None or not _is_worker_failure(exc):
                raise
            iterator = self._roll_back(self.dltune_fallback, exc)
        return _ProbedIterator(self, iterator, started)

    def _roll_back(
        self, fallback: tuple[LoaderConfig, Callable], exc: BaseException, remaining: Optional[Iterator] = None
    ) -> Iterator:
        config, notify = fallback
        self.dltune_fallback = None
        reconfigure(self, config)
        notify(config, exc)
        # mid-epoch, the rest of the epoch goes on; batches handed to the dead workers are lost
        return self._iter_remaining(remaining) if remaining is not None else super().__iter__()


def loader_config_of(loader: DataLoader) -> LoaderConfig:
    """The :class:`LoaderConfig` a live loader runs with."""
    return LoaderConfig(
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor or 2,
        pin_memory=bool(loader.pin_memory),
        persistent_workers=bool(loader.persistent_workers),
    )


def shutdown_workers(loader: DataLoader) -> None:
    """Stop a loader's persistent workers now (not whenever the garbage collector gets to them)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        loader._iterator = None


def reconfigure(loader: DataLoader, config: LoaderConfig, multiprocessing_context: Any = None) -> None:
    """Change a live loader's workers/prefetch/pinning in place; its next ``iter()`` starts the new workers.

    The old persistent workers are shut down first. Dataset, sampler, batch size and ``drop_last``
    are untouched, so Lightning's own loader (with its injected ``DistributedSampler``) stays valid.
    """
    shutdown_workers(loader)
    kwargs = config.dataloader_kwargs()
    loader.num_workers = kwargs["num_workers"]
    loader.prefetch_factor = kwargs["prefetch_factor"]
    loader.pin_memory = kwargs["pin_memory"]
    # DataLoader forbids setting this attribute after __init__; in place it is safe (read at iter()).
    object.__setattr__(loader, "persistent_workers", kwargs["persistent_workers"])
    if multiprocessing_context is not None and config.num_workers > 0 and loader.multiprocessing_context is None:
        loader.multiprocessing_context = multiprocessing_context


def build_loader(
    dataset: Dataset,
    config: LoaderConfig,
    batch_size: Optional[int],
    shuffle: bool = False,
    drop_last: bool = False,
    collate_fn: Optional[Callable] = None,
    **kwargs: Any,
) -> TunedDataLoader:
    """A :class:`TunedDataLoader` for ``dataset`` with ``config``, timing production in the workers.

    Map-style datasets are wrapped in :class:`ProbedDataset`; iterable datasets are used as they are
    (no worker-side timing; fetch waits are still exact).
    """
    from torch.utils.data import default_collate

    if kwargs.get("sampler") is not None or kwargs.get("batch_sampler") is not None:
        shuffle = False
    mp_context = kwargs.pop("multiprocessing_context", None)
    collate = collate_fn if collate_fn is not None else default_collate
    if not isinstance(dataset, IterableDataset) and batch_size is not None and kwargs.get("batch_sampler") is None:
        counters = ProductionCounters()
        dataset = ProbedDataset(dataset, counters)
        collate = TimedCollate(collate, counters)
    loader_kwargs = config.dataloader_kwargs()
    if config.num_workers > 0 and mp_context is not None:
        loader_kwargs["multiprocessing_context"] = mp_context
    if isinstance(dataset, IterableDataset):
        shuffle = False
    return TunedDataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        collate_fn=collate,
        **loader_kwargs,
        **kwargs,
    )
