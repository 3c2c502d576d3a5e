"""TunableDataModule: loaders from the current config, rebuilt in place, nothing lost, nothing leaked."""

import logging
import os
import time
import warnings

import lightning.pytorch as pl
import psutil
import pytest
import torch
from fit_workloads import SleepStepModule, SleepyDataModule, SleepyDataset
from lightning.pytorch.callbacks import Callback

from lightning_dltune import DataLoaderTuner, LoaderConfig
from lightning_dltune.control.budgets import earned_start
from lightning_dltune.control.resources import rank_budget
from lightning_dltune.core.records import Budget
from lightning_dltune.loaders.loader import TunedDataLoader


class AlternateConfigs(Callback):
    """Forces a new loader config every epoch through the mixin's own rebuild path."""

    def __init__(self, configs):
        self.configs = configs
        self.children = []
        self.fds = []

    def on_train_epoch_start(self, trainer, pl_module):
        trainer.datamodule.rebuild_loaders()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            me = psutil.Process()
            self.children.append(len(me.children(recursive=True)))
            self.fds.append(me.num_fds())

    def on_train_epoch_end(self, trainer, pl_module):
        epoch = trainer.current_epoch + 1
        trainer.datamodule.set_loader_config(self.configs[epoch % len(self.configs)])


@pytest.mark.slow
def test_train_drops_the_last_partial_batch_and_val_keeps_it(trainer_kwargs):
    dm = SleepyDataModule(train_length=10, val_length=10, batch_size=4)
    trainer = pl.Trainer(max_epochs=1, **trainer_kwargs)
    trainer.fit(SleepStepModule(), datamodule=dm)
    assert trainer.train_dataloader.drop_last is True and len(trainer.train_dataloader) == 2
    assert trainer.val_dataloaders.drop_last is False and len(trainer.val_dataloaders) == 3
    assert isinstance(trainer.train_dataloader, TunedDataLoader)


def test_loader_config_defaults_are_derived():
    dm = SleepyDataModule(num_workers=3)
    assert dm.loader_config == LoaderConfig(num_workers=3, prefetch_factor=2, pin_memory=False, persistent_workers=True)
    assert SleepyDataModule(pin_memory=True, persistent_workers=False).loader_config.persistent_workers is False


@pytest.mark.slow
def test_extra_loader_arguments_reach_both_loaders(trainer_kwargs):
    seen = []

    def collate(samples):
        seen.append(len(samples))
        from torch.utils.data import default_collate

        return default_collate(samples)

    dm = SleepyDataModule(
        train_length=8, val_length=8, batch_size=4, loader_kwargs={"collate_fn": collate, "timeout": 0}
    )
    pl.Trainer(max_epochs=1, **trainer_kwargs).fit(SleepStepModule(), datamodule=dm)
    assert seen.count(4) == 4  # 2 train + 2 val batches went through the user's collate_fn


@pytest.mark.slow
def test_thirty_rebuilds_leave_no_extra_processes_or_open_files(trainer_kwargs):
    configs = [LoaderConfig(num_workers=w, prefetch_factor=p) for w, p in ((1, 2), (2, 1), (0, 2), (2, 3))]
    forcer = AlternateConfigs(configs)
    dm = SleepyDataModule(train_length=16, val_length=8, batch_size=4, num_workers=1)
    before = len(psutil.Process().children(recursive=True))
    trainer = pl.Trainer(max_epochs=31, callbacks=[forcer], limit_val_batches=1, **trainer_kwargs)
    trainer.fit(SleepStepModule(), datamodule=dm)
    # while training: never more than this epoch's train and val workers alive
    for epoch, children in enumerate(forcer.children):
        workers = configs[epoch % len(configs)].num_workers
        assert children <= before + 2 * workers, (epoch, children)
    # open files do not grow with rebuilds: the last cycle of configs holds no more than an early one (a leak of
    # one descriptor per rebuild would show +20; a busy machine shifts single samples by a few, either way)
    assert max(forcer.fds[24:28]) <= max(forcer.fds[4:8]) + 3
    assert len(psutil.Process().children(recursive=True)) == before


