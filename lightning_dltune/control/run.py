"""One fit's tuning run: where windows close, what the policy decided, the loaders switched, the saved state.

:class:`TuningRun` is the control loop between the callback's hooks and the policy. It takes a
window's job-wide stats and returns its record; it never reads a Trainer. What it needs from the
job (the cross-rank broadcast, the budget) comes in as arguments, so a unit test drives it window
by window with plain stats and a real :class:`~lightning_dltune.TunableDataModule`.

Example::

    run = TuningRun(PolicySettings(), WindowSchedule(50, 3.0, first_batches=10), datamodule, tune=True)
    run.open_window(0, epoch_batches=900, world_size=1, switchable=True)
    record = run.close_window(config, stats, budget, epoch=0, global_step=10, end_batch=10)
    run.running_config(record)  # the config the rest of the epoch runs
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from lightning_dltune.control.budgets import cap_after_failure, less_the_other_side
from lightning_dltune.control.switchable import FailureListener, SwitchableLoaders
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.history import (
    CONFIRM_BATCHES,
    detect_shift,
    given_back_from,
    is_starved,
    same_conditions,
    starved_rise,
)
from lightning_dltune.core.policy import decide
from lightning_dltune.core.records import Budget, Decision, PolicySettings, WindowRecord
from lightning_dltune.core.stats import WindowStats
from lightning_dltune.core.val_start import first_val_config
from lightning_dltune.core.windows import VAL_FEWEST_BATCHES, WindowSchedule, starved_start

Broadcast = Callable[[Any], Any]
"""Rank zero's object on every rank (``trainer.strategy.broadcast``); the identity with one process."""


def _alone(obj: Any) -> Any:
    return obj


def _record(
    epoch: int, config: LoaderConfig, stats: WindowStats, decision: Decision, end_batch: Optional[int], step: int
) -> WindowRecord:
    """The record of one judged window (training) or validation run."""
    return WindowRecord(
        epoch, config, stats, decision.verdict, decision.reason, decision.config, end_batch, step, decision.judged_util
    )


