"""The timeline picture: utilization against the band, starvation, samples/s and the loader config on one step axis.

The picture is drawn from a :class:`Timeline`, the series as TensorBoard holds them (``dltune/*`` tag ->
``(step, value)`` points, and each window's ``dltune/decision`` text), so that the end of a fit
(:func:`timeline_of`, from its history) and ``dltune report`` (from event files) draw the same figure.
matplotlib is an optional extra (``pip install 'lightning-dltune[plot]'``), imported only to draw.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dltune.core.records import PolicySettings, Verdict, WindowRecord
from lightning_dltune.report.console import say
from lightning_dltune.report.metrics import lightning_step, window_scalars
from lightning_dltune.report.tensorboard import tag, utilization_title
from lightning_dltune.report.validation import val_scalars
from lightning_dltune.report.words import VERBOSE_LINE, decision_markdown

TIMELINE_FILE = "dltune_timeline.png"
TIMELINE_TAG = "dltune/timeline"  # TensorBoard's Images tab
PLOT_MISSING = "matplotlib is not installed (pip install 'lightning-dltune[plot]')"

# one colour per verdict, the same in every picture; anything else (older free text) is grey
VERDICT_COLOURS = {
    Verdict.DATA_BOUND_IO.value: "tab:red",
    Verdict.DATA_BOUND_CPU.value: "tab:orange",
    Verdict.COMPUTE_BOUND.value: "tab:blue",
    Verdict.IN_BAND.value: "tab:green",
    Verdict.MEMORY_CAPPED.value: "tab:purple",
}
# the first line of words.decision_markdown: "**epoch 0 to batch 10**: <verdict>, <config> → <action>"
_DECISION = re.compile(r"^\*\*(?P<where>.+?)\*\*: (?P<verdict>.+?), (?P<ran>\S.*?) → (?P<action>.+?)\s*$")
_SETTING = re.compile(r"(\w+)=(\S+)")


@dataclass(frozen=True)
class Timeline:
    """What the picture draws: scalar tag -> ``(step, value)`` points, and ``(step, decision text)`` per window.

    The tags and texts are those :func:`~lightning_dltune.report.metrics.log_window` logs
    (``dltune/gpu_util``, ...; the text is ``dltune/decision``'s markdown); ``title`` heads the figure.
    """

    scalars: Mapping[str, Sequence[tuple[int, float]]]
    decisions: Sequence[tuple[int, str]] = ()
    title: str = "dltune timeline"

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """The steps and values of ``dltune/<name>``, in step order (both empty when it was not logged)."""
        points = sorted(self.scalars.get(tag(name), ()), key=lambda p: p[0])
        return [p[0] for p in points], [p[1] for p in points]


class DecisionMark(NamedTuple):
    """One window's decision as the picture marks it: where, the verdict, and the change (``""``: kept)."""

    step: int
    verdict: str
    change: str
    tried: bool  # the change was only what the tuner would try (monitoring, no rebuild)


def timeline_of(
    history: Sequence[WindowRecord],
    band: tuple[float, float],
    tuning: bool,
    title: str,
    val_history: Sequence[WindowRecord] = (),
) -> Timeline:
    """The :class:`Timeline` of a fit's windows (and validation runs): the scalars and texts its loggers were
    given, at their x."""
    scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
    decisions = []
    rebuilds, x = 0, -1
    for record in history:
        x = lightning_step(record.step) if record.step is not None else x + 1  # older checkpoints kept no step
        rebuilds += int(tuning and record.changed)
        for name, value in window_scalars(record, band, rebuilds).items():
            scalars[name].append((x, value))
        decisions.append((x, decision_markdown(record, tuning)))
    for record in val_history:
        for name, value in val_scalars(record, band, rebuilds).items():
            scalars[name].append((lightning_step(record.step or 0), value))
    return Timeline(dict(scalars), decisions, title)


def decision_marks(timeline: Timeline) -> list[DecisionMark]:
    """Each decision text parsed back: its verdict and what it changes, in words as short as a label."""
    marks = []
    for step, text in sorted(timeline.decisions, key=lambda d: d[0]):
        first = text.strip().splitlines()[0] if text.strip() else ""
        found = _DECISION.match(first)
        if not found:
            marks.append(DecisionMark(step, first.replace("*", "").strip(), "", False))
            continue
        action = found["action"]
        tried = action.startswith("would try")
        change = "" if action == "keep" else _change_words(found["ran"], action)
        marks.append(DecisionMark(step, found["verdict"], change, tried))
    return marks


def _change_words(ran: str, action: str) -> str:
    """``workers 0→4, prefetch 2→4`` from the config a window ran and the one its action names."""
    before, after = dict(_SETTING.findall(ran)), dict(_SETTING.findall(action))
    parts = [f"{key} {before.get(key, '?')}→{value}" for key, value in after.items() if before.get(key) != value]
    return ", ".join(parts) or action


def plot_available() -> bool:
    """Whether matplotlib (the ``plot`` extra) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def run_label(directory: str) -> str:
    """The last two parts of a log dir (``demo/version_0``): the run's name without the machine's paths."""
    parts = os.path.normpath(os.path.abspath(directory)).split(os.sep)
    return "/".join(p for p in parts[-2:] if p)


def draw_timeline(timeline: Timeline) -> Any:
    """The picture of ``timeline``: a :class:`matplotlib.figure.Figure` (no pyplot, any backend).

    Panels share the step axis: the decisions (a mark per window, coloured by verdict, the changes
    written), GPU utilization raw and judged against the shaded band, the starvation ratio, samples/s,
    and the loader's workers and prefetch as steps (each value from the step it started running at).
    Fractions are drawn on a fixed 0-1 axis; a dotted line crosses every panel where the config changed.

    Raises:
        ImportError: without matplotlib.
    """
    from matplotlib.figure import Figure

    marks = decision_marks(timeline)
    x_range = _x_range(timeline, marks)
    labels = change_labels(marks, x_range)
    strip = 0.5 + 0.25 * max(2, 1 + max((label.row for label in labels), default=0))  # room for every row
    fig = Figure(figsize=(11.5, 8.1 + strip), layout="constrained")
    axes = fig.subplots(5, 1, sharex=True, gridspec_kw={"height_ratios": [strip, 2.4, 1.4, 1.4, 1.4]})
    _decision_panel(axes[0], marks, labels)
    estimate = _utilization_panel(axes[1], timeline)
    _starvation_panel(axes[2], timeline)
    _rate_panel(axes[3], timeline)
    _config_panel(axes[4], timeline)
    for ax in axes:
        for label in labels:
            alpha = 0.5 if label.mark.tried else 1.0
            ax.axvline(label.mark.step, color="0.45", linestyle=":", linewidth=1.0, alpha=alpha, zorder=1)
        ax.grid(True, axis="y", color="0.9", linewidth=0.8)
        ax.set_axisbelow(True)
    axes[-1].set_xlabel("global step (the x of Lightning's own metrics)")
    axes[-1].set_xlim(*x_range)
    fig.suptitle(f"{timeline.title}\n{_subtitle(marks, len(labels), estimate)}", fontsize=12)
    return fig


class ChangeLabel(NamedTuple):
    """Where a change's words go in the decisions panel: a row above the marks, left or right of its line."""

    mark: DecisionMark
    text: str
    row: int
    leftward: bool  # near the right edge: the words end at the line instead of starting there


_LABEL_CHARS = 125  # about this many characters of the labels' 8 pt type fit across the panel


def change_labels(marks: Sequence[DecisionMark], x_range: tuple[float, float]) -> list[ChangeLabel]:
    """A label per change, each on the lowest row where it overlaps no other (widths from its characters)."""
    low, high = x_range
    per_char = (high - low) / _LABEL_CHARS
    row_ends: list[float] = []  # each row's rightmost x taken so far
    labels = []
    for mark in (m for m in marks if m.change):
        text = ("would try " if mark.tried else "") + mark.change
        width = (len(text) + 2) * per_char
        leftward = mark.step + width > high
        start = mark.step - width if leftward else mark.step
        row = next((r for r, end in enumerate(row_ends) if end < start), len(row_ends))
        if row == len(row_ends):
            row_ends.append(start)
        row_ends[row] = start + width
        labels.append(ChangeLabel(mark, text, row, leftward))
    return labels


def _subtitle(marks: Sequence[DecisionMark], changes: int, estimate: bool) -> str:
    tried = any(m.tried for m in marks)
    what = "changes the tuner would try (monitoring)" if tried else "config changes"
    text = f"{len(marks)} windows, {changes} {what}"
    if estimate:
        text += "; no NVML: GPU busy is estimated as 1 - starvation"
    return text


def _x_range(timeline: Timeline, marks: Sequence[DecisionMark]) -> tuple[float, float]:
    steps = [m.step for m in marks] + [x for points in timeline.scalars.values() for x, _ in points]
    high = max(steps, default=1)
    pad = max(1.0, 0.02 * high)
    return min(0.0, min(steps, default=0)) - pad, high + pad


def _legend(ax: Any, **kwargs: Any) -> None:
    """A legend outside the panel's right edge, so no series hides behind it."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False, **kwargs)


def _fraction_axis(ax: Any, label: str) -> None:
    """A fixed 0-1 axis in percent, a little room either side so points on the edges stay whole."""
    from matplotlib.ticker import PercentFormatter

    ax.set_ylim(-0.04, 1.04)
    ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_ylabel(label)


def _decision_panel(ax: Any, marks: Sequence[DecisionMark], labels: Sequence[ChangeLabel]) -> None:
    """A mark per window, coloured by verdict; each change's words on its row above the marks."""
    seen = set()
    for m in marks:
        colour = VERDICT_COLOURS.get(m.verdict, "0.5")
        label = None if m.verdict in seen else m.verdict
        seen.add(m.verdict)
        ax.scatter([m.step], [0.0], s=46, color=colour, edgecolor="white", linewidth=0.6, zorder=3, label=label)
    for label in labels:
        ax.annotate(
            label.text,
            (label.mark.step, 1.0 + label.row),
            xytext=(-4 if label.leftward else 4, 0),
            textcoords="offset points",
            ha="right" if label.leftward else "left",
            va="center",
            fontsize=8,
            color="0.2",
            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "edgecolor": "none"},  # over other lines
            annotation_clip=False,
        )
    rows = 1 + max((label.row for label in labels), default=0)
    ax.set_ylim(-0.8, max(rows, 2) + 0.5)
    ax.set_yticks([])
    ax.set_ylabel("decisions")
    ax.set_title("decisions: verdict per window, config changes written", loc="left", fontsize=10)
    _legend(ax, title="verdict", title_fontsize=8)


