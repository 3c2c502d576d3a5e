"""Measured fetch wait, step time and starvation against ground truth, in real CPU fits.

The accelerator step is emulated with a sleep in the training process and each batch costs a known
sleep to produce, so the truth per batch is known: with 0 workers the loop waits the whole batch
cost; with W serial workers the steady-state period is max(step, cost / W).
"""

import lightning.pytorch as pl
import pytest
from fit_workloads import SleepStepModule, SleepyDataModule, SleepyDataset, steady_truth
from torch.utils.data import DataLoader

from lightning_dltune import DataLoaderTuner
from lightning_dltune.measure.meter import WindowMeter, stall_cutoff

BATCH = 4
PREFETCH = 2
BATCHES = 50
CASES = {0: (0.04, 0.04), 2: (0.16, 0.04)}  # workers: (batch cost, step) -> starvation 0.5 both


class PlainLoaderModule(SleepStepModule):
    """A module with its own plain DataLoaders: what the tuner sees in a project without the mixin."""

    def __init__(self, workers, batch_cost_s, batches, **kwargs):
        super().__init__(**kwargs)
        self.workers, self.batch_cost_s, self.batches = workers, batch_cost_s, batches

    def train_dataloader(self):
        ds = SleepyDataset(self.batches * BATCH, batch_cost_s=self.batch_cost_s)
        return DataLoader(
            ds,
            batch_size=BATCH,
            num_workers=self.workers,
            persistent_workers=self.workers > 0,
            prefetch_factor=PREFETCH if self.workers else None,
        )

    def val_dataloader(self):
        return DataLoader(SleepyDataset(2 * BATCH), batch_size=BATCH)


def _fit(trainer_kwargs, workers, validation, plain=False, batches=BATCHES):
    cost, step = CASES[workers]
    tuner = DataLoaderTuner(tune=False, verbose=False, recommendation_file=False)
    val_kwargs = dict(limit_val_batches=0)
    val_step_s = 0.0
    if validation:
        # two 1-second validations per epoch: one mid-epoch, one at the end
        val_kwargs = dict(val_check_interval=0.5)
        val_step_s = 0.5
    if plain:
        model, dm = PlainLoaderModule(workers, cost, batches, step_s=step, val_step_s=val_step_s), None
    else:
        model = SleepStepModule(step_s=step, val_step_s=val_step_s)
        dm = SleepyDataModule(
            train_length=batches * BATCH,
            val_length=2 * BATCH,
            batch_cost_s=cost,
            batch_size=BATCH,
            num_workers=workers,
            prefetch_factor=PREFETCH,
            shuffle=False,
        )
    trainer = pl.Trainer(max_epochs=1, callbacks=[tuner], **{**trainer_kwargs, **val_kwargs})
    trainer.fit(model, datamodule=dm)
    assert len(tuner.history) == 1
    wait, step = steady_truth(cost, step, workers)
    if validation and workers:
        # While validation runs, the train workers fill their queue (workers x prefetch batches); the
        # loop then takes those without waiting, which saves one production period per batch
        # queued. That time really was not spent waiting, so it is part of the truth.
        period = wait + step
        wait -= workers * PREFETCH * period / (batches - 1)
    return tuner.history[0].stats, (wait, step, workers)


def _assert_close_to_truth(stats, truth):
    # A sleep never ends early but may end late on a busy machine, so the step may run up to 30 % long.
    # With workers, the time a longer step takes is time the workers had: the wait shrinks by as much.
    wait, step, workers = truth
    assert 0.9 * step <= stats.step_mean_s <= 1.3 * step
    if workers:
        wait = max(0.0, wait - max(0.0, stats.step_mean_s - step))
    assert 0.9 * wait - 0.002 <= stats.fetch_wait_mean_s <= 1.3 * wait + 0.002
    assert abs(stats.starvation_ratio - wait / (wait + stats.step_mean_s)) <= 0.05


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_fetch_wait_step_time_and_starvation_match_truth(trainer_kwargs, workers):
    stats, truth = _fit(trainer_kwargs, workers, validation=False)
    _assert_close_to_truth(stats, truth)
    # every batch is accounted for: measured, or left out as warm-up (a first step a busy machine slowed is)
    assert stats.all_batches == BATCHES and stats.batches >= BATCHES - 5


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_validation_mid_epoch_and_at_epoch_end_is_not_fetch_wait(trainer_kwargs, workers):
    stats, truth = _fit(trainer_kwargs, workers, validation=True)
    # 2 s of validation inside a ~4 s epoch: counted as fetch wait, it would wreck these bounds
    _assert_close_to_truth(stats, truth)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_plain_dataloaders_are_measured_as_accurately(trainer_kwargs, workers):
    stats, truth = _fit(trainer_kwargs, workers, validation=True, plain=True)
    _assert_close_to_truth(stats, truth)


@pytest.mark.slow
def test_worker_startup_is_reported_apart_from_fetch_wait(trainer_kwargs):
    stats, _ = _fit(trainer_kwargs, 2, validation=False, batches=20)
    # the first batch needs a whole batch cost (160 ms) after the workers start: that is start-up
    assert stats.startup_s >= 0.16
    assert stats.fetch_wait_p95_s < 0.16


