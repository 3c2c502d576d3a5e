"""Every use of torch's private DataLoader internals, behind a small surface.

A loader switch needs four things torch does not offer publicly: to stop a live iterator from
handing out more work (its sampler iteration), to know which index batches its workers still hold,
to start an iterator over a given rest of an epoch, and to stop persistent workers now. Everything
here is checked by :func:`check_torch_internals` (run by the tests against the installed torch), so a
torch release that moves one of them fails loudly instead of silently losing or repeating samples.

What this module relies on (torch 2.1 to 2.13):

- ``DataLoader._index_sampler`` (property) is what an iterator draws index batches from; the iterator
  keeps it as ``_index_sampler`` and iterates it in ``_reset`` into ``_sampler_iter``.
- ``_MultiProcessingDataLoaderIter._task_info`` maps each task not yet yielded to its worker (tasks are
  numbered from 0 in the order an iteration draws its index batches, each ``_reset`` anew);
  ``_shutdown_workers()`` stops the workers; ``DataLoader._iterator`` holds persistent workers.
- ``DataLoader.persistent_workers`` may not be set after ``__init__`` (torch forbids it), but is only
  read when an iterator is created.
- ``_MultiProcessingDataLoaderIter`` registers its workers' pids with torch's SIGCHLD handler
  (``_utils.signal_handling._set_worker_pids`` / ``_remove_worker_pids``, ``_worker_pids_set``), which
  raises wherever the training process happens to be when a worker dies.
- A worker's exception reaches the training process as ``ExceptionWrapper.reraise`` with the
  worker's traceback as text after ``"Original Traceback"``.
- A worker makes each batch in ``fetch()`` of ``_utils.fetch._MapDatasetFetcher`` or
  ``_IterableDatasetFetcher`` (dataset reads and ``collate_fn``), created after ``worker_init_fn`` ran.
- A worker sends each result as ``(task, batch)`` through a ``multiprocessing`` queue, whose background
  thread pickles it and hands an error to ``Queue._on_queue_feeder_error(exc, obj)`` (standard library,
  Python 3.8 to 3.13), bound when the thread starts at the worker's first send.
"""

from __future__ import annotations

import itertools
import multiprocessing.queues
import os
import re
import time
import weakref
from collections import deque
from typing import Any, Callable, Generic, Iterable, Iterator, Optional, TypeVar

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import BatchSampler, DataLoader, get_worker_info
from torch.utils.data import dataloader as _dataloader_module
from torch.utils.data._utils import fetch as _fetch
from torch.utils.data._utils import signal_handling as _signal_handling

_TORCH_DIR = os.path.dirname(torch.__file__)
_MULTIPROCESSING_DIR = os.path.dirname(__import__("multiprocessing").__file__)
# Files whose frames are the loader machinery: where a dead worker, a worker start or an
# out-of-shared-memory allocation raises, never where a user's dataset or collate code runs.
_MACHINERY_FILES = (
    os.path.join(_TORCH_DIR, "utils", "data", "dataloader.py"),
    os.path.join(_TORCH_DIR, "utils", "data", "_utils", "signal_handling.py"),
    os.path.join(_TORCH_DIR, "utils", "data", "_utils", "pin_memory.py"),
)
_MACHINERY_DIRS = (os.path.join(_TORCH_DIR, "multiprocessing") + os.sep, _MULTIPROCESSING_DIR + os.sep)
# Inside a worker, only torch's shared-memory allocation of a batch counts as machinery.
_WORKER_MACHINERY = (
    os.path.join("torch", "storage.py"),
    os.path.join("torch", "multiprocessing", ""),
    os.path.join("multiprocessing", ""),
)
_FRAME = re.compile(r'File "([^"]+)", line \d+')
_WRAPPED = "Original Traceback"


