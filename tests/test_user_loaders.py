"""One added line tunes the loaders a project already has: real fits of the project shapes found in the wild.

Each fit starts a starved loader (I/O-bound storage, 0 workers) and checks what a user would: the tuner
moved it to workers, every sample was trained once per epoch and validated once per run, the words
reached the terminal, and what the user handed over (their loaders, their worker_init_fn) is theirs again
after the fit. The accelerator step is a sleep in the training process (the host idles while a GPU computes).
"""

from __future__ import annotations

import copy
import logging
import pickle
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from fit_workloads import CountingIterable, SleepStepModule, SleepyDataset
from lightning.pytorch.callbacks import Callback
from test_loader import CheckpointAndStop  # saves a checkpoint mid-epoch and stops, as a preemption would
from torch.utils.data import DataLoader, default_collate
from user_projects import BATCH, TRAIN_LENGTH, VAL_LENGTH, ModuleLoaders, TaggedLoader, fit_shape, train_set, val_set

from lightning_dltune import DataLoaderTuner
from lightning_dltune.control.budgets import earned_start
from lightning_dltune.control.resources import rank_budget
from lightning_dltune.core.records import Budget, ReasonKind
from lightning_dltune.loaders.adopt import AdoptedLoader, TimedWorkerInit, why_not_tunable
from lightning_dltune.report.words import reason_text

SHAPES = ["module", "datamodule", "fit_args", "subclass", "batch_sampler"]


def _tuner(**kwargs):
    return DataLoaderTuner(window_batches=10, window_seconds=0.3, max_workers=4, **kwargs)


def _every_sample_once(model, epochs):
    assert [sorted(ids) for ids in model.train_indices] == [list(range(TRAIN_LENGTH))] * epochs
    assert [sorted(ids) for ids in model.val_indices] == [list(range(VAL_LENGTH))] * epochs


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.slow
def test_a_starved_project_loader_gets_workers_and_every_sample_is_trained_once(trainer_kwargs, caplog, shape):
    tuner = _tuner()
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], **trainer_kwargs)
    with caplog.at_level(logging.INFO):  # without a progress bar the words go to Lightning's console logger
        model, held = fit_shape(shape, trainer)
    assert tuner.history[0].num_workers == 0 and tuner.history[0].changed
    assert tuner.history[-1].num_workers > 0  # tuned in place, mid-epoch
    # timed inside the workers: the latest window whose workers made a batch (a window of the epoch's last
    # one or two batches may hold only batches made before it began, and measures none)
    measured = [d.stats for d in tuner.history if d.num_workers > 0 and d.stats.worker_batch_s is not None]
    assert measured and measured[-1].worker_batch_s == pytest.approx(BATCH_COST, rel=0.5)
    assert measured[-1].queue_depth is not None  # exact stalls from the workers' counters
    _every_sample_once(model, epochs=2)
    assert "lightning-dltune: loader tuning" in caplog.text and "cannot be switched" not in caplog.text
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[dltune] tuning the loaders from")]
    owner = {"datamodule": "the datamodule (PlainData)", "fit_args": "the arguments of fit()"}
    assert said == [
        f"[dltune] tuning the loaders from {owner.get(shape, 'the LightningModule (ModuleLoaders)')} in place;"
        " the training loader switches mid-epoch, where a window ends"
    ]
    if shape == "fit_args":  # no class whose config could set them: the arguments in words
        assert "on the training DataLoader passed to fit()" in caplog.text
    for loader in held.values():  # what the user handed to fit() is theirs again (Lightning may seed its workers)
        assert type(loader) is DataLoader and loader.num_workers == 0
        assert not isinstance(loader.worker_init_fn, TimedWorkerInit)
        assert not isinstance(loader, AdoptedLoader) and pickle.loads(pickle.dumps(loader)).batch_size == BATCH


BATCH_COST = 0.03


