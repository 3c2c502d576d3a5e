"""The dltune panels: true at TensorBoard's default settings, one unit per chart, the headline first.

What TensorBoard does with them is taken from its own code (the custom-scalars dashboard of the installed
``tensorboard``): margin charts are never smoothed, "Ignore outliers in chart scaling" picks a chart's y range
from its values between the 5th and 95th percentile, and a chart's colour is its run's. The slow tests read
a real fit's event files back; where ``chromium`` is installed, a real TensorBoard and browser show them at
their defaults (``scripts/panels_screenshot.py``) and the page itself is checked.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from fit_workloads import SleepStepModule, SleepyDataModule
from lightning.pytorch.loggers import TensorBoardLogger
from tb_events import layout, scalars, texts

from lightning_dltune import DataLoaderTuner
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.records import Reason, ReasonKind, Verdict, WindowRecord
from lightning_dltune.core.stats import UtilSource, WindowStats
from lightning_dltune.report.metrics import (
    add_panels,
    log_window,
    panel_scalars,
    recent_peaks,
    window_scalars,
    window_span,
)
from lightning_dltune.report.tensorboard import (
    DETAIL,
    HEADLINE,
    ONE,
    PANEL_PREFIX,
    RECENT_ONE,
    RECENT_PEAKS,
    RECENT_ZERO,
    ZERO,
    custom_scalars_layout,
    displayed_titles,
    layout_tags,
    peak_tag,
)
from scripts.panels_screenshot import browser, shoot, y_range

UNITS = [  # (tag pattern, unit): what a user reads off the y axis
    (r"(gpu_util|gpu_util_judged|band_low|band_high|starvation_ratio|stall_fraction)$", "fraction"),
    (r"_ms(_peak)?$", "ms"),
    (r"samples_per_s(_peak)?$", "samples/s"),
    (r"recent/stalls(_peak)?$", "stalls per interval"),
    (r"/stalls$", "stalls per window"),
    (r"queue_depth$", "batches"),
    (r"num_workers$", "workers"),
    (r"prefetch_factor$", "prefetch"),
]
AXIS_CONSTANTS = {ZERO, ONE, RECENT_ZERO, RECENT_ONE}
HEADLINE_ORDER = ["per window, band shaded", "judged", "starvation", "throughput", "workers", "prefetch"]


def unit(tag: str) -> str:
    return next(u for pattern, u in UNITS if re.search(pattern, tag))


def charts(written) -> dict[str, list[tuple[str, str, str]]]:
    """Chart title -> its margin series as ``(value, lower, upper)``, from a layout proto."""
    return {
        chart.title: [(s.value, s.lower, s.upper) for s in chart.margin.series]
        for category in written.category
        for chart in category.chart
    }


def is_fraction(series) -> bool:
    return unit(series[0][0]) == "fraction"


def tensorboard_y_extent(values: list[float]) -> tuple[float, float]:
    """The extent TensorBoard's line chart fits its y axis to with "Ignore outliers in chart scaling" on.

    As its ``extentOfValues``: the values between d3's 5th and 95th percentile (linear interpolation), then
    their min and max (the axis adds 5 % padding either side and rounds to ticks).
    """
    ordered = sorted(v for v in values if math.isfinite(v))

    def quantile(p: float) -> float:
        h = (len(ordered) - 1) * p
        i = math.floor(h)
        return ordered[i] + (ordered[min(i + 1, len(ordered) - 1)] - ordered[i]) * (h - i)

    low, high = quantile(0.05), quantile(0.95)
    kept = [v for v in ordered if low <= v <= high]
    return kept[0], kept[-1]


def chart_values(series, logged) -> list[float]:
    """Every value a margin chart fits its axis to: each point's value, lower and upper, of every series."""
    return [v for s in series for t in s for _, v in logged.get(t, [])]


# -- the layout, as written --------------------------------------------------------------------------------
@pytest.mark.parametrize("recent", [False, True])
def test_every_chart_is_an_unsmoothed_margin_chart_of_one_unit_and_the_headline_comes_first(recent):
    written = custom_scalars_layout(recent=recent)
    assert [c.title for c in written.category] == [HEADLINE, DETAIL]
    shown = displayed_titles(written)[HEADLINE]
    assert [next(i for i, t in enumerate(shown) if key in t) for key in HEADLINE_ORDER] == list(range(6))
    for category in written.category:
        for chart in category.chart:
            assert chart.WhichOneof("content") == "margin", chart.title  # TensorBoard never smooths these
            tags = {t for s in chart.margin.series for t in (s.value, s.lower, s.upper)} - AXIS_CONSTANTS
            assert len({unit(t) for t in tags}) == 1, (chart.title, tags)
    headline = [s.value for chart in written.category[0].chart for s in chart.margin.series]
    assert all(value.startswith(PANEL_PREFIX) for value in headline)  # each window drawn over its steps