def is_machinery_failure(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by the loader machinery, not by the user's code.

    Machinery: a worker that died (killed, out of memory), could not start, or could not allocate
    shared memory for a batch; a loader ``timeout``. Everything raised in the user's dataset,
    sampler, collate or ``worker_init_fn`` code (in the training process or re-raised by torch from a
    worker) is the user's, whatever its type or message.
    """
    message = str(exc)
    if _WRAPPED in message:  # re-raised from a worker: judge by the frame that raised it there
        frames = _FRAME.findall(message.split(_WRAPPED, 1)[1])
        return bool(frames) and any(part in frames[-1] for part in _WORKER_MACHINERY)
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
    return filename in _MACHINERY_FILES or filename.startswith(_MACHINERY_DIRS)


def describe_failure(exc: BaseException) -> str:
    """``Type: message`` of a failure in one line; for a worker's, the line that names its cause."""
    message = str(exc)
    if _WRAPPED in message:
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        return f"{lines[-1][:300]} (in a worker)"
    return f"{type(exc).__name__}: {message[:300]}"


class RestOfEpoch:
    """Stands in for a loader's index sampler: iterating it continues an interrupted epoch."""

    def __init__(self, batches: Iterable) -> None:
        self._iterator = iter(batches)

    def __iter__(self) -> Iterator:
        return self._iterator


class EpochOrder:
    """Wraps a loader's own index sampler: at each epoch's first draw, notes what replays its order.

    The first index batch is drawn at ``iter()`` (not when torch first asks), right after the RNG
    states are noted, so nothing else draws from the RNG in between; the rest is chained in C.

    The loader (``owner``) is held weakly: its persistent iterator keeps this sampler, and a loader in a
    reference cycle with its iterator is freed by the cyclic garbage collector, which closes the worker
    queues before torch's iterator can tell its workers to stop (5 s a worker, in the training process).
    """

    def __init__(self, sampler: Any, owner: Any) -> None:
        self.sampler = sampler
        self._owner = weakref.ref(owner)

    def __iter__(self) -> Iterator:
        owner = self._owner()
        if owner is not None:
            owner.order_state = capture_order(self.sampler)
        iterator = iter(self.sampler)
        first = list(itertools.islice(iterator, 1))
        return itertools.chain(first, iterator) if first else iter(())

    def __len__(self) -> int:
        return len(self.sampler)


def _generators(sampler: Any) -> list[torch.Generator]:
    """The generators a (batch) sampler draws its order from, besides torch's global one."""
    found = []
    for obj in (sampler, getattr(sampler, "sampler", None)):
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _epoch_owner(sampler: Any) -> Any:
    """The (inner) sampler whose order depends on ``set_epoch`` (``DistributedSampler``), or ``None``."""
    for obj in (sampler, getattr(sampler, "sampler", None)):
        if callable(getattr(obj, "set_epoch", None)) and isinstance(getattr(obj, "epoch", None), int):
            return obj
    return None


def capture_order(sampler: Any) -> dict[str, Any]:
    """The RNG states (and sampler epoch) an epoch of ``sampler`` draws its order from, before its first draw."""
    owner = _epoch_owner(sampler)
    return {
        "torch": torch.get_rng_state(),
        "generators": [g.get_state() for g in _generators(sampler)],
        "epoch": owner.epoch if owner is not None else None,
    }


def replay_order(sampler: Any, state: dict[str, Any], skip: int) -> Iterator:
    """The epoch of ``sampler`` that ``state`` began, without its first ``skip`` index batches.

    Exact for samplers whose order follows from the RNG states at their first draw (torch's
    ``RandomSampler``, ``SubsetRandomSampler``, ``DistributedSampler``, a ``BatchSampler`` of them, any
    sequential sampler). The global RNG is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state["torch"])
        for generator, generator_state in zip(_generators(sampler), state["generators"]):
            generator.set_state(generator_state)
        owner = _epoch_owner(sampler)
        if owner is not None and state.get("epoch") is not None:
            owner.set_epoch(state["epoch"])  # a resumed fit creates its iterator before Lightning sets it
        iterator = iter(sampler)
        head = list(itertools.islice(iterator, skip + 1))  # every draw from the restored RNG happens here
    return itertools.chain(head[skip:], iterator)


def order_is_replayable(sampler: Any) -> bool:
    """Whether :func:`replay_order` replays ``sampler`` exactly: torch's own samplers, batched by torch's own.

    A sampler of another library or of the user may draw from another RNG (Python's, NumPy's) or keep
    state of its own; its epoch cannot be replayed from the RNG states alone.
    """
    layers = [sampler]
    if type(sampler) is BatchSampler:
        layers.append(sampler.sampler)
    return all(type(layer).__module__.startswith("torch.utils.data") for layer in layers)


class RecordingIndexSampler:
    """Wraps a loader's index sampler; while ``recorder`` asks, remembers the index batches drawn.

    Not recording, iterating it is iterating the wrapped sampler (no per-batch cost).
    """

    def __init__(self, sampler: Any, recorder: Any) -> None:
        self.sampler = sampler
        self._recorder = recorder

    def __iter__(self) -> Iterator:
        return self._recorder.record(iter(self.sampler))

    def __len__(self) -> int:
        return len(self.sampler)


class _Drawn:
    __slots__ = ("batches", "count")

    def __init__(self, keep: int) -> None:
        self.batches: deque = deque(maxlen=keep)
        self.count = 0


class DrawnLog:
    """The latest index batches a loader's current iteration drew, by task number (see ``_task_info``).

    A recorder for :class:`RecordingIndexSampler`, kept on a loader as ``_drawn_log``: each iteration
    (an iterator's start or ``_reset``) starts a log of its own; the ``keep`` latest batches are kept
    (references to index lists the sampler made anyway: one append per batch).
    """

    def __init__(self, keep: int = 1024) -> None:
        self._keep = keep
        self._current = _Drawn(keep)

    def record(self, index_batches: Iterator) -> Iterator:
        drawn = self._current = _Drawn(self._keep)

        def recording() -> Iterator:
            for batch in index_batches:
                drawn.batches.append(batch)
                drawn.count += 1
                yield batch

        return recording()

    def held(self, tasks: list[int]) -> Optional[list]:
        """The index batches of the current iteration's ``tasks`` (task numbers); ``None`` where one is not kept."""
        drawn = self._current
        first = drawn.count - len(drawn.batches)
        if tasks and (tasks[0] < first or tasks[-1] >= drawn.count):
            return None
        return [drawn.batches[t - first] for t in tasks]


def record_index_batches(loader: DataLoader, recorder: Any) -> None:
    """From the loader's next iterator on, ``recorder.record(batches)`` sees its index batches; ``None``: off."""
    loader._index_recorder = recorder  # type: ignore[attr-defined]


def index_sampler_of(loader: DataLoader) -> Any:
    """The index sampler torch's iterators draw from (``batch_sampler`` or ``sampler``)."""
    return _BASE_INDEX_SAMPLER.fget(loader)  # type: ignore[union-attr]


def iterate_over(loader: DataLoader, index_sampler: Any) -> Iterator:
    """A torch iterator of ``loader`` that draws its index batches from ``index_sampler``.

    ``loader`` must read ``_index_override`` in its ``_index_sampler`` (see :class:`IndexSamplerHook`).
    A persistent iterator starts its next epochs from the loader's whole sampler again.
    """
    loader._index_override = index_sampler  # type: ignore[attr-defined]
    try:
        iterator = DataLoader.__iter__(loader)
    finally:
        loader._index_override = None  # type: ignore[attr-defined]
    iterator._index_sampler = loader._index_sampler  # type: ignore[attr-defined]
    return iterator


_T = TypeVar("_T")


class IndexSamplerHook(Generic[_T]):
    """Mixin for a DataLoader subclass: lets :func:`iterate_over` and a recorder pick its index sampler.

    Generic like DataLoader, so that a class with this mixin first keeps DataLoader's object layout and
    a user's loader can take such a class in place (``__class__`` assignment).
    """

    _index_override: Any = None
    _index_recorder: Any = None
    _drawn_log: Optional[DrawnLog] = None  # the latest index batches of the current iteration, where kept
    order_state: Optional[dict] = None  # what replays the current epoch's order (see EpochOrder)

    @property
    def _index_sampler(self) -> Any:
        base = self.__dict__.get("_index_override")
        if base is None:
            base = EpochOrder(_BASE_INDEX_SAMPLER.fget(self), self)  # type: ignore[union-attr]
        log = self.__dict__.get("_drawn_log")
        if log is not None:
            base = RecordingIndexSampler(base, log)
        recorder = self.__dict__.get("_index_recorder")
        return base if recorder is None else RecordingIndexSampler(base, recorder)


def take_sampler_rest(iterator: Iterator) -> Optional[Iterator]:
    """Stop ``iterator`` from handing out new work; returns what its sampler iteration had left.

    ``None`` when ``iterator`` is not a torch iterator that can be split (nothing is taken then).
    """
    rest = getattr(iterator, "_sampler_iter", None)
    if rest is None:
        return None
    iterator._sampler_iter = iter(())  # type: ignore[attr-defined]
    return rest


def outstanding_tasks(iterator: Iterator) -> Optional[list[int]]:
    """Task numbers of ``iterator`` (the order its index batches were drawn) not yet yielded.

    ``None`` for an iterator without workers (nothing is held outside the training process).
    """
    info = getattr(iterator, "_task_info", None)
    return None if info is None else sorted(info)


def shutdown_iterator(iterator: Iterator) -> None:
    """Stop an iterator's workers now (a single-process iterator has none), dead ones included."""
    mute_worker_deaths(iterator)  # a dead worker must not raise again while the others stop
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def mute_worker_deaths(iterator: Iterator) -> None:
    """Stop torch's SIGCHLD handler raising for ``iterator``'s workers anywhere in the training process.

    A death is then found by the iterator itself when it waits for a batch (torch polls its workers
    every few seconds), inside ``next()``, where a switch can roll back.
    """
    if getattr(iterator, "_worker_pids_set", False):
        _signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False  # type: ignore[attr-defined]


def unmute_worker_deaths(iterator: Iterator) -> None:
    """Give ``iterator``'s workers back to torch's SIGCHLD handler (torch's own behaviour)."""
    workers = getattr(iterator, "_workers", None)
    if workers and not getattr(iterator, "_worker_pids_set", True) and not getattr(iterator, "_shutdown", True):
        _signal_handling._set_worker_pids(id(iterator), tuple(w.pid for w in workers))
        iterator._worker_pids_set = True  # type: ignore[attr-defined]


def shutdown_workers(loader: DataLoader) -> None:
    """Stop a loader's persistent workers now (not whenever the garbage collector gets to them)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        shutdown_iterator(iterator)
        loader._iterator = None


def release_iterator(loader: DataLoader, iterator: Iterator) -> None:
    """``iterator`` is no longer ``loader``'s persistent one (the next ``iter()`` starts new workers)."""
    if getattr(loader, "_iterator", None) is iterator:
        loader._iterator = None


def set_persistent_workers(loader: DataLoader, persistent: bool) -> None:
    """Set ``persistent_workers`` of a built loader (torch forbids it; it is read only at ``iter()``)."""
    object.__setattr__(loader, "persistent_workers", persistent)


_FETCHERS = ("_MapDatasetFetcher", "_IterableDatasetFetcher")


def time_worker_fetches(record: Callable[[float, float], None]) -> None:
    """In a loader worker (from its ``worker_init_fn``): ``record(wall_s, cpu_s)`` after each batch it makes.

    A worker process serves one loader, so its fetchers are timed there and nowhere else; the training
    process's own fetchers stay as torch has them. Exceptions pass unchanged.
    """
    for name in _FETCHERS:
        cls = getattr(_fetch, name)
        original = cls.__dict__["fetch"]
        if getattr(original, "timed_by_dltune", False):
            continue

        def timed(self: Any, index: Any, _original: Callable = original) -> Any:
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            batch = _original(self, index)
            record(time.perf_counter() - wall0, time.thread_time() - cpu0)
            return batch

        timed.timed_by_dltune = True  # type: ignore[attr-defined]
        cls.fetch = timed


def raise_unsent_batches() -> None:
    """In a loader worker, before its first send: a batch that cannot be sent is raised in the training
    process, where torch would lose it and leave the training process waiting for it forever.

    A worker puts each batch on a queue whose background thread pickles it. With torch's
    ``file_descriptor`` sharing, pickling moves every tensor not yet in shared memory there (a batch
    ``default_collate`` made already is; a tensor a ``collate_fn`` or the dataset built is not). When
    ``/dev/shm`` is full that move fails in the thread, which prints the error and drops the batch; the
    worker lives on, so torch (which only watches for dead workers) never raises. Here the thread sends
    the error in the batch's place, as torch sends an error raised while making a batch: the training
    process raises it at that batch (and a loader switch rolls back). Anything the queue carries that is
    not a worker's ``(task, result)`` goes to the standard library's handler as before.
    """
    queue_class = multiprocessing.queues.Queue
    report = queue_class.__dict__["_on_queue_feeder_error"]
    if getattr(report, "sends_unsent_batches", False):
        return
    print_error = report.__func__ if isinstance(report, staticmethod) else report

    def send_error_instead(queue: Any, exc: BaseException, obj: Any) -> None:
        info = get_worker_info()
        if info is None or not (isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], int)):
            print_error(exc, obj)
            return
        where = f"in DataLoader worker process {info.id}"
        queue.put((obj[0], ExceptionWrapper(exc_info=(type(exc), exc, exc.__traceback__), where=where)))

    send_error_instead.sends_unsent_batches = True  # type: ignore[attr-defined]
    queue_class._on_queue_feeder_error = send_error_instead  # type: ignore[method-assign]


