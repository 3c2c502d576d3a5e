"""DataLoaderTuner in real CPU fits: what it logs, where, and how it handles odd fits and bad input."""

import logging

import lightning.pytorch as pl
import pytest
import torch
from fit_workloads import CountingIterable, SleepStepModule, SleepyDataModule
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tb_events import layout, scalars, texts
from torch.utils.data import DataLoader, TensorDataset

from lightning_dltune import DataLoaderTuner
from lightning_dltune.report.tensorboard import layout_tags

EPOCH_TAGS = [
    "dltune/starvation_ratio",
    "dltune/gpu_util",
    "dltune/util_from_nvml",
    "dltune/band_low",
    "dltune/band_high",
    "dltune/fetch_wait_ms",
    "dltune/fetch_wait_p50_ms",
    "dltune/fetch_wait_p95_ms",
    "dltune/step_ms",
    "dltune/step_p50_ms",
    "dltune/step_p95_ms",
    "dltune/stalls",
    "dltune/stall_fraction",
    "dltune/queue_depth",
    "dltune/samples_per_s",
    "dltune/startup_ms",
    "dltune/worker_batch_ms",
    "dltune/num_workers",
    "dltune/prefetch_factor",
    "dltune/rebuilds",
    "dltune/gpu_util_judged",
]


def _small_fit(trainer_kwargs, tuner, dm=None, model=None, **overrides):
    dm = dm or SleepyDataModule(train_length=48, val_length=16, batch_cost_s=0.004, batch_size=4)
    model = model or SleepStepModule(step_s=0.002)
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], **{**trainer_kwargs, **overrides})
    trainer.fit(model, datamodule=dm)
    return trainer


@pytest.mark.slow
def test_tensorboard_gets_the_layout_every_scalar_and_the_decisions(trainer_kwargs, tmp_path):
    tuner = DataLoaderTuner(log_every_n_steps=4, verbose=False)
    _small_fit(trainer_kwargs, tuner, logger=TensorBoardLogger(str(tmp_path / "tb")))
    logged = scalars(str(tmp_path / "tb"))
    for name in EPOCH_TAGS:
        assert len(logged[name]) == 2, name  # one point per window: here, per epoch
    assert all(t in logged for t in ["dltune/recent/starvation_ratio", "dltune/recent/samples_per_s"])
    categories = layout(str(tmp_path / "tb")).category
    assert [c.title for c in categories] == ["dltune: headline", "dltune: detail"]
    first = categories[0].chart[-1]  # TensorBoard shows a category's margin charts last first
    assert first.title.startswith("GPU busy (estimate) per window")
    assert (first.margin.series[0].value, first.margin.series[0].lower, first.margin.series[0].upper) == (
        "dltune_panels/gpu_util",
        "dltune_panels/band_low",
        "dltune_panels/band_high",
    )
    assert set(layout_tags(recent=True)) <= set(logged)  # every panel has data
    decisions = texts(str(tmp_path / "tb"))
    assert len(decisions) == 2 and "epoch 0" in decisions[0] and "(estimate)" in decisions[0]
    assert logged["dltune/band_low"][0][1] == pytest.approx(0.85)


@pytest.mark.slow
def test_other_loggers_get_the_same_metric_names(trainer_kwargs, tmp_path):
    tuner = DataLoaderTuner(verbose=False)
    trainer = _small_fit(trainer_kwargs, tuner, logger=CSVLogger(str(tmp_path)))
    import csv

    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        header = next(csv.reader(f))
    assert set(EPOCH_TAGS) <= set(header)


@pytest.mark.slow
def test_fit_without_logger_prints_one_line_per_epoch_and_a_table(trainer_kwargs, caplog):
    tuner = DataLoaderTuner()
    with caplog.at_level(logging.INFO):
        _small_fit(trainer_kwargs, tuner)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[dltune] epoch")]
    assert len(lines) == 2
    assert "workers 0" in lines[0] and "GPU busy" in lines[0] and "(estimate)" in lines[0]
    assert all(len(line) <= 120 for line in lines)
    assert any("recommended: workers=" in r.getMessage() for r in caplog.records)
    assert len(tuner.history) == 2


@pytest.mark.slow
def test_verbose_2_adds_the_reason_and_0_prints_nothing(trainer_kwargs, caplog):
    with caplog.at_level(logging.INFO):
        _small_fit(trainer_kwargs, DataLoaderTuner(verbose=2))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[dltune] epoch")]
    assert len(said) == 2 and all("hook to hook" in text.splitlines()[1] for text in said)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _small_fit(trainer_kwargs, DataLoaderTuner(verbose=0))
    assert not [r for r in caplog.records if "[dltune]" in r.getMessage() or "loader tuning" in r.getMessage()]


@pytest.mark.slow
def test_history_holds_what_users_read(trainer_kwargs):
    tuner = DataLoaderTuner(verbose=False)
    _small_fit(trainer_kwargs, tuner)
    record = tuner.history[0]
    assert record.epoch == 0 and record.num_workers == 0 and record.prefetch_factor == 2
    assert 0 < record.starvation_ratio < 1 and 0 < record.gpu_util < 1
    assert record.util_source == "estimate" and record.stalls > 0 and record.samples_per_s > 0
    assert record.verdict and record.reason


@pytest.mark.slow
def test_zero_train_batches_does_not_break(trainer_kwargs):
    tuner = DataLoaderTuner(verbose=False)
    _small_fit(trainer_kwargs, tuner, limit_train_batches=0)
    assert tuner.history == []


