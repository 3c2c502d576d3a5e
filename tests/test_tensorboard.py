"""The dltune panels: one unit per chart, the headline first, and every series they draw logged by a real fit."""

import re

import lightning.pytorch as pl
import pytest
from fit_workloads import SleepStepModule, SleepyDataModule
from lightning.pytorch.loggers import TensorBoardLogger
from tb_events import layout, scalars, texts

from lightning_dltune import DataLoaderTuner
from lightning_dltune.report.tensorboard import DETAIL, HEADLINE, custom_scalars_layout, layout_tags

UNITS = [  # (tag pattern, unit): what a user reads off the y axis
    (r"(gpu_util|gpu_util_judged|band_low|band_high|starvation_ratio|stall_fraction)$", "fraction"),
    (r"_ms$", "ms"),
    (r"samples_per_s$", "samples/s"),
    (r"recent/stalls$", "stalls per interval"),
    (r"/stalls$", "stalls per window"),
    (r"queue_depth$", "batches"),
    (r"num_workers$", "workers"),
    (r"prefetch_factor$", "prefetch"),
    (r"rebuilds$", "rebuilds"),
]


def unit(tag: str) -> str:
    return next(u for pattern, u in UNITS if re.search(pattern, tag))


def drawn(pattern: str, tags) -> list[str]:
    """The tags a chart's pattern draws: TensorBoard matches them as regular expressions from the start."""
    return [t for t in tags if re.match(pattern, t)]


@pytest.mark.parametrize("recent", [False, True])
def test_every_chart_has_one_unit_and_the_headline_comes_first(recent):
    charts = custom_scalars_layout(recent=recent)
    assert list(charts) == [HEADLINE, DETAIL]
    kind, first_patterns = next(iter(charts[HEADLINE].values()))
    everything = layout_tags(recent=recent)
    assert kind == "Multiline" and [drawn(p, everything) for p in first_patterns] == [
        ["dltune/gpu_util"],
        ["dltune/gpu_util_judged"],
        ["dltune/band_low"],
        ["dltune/band_high"],
    ]
    for category in charts.values():
        for title, (_, patterns) in category.items():
            tags = [t for p in patterns for t in drawn(p, everything)]
            assert len(tags) == len(patterns) and len({unit(t) for t in tags}) == 1, (title, tags)
    headline_tags = [t for _, patterns in charts[HEADLINE].values() for p in patterns for t in drawn(p, everything)]
    assert ("dltune/recent/samples_per_s" in headline_tags) == recent


def test_the_utilization_title_says_estimate_where_it_is_one():
    assert "estimate" in next(iter(custom_scalars_layout(estimate=True)[HEADLINE]))
    assert "estimate" not in next(iter(custom_scalars_layout(estimate=False)[HEADLINE]))


def test_recent_series_do_not_share_a_prefix_with_the_window_step_times():
    tags = layout_tags(recent=True)
    assert [t for t in tags if t.startswith("dltune/step")] == ["dltune/step_ms", "dltune/step_p95_ms"]
    assert {t for t in tags if t.startswith("dltune/recent/")} == {
        "dltune/recent/" + n for n in ("starvation_ratio", "samples_per_s", "fetch_wait_ms", "step_ms", "stalls")
    }


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
        logger=TensorBoardLogger(str(tmp / "tb")),
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
    return str(tmp / "tb"), tuner


@pytest.mark.slow
def test_every_tag_the_written_layout_names_is_logged(windowed_fit):
    log_dir, _ = windowed_fit
    written = layout(log_dir)
    assert [c.title for c in written.category] == [HEADLINE, DETAIL]
    headline = written.category[0].chart[0]
    assert "estimate" in headline.title  # no NVML on this machine
    logged = set(scalars(log_dir))
    patterns = [p for c in written.category for chart in c.chart for p in chart.multiline.tag]
    assert patterns and all(len(drawn(p, logged)) == 1 for p in patterns)  # each draws its one logged series
    assert set(layout_tags(estimate=True, recent=True)) <= logged


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
def test_recent_steps_are_logged_beside_lightnings_own_step_points(windowed_fit):
    log_dir, _ = windowed_fit
    logged = scalars(log_dir)
    ours = {step for step, _ in logged["dltune/recent/samples_per_s"]}
    assert len(ours) >= 5 and ours <= {step for step, _ in logged["own_step"]}
    assert all(value > 0 for _, value in logged["dltune/recent/samples_per_s"])
    assert all(0 <= value <= 1 for _, value in logged["dltune/recent/starvation_ratio"])
    assert not [t for t in logged if t.startswith("dltune/step/")]
