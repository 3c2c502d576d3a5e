"""``dltune report LOGDIR``: the timeline picture of an earlier fit, redrawn from its TensorBoard event files.

    dltune report logs/demo/version_0                  # writes logs/demo/version_0/dltune_timeline.png
    dltune report logs/demo --output timeline.png      # the newest run under logs/demo with dltune events

No Trainer runs and no GPU is needed: the scalars and decision texts the fit logged are read back with
TensorBoard's own reader and drawn by :func:`lightning_dltune.report.timeline.draw_timeline`, the same
code the fit's own picture comes from. A LOGDIR that does not exist or holds no dltune events is an
error of one line, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn, Sequence

from lightning_dltune.report.metrics import DECISION_TAG
from lightning_dltune.report.tensorboard import tag
from lightning_dltune.report.timeline import (
    PLOT_MISSING,
    TIMELINE_FILE,
    Timeline,
    draw_timeline,
    plot_available,
    run_label,
    save_timeline,
)

PROG = "dltune report"
REPORT_DESCRIPTION = (
    "dltune report: redraw the timeline picture of an earlier fit (utilization against the band, starvation,"
    " samples/s, workers and prefetch, each decision's verdict) from the TensorBoard event files under LOGDIR."
)
REPORT_HELP = "The timeline picture of an earlier fit, from its event files (dltune report --help)."
EXIT_ERROR = 2
_MARKER_TAG = tag("gpu_util")  # every window logs it: a run without it has no dltune windows
_TEXT_TAG = DECISION_TAG + "/text_summary"  # where TensorBoard keeps add_text's markdown


class ReportError(Exception):
    """What stops ``dltune report``, in one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, no abbreviations, errors as the other ``dltune`` commands say them (one line, exit 2)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{PROG}: error: {message}\nRun '{PROG} --help' for the options.\n")
        self.exit(EXIT_ERROR)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=REPORT_DESCRIPTION, allow_abbrev=False)
    parser.add_argument("logdir", metavar="LOGDIR", help="A fit's log dir (trainer.log_dir), or a folder of runs.")
    parser.add_argument(
        "--output", metavar="PATH", default=None, help=f"Where to write the PNG; default: LOGDIR/{TIMELINE_FILE}."
    )
    return parser


def report_command(args: Sequence[str]) -> int:
    """``dltune report``: find the run, read its events, draw and write the picture; returns the exit status."""
    options = _parser().parse_args(list(args))
    try:
        if not plot_available():
            raise ReportError(PLOT_MISSING)
        run_dir, events, runs = newest_run(options.logdir)
    except ReportError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if runs > 1:
        print(f"{PROG}: drawing {run_dir}, the newest with dltune events of the {runs} runs under {options.logdir}")
    path = options.output or os.path.join(options.logdir, TIMELINE_FILE)
    save_timeline(draw_timeline(timeline_from_events(events, f"dltune timeline: {run_label(run_dir)}")), path)
    print(path)
    return 0


def event_dirs(logdir: str) -> list[str]:
    """Every folder under ``logdir`` (itself included) holding TensorBoard event files, newest first."""
    if not os.path.isdir(logdir):
        raise ReportError(f"no such directory: {logdir}")
    newest: dict[str, float] = {}
    for folder, _, files in os.walk(logdir):
        times = [os.path.getmtime(os.path.join(folder, f)) for f in files if "tfevents" in f]
        if times:
            newest[folder] = max(times)
    return sorted(newest, key=lambda folder: newest[folder], reverse=True)


def newest_run(logdir: str) -> tuple[str, Any, int]:
    """The newest run dir under ``logdir`` with dltune events, its events, and how many runs have event files."""
    folders = event_dirs(logdir)
    for folder in folders:
        events = _accumulator(folder)
        if _MARKER_TAG in events.Tags()["scalars"]:
            return folder, events, len(folders)
    raise ReportError(
        f"no dltune event files under {logdir} (a fit's log dir with a DataLoaderTuner and a TensorBoardLogger)"
    )


def timeline_from_events(events: Any, title: str) -> Timeline:
    """The :class:`~lightning_dltune.report.timeline.Timeline` in a run's loaded ``EventAccumulator``."""
    tags = events.Tags()
    scalars = {
        name: [(e.step, e.value) for e in events.Scalars(name)] for name in tags["scalars"] if name.startswith(tag(""))
    }
    texts = events.Tensors(_TEXT_TAG) if _TEXT_TAG in tags["tensors"] else []
    decisions = [(e.step, e.tensor_proto.string_val[0].decode()) for e in texts]
    return Timeline(scalars, decisions, title)


def _accumulator(folder: str) -> Any:
    """TensorBoard's reader over the event files in ``folder``, loaded (every scalar and text kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder, size_guidance={"scalars": 0, "tensors": 0, "images": 1})
    events.Reload()
    return events