@pytest.mark.slow
def test_a_subclass_keeps_its_own_arguments_and_class_while_tuned(trainer_kwargs):
    seen = []

    class Look(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            loader = trainer.train_dataloader
            seen.append((isinstance(loader, TaggedLoader), loader.tag, loader.num_workers, type(loader).__name__))

    trainer = pl.Trainer(max_epochs=1, callbacks=[_tuner(), Look()], **trainer_kwargs)
    fit_shape("subclass", trainer)
    assert {s[:2] for s in seen} == {(True, "train")} and {s[3] for s in seen} == {"TaggedLoader"}
    assert seen[0][2] == 0 and seen[-1][2] > 0
    assert type(trainer.train_dataloader) is TaggedLoader  # back to the user's own class after the fit
    copied = copy.deepcopy(trainer.train_dataloader)
    assert type(copied) is TaggedLoader and copied.tag == "train"


def _keep_seed(worker_id):
    torch.manual_seed(1234 + worker_id)


class _SeededModule(ModuleLoaders):
    def train_dataloader(self):
        loader = DataLoader(train_set(), BATCH, shuffle=True, num_workers=1, worker_init_fn=_keep_seed, timeout=60)
        return loader


@pytest.mark.slow
def test_the_users_worker_init_fn_and_timeout_run_in_the_new_workers(trainer_kwargs):
    inits = []

    class Look(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loader = trainer.train_dataloader
            inits.append((loader.num_workers, loader.timeout, loader.worker_init_fn.worker_init_fn is _keep_seed))

    model = _SeededModule()
    trainer = pl.Trainer(max_epochs=1, callbacks=[_tuner(), Look()], **trainer_kwargs)
    trainer.fit(model)
    assert inits[0][:2] == (1, 60) and inits[-1][0] > 1 and inits[-1][1] == 60
    assert all(i[2] for i in inits)
    assert trainer.train_dataloader.worker_init_fn is _keep_seed and trainer.train_dataloader.timeout == 60


class _DyingWorkers(ModuleLoaders):
    def train_dataloader(self):
        data = SleepyDataset(TRAIN_LENGTH, batch_cost_s=BATCH_COST, fail_in_worker_above=1)
        return DataLoader(data, batch_size=BATCH, shuffle=True)


@pytest.mark.slow
def test_a_switch_whose_workers_die_rolls_back_and_every_sample_is_still_trained_once(trainer_kwargs):
    # workers are killed (as by the OOM killer) whenever more than one runs
    model = _DyingWorkers()
    tuner = _tuner()
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], **trainer_kwargs)
    with pytest.warns(UserWarning, match="loader config failed") as record:
        trainer.fit(model)
    assert len([w for w in record if "loader config failed" in str(w.message)]) == 1
    assert tuner.history[-1].num_workers <= 1
    _every_sample_once(model, epochs=2)


class _FailingDataset(SleepyDataset):
    def __getitems__(self, indices):
        if 7 in indices:
            raise ValueError("bad sample 7")
        return super().__getitems__(indices)


class _FailingModule(ModuleLoaders):
    def train_dataloader(self):
        return DataLoader(_FailingDataset(64), batch_size=BATCH, num_workers=self.workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_the_users_dataset_error_reaches_them_unchanged(trainer_kwargs, workers):
    trainer = pl.Trainer(max_epochs=1, callbacks=[_tuner()], **trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="bad sample 7"):
        warnings.simplefilter("always")
        trainer.fit(_FailingModule(workers=workers))
    assert not [w for w in caught if "loader config failed" in str(w.message)]
    assert type(trainer.train_dataloader) is DataLoader  # given back after the exception too


class _SelfIterating(DataLoader):
    def __iter__(self):
        yield from super().__iter__()


class _SelfIteratingModule(ModuleLoaders):
    def train_dataloader(self):
        return _SelfIterating(train_set(), batch_size=BATCH)


@pytest.mark.slow
def test_a_loader_class_that_iterates_itself_is_measured_not_tuned_and_says_so_once(trainer_kwargs, caplog):
    tuner = _tuner()
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], **trainer_kwargs)
    model = _SelfIteratingModule()
    with caplog.at_level(logging.INFO):
        trainer.fit(model)
    said = [r.getMessage() for r in caplog.records if "cannot be switched" in r.getMessage()]
    assert said == [
        "DataLoaderTuner: the training DataLoader's class _SelfIterating defines its own __iter__, so it cannot"
        " be switched; measuring, logging and recommending only."
    ]
    assert {r.num_workers for r in tuner.history} == {0} and tuner.history[0].changed  # what it would try
    _every_sample_once(model, epochs=2)