def test_the_utilization_titles_say_estimate_where_it_is_one():
    for estimate in (True, False):
        first_two = displayed_titles(custom_scalars_layout(estimate=estimate))[HEADLINE][:2]
        assert all(("estimate" in title) == estimate for title in first_two)
    assert displayed_titles(custom_scalars_layout(estimate=True))[HEADLINE][0].startswith("GPU busy (estimate")


def test_measured_judged_and_the_band_are_told_apart_without_colour():
    """Colour is the run's: raw and judged get a chart each, the band is an area against their line."""
    measured, judged = displayed_titles(custom_scalars_layout())[HEADLINE][:2]
    drawn = charts(custom_scalars_layout())
    for title, value in ((measured, "gpu_util"), (judged, "gpu_util_judged")):
        main, *axis = drawn[title]
        assert main == (PANEL_PREFIX + value, PANEL_PREFIX + "band_low", PANEL_PREFIX + "band_high")
        assert {s[0] for s in axis} == {ZERO, ONE}


def test_every_fraction_chart_draws_0_and_1_in_a_third_of_its_values_or_more():
    for title, series in charts(custom_scalars_layout(recent=True)).items():
        if not is_fraction(series):
            continue
        tags = [t for s in series for t in s]
        zeros, ones = sum(t in (ZERO, RECENT_ZERO) for t in tags), sum(t in (ONE, RECENT_ONE) for t in tags)
        assert zeros * 6 >= len(tags) and ones * 3 >= len(tags), title  # far above the 5 % outlier cut


def test_a_fraction_axis_keeps_a_starved_window_among_many_in_band():
    """TensorBoard's outlier cut on one starved window in 60: the old line drops it, the panel keeps 0 to 1."""
    util = [0.2] + [0.9 + 0.01 * (i % 5) for i in range(59)]
    band = [0.85] * 60 + [0.95] * 60
    assert tensorboard_y_extent(util + band)[0] > 0.8  # a line of the values and the band: the 20 % is cut off
    panel = [v for u in util for v in (u, u)]  # each window at its first and last step
    lows, highs = [0.85] * len(panel), [0.95] * len(panel)
    axis = [0.0] * (3 * len(panel)) + [1.0] * (3 * len(panel))
    assert tensorboard_y_extent(panel + lows + highs + axis) == (0.0, 1.0)


def test_a_recent_peak_at_the_starved_start_stays_on_the_axis_beside_its_peak_so_far():
    fetch_wait = [90.0] + [2.0 + (i % 7) for i in range(40)]
    zero = [0.0] * len(fetch_wait)
    assert tensorboard_y_extent(3 * fetch_wait + 3 * zero)[1] < 90  # the line and its zero: the peak is cut
    peak = [max(fetch_wait[: i + 1]) for i in range(len(fetch_wait))]
    assert tensorboard_y_extent(3 * fetch_wait + 3 * peak + 3 * zero) == (0.0, 90.0)


class Writer:
    """A stand-in for a TensorBoard logger's writer (what the peaks are kept per)."""


def test_recent_peaks_are_the_highest_values_each_writer_was_given():
    first, second = Writer(), Writer()
    interval = lambda wait: {f"dltune/recent/{n}": wait for n in RECENT_PEAKS}
    assert recent_peaks(first, interval(90.0))[peak_tag("fetch_wait_ms")] == 90.0
    assert recent_peaks(first, interval(3.0))[peak_tag("fetch_wait_ms")] == 90.0
    assert recent_peaks(second, interval(3.0)) == {peak_tag(n): 3.0 for n in RECENT_PEAKS}


def test_recent_series_do_not_share_a_prefix_with_the_window_step_times():
    tags = layout_tags(recent=True)
    assert not [t for t in tags if t.startswith("dltune/step")]
    assert {t for t in tags if t.startswith("dltune/recent/")} == {
        "dltune/recent/" + n for n in ("starvation_ratio", "samples_per_s", "fetch_wait_ms", "step_ms", "stalls")
    }


