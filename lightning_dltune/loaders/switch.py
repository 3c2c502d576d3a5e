"""One loader's move to a new config, from its start to its confirmation or rollback.

A :class:`LoaderSwitch` is the only object that changes a live loader's workers. Its life:

- **pending**: asked for in the middle of an iteration; the loader stops handing out new work, and
  once its workers delivered what they hold, new workers take the rest of the epoch (nothing lost
  or repeated). A switch to more workers (``take_over``) stops the old ones at once instead: the new
  ones make the batches the old ones held first, then the rest. A loader that cannot be split
  switches at its next ``iter()``.
- **started**: the loader runs the new config. Until it has delivered ``confirm_after`` batches, a
  failure of the loader machinery (a worker killed, a worker that cannot start, shared memory full,
  a ``timeout``) rolls it back: the workers are stopped, the index batches they held go first to
  the loader of the fallback config, then the rest of the epoch. The user's own errors always pass.
- **confirmed** or **rolled back**: the switch is over and detaches from its loader.
"""

from __future__ import annotations

import enum
import itertools
import weakref
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader, IterableDataset

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.loaders.torch_internals import (
    RestOfEpoch,
    is_machinery_failure,
    iterate_over,
    mute_worker_deaths,
    outstanding_tasks,
    record_index_batches,
    release_iterator,
    set_persistent_workers,
    shutdown_iterator,
    shutdown_workers,
    take_sampler_rest,
    unmute_worker_deaths,
)

CONFIRM_AFTER_BATCHES = 30  # a few windows' worth: a config that failed later would fail here too


class SwitchState(enum.Enum):
    PENDING = "pending"
    STARTED = "started"
    CONFIRMED = "confirmed"
    ROLLED_BACK = "rolled back"


