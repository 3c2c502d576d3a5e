"""The TensorBoard custom-scalars layout: the ``dltune`` panels users open, true at TensorBoard's default settings.

TensorBoard opens with smoothing 0.6 and "Ignore outliers in chart scaling" on, and most users never change
them. So every chart here is a *margin* chart, which TensorBoard never smooths (tensorboard#903), of series
logged for it under ``dltune_panels/`` (TensorBoard only; other loggers get the stable ``dltune/`` names):

- each window's value at the window's first and last step, so a config is drawn as the step it was and a
  measurement as the flat value it averaged over its steps, never a ramp between windows;
- a shaded area (a margin series' lower and upper edge) for the band around utilization, for the p50-p95
  spread of fetch wait and step time, and under a count from zero;
- the constants 0 and 1 (:data:`ZERO`, :data:`ONE`) as lines in every fraction chart: "ignore outliers"
  drops the lowest and highest 5 % of a chart's values before it picks the y range, so a fraction's axis
  is pinned to 0-1 by giving those two values a third of the chart's points each, and a starved window can
  no longer fall off it; a count's area starts at 0.

Colour in a TensorBoard chart is the run's, never the series', so what must be told apart at a glance
(utilization as measured, as judged, the band) is in separate charts or drawn as line against area.
"""

from __future__ import annotations

from typing import NamedTuple

from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
from tensorboard.plugins.custom_scalar import layout_pb2, metadata

PREFIX = "dltune/"
PANEL_PREFIX = "dltune_panels/"  # what the charts draw, apart from the stable names in TensorBoard's tag groups
RECENT = "recent/"  # the log_every_n_steps series: not "step/", which TensorBoard's filter mixes with step_ms

HEADLINE = "dltune: headline"
DETAIL = "dltune: detail"

PANEL_NAMES = (
    "gpu_util",
    "gpu_util_judged",
    "band_low",
    "band_high",
    "starvation_ratio",
    "samples_per_s",
    "num_workers",
    "prefetch_factor",
    "stall_fraction",
    "fetch_wait_ms",
    "fetch_wait_p50_ms",
    "fetch_wait_p95_ms",
    "step_ms",
    "step_p50_ms",
    "step_p95_ms",
    "stalls",
    "queue_depth",
    "worker_batch_ms",
    "startup_ms",
)
"""The window scalars (``dltune/<name>``) the panels draw, each logged again as ``dltune_panels/<name>``."""


def tag(name: str) -> str:
    return PREFIX + name


def panel_tag(name: str) -> str:
    """A series the panels draw: ``dltune_panels/<name>``, at each window's first and last step."""
    return PANEL_PREFIX + name


ZERO = panel_tag("zero")
ONE = panel_tag("one")
RECENT_ZERO = panel_tag(RECENT + "zero")  # the same constants at the log_every_n_steps points
RECENT_ONE = panel_tag(RECENT + "one")
RECENT_PEAKS = ("samples_per_s", "fetch_wait_ms", "step_ms", "stalls")
"""The ``dltune/recent/*`` counts whose charts also draw their highest value so far (:func:`peak_tag`)."""


def peak_tag(name: str) -> str:
    """The highest ``dltune/recent/<name>`` so far, at the same points: it holds a peak (the starved start's
    fetch wait) on the axis, where "ignore outliers" would drop a peak of a few points among many."""
    return panel_tag(RECENT + name + "_peak")


class Series(NamedTuple):
    """One margin series: a line (``value``) and the area between ``lower`` and ``upper`` (none where equal)."""

    value: str
    lower: str
    upper: str


def line(t: str) -> Series:
    return Series(t, t, t)


def area(t: str, zero: str = ZERO) -> Series:
    """``t`` as a line with the area from zero up to it shaded (so the axis always shows 0)."""
    return Series(t, zero, t)


def utilization_title(estimate: bool) -> str:
    """The timeline picture's utilization title; where NVML cannot serve, it says the values are the estimate."""
    return "GPU busy (estimate) vs band: raw, judged" if estimate else "GPU utilization vs band: raw, judged"


def utilization_titles(estimate: bool) -> tuple[str, str]:
    """The headline's first two charts: the utilization as measured per window, and as the verdict judged it."""
    name = "GPU busy (estimate)" if estimate else "GPU utilization"
    return f"{name} per window, band shaded", f"{name} judged (pooled), band shaded"