# -- what log_window writes, without a fit ------------------------------------------------------------------
BAND = (0.85, 0.95)


def window(step, workers, util, batches=20, prefetch=2) -> WindowRecord:
    """A window of ``batches`` 30 ms steps that closed at global step ``step``, utilization ``util`` (NVML)."""
    wait = 0.03 * (1 - util) / util
    stats = WindowStats(
        batches=batches,
        samples=32 * batches,
        fetch_wait_total_s=wait * batches,
        step_total_s=0.03 * batches,
        fetches=batches,
        stalls=batches // 2,
        gpu_util=util,
        util_source=UtilSource.NVML,
    )
    config = LoaderConfig(num_workers=workers, prefetch_factor=prefetch)
    reason = Reason(ReasonKind.NOTE, {"text": "synthetic"})
    return WindowRecord(0, config, stats, Verdict.IN_BAND, reason, config, step=step, judged_util=util)


def write_history(log_dir: str, history: list[WindowRecord], accumulate: int = 1) -> None:
    """The event files the callback writes for ``history``: the layout, then each window as it closes."""
    logger = TensorBoardLogger(log_dir, name="", version="")
    trainer = SimpleNamespace(loggers=[logger], global_step=0, accumulate_grad_batches=accumulate)
    add_panels(trainer, estimate=False, recent=False)
    for record in history:
        trainer.global_step = record.step
        log_window(trainer, record, window_scalars(record, BAND, rebuilds=0), tuning=True)
    logger.finalize("success")


def starved_then_many_in_band() -> list[WindowRecord]:
    """One starved window at 0 workers (10 batches), then 59 windows of 20 at 4 workers in the band."""
    return [window(10, 0, 0.2, batches=10)] + [window(10 + 20 * i, 4, 0.9 + 0.01 * (i % 5)) for i in range(1, 60)]


def test_a_window_spans_its_own_steps_counted_back_from_where_it_closed():
    trainer = SimpleNamespace(global_step=0, accumulate_grad_batches=1)
    assert window_span(trainer, window(10, 0, 0.5, batches=10)) == (0, 9)
    assert window_span(trainer, window(30, 0, 0.5, batches=20)) == (10, 29)
    assert window_span(trainer, window(7, 0, 0.5, batches=20)) == (0, 6)  # never before step 0
    assert window_span(trainer, window(30, 0, 0.5, batches=0)) == (29, 29)
    # under gradient accumulation a window of 40 batches is 10 optimizer steps
    assert window_span(SimpleNamespace(accumulate_grad_batches=4), window(20, 0, 0.5, batches=40)) == (10, 19)


def test_panel_scalars_are_the_drawn_window_scalars_and_the_axis_constants():
    scalars = window_scalars(window(30, 2, 0.9), BAND, rebuilds=1)
    drawn = panel_scalars(scalars)
    assert drawn[ZERO] == 0.0 and drawn[ONE] == 1.0
    assert drawn[PANEL_PREFIX + "num_workers"] == scalars["dltune/num_workers"] == 2.0
    assert PANEL_PREFIX + "rebuilds" not in drawn and PANEL_PREFIX + "queue_depth" not in drawn  # none logged


def test_a_window_that_read_the_cores_logs_what_other_processes_took():
    record = window(30, 2, 0.9)
    assert "dltune/other_cpus" not in window_scalars(record, BAND, rebuilds=0)  # a window too short to say
    record = dataclasses.replace(record, stats=dataclasses.replace(record.stats, other_cpus=0.8, cpu_busy=1.0))
    assert window_scalars(record, BAND, rebuilds=0)["dltune/other_cpus"] == 0.8


def test_each_window_is_drawn_flat_from_its_first_to_its_last_step(tmp_path):
    history = starved_then_many_in_band()
    write_history(str(tmp_path), history)
    logged = scalars(str(tmp_path))
    workers = logged[PANEL_PREFIX + "num_workers"]
    assert workers[:4] == [(0, 0.0), (9, 0.0), (10, 4.0), (29, 4.0)]  # a step from 0 to 4, not a ramp
    assert [x for x, _ in workers] == sorted({x for x, _ in workers})  # strictly increasing, as TensorBoard keeps
    assert [x for x, _ in logged["dltune/num_workers"]] == [r.step - 1 for r in history]  # one point per window
    assert len(logged[ZERO]) == len(logged[ONE]) == len(workers)