class LoaderSwitch:
    """Moves ``loader`` to ``target``; goes back to ``fallback`` if the loader machinery fails first.

    Args:
        loader: a :class:`~lightning_dltune.loaders.loader.TunedDataLoader`.
        target: the config to run.
        fallback: the config to go back to on a machinery failure; ``None``: failures are raised.
        pending: ``True`` to switch in the middle of the loader's current iteration (or at its next
            ``iter()``); ``False`` when the loader already runs ``target`` from its next ``iter()``.
        confirm_after: batches the new config must deliver before the switch is over.
        on_rollback: called as ``on_rollback(switch, exception)`` after a rollback.
        multiprocessing_context: the context to give the loader when it gains workers.
        on_confirm: called as ``on_confirm(switch)`` once the new config is confirmed.
        take_over: mid-epoch, stop the old workers at once and have the new ones make the batches the old
            ones held (for a switch to more workers: the old ones are too few, and delivering what they
            hold would take them that many batches at the pace that starved the loop). Where that is not
            the quicker (shallow prefetch, most of it made) or the loader does not know those index
            batches, the old workers deliver them as without it.
    """

    def __init__(
        self,
        loader: DataLoader,
        target: LoaderConfig,
        fallback: Optional[LoaderConfig],
        pending: bool = False,
        confirm_after: int = CONFIRM_AFTER_BATCHES,
        on_rollback: Optional[Callable[[LoaderSwitch, BaseException], None]] = None,
        multiprocessing_context: Any = None,
        on_confirm: Optional[Callable[[LoaderSwitch], None]] = None,
        take_over: bool = False,
    ) -> None:
        self._loader = weakref.ref(loader)  # the loader holds its switch: no cycle for the garbage collector
        self.take_over = take_over
        self.target = target
        self.fallback = fallback
        self.confirm_after = confirm_after
        self.on_rollback = on_rollback
        self.on_confirm = on_confirm
        self.multiprocessing_context = multiprocessing_context
        self.error: Optional[BaseException] = None
        self.delivered = 0
        self._rest: Optional[Iterator] = None  # the epoch's rest while old workers drain
        self._drawn: Optional[list] = None  # index batches handed to the new workers, in the order drawn
        previous = getattr(loader, "switch", None)
        if previous is not None:
            previous._detach()  # superseded: this switch owns the loader now
        loader.switch = self
        self.state = SwitchState.PENDING if pending else SwitchState.STARTED
        if not pending:
            self._start()

    # -- used by the loader's iterator --------------------------------------------------------
    def begin_drain(self, iterator: Iterator) -> bool:
        """Pending, mid-iteration: stop ``iterator`` handing out work. ``False``: it cannot be split."""
        if self._is_stream():
            return False  # new workers would replay the stream: switch at the next iter()
        self._rest = take_sampler_rest(iterator)
        return self._rest is not None

    @property
    def loader(self) -> DataLoader:
        """The loader switched (held weakly: a loader freed by the cyclic garbage collector would stop its
        persistent workers only after torch's 5 s timeout a worker, in the training process)."""
        loader = self._loader()
        if loader is None:
            raise ReferenceError("the switched loader no longer exists")
        return loader

    def take_over_from(self, iterator: Iterator, workers: int, ready: int) -> Optional[Iterator]:
        """Pending, mid-iteration, ``take_over``: stop the ``workers`` of ``iterator`` now; a torch iterator of
        ``target`` over the index batches they held (in the order drawn), then the rest of the epoch.

        Taken where it is the quicker: the old workers would need ``(held - ready) / workers`` batch times
        to deliver what they hold (``ready``: made and not yet taken), the new ones one batch time at most
        to see the old ones stop (each ends the batch it is making) and ``held / new workers`` to make it
        all again. ``None``, and nothing done: not quicker, a stream, an iterator that cannot be split,
        held index batches the loader did not keep, or ``ready`` unknown (``-1``).
        """
        if not self.take_over or self._is_stream() or ready < 0 or workers <= 0:
            return None
        tasks = outstanding_tasks(iterator)
        log = getattr(self.loader, "_drawn_log", None)
        held = log.held(tasks) if tasks is not None and log is not None else None
        if held is None or (len(held) - ready) / workers <= 1 + len(held) / max(self.target.num_workers, 1):
            return None
        rest = take_sampler_rest(iterator)
        if rest is None:
            return None
        release_iterator(self.loader, iterator)
        shutdown_iterator(iterator)  # the batches they made and the loop did not take are made again
        self._rest = itertools.chain(held, rest)
        return self.start_rest()

    def start_rest(self) -> Iterator:
        """The old workers delivered all they held: a torch iterator of ``target`` over the rest."""
        rest, self._rest = self._rest, None
        self._start()
        try:
            return iterate_over(self.loader, RestOfEpoch(rest))
        except Exception as exc:
            recovered = self.recover(exc, None, 0, rest)
            if recovered is None:
                raise
            return recovered

    def start_now(self) -> None:
        """Pending at an ``iter()``: the loader's next iterator runs ``target``."""
        self._start()

    def watch(self, iterator: Iterator) -> None:
        """A started switch's torch iterator: a worker's death is raised in ``next()``, not anywhere."""
        if self.state is SwitchState.STARTED:
            mute_worker_deaths(iterator)

    def batch_delivered(self, iterator: Iterator) -> None:
        self.delivered += 1
        if self.delivered >= self.confirm_after:
            self.state = SwitchState.CONFIRMED
            self._detach()
            unmute_worker_deaths(iterator)
            if self.on_confirm is not None:
                self.on_confirm(self)

    def record(self, index_batches: Iterator) -> Iterator:
        """Remember the index batches a started switch's workers are handed (see ``IndexSamplerHook``)."""
        if self.state is not SwitchState.STARTED:
            return index_batches
        self._drawn = drawn = []

        def recording() -> Iterator:
            for batch in index_batches:
                drawn.append(batch)
                yield batch

        return recording()

    def recover(
        self, exc: BaseException, iterator: Optional[Iterator], yielded: int, rest: Optional[Iterator] = None
    ) -> Optional[Iterator]:
        """After ``exc`` from a started switch's loader: an iterator of ``fallback`` over what is left.

        ``None`` when ``exc`` must reach the user: it is not a machinery failure, there is no fallback,
        a stream (an iterable dataset) already delivered batches and cannot be resumed, or the iterator
        was not started by this switch (the batches its workers held are unknown).
        """
        if self.state is not SwitchState.STARTED or self.fallback is None or not is_machinery_failure(exc):
            return None
        stream = self._is_stream()
        if stream and yielded:
            return None
        held: list = []
        if iterator is not None:
            if self._drawn is None:
                return None  # an iterator started before this switch: what its workers held is unknown
            tasks = outstanding_tasks(iterator)
            if tasks is None or getattr(self.loader, "in_order", True):
                held = self._drawn[yielded:]
            else:
                held = [self._drawn[t] for t in tasks if t < len(self._drawn)]
            if rest is None:
                rest = take_sampler_rest(iterator)
            shutdown_iterator(iterator)
        self.state = SwitchState.ROLLED_BACK
        self.error = exc
        self._detach()
        reconfigure(self.loader, self.fallback)
        if self.on_rollback is not None:
            self.on_rollback(self, exc)
        if stream or (rest is None and not held):
            return DataLoader.__iter__(self.loader)  # nothing was delivered: the iteration starts afresh
        return iterate_over(self.loader, RestOfEpoch(itertools.chain(held, rest if rest is not None else ())))

    # -- internals ------------------------------------------------------------------------------
    def _start(self) -> None:
        if loader_config_of(self.loader).dataloader_kwargs() != self.target.dataloader_kwargs():
            reconfigure(self.loader, self.target, self.multiprocessing_context)
        self.state = SwitchState.STARTED
        if self.fallback is None:
            self.state = SwitchState.CONFIRMED  # nothing to go back to: the switch is over once applied
            self._detach()
        else:
            record_index_batches(self.loader, self)

    def _detach(self) -> None:
        if getattr(self.loader, "switch", None) is self:
            self.loader.switch = None
            record_index_batches(self.loader, None)

    def _is_stream(self) -> bool:
        return isinstance(self.loader.dataset, IterableDataset)

    def __repr__(self) -> str:
        return f"LoaderSwitch({self.state.value}: {self.target.short()}, fallback {self.fallback})"


def loader_config_of(loader: DataLoader) -> LoaderConfig:
    """The :class:`LoaderConfig` a live loader runs with."""
    return LoaderConfig(
        num_workers=loader.num_workers,
        prefetch_factor=loader.prefetch_factor or 2,
        pin_memory=bool(loader.pin_memory),
        persistent_workers=bool(loader.persistent_workers),
    )


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
    # torch refuses a timeout without workers; the user's comes back with them
    loader.timeout = getattr(loader, "worker_timeout", loader.timeout) if config.num_workers > 0 else 0
    set_persistent_workers(loader, kwargs["persistent_workers"])
    if multiprocessing_context is not None and config.num_workers > 0 and loader.multiprocessing_context is None:
        loader.multiprocessing_context = multiprocessing_context
