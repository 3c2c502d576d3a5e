"""Each validation loader's own part of a run, without a Trainer: what its fetches and steps add up to, across ranks."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from fit_workloads import SleepyDataset

from lightning_dltune import LoaderConfig
from lightning_dltune.loaders.loader import build_loader
from lightning_dltune.measure.meter import WindowMeter
from lightning_dltune.measure.val_loaders import ValLoaderMeter, ValLoaderRun


def _trainer(loaders, mode=None):
    """What the meter reads of a Trainer: the validation loaders and the validation loop's combined mode."""
    combined = None if mode is None else SimpleNamespace(_mode=mode)
    val_loop = SimpleNamespace(_combined_loader=combined)
    return SimpleNamespace(
        val_dataloaders=loaders, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(val_loop=val_loop))
    )


def _run(cost_s=(0.01, 0.0), lengths=(12, 8), step_s=0.002):
    """One sequential validation run over two loaders (slow, fast) the way the loop and the hooks drive it."""
    loaders = [
        build_loader(SleepyDataset(n, batch_cost_s=c), LoaderConfig(), batch_size=4) for n, c in zip(lengths, cost_s)
    ]
    pooled, meter = WindowMeter(), ValLoaderMeter()
    for loader in loaders:
        loader.fetch_recorder = pooled  # as the pooled probe attaches them
    meter.attach(_trainer(loaders), pooled)
    for idx, loader in enumerate(loaders):
        for batch in loader:
            meter.batch_started(time.perf_counter())
            time.sleep(step_s)
            meter.batch_ended(batch, idx, time.perf_counter())
    return meter, pooled


def test_each_loaders_fetches_and_steps_are_its_own_and_add_up_to_the_pooled_run():
    meter, pooled = _run()
    slow, fast = meter.local_stats()
    assert (slow.batches, slow.samples, fast.batches, fast.samples) == (3, 12, 2, 8)
    assert slow.fetches + fast.fetches == pooled.fetches == 3  # each loader's first batch is its start-up
    assert slow.fetch_wait_total_s + fast.fetch_wait_total_s == pytest.approx(pooled.fetch_wait_total_s)
    assert slow.fetch_wait_total_s >= 0.019 and slow.starvation_ratio > fast.starvation_ratio  # two 10 ms fetches
    assert slow.stalls == slow.fetches  # no workers: every fetch made its batch while the loop waited
    meter.close()
    assert meter.count == 0 and meter.local_stats() == []


def test_one_validation_loader_has_no_parts():
    loader = build_loader(SleepyDataset(8), LoaderConfig(), batch_size=4)
    meter = ValLoaderMeter()
    meter.attach(_trainer([loader]), WindowMeter())
    meter.batch_started(time.perf_counter())
    meter.batch_ended(next(iter(loader)), 0, time.perf_counter())
    assert meter.count == 0 and meter.local_stats() == []


def test_in_a_combined_mode_each_step_counts_for_every_loader_with_a_batch_in_it():
    loaders = [build_loader(SleepyDataset(n), LoaderConfig(), batch_size=4) for n in (12, 4)]
    meter = ValLoaderMeter()
    meter.attach(_trainer(loaders, mode="max_size"), WindowMeter())
    first, second = iter(loaders[0]), iter(loaders[1])
    for step in range(3):  # max_size: the short loader ran out after one batch and gives None
        meter.batch_started(time.perf_counter())
        meter.batch_ended([next(first), next(second) if step == 0 else None], 0, time.perf_counter())
    assert [s.batches for s in meter.local_stats()] == [3, 1]


class _TwoRanks:
    """A strategy whose other rank measured the same loaders, the slow one more starved (twice the wait)."""

    global_rank = 0

    def reduce(self, block, reduce_op):  # the sum all-reduce adds the other rank's slot
        other = block[0].clone()
        other[0, 2] *= 2  # fetch_wait_total_s of loader 0, in the declared field order
        return block + torch.stack([torch.zeros_like(other), other])


def test_across_ranks_each_loader_is_its_most_starved_ranks_and_the_samples_are_the_jobs():
    meter, _ = _run()
    local = meter.local_stats()
    slow, fast = meter.job_stats(_TwoRanks(), world_size=2)
    assert slow.fetch_wait_total_s == pytest.approx(2 * local[0].fetch_wait_total_s)  # the other rank's
    assert fast.fetch_wait_total_s == pytest.approx(local[1].fetch_wait_total_s)
    assert (slow.samples, fast.samples) == (2 * local[0].samples, 2 * local[1].samples)


def test_a_part_round_trips_through_a_checkpoint_dict():
    meter, _ = _run()
    part = ValLoaderRun(run=0, step=20, epoch=0, dataloader_idx=1, stats=meter.local_stats()[1])
    assert ValLoaderRun.from_dict(part.to_dict()) == part
