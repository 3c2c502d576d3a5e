"""The next fit starts tuned (``start_tuned=True``): real fits, the cache directory read back."""

from __future__ import annotations

import json
import logging

import lightning.pytorch as pl
import pytest
from fit_workloads import SleepStepModule, SleepyDataModule
from user_projects import ModuleLoaders

from lightning_dltune import DataLoaderTuner


def _tuner(cache, **kwargs):
    return DataLoaderTuner(
        window_batches=10, window_seconds=0.3, max_workers=4, start_tuned=True, start_cache_dir=str(cache), **kwargs
    )


def _messages(caplog, prefix):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


@pytest.mark.slow
def test_a_second_fit_starts_from_the_first_fits_recommendation_and_another_machine_does_not(
    trainer_kwargs, tmp_path, caplog
):
    cache = tmp_path / "cache"
    first = _tuner(cache)
    with caplog.at_level(logging.INFO):
        pl.Trainer(max_epochs=1, callbacks=[first], **trainer_kwargs).fit(ModuleLoaders())
    assert first.history[0].num_workers == 0 and first.recommended_config.num_workers > 0
    saved = list(cache.glob("*.json"))
    assert len(saved) == 1 and _messages(caplog, "[dltune] no saved start for this machine and data yet")
    entry = json.loads(saved[0].read_text())
    assert entry["config"]["num_workers"] == first.recommended_config.num_workers
    assert entry["data"]["length"] == 240 and entry["data"]["batch_size"] == 4

    caplog.clear()
    second = _tuner(cache)
    with caplog.at_level(logging.INFO):
        pl.Trainer(max_epochs=1, callbacks=[second], **trainer_kwargs).fit(ModuleLoaders())
    assert second.history[0].num_workers == first.recommended_config.num_workers  # started tuned
    assert len(_messages(caplog, "[dltune] starting from the last recommendation for this machine and data")) == 1

    entry["machine"]["cpus"] = 64.0  # as if measured on a bigger machine
    saved[0].write_text(json.dumps(entry))
    caplog.clear()
    third = _tuner(cache)
    with caplog.at_level(logging.INFO):
        pl.Trainer(max_epochs=1, callbacks=[third], **trainer_kwargs).fit(ModuleLoaders())
    assert third.history[0].num_workers == 0  # the project's own start
    said = _messages(caplog, "[dltune] the saved start for this data")
    assert len(said) == 1 and "another machine" in said[0] and "64.0 CPUs" in said[0]


@pytest.mark.slow
def test_a_tunable_datamodule_starts_from_the_saved_recommendation_too(trainer_kwargs, tmp_path):
    cache = tmp_path / "cache"

    def fit():
        tuner = _tuner(cache, verbose=False)
        data = SleepyDataModule(train_length=160, val_length=8, batch_size=4, batch_cost_s=0.03)
        pl.Trainer(max_epochs=1, callbacks=[tuner], **trainer_kwargs).fit(
            SleepStepModule(step_s=0.005), datamodule=data
        )
        return tuner

    first, second = fit(), fit()
    assert first.history[0].num_workers == 0 and second.history[0].num_workers == first.recommended_config.num_workers


def test_start_cache_dir_must_be_a_path():
    with pytest.raises(TypeError, match="start_cache_dir"):
        DataLoaderTuner(start_cache_dir=3)
