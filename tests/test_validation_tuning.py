"""Validation measured and tuned on its own: a real fit where the validation loader starves and training does not.

A validation step has no backward pass: with training's workers it starves where training does not.
Each validation run is the validation side's window; the accelerator step is a sleep in the training
process (the host idles while a GPU computes).
"""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
from fit_workloads import SleepStepModule, SleepyDataModule, SleepyDataset
from lightning.pytorch.loggers import TensorBoardLogger
from tb_events import scalars

from lightning_dltune import DataLoaderTuner

TRAIN, VAL, BATCH = 160, 40, 4
VAL_COST_S = 0.03  # slow held-out storage: 30 ms a batch against a 1 ms validation step


class _DyingValData(SleepyDataModule):
    """Its validation workers are killed (as by the OOM killer) whenever more than one runs."""

    def setup(self, stage):
        super().setup(stage)
        self.val_dataset = SleepyDataset(VAL, batch_cost_s=VAL_COST_S, fail_in_worker_above=1)


def _fit(trainer_kwargs, data_cls=SleepyDataModule, **trainer_args):
    tuner = DataLoaderTuner(window_batches=10, window_seconds=0.2, max_workers=4)
    model = SleepStepModule(step_s=0.02, val_step_s=0.001, record_indices=True)
    data = data_cls(train_length=TRAIN, val_length=VAL, batch_size=BATCH, val_batch_cost_s=VAL_COST_S)
    trainer = pl.Trainer(callbacks=[tuner], **{**trainer_kwargs, **trainer_args})
    trainer.fit(model, datamodule=data)
    return tuner, model, data


def _every_val_sample_once_per_run(model):
    assert model.val_indices and [sorted(ids) for ids in model.val_indices] == [list(range(VAL))] * len(
        model.val_indices
    )


@pytest.mark.slow
def test_a_starved_validation_loader_gets_workers_of_its_own_and_training_keeps_its_config(
    trainer_kwargs, tmp_path, caplog
):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    with caplog.at_level(logging.INFO):
        tuner, model, data = _fit(trainer_kwargs, max_epochs=2, val_check_interval=0.5, logger=logger)
    runs = tuner.val_history
    assert len(runs) == 4  # twice an epoch, the sanity check left out
    assert runs[0].num_workers == 0 and runs[0].next_config.num_workers > 0
    assert runs[-1].num_workers > 0 and runs[-1].samples_per_s > 2 * runs[0].samples_per_s
    assert {r.num_workers for r in tuner.history} == {0}  # training was never starved: it keeps its config
    assert data.loader_config.num_workers == 0 and data.val_config.num_workers > 0
    _every_val_sample_once_per_run(model)
    assert [sorted(ids) for ids in model.train_indices] == [list(range(TRAIN))] * 2
    logged = scalars(str(tmp_path))
    val_steps = [step for step, _ in logged["dltune/val/starvation_ratio"]]
    assert len(val_steps) == 4 and val_steps == sorted(val_steps)
    assert "dltune/val/num_workers" in logged and "dltune/val/gpu_util" not in logged
    assert "lightning-dltune: validation loaders" in caplog.text
    assert "[dltune] validation at step" in caplog.text and "[dltune] validation loaders: recommended" in caplog.text
    fragment = next(tmp_path.rglob("dltune_recommendation.yaml")).read_text()
    assert "val_num_workers:" in fragment and "num_workers: 0" in fragment


@pytest.mark.slow
def test_a_validation_switch_whose_workers_die_rolls_back_with_every_sample_once_per_run(trainer_kwargs):
    with pytest.warns(UserWarning, match="loader config failed") as record:
        tuner, model, data = _fit(trainer_kwargs, _DyingValData, max_epochs=2, val_check_interval=0.5)
    assert len([w for w in record if "loader config failed" in str(w.message)]) == 1
    assert data.val_config.num_workers <= 1 and data.loader_config.num_workers == 0
    assert len(tuner.val_history) == 4
    _every_val_sample_once_per_run(model)


@pytest.mark.parametrize(
    ("trainer_args", "runs"),
    [
        (dict(val_check_interval=10, max_epochs=1), 4),  # 40 batches an epoch: at 10, 20, 30 and 40
        (dict(check_val_every_n_epoch=2, max_epochs=4), 2),
        (dict(limit_val_batches=4, max_epochs=2), 2),
        (dict(num_sanity_val_steps=2, max_epochs=2), 2),  # no window for the sanity check
    ],
    ids=["val_check_interval-int", "check_val_every_n_epoch", "limit_val_batches", "sanity-steps"],
)
@pytest.mark.slow
def test_each_validation_run_is_one_validation_window(trainer_kwargs, trainer_args, runs):
    tuner, model, _ = _fit(trainer_kwargs, **trainer_args)
    assert len(tuner.val_history) == len(model.val_indices) == runs
    if "limit_val_batches" in trainer_args:
        assert {r.stats.batches for r in tuner.val_history} == {4}
    else:
        _every_val_sample_once_per_run(model)