@pytest.mark.parametrize("reload", [0, 1])
@pytest.mark.slow
def test_nothing_is_lost_or_repeated_across_rebuilds(trainer_kwargs, reload):
    configs = [LoaderConfig(num_workers=w, prefetch_factor=p) for w, p in ((2, 1), (0, 2), (1, 3))]
    model = SleepStepModule(record_indices=True)
    dm = SleepyDataModule(train_length=30, val_length=13, batch_size=4, num_workers=2)
    trainer = pl.Trainer(
        max_epochs=6, callbacks=[AlternateConfigs(configs)], reload_dataloaders_every_n_epochs=reload, **trainer_kwargs
    )
    trainer.fit(model, datamodule=dm)
    assert len(model.val_indices) == 6
    for seen in model.val_indices:
        assert sorted(seen) == list(range(13))  # every validation sample exactly once
    for seen in model.train_indices:
        assert len(seen) == len(set(seen)) == 28  # at most once; 2 (< batch_size) dropped
    assert {len(set(s)) for s in model.train_indices} == {28}


@pytest.mark.slow
def test_tune_false_never_rebuilds(trainer_kwargs):
    tuner = DataLoaderTuner(tune=False, verbose=False, max_workers=4)
    dm = SleepyDataModule(train_length=40, val_length=8, batch_size=4, batch_cost_s=0.01)
    pl.Trainer(max_epochs=3, callbacks=[tuner], **trainer_kwargs).fit(SleepStepModule(step_s=0.002), datamodule=dm)
    assert [r.num_workers for r in tuner.history] == [0, 0, 0]
    assert tuner.rebuilds == 0
    assert tuner.history[0].changed  # it recommends more workers, without applying them
    assert dm.loader_config.num_workers == 0


@pytest.mark.slow
@pytest.mark.parametrize("tune", [True, False])
def test_a_start_over_the_worker_budget_begins_at_one_worker_a_cpu_when_tuning(trainer_kwargs, caplog, tune):
    # 16 workers x prefetch 8 asked for, 5 allowed: tuning starts at one worker a usable CPU and earns the rest
    # (the batches here are free: the fit never needs more); only measuring, it runs the budget's 5
    tuner = DataLoaderTuner(tune=tune, verbose=True, max_workers=5, window_batches=5, window_seconds=0.1)
    dm = SleepyDataModule(train_length=40, val_length=8, batch_size=4, num_workers=16, prefetch_factor=8)
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], **trainer_kwargs)
    with caplog.at_level(logging.INFO):
        trainer.fit(SleepStepModule(step_s=0.002), datamodule=dm)
    first = tuner.history[0].config
    assert first == LoaderConfig(earned_start(Budget(max_workers=5, cpus=rank_budget().cpus)) if tune else 5, 8)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[dltune] start: ")]
    assert len(said) == 1 and "workers=16 prefetch=8 pin=off persistent=on exceeds the budget" in said[0]
    assert ("one worker a usable CPU" in said[0]) == (tune and first.num_workers < 5)


@pytest.mark.slow
def test_a_rebuild_whose_workers_die_rolls_back_and_the_fit_goes_on(trainer_kwargs):
    # workers are killed (as by the OOM killer) whenever more than one runs
    tuner = DataLoaderTuner(verbose=False, max_workers=6)
    dm = SleepyDataModule(
        train_length=48, val_length=8, batch_size=4, batch_cost_s=0.02, dataset_kwargs={"fail_in_worker_above": 1}
    )
    trainer = pl.Trainer(max_epochs=4, callbacks=[tuner], **trainer_kwargs)
    with pytest.warns(UserWarning, match="loader config failed") as record:
        trainer.fit(SleepStepModule(step_s=0.005), datamodule=dm)
    assert len([w for w in record if "loader config failed" in str(w.message)]) == 1  # warned once
    assert trainer.current_epoch == 4 and len(tuner.history) == 4
    assert all(r.num_workers <= 1 for r in tuner.history)  # the fit ran only configs that work
    assert dm.loader_config.num_workers <= 1


class FailingDataset(SleepyDataset):
    def __getitems__(self, indices):
        if 7 in indices:
            raise ValueError("bad sample 7")
        return super().__getitems__(indices)


class FailingData(SleepyDataModule):
    def setup(self, stage):
        super().setup(stage)
        self.train_dataset = FailingDataset(32)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_a_dataset_error_reaches_the_user_unchanged(trainer_kwargs, workers):
    tuner = DataLoaderTuner(verbose=False)
    dm = FailingData(batch_size=4, num_workers=workers)
    trainer = pl.Trainer(max_epochs=1, callbacks=[tuner], **trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="bad sample 7"):
        warnings.simplefilter("always")
        trainer.fit(SleepStepModule(), datamodule=dm)
    assert not [w for w in caught if "loader config failed" in str(w.message)]


