"""The timeline picture: drawn from a fit's history and from its event files alike, saved, logged, redrawn."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from dltune_command import run_script
from fit_workloads import SleepStepModule, SleepyDataModule
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image
from tb_events import accumulator
from torch.utils.tensorboard import SummaryWriter

from lightning_dltune import DataLoaderTuner
from lightning_dltune.cli import report
from lightning_dltune.cli.command import main
from lightning_dltune.cli.report import timeline_from_events
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.records import Reason, ReasonKind, Verdict, WindowRecord
from lightning_dltune.core.stats import UtilSource, WindowStats
from lightning_dltune.report import timeline
from lightning_dltune.report.recommendation import RECOMMENDATION_FILE, conclude_fit
from lightning_dltune.report.timeline import (
    TIMELINE_FILE,
    TIMELINE_TAG,
    Timeline,
    config_steps,
    decision_marks,
    draw_timeline,
    save_timeline,
    timeline_of,
)
from lightning_dltune.report.words import decision_markdown

BAND = (0.85, 0.95)


def window(step, workers, prefetch, starvation, verdict, to=None, batches=20, util=None):
    """A window of 20 batches of 32 samples and 30 ms steps, ``starvation`` of the loop spent waiting."""
    wait = 0.03 * starvation / (1 - starvation)
    stats = WindowStats(
        batches=batches,
        samples=32 * batches,
        fetch_wait_total_s=wait * batches,
        step_total_s=0.03 * batches,
        fetches=batches,
        stalls=batches // 2,
        gpu_util=util,
        util_source=UtilSource.ESTIMATE if util is None else UtilSource.NVML,
    )
    config = LoaderConfig(num_workers=workers, prefetch_factor=prefetch)
    nxt = config if to is None else LoaderConfig(num_workers=to[0], prefetch_factor=to[1])
    reason = Reason(ReasonKind.NOTE, {"text": "synthetic"})
    return WindowRecord(0, config, stats, verdict, reason, nxt, step=step, judged_util=None if util is None else util)


def starved_then_tuned() -> list[WindowRecord]:
    """Starved at 0 workers, 0 -> 4 -> 6 workers into the band, one give-back, deeper prefetch for bursts."""
    return [
        window(11, 0, 2, 0.57, Verdict.DATA_BOUND_IO, to=(4, 2), util=0.43),
        window(61, 4, 2, 0.21, Verdict.DATA_BOUND_IO, to=(6, 2), util=0.79),
        window(111, 6, 2, 0.09, Verdict.IN_BAND, util=0.88),
        window(161, 6, 2, 0.03, Verdict.COMPUTE_BOUND, to=(5, 2), util=0.97),
        window(211, 5, 2, 0.30, Verdict.DATA_BOUND_CPU, to=(5, 4), util=0.70),
        window(261, 5, 4, 0.08, Verdict.IN_BAND, util=0.90),
    ]


def check_png(path) -> None:
    """A real PNG of a readable size, with a picture on it (not one flat colour)."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.width >= 1000 and image.height >= 800
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 50


# -------------------------------------------------------------------------------------------- the picture alone
def test_the_picture_draws_each_panel_on_one_step_axis_with_the_true_config_steps(tmp_path):
    fig = draw_timeline(timeline_of(starved_then_tuned(), BAND, tuning=True, title="dltune timeline: demo/version_0"))
    decisions, util, starvation, rate, config = fig.axes[:5]
    assert len({ax.get_xlim() for ax in fig.axes[:5]}) == 1  # one shared step axis
    for fraction in (util, starvation):
        low, high = fraction.get_ylim()
        assert low <= 0 and 1 <= high < 1.1  # 0-1 whatever the values: nothing clipped, nothing zoomed
    workers = next(line for line in config.get_lines() if line.get_label() == "num_workers")
    assert workers.get_drawstyle() == "steps-post"
    assert list(workers.get_xdata()) == [0, 10, 60, 110, 160, 210, 260]  # each value from where it started running
    assert list(workers.get_ydata()) == [0, 4, 6, 6, 5, 5, 5]
    assert [t.get_text() for t in util.get_legend().get_texts()] == [
        "band 85%-95%",
        "raw (this window)",
        "judged (pooled)",
    ]
    verdicts = [t.get_text() for t in decisions.get_legend().get_texts()]
    assert verdicts == ["data-bound (I/O)", "in band", "compute-bound", "data-bound (CPU saturated)"]
    written = [t.get_text() for t in decisions.texts]
    assert written == ["workers 0→4", "workers 4→6", "workers 6→5", "prefetch 2→4"]
    changed_at = sorted({line.get_xdata()[0] for line in rate.get_lines() if line.get_linestyle() == ":"})
    assert changed_at == [10, 60, 160, 210]  # a dotted line in every panel where the config changed
    assert "4 config changes" in fig.get_suptitle()
    check_png(save_timeline(fig, str(tmp_path / "picture.png")))