def _utilization_panel(ax: Any, timeline: Timeline) -> bool:
    """GPU utilization (raw and judged) against the shaded band; returns whether it is the estimate."""
    x, raw = timeline.series("gpu_util")
    _, judged = timeline.series("gpu_util_judged")
    _, nvml = timeline.series("util_from_nvml")
    _, low = timeline.series("band_low")
    _, high = timeline.series("band_high")
    estimate = bool(nvml) and not any(nvml)
    if low and high:
        ax.axhspan(
            low[-1], high[-1], color="tab:green", alpha=0.16, linewidth=0, label=f"band {low[-1]:.0%}-{high[-1]:.0%}"
        )
    ax.plot(x, raw, color="tab:blue", marker="o", markersize=4, linewidth=1.6, label="raw (this window)")
    if judged:
        ax.plot(
            x[: len(judged)],
            judged,
            color="black",
            linestyle="--",
            marker="s",
            markersize=4,
            markerfacecolor="none",
            linewidth=1.2,
            label="judged (pooled)",
        )
    _fraction_axis(ax, "GPU busy" if estimate else "GPU utilization")
    ax.set_title(utilization_title(estimate), loc="left", fontsize=10)
    _legend(ax)
    return estimate


def _window_line(ax: Any, timeline: Timeline, name: str, colour: str) -> list[float]:
    """The window series ``name`` as points joined by a line; returns its values.

    Only the windows are drawn (not the ``recent/`` series of ``log_every_n_steps``): a fit's history
    holds no more, and the picture from event files must be the same picture.
    """
    x, values = timeline.series(name)
    ax.plot(x, values, color=colour, marker="o", markersize=4, linewidth=1.6, label="window")
    return values


