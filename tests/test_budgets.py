"""budgets: the worker cap after a failed switch, the start clamp (pure parts; DDP reduction runs in test_ddp), and
the batches a fit has left (read from a real Trainer)."""

from dataclasses import replace

import lightning.pytorch as pl
import pytest
from fit_workloads import SleepStepModule, SleepyDataset
from torch.utils.data import DataLoader

from lightning_dltune.control.budgets import cap_after_failure, clamp_start, fit_batches_left
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.records import Budget, PolicySettings

MB = 2**20


def test_a_failed_switch_caps_workers_halfway_back_up_and_never_raises_the_cap():
    cap = cap_after_failure(None, failed=LoaderConfig(num_workers=6), restored=LoaderConfig(num_workers=2))
    assert cap == 4
    assert cap_after_failure(cap, failed=LoaderConfig(num_workers=8), restored=LoaderConfig(num_workers=2)) == 4
    assert cap_after_failure(cap, failed=LoaderConfig(num_workers=3), restored=LoaderConfig(num_workers=1)) == 2


def test_a_failure_that_did_not_add_workers_leaves_the_cap_alone():
    assert (
        cap_after_failure(
            None, failed=LoaderConfig(num_workers=2, prefetch_factor=8), restored=LoaderConfig(num_workers=2)
        )
        is None
    )


def test_the_start_clamp_shares_dev_shm_between_train_and_val_and_keeps_a_batch_per_loop():
    # 8 MB /dev/shm, half of it for batches; 1 MB batches; persistent train and val workers
    budget = Budget(max_workers=8, memory_bytes=None, shm_bytes=4 * MB, cpus=8)
    start = LoaderConfig(num_workers=4, prefetch_factor=4)
    clamped = clamp_start(start, budget, batch_bytes=MB, loaders=2, settings=PolicySettings())
    assert 2 * (clamped.num_workers * clamped.prefetch_factor + 1) * MB <= 4 * MB
    assert clamped.num_workers >= 1


def test_the_start_clamp_gives_prefetch_first_then_workers():
    budget = Budget(max_workers=8, memory_bytes=9 * MB, shm_bytes=None, cpus=8)
    clamped = clamp_start(LoaderConfig(num_workers=4, prefetch_factor=4), budget, MB, 1, PolicySettings())
    assert clamped == LoaderConfig(num_workers=4, prefetch_factor=2)  # 8 batches + the loop's own within 9 MB


def test_the_start_clamp_without_a_batch_size_only_applies_the_worker_and_prefetch_caps():
    budget = Budget(max_workers=3, memory_bytes=1.0, shm_bytes=1.0, cpus=4)
    clamped = clamp_start(LoaderConfig(num_workers=6, prefetch_factor=16), budget, None, 2, PolicySettings())
    assert clamped == LoaderConfig(num_workers=3, prefetch_factor=8)


def test_a_run_of_fewer_batches_than_the_worker_budget_lowers_it_and_the_other_sides_share_keeps_that():
    from lightning_dltune.control.budgets import less_the_other_side

    budget = Budget(7, memory_bytes=1e9, shm_bytes=1e9, cpus=8)
    assert budget.for_runs_of(None) is budget and budget.for_runs_of(7) is budget and budget.for_runs_of(40) is budget
    short = budget.for_runs_of(2)
    assert (short.max_workers, short.run_batches, short.cpus) == (2, 2, 8)
    assert budget.for_runs_of(0).max_workers == 0
    shared = less_the_other_side(short, LoaderConfig(num_workers=3, prefetch_factor=2), batch_bytes=1000)
    assert (shared.max_workers, shared.run_batches) == (2, 2) and shared.memory_bytes < 1e9


def test_a_start_over_the_worker_budget_begins_at_one_worker_a_cpu_where_the_tuner_earns_the_rest():
    budget = Budget(max_workers=7, memory_bytes=None, shm_bytes=None, cpus=2)
    greedy = LoaderConfig(num_workers=16, prefetch_factor=8)
    assert clamp_start(greedy, budget, None, 1, PolicySettings(), earn=True) == LoaderConfig(2, 8)
    assert clamp_start(greedy, budget, None, 1, PolicySettings()) == LoaderConfig(7, 8)  # measuring only
    assert clamp_start(greedy, replace(budget, cpus=1.5), None, 1, PolicySettings(), earn=True).num_workers == 1
    assert clamp_start(greedy, replace(budget, max_workers=1, cpus=8), None, 1, PolicySettings(), earn=True) == (
        LoaderConfig(1, 8)
    )
    # within the budget, more workers than CPUs are the project's choice: kept
    assert clamp_start(LoaderConfig(6, 2), budget, None, 1, PolicySettings(), earn=True) == LoaderConfig(6, 2)


class _BatchesLeft(pl.Callback):
    """What ``fit_batches_left`` says after each batch and at each epoch end, beside the batches trained so far."""

    def __init__(self) -> None:
        self.trained = 0
        self.said: list[tuple[int, object]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.trained += 1
        self.said.append((self.trained, fit_batches_left(trainer, batch_idx + 1)))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.said.append((self.trained, fit_batches_left(trainer, None)))


def _fit(trainer_kwargs: dict, **limits) -> _BatchesLeft:
    counter = _BatchesLeft()
    trainer = pl.Trainer(**limits, limit_val_batches=0, callbacks=[counter], **trainer_kwargs)
    trainer.fit(SleepStepModule(), train_dataloaders=DataLoader(SleepyDataset(40), batch_size=8))  # 5 batches an epoch
    return counter


@pytest.mark.slow  # real fits
@pytest.mark.parametrize(
    "limits", [{"max_epochs": 3}, {"max_epochs": 3, "max_steps": 12}, {"max_epochs": -1, "max_steps": 8}]
)
def test_the_batches_a_fit_has_left_are_the_batches_it_then_trains(trainer_kwargs, limits):
    counter = _fit(trainer_kwargs, **limits)
    assert counter.trained == min(15, limits.get("max_steps", 15))
    assert [left for _, left in counter.said] == [counter.trained - trained for trained, _ in counter.said]


@pytest.mark.slow  # real fits
def test_with_accumulated_batches_the_steps_left_bound_the_batches_left_from_above(trainer_kwargs):
    # 5 batches an epoch in steps of 2 batches: Lightning steps at each epoch's end too (2 + 2 + 1)
    counter = _fit(trainer_kwargs, max_epochs=-1, max_steps=7, accumulate_grad_batches=2)
    assert all(left >= counter.trained - trained for trained, left in counter.said)
    assert counter.said[-1][1] == 0


@pytest.mark.slow  # real fits
def test_a_fit_bounded_by_time_alone_has_no_batches_left_to_count(trainer_kwargs):
    counter = _fit(trainer_kwargs, max_epochs=-1, max_time={"seconds": 1}, limit_train_batches=5)
    assert counter.said and all(left is None for _, left in counter.said)
