"""The TensorBoard custom-scalars layout: the ``dltune`` panels users open."""

from __future__ import annotations

import re

PREFIX = "dltune/"
RECENT = "recent/"  # the log_every_n_steps series: not "step/", which TensorBoard's filter mixes with step_ms

HEADLINE = "dltune: headline"
DETAIL = "dltune: detail"


def tag(name: str) -> str:
    return PREFIX + name


def utilization_title(estimate: bool) -> str:
    """The headline chart's title; where NVML cannot serve, it says the values are the estimate."""
    return "GPU busy (estimate) vs band: raw, judged" if estimate else "GPU utilization vs band: raw, judged"


def custom_scalars_layout(estimate: bool = False, recent: bool = False) -> dict[str, dict[str, list]]:
    """The layout for :meth:`torch.utils.tensorboard.SummaryWriter.add_custom_scalars`.

    Two categories, the headline first: utilization (raw and the value the verdict judged) against
    the band's edges, starvation, throughput and workers; then the detail. One unit per chart, so no series
    flattens another. ``estimate``: utilization is ``1 - starvation`` (no NVML), and the title says
    so. ``recent``: ``log_every_n_steps`` is on, so the ``dltune/recent/*`` series join their charts.
    Each tag is written as an anchored pattern: TensorBoard matches chart tags as regular expressions
    from the start, so ``dltune/gpu_util`` alone would also draw ``dltune/gpu_util_judged``.
    """
    return {
        category: {title: ["Multiline", [re.escape(t) + "$" for t in tags]] for title, tags in charts.items()}
        for category, charts in _charts(estimate, recent).items()
    }


def layout_tags(estimate: bool = False, recent: bool = False) -> list[str]:
    """Every scalar tag the layout draws."""
    return [t for charts in _charts(estimate, recent).values() for tags in charts.values() for t in tags]


def _charts(estimate: bool, recent: bool) -> dict[str, dict[str, list[str]]]:
    with_recent = (lambda *names: [tag(RECENT + n) for n in names]) if recent else (lambda *names: [])
    headline = {
        utilization_title(estimate): [tag("gpu_util"), tag("gpu_util_judged"), tag("band_low"), tag("band_high")],
        "starvation ratio (0-1)": [tag("starvation_ratio"), *with_recent("starvation_ratio")],
        "throughput (samples/s)": [tag("samples_per_s"), *with_recent("samples_per_s")],
        "workers (processes)": [tag("num_workers")],
    }
    detail = {
        "stall fraction (0-1 of fetches)": [tag("stall_fraction")],
        "fetch wait vs step time, hook to hook (ms)": [
            tag("fetch_wait_ms"),
            tag("step_ms"),
            tag("fetch_wait_p95_ms"),
            tag("step_p95_ms"),
        ],
        "stalls (fetches per window)": [tag("stalls")],
        "queue depth (ready batches)": [tag("queue_depth")],
        "prefetch factor (batches per worker)": [tag("prefetch_factor")],
        "rebuilds (config changes)": [tag("rebuilds")],
        "worker time per batch and start-up (ms)": [tag("worker_batch_ms"), tag("startup_ms")],
    }
    if recent:
        detail["recent steps: fetch wait vs step time (ms)"] = with_recent("fetch_wait_ms", "step_ms")
        detail["recent steps: stalls (fetches per interval)"] = with_recent("stalls")
    return {HEADLINE: headline, DETAIL: detail}