def test_in_a_long_fit_outlier_scaling_keeps_the_starved_start_on_every_fraction_axis(tmp_path):
    write_history(str(tmp_path), starved_then_many_in_band())
    logged = scalars(str(tmp_path))
    for title, series in charts(layout(str(tmp_path))).items():
        if series[0][0] in logged and is_fraction(series):
            assert tensorboard_y_extent(chart_values(series, logged)) == (0.0, 1.0), title
    workers = charts(layout(str(tmp_path)))["workers (processes) as they ran"]
    assert tensorboard_y_extent(chart_values(workers, logged)) == (0.0, 4.0)


# -- a real fit's event files -------------------------------------------------------------------------------
class EpochLoggingModule(SleepStepModule):
    """Logs a metric of its own per step and per epoch, so our points can be laid beside Lightning's."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("own_step", loss, on_step=True, on_epoch=False)
        self.log("own_epoch", loss, on_step=False, on_epoch=True)
        return loss


@pytest.fixture(scope="module")
def windowed_fit(tmp_path_factory):
    """A starved start, an early decision after 3 batches, then epoch-end windows: several windows."""
    tmp = tmp_path_factory.mktemp("tb")
    tuner = DataLoaderTuner(first_decision_after=3, log_every_n_steps=4, verbose=False)
    dm = SleepyDataModule(train_length=48, val_length=8, batch_cost_s=0.004, batch_size=4)
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=[tuner],
        logger=TensorBoardLogger(str(tmp / "logs"), name="fit"),
        log_every_n_steps=4,
        default_root_dir=str(tmp),
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(EpochLoggingModule(step_s=0.002), datamodule=dm)
    return str(tmp / "logs"), tuner


@pytest.mark.slow
def test_every_tag_the_written_layout_names_is_logged(windowed_fit):
    log_dir, _ = windowed_fit
    written = layout(log_dir)
    assert [c.title for c in written.category] == [HEADLINE, DETAIL]
    assert displayed_titles(written)[HEADLINE][0].startswith("GPU busy (estimate")  # no NVML on this machine
    logged = set(scalars(log_dir))
    drawn = {t for series in charts(written).values() for s in series for t in s}
    assert drawn == set(layout_tags(estimate=True, recent=True))
    assert drawn - {PANEL_PREFIX + "queue_depth", PANEL_PREFIX + "worker_batch_ms"} <= logged


@pytest.mark.slow
def test_each_window_is_a_point_where_it_closed_on_lightnings_own_x(windowed_fit):
    log_dir, tuner = windowed_fit
    logged = scalars(log_dir)
    history = tuner.history
    assert any(r.end_batch for r in history) and len(history) >= 4  # a mid-epoch window, then the epoch ends
    x = [step for step, _ in logged["dltune/gpu_util"]]
    assert x == [r.step - 1 for r in history]
    # at epoch ends our points sit on the x of Lightning's own on_epoch values
    assert {step for step, _ in logged["own_epoch"]} == {r.step - 1 for r in history if r.end_batch is None}
    judged = [value for _, value in logged["dltune/gpu_util_judged"]]
    assert judged == pytest.approx([r.judged_util for r in history], abs=1e-6)
    raw = [value for _, value in logged["dltune/gpu_util"]]
    assert raw == pytest.approx([r.gpu_util for r in history], abs=1e-6)
    assert len(texts(log_dir)) == len(history)


@pytest.mark.slow
def test_the_panels_draw_each_window_over_exactly_its_steps(windowed_fit):
    log_dir, tuner = windowed_fit
    logged = scalars(log_dir)
    ends = [r.step - 1 for r in tuner.history]
    starts = [0] + [end + 1 for end in ends[:-1]]  # the windows tile the fit: each starts after the last
    expected = [(x, float(r.num_workers)) for r, s, e in zip(tuner.history, starts, ends) for x in sorted({s, e})]
    assert logged[PANEL_PREFIX + "num_workers"] == expected
    assert [v for _, v in logged[PANEL_PREFIX + "starvation_ratio"][1::2]] == pytest.approx(
        [r.starvation_ratio for r in tuner.history], abs=1e-6
    )


@pytest.mark.slow
def test_recent_steps_are_logged_beside_lightnings_own_step_points(windowed_fit):
    log_dir, _ = windowed_fit
    logged = scalars(log_dir)
    ours = {step for step, _ in logged["dltune/recent/samples_per_s"]}
    assert len(ours) >= 5 and ours <= {step for step, _ in logged["own_step"]}
    assert all(value > 0 for _, value in logged["dltune/recent/samples_per_s"])
    assert all(0 <= value <= 1 for _, value in logged["dltune/recent/starvation_ratio"])
    assert [x for x, _ in logged[RECENT_ZERO]] == [x for x, _ in logged["dltune/recent/starvation_ratio"]]
    assert not [t for t in logged if t.startswith("dltune/step/")]


@pytest.mark.slow
def test_outlier_scaling_keeps_every_axis_from_0_and_every_headline_value_of_a_real_fit(windowed_fit):
    log_dir, _ = windowed_fit
    logged = scalars(log_dir)
    headline = {chart.title for chart in layout(log_dir).category[0].chart}
    for title, series in charts(layout(log_dir)).items():
        if series[0][0] not in logged:  # a loader that reports no queue depth
            continue
        low, high = tensorboard_y_extent(chart_values(series, logged))
        assert low == 0.0 and (high == 1.0 or not is_fraction(series)), title
        values = [v for _, v in logged[series[0][0]]]
        assert title not in headline or low <= min(values) and max(values) <= high, title


# -- a real TensorBoard in a real browser, at its defaults --------------------------------------------------
needs_chromium = pytest.mark.skipif(
    browser() is None, reason="no chromium on PATH (apt-get install chromium): the panels are not looked at"
)


def _segments(path: str) -> list[tuple[float, float, float, float]]:
    """The straight pieces of an SVG line path ``M x,y L x,y ...``."""
    points = [tuple(map(float, p.split(","))) for p in re.findall(r"[-\d.e]+,[-\d.e]+", path)]
    return [(*a, *b) for a, b in zip(points, points[1:])]


def _is_staircase(path: str, steps: int) -> bool:
    """Every piece of a line over ``steps`` steps is flat or at most one step wide: a staircase, no ramp."""
    pieces = _segments(path)
    xs = [x for piece in pieces for x in piece[::2]]
    one_step = (max(xs) - min(xs)) / steps
    return all(abs(y1 - y0) < 0.5 or abs(x1 - x0) <= 1.01 * one_step for x0, y0, x1, y1 in pieces)


@pytest.mark.slow
@needs_chromium
def test_at_tensorboard_defaults_a_browser_shows_the_windows_true(windowed_fit, tmp_path):
    log_dir, tuner = windowed_fit
    seen = shoot(Path(log_dir), tmp_path / "panels.png")
    assert seen["smoothing"] == [0.6] and seen["ignore_outliers"] == [True]  # a fresh profile: the defaults
    shown = displayed_titles(layout(log_dir))
    assert [c["title"] for c in seen["charts"]] == shown[HEADLINE] + shown[DETAIL]
    by_title = {c["title"]: c for c in seen["charts"]}
    assert all(c["kind"] == "margin" and not c["warnings"] for c in seen["charts"])
    for title, series in charts(layout(log_dir)).items():
        if is_fraction(series):
            low, high = y_range(by_title[title])
            assert low <= 0 and high >= 1, title
    workers = by_title["workers (processes) as they ran"]
    assert y_range(workers)[1] >= max(r.num_workers for r in tuner.history)
    last = tuner.history[-1].step - 1
    assert workers["lines"] and all(_is_staircase(d, last) for d in workers["lines"])
    assert "fit/version_0" in seen["runs_pane"] and str(tmp_path.parent) not in seen["runs_pane"]
    assert (tmp_path / "panels.png").stat().st_size > 50_000


@pytest.mark.slow
@needs_chromium
def test_at_tensorboard_defaults_one_starved_window_in_sixty_stays_on_the_axis(tmp_path):
    write_history(str(tmp_path / "logs" / "long"), starved_then_many_in_band())
    seen = shoot(tmp_path / "logs", tmp_path / "long.png", height=2400, wait_ms=30000)
    by_title = {c["title"]: c for c in seen["charts"]}
    measured, judged = displayed_titles(custom_scalars_layout())[HEADLINE][:2]
    for title in (measured, judged, "starvation ratio (0-1) per window"):
        low, high = y_range(by_title[title])
        assert low <= 0 and high >= 1, title
    assert y_range(by_title["workers (processes) as they ran"])[0] <= 0
    last = starved_then_many_in_band()[-1].step - 1
    assert all(_is_staircase(d, last) for d in by_title["workers (processes) as they ran"]["lines"])
