"""DataLoaders that can see inside themselves, resume mid-epoch, and carry out a loader switch.

A :class:`TunedDataLoader` is a plain :class:`~torch.utils.data.DataLoader` (Lightning may re-create
it, e.g. to inject a ``DistributedSampler``) whose iterator reports to a fetch recorder:

- the fetch wait of every batch, and the exact number of ready batches when the loop asked for it
  (batches the workers finished minus batches the loop took), so a stall is exact;
- the start-up of every iterator (workers starting and the first batch), apart from fetch waits;
- inside the workers, the wall and CPU time to produce each batch (samples plus collate), written
  to a small shared-memory array: what a worker costs per batch, measured where it is spent (for an
  iterable dataset, batches are counted, not timed).

Its workers change only through a :class:`~lightning_dltune.loaders.switch.LoaderSwitch`; its training
position and sampler order go into Lightning's checkpoints (``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import time
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.loaders.switch import LoaderSwitch, SwitchState
from lightning_dltune.loaders.torch_internals import (
    DrawnLog,
    IndexSamplerHook,
    RestOfEpoch,
    index_sampler_of,
    iterate_over,
    raise_unsent_batches,
    replay_order,
    shutdown_iterator,
)

__all__ = ["TunedDataLoader", "TunedLoader", "build_loader", "counters_of", "sample_bytes"]

_SLOTS = 1024  # worker slots in the shared counters (slot 0: the training process)
_BINS = 64  # a log histogram of the wall time per batch: 4 bins an octave from 0.1 ms (0.1 ms .. ~6.5 min)
_FIELDS = 4 + _BINS  # batches made, batches timed, wall seconds, cpu seconds, then the histogram
_BIN_FLOOR_S = 1e-4


def _bin_of(wall_s: float) -> int:
    return min(_BINS - 1, max(0, int(4.0 * math.log2(max(wall_s, _BIN_FLOOR_S) / _BIN_FLOOR_S))))


def histogram_quantile(counts: Sequence[float], q: float, mean: Optional[float] = None) -> Optional[float]:
    """The ``q`` quantile of a :meth:`ProductionCounters.histogram` (its bin's middle); ``None`` when empty.

    ``mean``: the exact mean of the same batches; a quantile in the mean's own bin is the mean (a bin is
    19 % wide: a steady time per batch shows no spread), and no quantile above the median is below it.
    """
    total = sum(counts)
    if total <= 0:
        return None
    rank, seen, k = q * total, 0.0, len(counts) - 1
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank and n > 0:
            k = i
            break
    value = _BIN_FLOOR_S * 2.0 ** ((k + 0.5) / 4.0)
    if mean is not None and (k == _bin_of(mean) or (q >= 0.5 and value < mean)):
        return mean
    return value


def histogram_top(counts: Sequence[float]) -> Optional[float]:
    """The upper edge of the highest bin of a :meth:`ProductionCounters.histogram` that counted a batch (``None``:
    empty): the slowest batch, up to a bin's width (19 %) over."""
    top = max((i for i, n in enumerate(counts) if n > 0), default=None)
    return None if top is None else _BIN_FLOOR_S * 2.0 ** ((top + 1) / 4.0)


class FetchRecorder(Protocol):
    def record_fetch(self, wait_s: float, ready: int = -1) -> None: ...

    def record_startup(self, seconds: float) -> None: ...

    def record_drain(self) -> None: ...

    def record_drained(self) -> None: ...