@pytest.mark.parametrize("start_workers", [0, 1])
@pytest.mark.slow
def test_the_first_epoch_switches_loaders_mid_epoch_without_losing_or_repeating_a_batch(trainer_kwargs, start_workers):
    # I/O-bound: 30 ms of storage latency per batch against a 5 ms step
    model = SleepStepModule(step_s=0.005, record_indices=True)
    dm = SleepyDataModule(train_length=250, val_length=8, batch_cost_s=0.03, batch_size=4, num_workers=start_workers)
    tuner = DataLoaderTuner(verbose=False, first_decision_after=10)
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], **trainer_kwargs)
    trainer.fit(model, datamodule=dm)
    early, rest = tuner.history[0], tuner.history[1]
    # from 0 workers, 86 % starved: the first window's early look (4 batches, or 6 after slow first steps) judges it
    assert early.epoch == rest.epoch == 0 and early.end_batch in ((4, 6) if start_workers == 0 else (10,))
    assert early.config.num_workers == start_workers and rest.config.num_workers > start_workers
    assert rest.stats.all_batches == 62 - early.end_batch  # the rest of the epoch ran with the new workers
    for seen in model.train_indices:
        assert len(seen) == len(set(seen)) == 248  # each sample at most once, 2 (< batch_size) dropped
    assert sorted(model.val_indices[-1]) == list(range(8))
    assert tuner.rebuilds >= 1


# -- iterable datasets -----------------------------------------------------------------------------
class ReplayingIterable(torch.utils.data.IterableDataset):
    """A stream written for ``num_workers=0``: every worker would replay all of it."""

    def __init__(self, length=200, batch_cost_s=0.0, batch_size=4):
        self.length = length
        self.sample_cost_s = batch_cost_s / batch_size

    def __iter__(self):
        for i in range(self.length):
            if self.sample_cost_s:
                time.sleep(self.sample_cost_s)
            yield {"x": torch.full((8,), float(i)), "index": i}


class ShardedIterable(ReplayingIterable):
    """The same stream, split across workers by ``get_worker_info()``."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i, sample in enumerate(super().__iter__()):
            if i % step == start:
                yield sample


class StreamData(SleepyDataModule):
    def __init__(self, stream=ReplayingIterable, **kwargs):
        super().__init__(**kwargs)
        self.stream = stream

    def setup(self, stage):
        super().setup(stage)
        self.train_dataset = self.stream(self.train_length, self.batch_cost_s, self.batch_size)


@pytest.mark.slow
def test_an_iterable_dataset_that_does_not_shard_keeps_its_workers_and_each_sample_once(trainer_kwargs, caplog):
    # data-bound (20 ms a batch against a 2 ms step): the tuner would add workers, which would replay the stream
    model = SleepStepModule(step_s=0.002, record_indices=True)
    dm = StreamData(train_length=120, val_length=8, batch_size=4, batch_cost_s=0.02, num_workers=0)
    tuner = DataLoaderTuner(first_decision_after=0)
    with caplog.at_level(logging.INFO):
        pl.Trainer(max_epochs=3, callbacks=[tuner], **trainer_kwargs).fit(model, datamodule=dm)
    for seen in model.train_indices:
        assert sorted(seen) == list(range(120))  # each sample once per epoch, never replayed
    assert [r.config.num_workers for r in tuner.history] == [0, 0, 0]
    said = [r.getMessage() for r in caplog.records if "iterable_shards_by_worker=True" in r.getMessage()]
    assert len(said) == 1 and "holding num_workers=0" in said[0]


@pytest.mark.slow
def test_an_iterable_dataset_that_shards_by_worker_is_tuned_and_drops_less_than_a_batch_per_worker(trainer_kwargs):
    model = SleepStepModule(step_s=0.002, record_indices=True)
    dm = StreamData(
        stream=ShardedIterable,
        train_length=120,
        val_length=8,
        batch_size=4,
        batch_cost_s=0.02,
        num_workers=0,
        iterable_shards_by_worker=True,
    )
    tuner = DataLoaderTuner(first_decision_after=0, verbose=False, max_workers=3)
    pl.Trainer(max_epochs=3, callbacks=[tuner], **trainer_kwargs).fit(model, datamodule=dm)
    assert tuner.history[-1].config.num_workers > 0
    for seen, record in zip(model.train_indices, tuner.history):
        workers = record.config.num_workers
        assert len(seen) == len(set(seen))  # never replayed
        assert 120 - len(seen) < max(1, workers) * 4  # each worker drops at most its last partial batch


# -- the user's errors, with any worker count -----------------------------------------------------
class FailsInTheTrainingProcess(SleepyDataset):
    """Loads fine in workers; in the training process (0 workers) it raises the user's ``error``."""

    def __init__(self, length, error):
        super().__init__(length)
        self.error = error

    def __getitems__(self, indices):
        if torch.utils.data.get_worker_info() is None:
            raise self.error
        return super().__getitems__(indices)