def _starvation_panel(ax: Any, timeline: Timeline) -> None:
    _window_line(ax, timeline, "starvation_ratio", "tab:red")
    x, values = timeline.series("starvation_ratio")
    ax.fill_between(x, values, color="tab:red", alpha=0.1, linewidth=0)
    val_x, val_values = timeline.series("val/starvation_ratio")
    if val_x:  # the validation runs, each the validation side's window
        ax.plot(val_x, val_values, color="tab:purple", marker="s", markersize=4, linewidth=1.2, label="validation run")
    _fraction_axis(ax, "starvation")
    ax.set_title("starvation ratio: share of the loop spent waiting for data", loc="left", fontsize=10)
    _legend(ax)


def _rate_panel(ax: Any, timeline: Timeline) -> None:
    values = _window_line(ax, timeline, "samples_per_s", "tab:cyan")
    ax.set_ylim(0, 1.12 * max(values, default=1.0) or 1.0)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:,.0f}")
    ax.set_ylabel("samples/s")
    ax.set_title("throughput (samples/s)", loc="left", fontsize=10)
    _legend(ax)


def config_steps(x: Sequence[int], values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Points for a ``steps-post`` line of a config the windows at ``x`` ran: each value from its start.

    A window closing at ``x[i]`` ran its config since the previous window closed (the first since step 0),
    so its value is drawn from ``x[i - 1]`` on, and the last one holds to ``x[-1]``.
    """
    if not x:
        return [], []
    starts = [min(0, x[0]), *x[:-1]]
    return [*starts, x[-1]], [*values, values[-1]]


def _config_panel(ax: Any, timeline: Timeline) -> None:
    from matplotlib.ticker import MaxNLocator

    top = 1.0
    for name, colour, style, width, label in (
        ("num_workers", "tab:brown", "-", 2.4, "num_workers"),
        ("prefetch_factor", "tab:gray", "--", 1.5, "prefetch_factor"),
        ("val/num_workers", "tab:purple", ":", 2.0, "validation num_workers"),
    ):
        x, values = config_steps(*timeline.series(name))
        if not x:
            continue  # no validation runs measured
        ax.plot(x, values, drawstyle="steps-post", color=colour, linestyle=style, linewidth=width, label=label)
        top = max([top, *values])
    ax.set_ylim(-0.4, top + 0.8)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loader")
    ax.set_title("loader config: workers and prefetch (as they ran)", loc="left", fontsize=10)
    _legend(ax)


def save_timeline(figure: Any, path: str) -> str:
    """Write ``figure`` as a PNG at ``path`` (its directory made); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def fit_timeline(
    trainer: Any,
    history: Sequence[WindowRecord],
    directory: str,
    verbose: int,
    val_history: Sequence[WindowRecord] = (),
) -> Optional[str]:
    """At the end of a fit, on rank zero: the picture in ``directory`` and in TensorBoard's Images tab.

    Without matplotlib the console says once where to get it. A failure to draw is a warning, never an
    error: the fit is over and its results stand. Returns the PNG's path (``None`` when none was written).
    """
    if not plot_available():
        if verbose >= VERBOSE_LINE:
            say(trainer, f"[dltune] timeline picture skipped: {PLOT_MISSING}")
        return None
    band, tuning = _tuner_settings(trainer)
    try:
        title = f"dltune timeline: {run_label(directory)}"
        figure = draw_timeline(timeline_of(history, band, tuning, title, val_history))
        path = save_timeline(figure, os.path.join(directory, TIMELINE_FILE))
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure(TIMELINE_TAG, figure, lightning_step(trainer.global_step))
    except Exception as exc:  # a picture must not fail a finished fit: its results stand
        rank_zero_warn(f"DataLoaderTuner: the timeline picture failed ({type(exc).__name__}: {exc})")
        return None
    if verbose >= VERBOSE_LINE:
        say(trainer, f"[dltune] timeline picture written to {path}")
    return path


def _tuner_settings(trainer: Any) -> tuple[tuple[float, float], bool]:
    """The band and the ``tune`` flag of the fit's tuner (the callback holding :class:`PolicySettings`)."""
    for callback in getattr(trainer, "callbacks", ()):
        settings = getattr(callback, "settings", None)
        if isinstance(settings, PolicySettings):
            return settings.band, bool(getattr(callback, "tune", True))
    return PolicySettings().band, True