def crowded() -> list[WindowRecord]:
    """30 windows: a change in each of the first 10 (some of two settings), one more in the last."""
    history, workers, prefetch = [], 0, 2
    for i in range(30):
        to = (workers + 1, prefetch + (i % 3 == 0)) if i < 10 or i == 29 else None
        starvation = max(0.02, 0.6 - 0.06 * i)
        verdict = Verdict.DATA_BOUND_IO if to else Verdict.IN_BAND
        history.append(window(5 + 20 * i, workers, prefetch, starvation, verdict, to=to, util=1 - starvation))
        workers, prefetch = to or (workers, prefetch)
    return history


def test_crowded_changes_are_written_without_overlapping_words_or_clipped_text():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = draw_timeline(timeline_of(crowded(), BAND, tuning=True, title="dltune timeline: crowded/version_0"))
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    words = [t.get_window_extent(renderer) for t in fig.axes[0].texts]
    assert len(words) == 11
    assert not [(a, b) for i, a in enumerate(words) for b in words[i + 1 :] if a.overlaps(b)]
    page = fig.bbox
    everything = [t for ax in fig.axes for t in (*ax.texts, ax.title, ax.yaxis.label, *ax.get_yticklabels())]
    everything += [fig.axes[0].get_legend(), fig.axes[-1].xaxis.label, fig._suptitle]
    for artist in everything:
        box = artist.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, artist


def test_without_nvml_the_picture_says_the_utilization_is_the_estimate():
    history = [window(11, 0, 2, 0.5, Verdict.DATA_BOUND_IO, to=(2, 2)), window(31, 2, 2, 0.1, Verdict.IN_BAND)]
    fig = draw_timeline(timeline_of(history, BAND, tuning=True, title="t"))
    assert "estimate" in fig.axes[1].get_title(loc="left") and "estimated" in fig.get_suptitle()


def test_decision_texts_parse_back_to_their_verdict_and_change():
    changed, kept = starved_then_tuned()[0], starved_then_tuned()[2]
    texts = [(10, decision_markdown(changed, True)), (20, decision_markdown(changed, False))]
    texts += [(30, decision_markdown(kept, True)), (40, "**epoch 3**: an older release's free text")]
    marks = decision_marks(Timeline({}, texts))
    assert [(m.verdict, m.change, m.tried) for m in marks] == [
        ("data-bound (I/O)", "workers 0→4", False),
        ("data-bound (I/O)", "workers 0→4", True),
        ("in band", "", False),
        ("epoch 3: an older release's free text", "", False),
    ]


def test_a_config_holds_from_where_it_started_running_to_the_window_that_measured_it():
    assert config_steps([9, 19, 29], [0, 4, 4]) == ([0, 9, 19, 29], [0, 4, 4, 4])
    assert config_steps([], []) == ([], [])


# ------------------------------------------------------------------------------------------- at the end of a fit
def fake_trainer(tmp_path, loggers):
    return SimpleNamespace(
        loggers=loggers,
        fast_dev_run=False,
        log_dir=str(tmp_path),
        is_global_zero=True,
        callbacks=[DataLoaderTuner(band=(0.8, 0.9), verbose=False)],
        global_step=40,
        progress_bar_callback=None,
        datamodule=None,
        lightning_module=SleepStepModule(),
    )