class _IterableModule(SleepStepModule):
    def train_dataloader(self):
        return DataLoader(CountingIterable(32), batch_size=4, num_workers=2)


@pytest.mark.slow
def test_iterable_dataset_without_len(trainer_kwargs):
    tuner = DataLoaderTuner(verbose=False)
    trainer = pl.Trainer(max_epochs=2, callbacks=[tuner], limit_val_batches=0, **trainer_kwargs)
    trainer.fit(_IterableModule())
    assert [r.stats.all_batches for r in tuner.history] == [8, 8]  # every batch, a warm-up step included
    assert all(r.stats.samples == 4 * r.stats.batches for r in tuner.history)


class _TupleModule(SleepStepModule):
    def train_dataloader(self):
        data = TensorDataset(torch.randn(40, 8), torch.arange(40))
        return DataLoader(data, batch_size=5)


@pytest.mark.slow
def test_tuple_batches(trainer_kwargs):
    tuner = DataLoaderTuner(verbose=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[tuner], limit_val_batches=0, **trainer_kwargs)
    trainer.fit(_TupleModule())
    first = tuner.history[0].stats
    assert first.all_batches * 5 == 40 and first.samples == 5 * first.batches and first.batch_bytes == 5 * (8 * 4 + 8)


@pytest.mark.slow
def test_util_source_nvml_without_a_gpu_warns_and_estimates(trainer_kwargs):
    tuner = DataLoaderTuner(util_source="nvml", verbose=False)
    with pytest.warns(UserWarning, match="NVML cannot serve"):
        _small_fit(trainer_kwargs, tuner)
    assert tuner.history[-1].util_source == "estimate"


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (dict(band=(0.9, 0.8)), "band"),
        (dict(band=(0.0, 0.9)), "band"),
        (dict(band=(0.5, 1.2)), "band"),
        (dict(band=(0.5,)), "band"),
        (dict(util_source="nvidia-smi"), "util_source"),
        (dict(stall_threshold_ms=-1), "stall_threshold_ms"),
        (dict(log_every_n_steps=-5), "log_every_n_steps"),
        (dict(max_workers=-1), "max_workers"),
        (dict(memory_fraction=0), "memory_fraction"),
        (dict(shm_fraction=1.5), "shm_fraction"),
        (dict(max_rebuilds=-1), "max_rebuilds"),
        (dict(window_batches=0), "window_batches"),
        (dict(window_seconds=-1.0), "window_seconds"),
        (dict(max_prefetch_factor=0), "max_prefetch_factor"),
        (dict(min_gain=1.0), "min_gain"),
        (dict(nvml_poll_interval_s=-0.1), "nvml_poll_interval_s"),
        (dict(nvml_poll_interval_s=0), "nvml_poll_interval_s"),
    ],
)
def test_bad_arguments_raise_at_construction_naming_the_argument(kwargs, names):
    with pytest.raises(ValueError, match=f"`{names}`"):
        DataLoaderTuner(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(num_workers=-1), "num_workers"),
        (dict(batch_size=0), "batch_size"),
        (dict(prefetch_factor=0), "prefetch_factor"),
        (dict(loader_kwargs={"num_workers": 2}), "loader_kwargs"),
    ],
)
def test_bad_datamodule_arguments_raise_at_construction(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        SleepyDataModule(**kwargs)


def test_the_worker_cap_after_a_failed_switch_is_kept_in_checkpoints_and_older_ones_still_load():
    from lightning_dltune import LoaderConfig

    tuner = DataLoaderTuner(verbose=False)
    with pytest.warns(UserWarning, match="went back"):
        tuner._run.rolled_back(LoaderConfig(num_workers=6), LoaderConfig(num_workers=2), RuntimeError("killed"))
    restored = DataLoaderTuner(verbose=False)
    restored.load_state_dict(tuner.state_dict())
    assert restored.state_dict()["worker_cap"] == 4  # at most halfway back up to the count that failed
    older = DataLoaderTuner(verbose=False)
    older.load_state_dict({"config": None, "rebuilds": 0, "history": []})  # a checkpoint from before the cap
    assert older.state_dict()["worker_cap"] is None


@pytest.mark.slow
def test_a_fit_resumed_mid_epoch_records_the_rest_of_that_epoch(trainer_kwargs, tmp_path):
    from test_loader import CheckpointAndStop

    ckpt = str(tmp_path / "mid.ckpt")
    dm = SleepyDataModule(train_length=80, val_length=8, batch_size=4, num_workers=0)
    first = DataLoaderTuner(verbose=False, first_decision_after=0)
    pl.Trainer(max_epochs=3, callbacks=[first, CheckpointAndStop(ckpt, epoch=1, batch_idx=6)], **trainer_kwargs).fit(
        SleepStepModule(), datamodule=dm
    )
    tuner = DataLoaderTuner(verbose=False, first_decision_after=0)
    dm = SleepyDataModule(train_length=80, val_length=8, batch_size=4, num_workers=0)
    # Lightning skips on_train_epoch_start when it resumes mid-epoch: the window starts at the first batch
    pl.Trainer(max_epochs=3, callbacks=[tuner], **trainer_kwargs).fit(SleepStepModule(), datamodule=dm, ckpt_path=ckpt)
    resumed = [r for r in tuner.history if r.epoch == 1]
    assert len(resumed) == 1 and resumed[0].stats.all_batches == 20 - 7  # the rest of epoch 1
    assert [r.epoch for r in tuner.history][-1] == 2 and tuner.history[-1].stats.all_batches == 20