def test_what_cannot_be_tuned_is_named():
    assert why_not_tunable(DataLoader(range(4))) is None
    assert "not a torch DataLoader" in why_not_tunable([1, 2])

    class Stateful(DataLoader):
        def state_dict(self):
            return {}

    assert "keeps its own state" in why_not_tunable(Stateful(range(4)))


@pytest.mark.slow
def test_monitor_only_leaves_the_project_loaders_untouched(trainer_kwargs):
    seen = []

    class Look(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(type(trainer.train_dataloader))

    tuner = _tuner(tune=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[tuner, Look()], **trainer_kwargs)
    fit_shape("module", trainer)
    assert set(seen) == {DataLoader} and {r.num_workers for r in tuner.history} == {0}


# -- exact mid-epoch resume of a project's own loader, with another worker count ----------------------
@pytest.mark.parametrize("resume_with_tuner", [True, False])
@pytest.mark.slow
def test_a_fit_resumed_mid_epoch_trains_the_rest_of_the_epoch_once(trainer_kwargs, tmp_path, caplog, resume_with_tuner):
    ckpt = str(tmp_path / "mid.ckpt")
    first = ModuleLoaders()
    stop = CheckpointAndStop(ckpt, epoch=1, batch_idx=19)
    pl.Trainer(max_epochs=3, callbacks=[_tuner(), stop], **trainer_kwargs).fit(first)
    assert len(first.train_indices[1]) == 20 * BATCH

    resumed = ModuleLoaders(workers=2)  # another worker count than the checkpoint's
    resumed.train_indices.append([])  # Lightning skips on_train_epoch_start when it resumes mid-epoch
    tuner = _tuner() if resume_with_tuner else None
    trainer = pl.Trainer(max_epochs=3, callbacks=[tuner] if tuner else [], **trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer.fit(resumed, ckpt_path=ckpt)  # a checkpoint of a tuned fit resumes with or without the tuner
    not_resumable = [w for w in caught if "your dataloader is not resumable" in str(w.message)]
    assert len(not_resumable) == (0 if resume_with_tuner else 1)  # Lightning's warning, only where it is true
    said = [r.getMessage() for r in caplog.records if "resumes epoch 1 at batch 20" in r.getMessage()]
    assert len(said) == (1 if resume_with_tuner else 0), said
    epoch_1 = first.train_indices[1] + resumed.train_indices[0]
    if resume_with_tuner:
        assert sorted(epoch_1) == list(range(TRAIN_LENGTH))  # the rest of the epoch, none twice, none missed
    assert sorted(resumed.train_indices[1]) == list(range(TRAIN_LENGTH))  # the next epoch is a whole one


class _StreamModule(ModuleLoaders):
    def train_dataloader(self):
        return DataLoader(CountingIterable(48), batch_size=BATCH, num_workers=2)


@pytest.mark.slow
def test_a_stream_keeps_its_worker_count_and_says_so(trainer_kwargs, caplog):
    tuner = _tuner()
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], limit_val_batches=0, **trainer_kwargs)
    model = _StreamModule()
    with caplog.at_level(logging.INFO):
        trainer.fit(model)
    assert {r.num_workers for r in tuner.history} == {2}
    assert [sorted(ids) for ids in model.train_indices] == [list(range(48))] * 2
    assert "holding num_workers=2" in caplog.text and "switches at the next epoch start" in caplog.text


class _TwoLoaders(ModuleLoaders):
    def training_step(self, batch, batch_idx):
        for part in batch.values():
            self.train_indices[-1].extend(part["index"].tolist())
        return self.layer(batch["a"]["x"]).pow(2).mean()

    def train_dataloader(self):
        return {
            "a": DataLoader(train_set(), batch_size=BATCH, shuffle=True),
            "b": DataLoader(SleepyDataset(TRAIN_LENGTH, batch_cost_s=BATCH_COST), batch_size=BATCH),
        }