def test_the_picture_is_drawn_without_a_recommendation_and_logged_to_the_images_tab(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(timeline, "draw_timeline", lambda t: drawn.append(t) or draw_timeline(t))
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    nothing = [
        window(11, 0, 2, 0.5, Verdict.DATA_BOUND_IO, batches=0),
        window(21, 0, 2, 0.5, Verdict.IN_BAND, batches=0),
    ]
    config, path = conclude_fit(fake_trainer(tmp_path, [logger]), nothing, 0.05, write_file=True, verbose=0)
    logger.experiment.flush()
    assert config is None and path is None and not (tmp_path / RECOMMENDATION_FILE).exists()
    check_png(tmp_path / TIMELINE_FILE)
    assert [e.step for e in accumulator(str(tmp_path / "tb")).Images(TIMELINE_TAG)] == [39]
    assert drawn[0].series("band_low")[1] == [0.8, 0.8]  # the fit's tuner's band
    assert drawn[0].title == f"dltune timeline: {tmp_path.parent.name}/{tmp_path.name}"  # no machine paths


def test_without_matplotlib_the_fit_says_once_where_to_get_the_picture(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(timeline, "plot_available", lambda: False)
    with caplog.at_level(logging.INFO):
        conclude_fit(fake_trainer(tmp_path, [object()]), starved_then_tuned(), 0.05, write_file=False, verbose=1)
    said = [r.getMessage() for r in caplog.records if "timeline" in r.getMessage()]
    assert said == [
        "[dltune] timeline picture skipped: matplotlib is not installed (pip install 'lightning-dltune[plot]')"
    ]
    assert not (tmp_path / TIMELINE_FILE).exists()


# ----------------------------------------------------------------------------------------------- dltune report
def write_run(folder, dltune: bool) -> None:
    writer = SummaryWriter(str(folder))
    for step, record in enumerate(starved_then_tuned() if dltune else []):
        writer.add_scalar("dltune/gpu_util", record.gpu_util, step * 10)
        writer.add_text("dltune/decision", decision_markdown(record, True), step * 10)
    writer.add_scalar("loss", 1.0, 0)
    writer.close()


def test_report_draws_the_newest_run_with_dltune_events_and_says_which(tmp_path, capsys):
    for version, dltune in ((0, True), (1, True), (2, False)):  # version_2, the newest, has no dltune tags
        write_run(tmp_path / f"version_{version}", dltune)
        for events in (tmp_path / f"version_{version}").iterdir():
            os.utime(events, (1e9 + version, 1e9 + version))
    assert main(["report", str(tmp_path), "--output", str(tmp_path / "out" / "t.png")]) == 0
    said, written = capsys.readouterr().out.splitlines()
    newest = tmp_path / "version_1"
    assert said == f"dltune report: drawing {newest}, the newest with dltune events of the 3 runs under {tmp_path}"
    assert written == str(tmp_path / "out" / "t.png")
    check_png(tmp_path / "out" / "t.png")


def test_report_without_matplotlib_says_where_to_get_it_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report, "plot_available", lambda: False)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "dltune report: error: matplotlib is not installed (pip install 'lightning-dltune[plot]')\n"


def test_report_on_a_missing_dir_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"dltune report: error: no such directory: {tmp_path / 'nowhere'}\n"


@pytest.mark.slow
def test_report_on_a_dir_without_dltune_events_is_one_line_and_exit_2(tmp_path):
    write_run(tmp_path / "version_0", dltune=False)
    proc = run_script("report", str(tmp_path), tmp=tmp_path, timeout=120)
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr.splitlines() == [
        f"dltune report: error: no dltune event files under {tmp_path}"
        " (a fit's log dir with a DataLoaderTuner and a TensorBoardLogger)"
    ]


# ------------------------------------------------------------------------------------------------- a real fit
@pytest.mark.slow
def test_a_fit_writes_the_picture_beside_the_recommendation_and_dltune_report_redraws_it(tmp_path):
    tuner = DataLoaderTuner(first_decision_after=3, log_every_n_steps=4, verbose=False)
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=[tuner],
        logger=TensorBoardLogger(str(tmp_path / "tb")),
        log_every_n_steps=4,
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    dm = SleepyDataModule(train_length=48, val_length=8, batch_cost_s=0.004, batch_size=4)
    trainer.fit(SleepStepModule(step_s=0.002), datamodule=dm)
    log_dir = trainer.log_dir
    assert tuner.recommendation_path == os.path.join(log_dir, RECOMMENDATION_FILE)
    check_png(os.path.join(log_dir, TIMELINE_FILE))  # beside the recommendation
    events = accumulator(log_dir)
    assert [e.step for e in events.Images(TIMELINE_TAG)] == [trainer.global_step - 1]  # the Images tab
    # the picture from the event files is the picture from the history: the same points and texts
    from_events = timeline_from_events(events, "t")
    from_history = timeline_of(tuner.history, tuner.band, tuner.tune, "t")
    for name in ("gpu_util", "gpu_util_judged", "starvation_ratio", "samples_per_s", "num_workers", "band_low"):
        assert from_events.series(name)[0] == from_history.series(name)[0], name
        assert from_events.series(name)[1] == pytest.approx(from_history.series(name)[1], rel=1e-6), name
    assert decision_marks(from_events) == decision_marks(from_history) and len(tuner.history) >= 4
    os.remove(os.path.join(log_dir, TIMELINE_FILE))
    proc = run_script("report", log_dir, tmp=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [os.path.join(log_dir, TIMELINE_FILE)]
    check_png(os.path.join(log_dir, TIMELINE_FILE))