@pytest.mark.parametrize(
    "error", [FileNotFoundError("/data/shard-7.tar"), MemoryError("decoder"), RuntimeError("my shm cache is full")]
)
@pytest.mark.slow
def test_a_dataset_error_after_a_rebuild_to_no_workers_reaches_the_user_unchanged(trainer_kwargs, error):
    class Data(SleepyDataModule):
        def setup(self, stage):
            super().setup(stage)
            self.train_dataset = FailsInTheTrainingProcess(16, error)

    forcer = AlternateConfigs([LoaderConfig(num_workers=1), LoaderConfig(num_workers=0)])
    dm = Data(batch_size=4, num_workers=1, shuffle=False)
    trainer = pl.Trainer(max_epochs=2, callbacks=[forcer], **trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(type(error), match=str(error)) as raised:
        warnings.simplefilter("always")
        trainer.fit(SleepStepModule(), datamodule=dm)
    assert raised.value is error  # the very exception the dataset raised
    assert trainer.current_epoch == 1 and dm.loader_config.num_workers == 0  # no rollback
    assert not [w for w in caught if "went back" in str(w.message)]


# -- rollbacks: every sample once, nothing skipped -------------------------------------------------
class KilledFromIndex(SleepyDataset):
    """Workers are killed (as by the OOM killer) at a batch from ``kill_from`` on when more than ``above`` run."""

    def __init__(self, length, kill_from=0, above=1, batch_cost_s=0.0):
        super().__init__(length, batch_cost_s=batch_cost_s)
        self.kill_from = kill_from
        self.above = above

    def __getitems__(self, indices):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > self.above and max(indices) >= self.kill_from:
            os.kill(os.getpid(), 9)
        return super().__getitems__(indices)


class KilledData(SleepyDataModule):
    def __init__(self, kill_from=0, above=1, kill_val=False, **kwargs):
        super().__init__(**kwargs)
        self.kill = {"kill_from": kill_from, "above": above}
        self.kill_val = kill_val

    def setup(self, stage):
        super().setup(stage)
        self.train_dataset = KilledFromIndex(self.train_length, batch_cost_s=self.batch_cost_s, **self.kill)
        if self.kill_val:
            self.val_dataset = KilledFromIndex(self.val_length, **self.kill)


def _fit_counting_rollbacks(trainer, model, dm) -> int:
    """Fit, and how many rollbacks it warned of ("went back")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    return sum(1 for w in caught if "went back" in str(w.message))


@pytest.mark.slow
def test_a_rebuilt_loader_whose_workers_die_after_its_end_batch_rolls_back_with_every_sample_once(trainer_kwargs):
    # epoch 1 runs 2 workers, killed from batch 5 on: later than the first batch, within a few windows
    forcer = AlternateConfigs([LoaderConfig(num_workers=0), LoaderConfig(num_workers=2)])
    model = SleepStepModule(record_indices=True)
    dm = KilledData(kill_from=20, train_length=40, val_length=8, batch_size=4, shuffle=False)
    trainer = pl.Trainer(max_epochs=2, callbacks=[forcer], **trainer_kwargs)
    assert _fit_counting_rollbacks(trainer, model, dm) == 1
    assert [sorted(seen) for seen in model.train_indices] == [list(range(40))] * 2
    assert [sorted(seen) for seen in model.val_indices] == [list(range(8))] * 2
    assert dm.loader_config.num_workers == 0


@pytest.mark.slow
def test_a_failed_mid_epoch_switch_keeps_the_whole_epoch_and_its_validation(trainer_kwargs):
    # I/O-bound, so the early decision adds workers mid-epoch; more than one worker is killed
    model = SleepStepModule(step_s=0.005, record_indices=True)
    dm = KilledData(train_length=160, val_length=8, batch_size=4, batch_cost_s=0.03, num_workers=0)
    tuner = DataLoaderTuner(verbose=False, first_decision_after=10, max_workers=4)
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], **trainer_kwargs)
    rollbacks = _fit_counting_rollbacks(trainer, model, dm)
    assert tuner.history[0].end_batch in (4, 6) and tuner.history[0].changed  # an early look, from 0 workers
    assert rollbacks == 1
    for seen in model.train_indices:
        assert sorted(seen) == list(range(160))  # full length: the dead workers' batches came again
    assert [sorted(seen) for seen in model.val_indices] == [list(range(8))] * 2  # validation ran every epoch
    assert all(r.config.num_workers <= 1 for r in tuner.history[1:])


@pytest.mark.slow
def test_a_start_config_whose_workers_die_falls_back_for_train_val_and_the_sanity_check(trainer_kwargs):
    model = SleepStepModule(record_indices=True)
    dm = KilledData(kill_val=True, train_length=32, val_length=8, batch_size=4, num_workers=2)
    tuner = DataLoaderTuner(verbose=False, first_decision_after=0)
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], **{**trainer_kwargs, "num_sanity_val_steps": 2})
    assert _fit_counting_rollbacks(trainer, model, dm) == 1
    assert [sorted(seen) for seen in model.train_indices] == [list(range(32))] * 2
    assert [sorted(seen) for seen in model.val_indices] == [list(range(8))] * 2
    assert tuner.history[0].config.num_workers <= 1
    assert all(dl.num_workers <= 1 for dl in dm.live_loaders())
    assert tuner.state_dict()["worker_cap"] == 1  # halfway back up to the count that failed, kept in checkpoints


@pytest.mark.slow
def test_a_mid_epoch_switch_moves_validation_too_in_the_same_epoch(trainer_kwargs):
    class SwitchAtBatch3(Callback):
        val_workers = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.current_epoch == 0 and batch_idx == 3:
                trainer.datamodule.switch_train_loaders(LoaderConfig(num_workers=0))

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            if batch_idx == 0:
                self.val_workers.append(trainer.val_dataloaders.num_workers)

    model = SleepStepModule(record_indices=True)
    dm = SleepyDataModule(train_length=32, val_length=8, batch_size=4, num_workers=1)
    trainer = pl.Trainer(max_epochs=1, callbacks=[SwitchAtBatch3()], **trainer_kwargs)
    trainer.fit(model, datamodule=dm)
    assert SwitchAtBatch3.val_workers == [0]  # validation of that epoch already ran the new config
    assert sorted(model.train_indices[0]) == list(range(32)) and sorted(model.val_indices[0]) == list(range(8))


@pytest.mark.slow
def test_checking_the_start_config_never_opens_the_dataset_in_the_training_process(trainer_kwargs):
    class LazyHandle(SleepyDataset):
        opened_in = None  # like an HDF5/LMDB handle, opened on first read; unsafe to inherit across fork

        def __getitem__(self, index):
            if self.opened_in is None:
                self.opened_in = os.getpid()
            return super().__getitem__(index)

    class Data(SleepyDataModule):
        def setup(self, stage):
            super().setup(stage)
            self.train_dataset = LazyHandle(16)

    dm = Data(batch_size=4, num_workers=1, val_length=4)
    tuner = DataLoaderTuner(verbose=False, first_decision_after=0)
    pl.Trainer(max_epochs=1, callbacks=[tuner], **trainer_kwargs).fit(SleepStepModule(), datamodule=dm)
    assert dm.train_dataset.opened_in is None  # read only in workers (and in a throwaway child)
    assert dm.estimate_batch_bytes() == 4 * 8 * 4  # 8 float32 a sample (the index is a Python int)


def test_bad_switch_arguments_fail_at_once_naming_the_argument():
    with pytest.raises(TypeError, match="`config` must be a LoaderConfig"):
        SleepyDataModule().set_loader_config("4 workers")
    with pytest.raises(TypeError, match="`iterable_shards_by_worker` must be True or False"):
        SleepyDataModule(iterable_shards_by_worker="yes")
