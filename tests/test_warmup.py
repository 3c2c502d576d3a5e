"""Warm-up is not evidence: a window's first slow steps are left out, and a window whose step time still
falls goes on until it settles.

The accelerator step is a sleep in the training process (the host idles while a GPU computes); the
first steps sleep longer, as the first steps of a real fit do (lazy initialization, autotuning).
"""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
from fit_workloads import SleepStepModule, SleepyDataModule

from lightning_dltune import DataLoaderTuner
from lightning_dltune.core.windows import warmup_steps

# -- the rule ------------------------------------------------------------------------------------


def test_the_slow_first_steps_of_a_window_are_warm_up():
    assert warmup_steps([2.0, 0.5, 0.2, 0.031, 0.030, 0.032, 0.030, 0.031, 0.030]) == (3, False)


def test_a_steady_window_has_no_warm_up_even_with_noise():
    noisy = [0.030, 0.041, 0.029, 0.035, 0.030, 0.044, 0.031, 0.030, 0.038, 0.030, 0.032, 0.036]
    assert warmup_steps(noisy) == (0, False)
    assert warmup_steps([0.09, 0.03, 0.03, 0.03, 0.03, 0.03, 0.03]) == (1, False)  # one slow step at most


def test_a_window_whose_step_time_still_falls_is_not_settled():
    falling = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.03]
    assert warmup_steps(falling)[1] is True


def test_short_windows_are_taken_as_they_are():
    assert warmup_steps([1.0, 0.03, 0.03]) == (0, False)


def test_four_steps_tell_a_slow_first_step_but_not_a_longer_warm_up():
    assert warmup_steps([0.09, 0.03, 0.03, 0.03]) == (1, False)  # 3 settled steps after it
    assert warmup_steps([0.09, 0.03, 0.031, 0.029, 0.03]) == (1, False)
    assert warmup_steps([2.0, 0.5, 0.2, 0.031, 0.03]) == (3, True)  # over half of it: not settled yet
    assert warmup_steps([2.0, 0.5, 0.2, 0.031]) == (0, False)  # no two settled in a row: taken as it is (busy)
    assert warmup_steps([0.03, 0.031, 0.029, 0.03]) == (0, False)


# -- in a real fit -------------------------------------------------------------------------------


class _WarmingUpModule(SleepStepModule):
    """Its first training steps take ``slow_s`` longer each (the first steps of a real fit)."""

    def __init__(self, slow_s: list[float], **kwargs):
        super().__init__(**kwargs)
        self.slow_s = slow_s

    def training_step(self, batch, batch_idx):
        if self.global_step < len(self.slow_s):
            time.sleep(self.slow_s[self.global_step])
        return super().training_step(batch, batch_idx)


def _first_window(trainer_kwargs, slow_s: list[float]):
    tuner = DataLoaderTuner(window_batches=20, window_seconds=0.0, first_decision_after=10, max_workers=4, verbose=0)
    model = _WarmingUpModule(slow_s, step_s=0.01)
    data = SleepyDataModule(train_length=4 * 60, val_length=8, batch_size=4, batch_cost_s=0.02, num_workers=0)
    pl.Trainer(callbacks=[tuner], max_epochs=1, limit_val_batches=0, **trainer_kwargs).fit(model, datamodule=data)
    return tuner.history[0]


@pytest.mark.slow
def test_the_first_look_sees_the_starvation_behind_slow_first_steps(trainer_kwargs):
    # 5 steps of 300 ms would hide a loader that doubles every step's time (20 ms a batch against a 10 ms step):
    # judged with them, the window is 86 % busy, in the band
    first = _first_window(trainer_kwargs, [0.3] * 5)
    assert first.end_batch == 10 and first.stats.warmup_batches == 5 and first.stats.batches == 5
    assert first.stats.starvation_ratio > 0.4
    assert first.num_workers == 0 and first.next_config.num_workers > 0


@pytest.mark.slow
def test_a_first_window_still_warming_up_goes_on_until_the_steps_settle(trainer_kwargs):
    # the planned 10 batches are all warm-up, falling; at batch 20 more than half the window still is. The
    # window goes on 10 batches at a time, each with its early looks 4 and 6 batches in: at batch 24 the steps
    # have settled (12 of warm-up, 12 after) and the loop waits twice as long as it computes, so it is judged there
    falling = [0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.03]
    first = _first_window(trainer_kwargs, falling)
    assert first.end_batch == 24 and first.stats.warmup_batches == 12 and first.stats.batches == 12
    assert first.stats.starvation_ratio > 0.4 and first.next_config.num_workers > 0