class ProductionCounters:
    """Cumulative batches, wall and CPU seconds of batch production and a histogram of the wall time per
    batch, per worker, in shared memory.

    Each worker writes only its own slot, so no lock is needed; the training process only reads.
    """

    def __init__(self) -> None:
        self._array = multiprocessing.RawArray("d", _FIELDS * _SLOTS)

    def add(self, wall_s: Optional[float] = None, cpu_s: float = 0.0) -> None:
        """One batch made in this process; ``wall_s`` ``None``: its production was not timed."""
        info = get_worker_info()
        base = _FIELDS * ((info.id + 1) % _SLOTS if info is not None else 0)
        arr = self._array
        arr[base] += 1.0
        if wall_s is not None:
            arr[base + 1] += 1.0
            arr[base + 2] += wall_s
            arr[base + 3] += cpu_s
            arr[base + 4 + _bin_of(wall_s)] += 1.0

    def produced(self, num_workers: int) -> float:
        """Batches produced so far by the training process and workers ``0..num_workers-1``."""
        arr = self._array
        total = 0.0
        for base in range(0, _FIELDS * (num_workers + 1), _FIELDS):
            total += arr[base]
        return total

    def totals(self) -> tuple[float, float, float]:
        """(timed batches, wall seconds, cpu seconds) summed over all slots."""
        arr = self._array
        return (sum(arr[1::_FIELDS]), sum(arr[2::_FIELDS]), sum(arr[3::_FIELDS]))

    def histogram(self) -> list[float]:
        """Timed batches per wall-time bin, summed over all slots (see :func:`histogram_quantile`)."""
        arr = self._array
        counts = [0.0] * _BINS
        for base in range(0, len(arr), _FIELDS):
            if arr[base + 1]:  # only the slots of processes that timed a batch (a few of the 1024)
                for k, n in enumerate(arr[base + 4 : base + _FIELDS]):
                    counts[k] += n
        return counts


# Start of the batch being produced in this process (workers produce one batch at a time).
_batch_started: Optional[tuple[float, float]] = None
_quiet_resets = False  # this worker process hides its fd server's resets at shutdown (installed once)


def quiet_fd_server_resets() -> None:
    """In a loader worker: a connection reset in the server that hands out a batch's file descriptors is no error.

    With torch's ``file_descriptor`` sharing a worker hands each batch's storage to the training process
    through a background server (``multiprocessing.resource_sharer``), which reports its errors through
    ``sys.excepthook`` itself. When the training process stops mid-transfer (Ctrl-C, a shutdown), its
    ``ConnectionResetError`` would print a traceback from inside the standard library; every other
    exception still reaches the hook as before.
    """
    global _quiet_resets
    _quiet_resets = True
    report = sys.excepthook

    def hook(exc_type: type, exc: BaseException, tb: Any) -> None:
        frame = tb.tb_frame if tb is not None else None
        if (
            issubclass(exc_type, (ConnectionError, EOFError))
            and frame is not None
            and frame.f_code.co_name == "_serve"
            and frame.f_code.co_filename.endswith("resource_sharer.py")
        ):
            return
        report(exc_type, exc, tb)

    sys.excepthook = hook


class TimedDataset(Dataset):
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
        if not _quiet_resets and get_worker_info() is not None:  # this worker's first batch, before its first send
            quiet_fd_server_resets()
            raise_unsent_batches()
        batch = self.collate_fn(samples)
        if _batch_started is not None:
            wall0, cpu0 = _batch_started
            _batch_started = None
            self.counters.add(time.perf_counter() - wall0, time.thread_time() - cpu0)
        else:  # an iterable dataset's batch: counted (exact queue depth), not timed
            self.counters.add()
        return batch


def counters_of(loader: DataLoader) -> Optional[ProductionCounters]:
    """The shared counters a loader's batch production is timed into, if it has them."""
    counters = getattr(loader, "production_counters", None)
    if counters is not None:
        return counters
    collate = loader.collate_fn
    return collate.counters if isinstance(collate, TimedCollate) else None