@pytest.mark.slow
def test_every_train_loader_of_a_combined_loader_is_tuned(trainer_kwargs):
    seen = []

    class Look(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(tuple(dl.num_workers for dl in trainer.train_dataloader.values()))

    tuner = _tuner()
    model = _TwoLoaders()
    trainer = pl.Trainer(max_epochs=1, callbacks=[tuner, Look()], limit_val_batches=0, **trainer_kwargs)
    trainer.fit(model)
    assert seen[0] == (0, 0) and seen[-1][0] > 0 and seen[-1][0] == seen[-1][1]
    assert sorted(model.train_indices[0]) == sorted(list(range(TRAIN_LENGTH)) * 2)  # each loader's samples once


class _GreedyStart(ModuleLoaders):
    def train_dataloader(self):
        return DataLoader(train_set(), batch_size=BATCH, shuffle=True, num_workers=16, prefetch_factor=8)

    def val_dataloader(self):
        return DataLoader(val_set(), batch_size=BATCH, num_workers=16, prefetch_factor=8)


@pytest.mark.slow
def test_a_start_over_the_budget_is_clamped_before_any_worker_starts(trainer_kwargs, caplog):
    seen = []

    class Look(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(trainer.train_dataloader.num_workers)

    trainer_kwargs = {**trainer_kwargs, "num_sanity_val_steps": 2}
    trainer = pl.Trainer(max_epochs=1, callbacks=[_tuner(), Look()], limit_train_batches=20, **trainer_kwargs)
    with caplog.at_level(logging.INFO):
        trainer.fit(_GreedyStart())
    assert max(seen) <= 4  # max_workers=4: the 16 workers the project asked for never started
    # they start at one worker a usable CPU, and earn more where the loop starves
    assert seen[0] == earned_start(Budget(max_workers=4, cpus=rank_budget().cpus))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[dltune] start: ")]
    assert len(said) == 1 and "workers=16 prefetch=8" in said[0] and "exceeds the budget" in said[0]


class _DearToHandOver:
    """A part of a batch that costs the process receiving it ``cost_s`` to unpickle, as a large batch taken out of a
    worker's shared memory does. Made in the training process itself (0 workers), it is never pickled."""

    def __init__(self, cost_s: float) -> None:
        self.cost_s = cost_s

    def __reduce__(self):
        return _received, (self.cost_s,)


def _received(cost_s: float) -> _DearToHandOver:
    time.sleep(cost_s)
    return _DearToHandOver(cost_s)


def _collate_with_a_dear_hand_over(samples):
    return {**default_collate(samples), "hand_over": _DearToHandOver(0.012)}


class _DearHandOverLoaders(SleepStepModule):
    """Loaders in the LightningModule: 2 ms batches (a sleep in the workers: storage) that cost the loop 12 ms to
    take from a worker, behind a 30 ms emulated step."""

    def __init__(self) -> None:
        super().__init__(step_s=0.03, record_indices=True)

    def train_dataloader(self) -> DataLoader:
        dataset = SleepyDataset(TRAIN_LENGTH, batch_cost_s=0.002)
        return DataLoader(
            dataset, batch_size=BATCH, shuffle=True, num_workers=2, collate_fn=_collate_with_a_dear_hand_over
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(SleepyDataset(VAL_LENGTH), batch_size=BATCH)


@pytest.mark.slow
def test_a_loop_that_waits_on_each_batchs_hand_over_goes_to_zero_workers_and_runs_faster(trainer_kwargs):
    # every fetch finds a batch ready, yet the loop waits 12 ms for it (28 % of its time): no worker count or
    # prefetch depth shortens that, and the 2 ms batch costs less made in the loop
    tuner = _tuner()
    trainer = pl.Trainer(max_epochs=3, callbacks=[tuner], **trainer_kwargs)
    model = _DearHandOverLoaders()
    trainer.fit(model)
    moved = [r for r in tuner.history if r.reason.kind is ReasonKind.HANDED_OVER]
    assert moved and moved[0].config.num_workers > 0 and moved[0].next_config.num_workers == 0, tuner.history
    assert "though a batch was ready at" in reason_text(moved[0].reason)
    assert tuner.history[-1].next_config.num_workers == 0, [reason_text(r.reason) for r in tuner.history]
    rate = lambda workers: max(r.stats.samples_per_s for r in tuner.history if r.num_workers == workers)  # noqa: E731
    assert rate(0) > 1.1 * rate(moved[0].config.num_workers)
    assert [sorted(ids) for ids in model.train_indices] == [list(range(TRAIN_LENGTH))] * 3  # each sample once