def write_summary(writer: Any, summary: Any) -> None:
    """A summary proto into a torch ``SummaryWriter``'s event file (``_get_file_writer()``, as its own
    ``add_custom_scalars`` does; that one takes a single series per margin chart)."""
    writer._get_file_writer().add_summary(summary)


def check_torch_internals() -> None:
    """Raise :class:`RuntimeError` naming what is missing if this torch lacks what this module uses."""
    missing = []
    if not isinstance(_BASE_INDEX_SAMPLER, property):
        missing.append("DataLoader._index_sampler (property)")
    multi = getattr(_dataloader_module, "_MultiProcessingDataLoaderIter", None)
    base = getattr(_dataloader_module, "_BaseDataLoaderIter", None)
    for owner, names in (
        (multi, ("_shutdown_workers", "_try_put_index", "_reset", "_next_index")),
        (base, ("_reset", "_next_index")),
    ):
        if owner is None:
            missing.append("torch.utils.data.dataloader iterator classes")
            continue
        missing.extend(f"{owner.__name__}.{n}" for n in names if not hasattr(owner, n))
    for name in ("_set_worker_pids", "_remove_worker_pids"):
        if not hasattr(_signal_handling, name):
            missing.append(f"torch.utils.data._utils.signal_handling.{name}")
    fetchers = ((n, getattr(_fetch, n, None)) for n in _FETCHERS)
    missing.extend(f"torch.utils.data._utils.fetch.{n}.fetch" for n, c in fetchers if "fetch" not in vars(c or object))
    from torch.utils.tensorboard import SummaryWriter

    if not callable(getattr(SummaryWriter, "_get_file_writer", None)):
        missing.append("torch.utils.tensorboard.SummaryWriter._get_file_writer")
    if "_on_queue_feeder_error" not in vars(multiprocessing.queues.Queue):
        missing.append("multiprocessing.queues.Queue._on_queue_feeder_error")
    for path in _MACHINERY_FILES:
        if not os.path.exists(path):
            missing.append(path)
    if missing:
        raise RuntimeError(
            f"lightning-dltune's loader switch relies on torch internals this torch {torch.__version__} lacks:"
            f" {', '.join(missing)}. Pin torch to a tested version or update"
            " lightning_dltune/loaders/torch_internals.py."
        )


_BASE_INDEX_SAMPLER = DataLoader.__dict__.get("_index_sampler")