class _FetchTimingIterator(Iterator):
    """Reports each fetch of a torch iterator, and carries out the loader's switch when it has one."""

    def __init__(self, loader: TunedLoader, iterator: Iterator, started: float) -> None:
        self._loader = loader
        self._counters = counters_of(loader)
        self._draining: Optional[LoaderSwitch] = None  # a pending switch waiting for the old workers
        self._use(iterator, started)

    def _use(self, iterator: Iterator, started: float) -> None:
        self._it = iterator
        self._started = started
        self._first = True
        self._workers = self._loader.num_workers
        # a user's loader without workers: its batches are made right here, timed around next()
        self._time_here = self._workers == 0 and self._loader.production_counters is not None
        self._baseline = self._counters.produced(self._workers) if self._counters is not None else 0.0
        self._consumed = 0
        switch = self._loader.switch
        if switch is not None:
            switch.watch(iterator)

    def shutdown(self) -> None:
        """Stop the workers of the torch iterator this one wraps, now."""
        shutdown_iterator(self._it)

    def _ready(self) -> int:
        if self._counters is None:
            return -1
        if self._workers == 0:
            return 0  # the training process makes every batch itself: every fetch stalls
        return max(0, int(self._counters.produced(self._workers) - self._baseline) - self._consumed)

    def __next__(self) -> Any:
        switch = self._loader.switch
        recorder = self._loader.fetch_recorder
        if switch is not None and switch.state is SwitchState.PENDING and self._draining is None:
            taken = switch.take_over_from(self._it, self._workers, self._ready()) if self._workers else None
            if taken is not None:  # the new workers make what the old ones held: their first batch is start-up
                self._use(taken, time.perf_counter())
            elif switch.begin_drain(self._it):
                self._draining = switch
                if recorder is not None:  # what the old workers hold is the config before's: not measured
                    recorder.record_drain()
        ready = self._ready() if recorder is not None and not self._first else -1
        t0 = time.perf_counter()
        cpu0 = time.thread_time() if self._time_here else 0.0
        try:
            batch = next(self._it)
        except StopIteration:
            if self._draining is None:
                raise  # the epoch really ended
            draining, self._draining = self._draining, None
            if recorder is not None:
                recorder.record_drained()
            self._use(draining.start_rest(), time.perf_counter())  # new workers' first batch: start-up
            return self.__next__()
        except Exception as exc:
            recovered = switch.recover(exc, self._it, self._consumed) if switch is not None else None
            if recovered is None:
                raise
            self._use(recovered, self._started)
            return self.__next__()
        if self._time_here:
            self._counters.add(time.perf_counter() - t0, time.thread_time() - cpu0)  # type: ignore[union-attr]
        if recorder is not None:
            if self._first:
                recorder.record_startup(time.perf_counter() - self._started)
            else:
                recorder.record_fetch(time.perf_counter() - t0, ready)
        self._first = False
        self._consumed += 1
        if switch is not None and switch.state is SwitchState.STARTED:
            switch.batch_delivered(self._it)
        return batch


class TunedLoader(IndexSamplerHook):
    """What every loader the tuner switches does, whoever built it: report fetches, carry a switch, resume.

    The base of :class:`TunedDataLoader` (built by :class:`~lightning_dltune.TunableDataModule`) and of the
    classes :mod:`~lightning_dltune.loaders.adopt` gives a user's own loaders. Reports go to
    ``fetch_recorder`` when one is set (the :class:`~lightning_dltune.DataLoaderTuner` sets it on the
    training loaders); otherwise the iterator adds nothing but two attribute reads per batch. Its workers
    change only through a :class:`~lightning_dltune.loaders.switch.LoaderSwitch` (``switch``).
    """

    fetch_recorder: Optional[FetchRecorder] = None
    switch: Optional[LoaderSwitch] = None  # the change in progress, from its start to its end
    # (batches the training loop took this epoch, whether the epoch is done): set for a training loader
    loop_position: Optional[Callable[[], tuple[int, bool]]] = None
    # where batch production is timed when no TimedCollate does (a user's loader): see loaders/adopt.py
    production_counters: Optional[ProductionCounters] = None
    _resume: Optional[dict] = None  # a mid-epoch position loaded from a checkpoint, for the next iter()

    def position(self) -> dict[str, Any]:
        """Where the training loop is in this epoch, and what replays the epoch's sampler order.

        Empty for a stream (an ``IterableDataset`` cannot be replayed) or a loader outside a fit.
        """
        if self.loop_position is None or self.order_state is None or isinstance(self.dataset, IterableDataset):
            return {}
        taken, done = self.loop_position()
        return {"order": self.order_state, "batches_taken": int(taken), "epoch_done": bool(done)}

    def resume_at(self, position: dict[str, Any]) -> None:
        """Resume at ``position`` (from :meth:`position`) at the next ``iter()`` (nothing after a finished epoch)."""
        if position and not position.get("epoch_done", True) and position.get("order") is not None:
            self._resume = position

    def __iter__(self) -> Iterator:
        started = time.perf_counter()
        if self.__dict__.get("_drawn_log") is None:
            self._drawn_log = DrawnLog()  # what a switch to more workers hands to the new ones
        switch = self.switch
        if switch is not None and switch.state is SwitchState.PENDING:
            switch.start_now()  # a new iteration: the switch needs no draining
        try:
            iterator = self._iter_resumed() if self._resume is not None else super().__iter__()
        except Exception as exc:
            recovered = switch.recover(exc, None, 0) if switch is not None else None
            if recovered is None:
                raise
            iterator = recovered
        return _FetchTimingIterator(self, iterator, started)

    def _iter_resumed(self) -> Iterator:
        resume, self._resume = self._resume, None
        assert resume is not None
        rest = replay_order(index_sampler_of(self), resume["order"], resume["batches_taken"])
        self.order_state = resume["order"]  # still this epoch's order, for the next checkpoint
        return iterate_over(self, RestOfEpoch(rest))