class TuningRun:
    """The windows, decisions and loader changes of one fit, and what a checkpoint keeps of them.

    Args:
        settings: the policy's band, rebuild cap, gain threshold and deepest prefetch.
        schedule: where this fit's windows close.
        datamodule: the loaders to switch; ``None``: measure and recommend only.
        tune: switch the loaders to the policy's configs (``False``: the decisions are what it would try).
    """

    def __init__(
        self,
        settings: PolicySettings,
        schedule: WindowSchedule,
        datamodule: Optional[SwitchableLoaders] = None,
        tune: bool = True,
    ) -> None:
        self.settings = settings
        self.windows = schedule
        self.datamodule = datamodule
        self._tune = tune
        self.history: list[WindowRecord] = []
        self.val_history: list[WindowRecord] = []  # one record per validation run (the val side's windows)
        self.tune_validation = True  # False: the validation loaders follow the training config
        self.rebuilds = 0  # config changes in this fit
        self.worker_cap: Optional[int] = None  # lowered when a switch rolled back
        self.restored_config: Optional[LoaderConfig] = None  # from a checkpoint, applied at fit start
        self.on_rollback: Optional[FailureListener] = None  # also told when a switch rolls back
        self.restored_positions: list[dict[str, Any]] = []  # a project's own train loaders' places in the epoch
        self.restored_val_config: Optional[LoaderConfig] = None  # the validation side's own config, from a checkpoint
        self.val_start: Optional[LoaderConfig] = None  # the validation side's first config, sized by a training window
        self.val_run_batches: Optional[int] = None  # the most batches a validation run takes (None: unknown)

    @property
    def tuning(self) -> bool:
        """Whether the policy's configs reach the loaders (a project's loader may turn out not switchable)."""
        return self._tune and self.datamodule is not None and getattr(self.datamodule, "tunable", True)

    # -- windows ---------------------------------------------------------------------------------
    def open_window(self, first_batch: int, epoch_batches: float, world_size: int, switchable: bool) -> None:
        """Plan the window opening at ``first_batch`` of an epoch of ``epoch_batches`` (``inf``: unknown).

        It closes mid-epoch only where every rank reaches that batch (a known epoch length, or one
        process) and, when tuning, where the training loaders can switch right there (``switchable``).
        """
        mid_epoch = (math.isfinite(epoch_batches) or world_size == 1) and (not self.tuning or switchable)
        self.windows.open(first_batch, epoch_batches, mid_epoch, seen=bool(self.history), looks=self.tuning)

    def closes_at_look(self, config: Optional[LoaderConfig], stats: WindowStats) -> bool:
        """Whether the open window closes at this look: the fit's first starves plainly at 0 workers
        (:func:`~lightning_dltune.core.windows.starved_start`), a later one shows new conditions against
        ``config``'s earlier windows (two, as the decision needs, or one where the loop now starves), or, the
        first of a give-back, a measured cost that rose and starved the loop against the windows of the config
        it left (:func:`~lightning_dltune.core.history.starved_rise`)."""
        if config is None or not stats.fetches:
            return False
        if not self.history:
            return starved_start(stats, config.num_workers)
        prior = same_conditions(self.history, config)
        if prior:
            # against one earlier window (no spread to weigh a move against) a move is news only where the loop
            # now starves: the decision acts on that (it judges the change that made the config, or adds)
            moved = detect_shift(prior, stats, config.num_workers, part=True) is not None
            return moved and (len(prior) >= 2 or is_starved(stats, self.settings))
        given_back = given_back_from(self.history, config)  # a give-back's first window: against the config it left
        return starved_rise(given_back, stats, config.num_workers, self.settings, part=True) is not None

    def looked(self, batch_idx: int) -> None:
        """A look at ``batch_idx`` found the same conditions."""
        self.windows.looked(batch_idx)

    def close_window(
        self,
        config: LoaderConfig,
        stats: WindowStats,
        budget: Budget,
        epoch: int,
        global_step: int,
        end_batch: Optional[int] = None,
        broadcast: Broadcast = _alone,
    ) -> Optional[WindowRecord]:
        """Judge a window of ``config`` that measured the job-wide ``stats``; ``None`` without a fetch to judge,
        mid-epoch while its step time still falls or its config barely ran after a switch's drain
        (:meth:`WindowSchedule.goes_on`: it goes on), or at an epoch end where the config made fewer than
        ``CONFIRM_BATCHES`` batches after that drain (the next epoch's window is its first).

        Every rank runs the same numbers and keeps rank zero's decision and next window length (one
        ``broadcast``). A changed config applies from the next epoch start or, mid-epoch (``end_batch``),
        to the training loaders right away.
        """
        if stats.fetches == 0:  # no evidence: a window whose only fetch was the loader's start-up
            return None
        if end_batch is None and stats.drained_batches and stats.batches < CONFIRM_BATCHES:
            return None
        if end_batch is not None and self.windows.goes_on(stats, seen=bool(self.history)):
            return None  # the step time still falls (warm-up): the window goes on, judged when settled
        decision = decide(config, stats, budget, self.history, self.settings)
        next_length = self.windows.length_after(stats, decision.confirm_batches)
        decision, self.windows.next_length = broadcast((decision, next_length))
        record = _record(epoch, config, stats, decision, end_batch, global_step)
        self.history.append(record)
        if self.tuning:
            self._apply(record, mid_epoch=end_batch is not None)
            self._start_validation(record, budget)
        return record

    def _start_validation(self, record: WindowRecord, budget: Budget) -> None:
        """Before the validation side's first run: a config of its own, sized from this training window where the
        shorter validation step needs more workers than the training config (:mod:`~lightning_dltune.core.val_start`).
        """
        datamodule = self.datamodule
        assert datamodule is not None
        if not self.tune_validation or self.val_history or self.val_start is not None:
            return
        if datamodule.has_val_config() or datamodule.held_workers() is not None:
            return
        follows = record.next_config
        val_budget = less_the_other_side(budget, follows, record.stats.batch_bytes)  # the idle training workers
        val_budget = val_budget.for_runs_of(self.val_run_batches)
        start = first_val_config(record.config, record.stats, follows, val_budget, self.settings)
        if start is None and follows.num_workers > val_budget.max_workers:  # workers a run would leave idle
            start = follows.replace(num_workers=val_budget.max_workers)
        if start is not None:  # a start, not a rebuild: the validation loaders have not run yet
            self.val_start = start
            datamodule.switch_val_loaders(start, on_failure=self.rolled_back)

    def close_val_run(
        self,
        config: LoaderConfig,
        stats: WindowStats,
        budget: Budget,
        epoch: int,
        global_step: int,
        broadcast: Broadcast = _alone,
    ) -> Optional[WindowRecord]:
        """Judge a validation run of ``config``: the validation side's window, decided on its own history.

        A changed config gives the validation loaders a config of their own from their next run on
        (the training loaders keep theirs; with ``tune_validation`` off it is what the tuner would try).
        Runs of a few batches pool until :data:`~lightning_dltune.core.windows.VAL_FEWEST_BATCHES` are
        measured with one config (held till then). ``None`` without a fetch to judge.
        """
        if stats.fetches == 0:
            return None
        budget = budget.for_runs_of(self.val_run_batches)
        decision = broadcast(decide(config, stats, budget, self.val_history, self.settings, VAL_FEWEST_BATCHES))
        record = _record(epoch, config, stats, decision, None, global_step)
        self.val_history.append(record)
        if self.tuning and self.tune_validation:
            assert self.datamodule is not None
            self.datamodule.mark_val_config_good()
            if record.changed:
                self.rebuilds += 1
                self.datamodule.switch_val_loaders(record.next_config, on_failure=self.rolled_back)
        return record

    def running_config(self, record: WindowRecord) -> LoaderConfig:
        """The config the loaders run after ``record`` (a monitor's decision is only what it would try)."""
        return record.next_config if self.tuning else record.config

    def _apply(self, record: WindowRecord, mid_epoch: bool) -> None:
        datamodule = self.datamodule
        assert datamodule is not None
        datamodule.mark_config_good()
        if not record.changed:
            return
        self.rebuilds += 1
        if mid_epoch:  # more workers take over what the old, too few, hold; otherwise the old ones deliver it
            take_over = 0 < record.config.num_workers < record.next_config.num_workers
            datamodule.switch_train_loaders(record.next_config, on_failure=self.rolled_back, take_over=take_over)
        else:
            datamodule.set_loader_config(record.next_config)

    # -- loaders ---------------------------------------------------------------------------------
    def start_fit(self) -> None:
        """At fit start: the restored config (a resumed fit) on the loaders, and rollback reported here."""
        if self.tuning:
            assert self.datamodule is not None
            self.datamodule.enable_rollback(self.rolled_back)
            if self.restored_config is not None:
                self.datamodule.set_loader_config(self.restored_config)
            if self.restored_val_config is not None:
                self.datamodule.switch_val_loaders(self.restored_val_config)

    def start_epoch(self) -> None:
        """At an epoch start: the loaders built for the config the last window chose."""
        if self.tuning:
            self.datamodule.rebuild_loaders(on_failure=self.rolled_back)  # type: ignore[union-attr]

    def rolled_back(self, failed: LoaderConfig, restored: LoaderConfig, exc: BaseException) -> None:
        """A loader switch rolled back: at most halfway back up to ``failed`` from now on."""
        self.worker_cap = cap_after_failure(self.worker_cap, failed, restored)
        if self.on_rollback is not None:
            self.on_rollback(failed, restored, exc)

    def held_workers(self) -> Optional[int]:
        """Workers the datamodule must keep (a stream that does not shard by worker), else ``None``."""
        return self.datamodule.held_workers() if self.datamodule is not None else None

    # -- checkpoints -----------------------------------------------------------------------------
    def _val_config_state(self) -> Optional[dict[str, Any]]:
        own = getattr(self.datamodule, "_val_config", None)
        return own.as_dict() if own is not None else None

    def state_dict(self, current: Optional[LoaderConfig]) -> dict[str, Any]:
        """What a checkpoint keeps: the config to resume with (``current`` before any window), the history,
        the rebuild count, the worker cap after a failed switch, the next window's length and where a project's
        own training loaders stand in their epoch (Lightning keeps only the positions of loaders with a state)."""
        if self.history:
            current = self.history[-1].next_config
        positions = getattr(self.datamodule, "positions", None)  # loaders Lightning does not checkpoint itself
        return {
            "loader_positions": positions() if positions is not None else [],
            "config": current.as_dict() if current is not None else None,
            "rebuilds": self.rebuilds,
            "history": [record.to_dict() for record in self.history],
            "val_history": [record.to_dict() for record in self.val_history],
            "val_config": self._val_config_state(),
            "worker_cap": self.worker_cap,
            "next_window": self.windows.next_length,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved run (checkpoints from before a key existed load with its default)."""
        config = state.get("config")
        self.restored_config = LoaderConfig(**config) if config else None
        self.rebuilds = state.get("rebuilds", 0)
        self.worker_cap = state.get("worker_cap")
        self.windows.next_length = state.get("next_window", self.windows.next_length)
        self.history = [WindowRecord.from_dict(d) for d in state.get("history", [])]
        self.val_history = [WindowRecord.from_dict(d) for d in state.get("val_history", [])]
        val_config = state.get("val_config")
        self.restored_val_config = LoaderConfig(**val_config) if val_config else None
        self.restored_positions = list(state.get("loader_positions", []))
