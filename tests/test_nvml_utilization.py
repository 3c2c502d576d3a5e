"""The arithmetic of a time-weighted window: training spans, sample coverage, idle gaps."""

from __future__ import annotations

import pytest

from lightning_dltune.nvml.utilization import (
    TimeWeightedMean,
    TrainingSpans,
    idle_tail_us,
    sample_intervals,
    sample_period_us,
)


def test_training_overlap_leaves_out_time_before_the_window_and_inside_pauses():
    spans = TrainingSpans(100)
    spans.pause(200)
    spans.resume(300)
    spans.pause(400)  # still paused
    assert spans.paused
    assert spans.overlap(0, 150) == 50
    assert spans.overlap(150, 350) == 100  # (150, 200] and (300, 350]
    assert spans.overlap(250, 290) == 0
    assert spans.overlap(350, 1000) == 50  # the open pause runs to the end


def test_mean_weighs_each_reading_by_its_training_time_and_counts_idle_tail():
    spans = TrainingSpans(0)
    mean = TimeWeightedMean()
    mean.add(spans, 0, 100, 1.0)
    mean.add(spans, 100, 400, 0.0)
    assert mean.mean() == pytest.approx(0.25) and mean.count == 2
    assert mean.mean(idle_us=400) == pytest.approx(100 / 800)
    assert TimeWeightedMean().mean() is None


def test_sample_period_is_the_median_step_so_idle_gaps_do_not_stretch_it():
    assert sample_period_us([0, 10, 20, 30, 500, 510], None) == 10
    assert sample_period_us([0, 10], 7.0) == 7.0  # too few steps: keep what was known


def test_a_long_gap_between_samples_is_idle_beyond_one_period():
    out = sample_intervals([(10, 0.5), (20, 1.0), (100, 1.0)], previous_us=0, period_us=10)
    assert out == [(0, 10, 0.5), (10, 20, 1.0), (20, 90, 0.0), (90, 100, 1.0)]
    # unknown previous sample: the first covers its own period; unknown period: no gap is called idle
    assert sample_intervals([(50, 1.0)], previous_us=None, period_us=10) == [(40, 50, 1.0)]
    assert sample_intervals([(50, 1.0), (500, 1.0)], previous_us=0, period_us=None) == [(0, 50, 1.0), (50, 500, 1.0)]


def test_idle_tail_needs_a_silence_longer_than_a_gap():
    spans = TrainingSpans(0)
    assert idle_tail_us(spans, last_sample_us=100, now_us=120, period_us=10) == 0  # next sample not due yet
    assert idle_tail_us(spans, last_sample_us=100, now_us=200, period_us=10) == 100
    assert idle_tail_us(None, last_sample_us=100, now_us=200, period_us=10) == 0  # clocks not comparable