@pytest.mark.slow
def test_stalls_are_exact_for_tunable_loaders(trainer_kwargs):
    stats, _ = _fit(trainer_kwargs, 0, validation=False, batches=20)
    # with no workers every batch is made on demand: every fetch is a stall, nothing is ever ready
    assert stats.stalls == stats.fetches == 19
    assert stats.queue_depth == 0


@pytest.mark.slow
def test_worker_side_batch_cost_is_measured_in_the_workers(trainer_kwargs):
    stats, _ = _fit(trainer_kwargs, 2, validation=False, batches=20)
    assert stats.worker_batch_s == pytest.approx(0.16, rel=0.10)
    assert stats.worker_cpu_fraction < 0.3  # a sleep is not CPU work


@pytest.mark.slow
def test_one_batch_far_slower_than_the_rest_is_the_windows_tail_stall(trainer_kwargs):
    # 2 workers x 100 ms a batch vs a 40 ms step: every fetch waits ~10 ms; batch 30 takes 1.2 s and holds
    # the loop for most of it (its lead: 4 batches queued). Plain loaders: the queue is unknown.
    class OneSlowBatch(PlainLoaderModule):
        def train_dataloader(self):
            ds = SleepyDataset(self.batches * BATCH, batch_cost_s=0.1, slow_every=30, slow_factor=12.0)
            return DataLoader(ds, batch_size=BATCH, num_workers=2, persistent_workers=True, prefetch_factor=PREFETCH)

    tuner = DataLoaderTuner(tune=False, verbose=False, recommendation_file=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[tuner], limit_val_batches=0, **trainer_kwargs)
    trainer.fit(OneSlowBatch(2, 0.1, 50, step_s=0.04))
    stats = tuner.history[0].stats
    assert 0.7 <= stats.tail_wait_s <= 1.5
    # without it, the window's starvation is its typical one: ~10 ms of ~50 ms per batch
    assert stats.starvation_ratio > 0.35 and 0.05 <= stats.typical_starvation <= 0.35


def test_meter_counts_stalls_by_threshold_when_the_queue_is_unknown():
    meter = WindowMeter(stall_threshold_s=0.002)
    for wait in (0.0001, 0.0005, 0.003, 0.010):
        meter.record_fetch(wait)
        meter.record_step(0.01)
    stats = meter.window_stats(batch_size=4)
    assert stats.stalls == 2 and stats.fetches == 4
    assert stats.queue_depth is None
    assert stats.samples == 16


def test_a_big_batchs_hand_over_is_no_stall_when_the_queue_is_unknown():
    # a 9.6 MB batch takes ~1.5 ms to hand over from a worker even when it was ready: at a 1 ms threshold
    # every fetch would be a "stall"; judged against the window's own hand-over time, only real waits are
    meter = WindowMeter(stall_threshold_s=0.001)
    waits = [0.0015, 0.0016, 0.0018, 0.0015, 0.0017] * 5 + [0.030]
    for wait in waits:
        meter.record_fetch(wait)
        meter.record_step(0.01)
    stats = meter.window_stats(batch_size=64, batch_bytes=9_600_000)
    assert stats.stalls == 1 and stats.fetches == 26


def test_when_every_fetch_waits_for_a_worker_every_fetch_is_a_stall():
    # the fastest fetch is no hand-over when all of them waited: the cutoff stays below what moving
    # the batch's bytes takes
    meter = WindowMeter(stall_threshold_s=0.001)
    for wait in [0.015, 0.016, 0.020, 0.018] * 5:
        meter.record_fetch(wait)
        meter.record_step(0.005)
    assert meter.window_stats(batch_size=64, batch_bytes=9_600_000).stalls == 20


def test_the_hand_over_cutoff_never_goes_below_the_threshold():
    assert stall_cutoff(0.002, 0.0001, 128) == 0.002
    assert stall_cutoff(0.001, 0.0015, 9_600_000) == pytest.approx(0.0045)
    assert stall_cutoff(0.001, 0.015, 9_600_000) == pytest.approx(2 * (0.0005 + 0.0048))
    assert stall_cutoff(0.001, 0.015, None) == 0.001  # no bytes known: the threshold, as configured


def test_the_batches_a_switchs_old_workers_held_are_left_out_and_the_production_is_counted_anew():
    meter = WindowMeter(stall_threshold_s=0.001)
    marked = []
    meter.on_drained = lambda: marked.append(meter.fetches)
    meter.record_drain()  # a switch mid-epoch: the old workers deliver what they hold, at their pace
    for _ in range(6):
        meter.record_fetch(0.030)
        meter.record_step(0.010)
    draining = meter.window_stats(batch_size=4)
    assert draining.batches == 0 and draining.drained_batches == 6  # nothing of the new config's yet
    meter.record_drained()
    assert marked == [6]  # the probe counts the new workers' production from here
    for _ in range(20):
        meter.record_fetch(0.002)
        meter.record_step(0.010)
    stats = meter.window_stats(batch_size=4)
    assert (stats.batches, stats.drained_batches, stats.all_batches) == (20, 6, 26)
    assert stats.fetch_wait_mean_s == pytest.approx(0.002) and stats.samples == 80
    # an epoch start ends any drain: the loaders start afresh
    meter.record_drain()
    meter.drain_over()
    meter.reset()
    meter.record_fetch(0.002)
    meter.record_step(0.010)
    assert meter.window_stats().batches == 1