class TunedDataLoader(TunedLoader, DataLoader):
    """A :class:`~torch.utils.data.DataLoader` that reports fetch waits, exact stalls and worker cost.

    It takes exactly DataLoader's arguments. Build it with :func:`build_loader` to get worker-side
    timing (a map-style dataset is wrapped in :class:`TimedDataset`). See :class:`TunedLoader` for what
    it reports; its training position and sampler order go into Lightning's checkpoints.
    """

    def __init__(
        self,
        *args: Any,
        loop_position: Optional[Callable[[], tuple[int, bool]]] = None,
        worker_timeout: Optional[float] = None,
        **kwargs: Any,
    ) -> None:
        # the user's ``timeout`` applies to workers; torch refuses one without workers
        self.worker_timeout = kwargs.get("timeout", 0) if worker_timeout is None else worker_timeout
        if not kwargs.get("num_workers", 0):
            kwargs["timeout"] = 0
        super().__init__(*args, **kwargs)
        # arguments, not only attributes, so a loader Lightning re-creates (DDP's sampler) keeps them
        self.loop_position = loop_position

    def state_dict(self) -> dict[str, Any]:
        """:meth:`~TunedLoader.position`: Lightning saves it in checkpoints.

        :meth:`load_state_dict` resumes the epoch with every remaining sample exactly once, whatever the
        worker count of the resumed fit.
        """
        return self.position()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved position at the next ``iter()`` (nothing to do after a finished epoch)."""
        self.resume_at(state_dict)


def sample_bytes(dataset: Dataset, timeout_s: float = 30.0) -> Optional[int]:
    """Tensor bytes of ``dataset[0]``, read in a forked child process; ``None`` if it cannot be read.

    A child, so that a dataset opening files or handles lazily (HDF5, LMDB) does not open them in the
    training process before its workers fork.
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        return None
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_sample_bytes, args=(dataset, send), daemon=True)
    child.start()
    send.close()
    try:
        return receive.recv() if receive.poll(timeout_s) else None
    except EOFError:  # the child died; the fit meets the same problem where the user expects it
        return None
    finally:
        receive.close()
        child.join(timeout=5.0)
        if child.is_alive():
            child.kill()


def _send_sample_bytes(dataset: Dataset, send: Any) -> None:
    try:
        tensors = batch_tensors(dataset[0])
    except Exception:  # the user's error belongs to the fit, with its own traceback
        tensors = []
    send.send(tensor_bytes(tensors) if tensors else None)
    send.close()


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a batch or sample, in order (nested tuples, lists, dicts, dataclasses)."""
    from lightning_utilities.core.apply_func import apply_to_collection

    tensors: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, tensors.append)
    return tensors


def tensor_bytes(batch: Any) -> int:
    """Bytes of the tensors of a batch or sample (the one count of them: probe, sample and sweep use it)."""
    return sum(t.nelement() * t.element_size() for t in batch_tensors(batch))


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

    Map-style datasets are wrapped in :class:`TimedDataset`; iterable datasets are used as they are
    (no worker-side timing; fetch waits are still exact).
    """
    from torch.utils.data import default_collate

    if kwargs.get("sampler") is not None or kwargs.get("batch_sampler") is not None:
        shuffle = False
    mp_context = kwargs.pop("multiprocessing_context", None)
    collate = collate_fn if collate_fn is not None else default_collate
    if batch_size is not None and kwargs.get("batch_sampler") is None:
        counters = ProductionCounters()
        if not isinstance(dataset, IterableDataset):
            dataset = TimedDataset(dataset, counters)
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
