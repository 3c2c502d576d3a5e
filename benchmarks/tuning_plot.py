"""``tuning.png``: per workload, samples/s per epoch of every strategy (utilization along the epoch for a
one-epoch workload), and a last panel of tuned / oracle fit time per workload and start against the target
(the mixin's tuned fits and, where the run has them, the project's own loaders').
"""

from __future__ import annotations

import math
from typing import Any

from phases import UTIL_BLOCK
from strategies import BAND, STRATEGIES, config_text
from targets import TARGET_TIME_RATIO

STYLES = {
    "default": ("tab:gray", "o", "-"),
    "rule": ("tab:brown", "s", "-"),
    "oracle": ("black", "D", "--"),
    "tuned_default": ("tab:blue", "^", "-"),
    "tuned_bad": ("tab:red", "v", "-"),
    "own_default": ("tab:cyan", "^", ":"),
    "own_bad": ("tab:orange", "v", ":"),
}  # (color, marker, line)


def write_plot(results: dict[str, Any], path: str) -> None:
    """The figure of ``results`` as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    panels = len(names) + 1
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        _workload_panel(ax, name, results["workloads"][name])
    _ratio_panel(axes.flat[len(names)], results, names)
    for extra in list(axes.flat)[panels:]:
        extra.axis("off")
    meta = results["meta"]
    fig.suptitle(
        f"lightning-dltune tuning benchmark ({meta['mode']}): samples/s per epoch, "
        f"{meta['machine']['usable_cpus']:g} CPUs, accelerator step emulated by a sleep",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _workload_panel(ax, name: str, w: dict[str, Any]) -> None:
    """One workload: samples/s per epoch of every strategy, or utilization along the epoch for a one-epoch one."""
    import matplotlib.ticker

    single = w.get("epochs") == 1  # one epoch: utilization along the epoch, from the batch clocks
    for key in STRATEGIES:
        s = w["strategies"].get(key, {"error": "not in these results"})
        if "error" in s:
            continue
        color, marker, ls = STYLES[key]
        label = s["label"] + (f" ({config_text(s['start_config'])})" if key in ("oracle", "rule") else "")
        ys = s.get("util_blocks") if single else s["samples_per_s"]
        xs = [UTIL_BLOCK * i for i in range(len(ys))] if single else range(len(ys))
        ax.plot(xs, ys, color=color, marker=marker, linestyle=ls, label=label, markersize=2 if single else 4)
    ax.set_title(f"{name}", fontsize=10)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("batch" if single else "epoch")
    ax.set_ylabel(f"utilization (per {UTIL_BLOCK} batches)" if single else "samples/s")
    if single:
        ax.axhspan(*BAND, color="tab:green", alpha=0.1)
        if w.get("phase_start"):
            ax.axvline(w["phase_start"], color="gray", linestyle=":", linewidth=1)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _ratio_panel(ax, results: dict[str, Any], names: list[str]) -> None:
    """The last panel: tuned / oracle fit time per workload and start, against the target."""
    xs = range(len(names))
    workloads = [results["workloads"][n] for n in names]
    bars = [("tuned", "from_default", "tab:blue"), ("tuned", "from_bad", "tab:red")]
    if any("own_loaders" in w for w in workloads):
        bars = [
            bars[0],
            ("own_loaders", "from_default", "tab:cyan"),
            bars[1],
            ("own_loaders", "from_bad", "tab:orange"),
        ]
    width = 0.8 / len(bars)
    for i, (part, start, color) in enumerate(bars):
        field = "tuned_over_oracle_time" if part == "tuned" else "own_over_oracle_time"
        values = [w.get(part, {}).get(start, {}).get(field) or 0 for w in workloads]
        offset = (i - (len(bars) - 1) / 2) * width
        label = f"{'tuned' if part == 'tuned' else 'own loaders, tuned'} {start.replace('_', ' ')}"
        ax.bar([x + offset for x in xs], values, width=width, color=color, label=label)
    ax.axhline(TARGET_TIME_RATIO, color="black", linestyle="--", linewidth=1, label=f"target {TARGET_TIME_RATIO:.2f}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=20, fontsize=8)
    ax.set_ylabel("tuned / oracle fit time (phase)")
    ax.set_title("fit time vs oracle (changing workloads: the phase after the change)", fontsize=9)
    ax.legend(fontsize=7)