def custom_scalars_layout(estimate: bool = False, recent: bool = False) -> layout_pb2.Layout:
    """The layout :func:`~lightning_dltune.report.metrics.add_panels` writes (see :func:`layout_summary`).

    Two categories, the headline first: utilization against the band (as measured, as judged), starvation,
    throughput, workers and prefetch; then the detail. One unit per chart, so no series flattens another.
    ``estimate``: utilization is ``1 - starvation`` (no NVML), and the titles say so. ``recent``:
    ``log_every_n_steps`` is on, so the ``dltune/recent/*`` series get charts of their own in the detail.

    Each category's charts are written last first: TensorBoard's dashboard (2.x) stamps margin charts in
    the reverse of their order in the layout (its ``tf-dom-repeat`` inserts a chart before the element at
    the chart's index, and each chart brings two ``dom-if`` elements), so this way they read first to last.
    """
    return layout_pb2.Layout(
        category=[
            layout_pb2.Category(
                title=category,
                chart=[
                    layout_pb2.Chart(
                        title=title,
                        margin=layout_pb2.MarginChartContent(
                            series=[layout_pb2.MarginChartContent.Series(**s._asdict()) for s in series]
                        ),
                    )
                    for title, series in reversed(charts.items())
                ],
            )
            for category, charts in _charts(estimate, recent).items()
        ]
    )


def displayed_titles(layout: layout_pb2.Layout) -> dict[str, list[str]]:
    """Each category's chart titles in the order TensorBoard shows them (see :func:`custom_scalars_layout`)."""
    return {c.title: [chart.title for chart in reversed(c.chart)] for c in layout.category}


def layout_summary(layout: layout_pb2.Layout) -> Summary:
    """``layout`` as the summary TensorBoard's custom-scalars plugin reads (torch's ``add_custom_scalars``
    writes the same, but takes one series per margin chart)."""
    tensor = TensorProto(dtype="DT_STRING", string_val=[layout.SerializeToString()], tensor_shape=TensorShapeProto())
    value = Summary.Value(tag=metadata.CONFIG_SUMMARY_TAG, tensor=tensor, metadata=metadata.create_summary_metadata())
    return Summary(value=[value])


def layout_tags(estimate: bool = False, recent: bool = False) -> list[str]:
    """Every scalar tag the layout draws, once each."""
    charts = [series for category in _charts(estimate, recent).values() for series in category.values()]
    return list(dict.fromkeys(t for series in charts for s in series for t in s))


def _charts(estimate: bool, recent: bool) -> dict[str, dict[str, list[Series]]]:
    p = panel_tag
    fraction = [line(ZERO), line(ONE)]
    in_band = lambda name: Series(p(name), p("band_low"), p("band_high"))
    spread = lambda name: Series(p(name + "_ms"), p(name + "_p50_ms"), p(name + "_p95_ms"))
    measured, judged = utilization_titles(estimate)
    headline = {
        measured: [in_band("gpu_util"), *fraction],
        judged: [in_band("gpu_util_judged"), *fraction],
        "starvation ratio (0-1) per window": [area(p("starvation_ratio")), line(ONE)],
        "throughput (samples/s) per window": [area(p("samples_per_s"))],
        "workers (processes) as they ran": [area(p("num_workers"))],
        "prefetch factor (batches per worker)": [area(p("prefetch_factor"))],
    }
    detail = {
        "stall fraction (0-1 of fetches)": [area(p("stall_fraction")), line(ONE)],
        "fetch wait per batch (ms): mean, p50-p95": [spread("fetch_wait"), line(ZERO)],
        "step time, hook to hook (ms): mean, p50-p95": [spread("step"), line(ZERO)],
        "stalls (fetches per window)": [area(p("stalls"))],
        # tags only some loaders log are drawn as lines: a margin series missing only some of its tags warns
        "queue depth (ready batches)": [line(p("queue_depth")), line(ZERO)],
        "worker time per batch (ms)": [line(p("worker_batch_ms")), line(ZERO)],
        "loader start-up per window (ms)": [area(p("startup_ms"))],
    }
    if recent:
        r = lambda name: line(tag(RECENT + name))
        zero, one = line(RECENT_ZERO), line(RECENT_ONE)
        peak = lambda name: line(peak_tag(name))
        detail["recent steps: starvation ratio (0-1)"] = [r("starvation_ratio"), zero, one]
        detail["recent steps: throughput (samples/s), peak so far"] = [r("samples_per_s"), peak("samples_per_s"), zero]
        detail["recent steps: fetch wait (ms), peak so far"] = [r("fetch_wait_ms"), peak("fetch_wait_ms"), zero]
        detail["recent steps: step time (ms), peak so far"] = [r("step_ms"), peak("step_ms"), zero]
        detail["recent steps: stalls (per interval), peak so far"] = [r("stalls"), peak("stalls"), zero]
    return {HEADLINE: headline, DETAIL: detail}
