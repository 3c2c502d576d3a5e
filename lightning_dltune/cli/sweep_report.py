"""What ``dltune sweep`` shows and writes: the console table, the JSON file and the heatmap PNG."""

from __future__ import annotations

import io
import json

from lightning_dltune.cli.sweep import SweepResult
from lightning_dltune.report.words import byte_text, console_text

JSON_FILE = "dltune_sweep.json"
HEATMAP_FILE = "dltune_sweep.png"


def step_text(result: SweepResult) -> str:
    """The step and where it came from: ``31.6 ms (median of 10 steps, 31-680 ms)`` or ``30.0 ms (--step_ms)``."""
    samples = result.step_samples_ms
    if not samples:
        return f"{result.step_ms:.1f} ms ({result.step_source})"
    return f"{result.step_ms:.1f} ms (median of {len(samples)} steps, {min(samples):.0f}-{max(samples):.0f} ms)"


def sweep_table(result: SweepResult) -> str:
    """The per-point table (rich) and the recommendation, as the console shows them."""
    from rich.console import Console
    from rich.table import Table

    show_pin = len({p.config.pin_memory for p in result.points}) > 1
    rec = result.recommended
    table = Table(title=f"dltune sweep: train loader alone, step {step_text(result)}", title_justify="left")
    columns = [
        "workers",
        "prefetch",
        *(["pin"] if show_pin else []),
        "samples/s",
        "ms/batch",
        "start-up",
        "worker CPU",
        "peak memory",
        "/dev/shm",
        "starvation*",
        "fit samples/s*",
        "pick",
    ]
    for column in columns:
        table.add_column(column, justify="right", no_wrap=True)
    for p in result.points:
        c = p.config
        table.add_row(
            str(c.num_workers),
            str(c.prefetch_factor) if c.num_workers else "-",
            *(["on" if c.pin_memory else "off"] if show_pin else []),
            f"{p.samples_per_s:,.0f}",
            f"{p.loader_ms_per_batch:.1f}",
            f"{p.startup_s:.2f} s",
            f"{p.worker_cpu_cores:.2f}",
            byte_text(p.peak_memory_bytes),
            byte_text(p.shm_bytes),
            f"{p.predicted_starvation:.0%}",
            f"{p.fit_samples_per_s:,.0f}",
            "<-" if p is rec else "",
        )
    buffer = io.StringIO()
    console = Console(file=buffer, width=160, force_terminal=False, color_system=None)
    console.print(table)
    console.print("* predicted for a fit with this step (workers hide the loader behind it; 0 workers cannot)")
    for config, why in result.skipped:
        console.print(f"skipped workers={config.num_workers} prefetch={config.prefetch_factor}: {why}")
    if rec is not None:
        best = max(p.fit_samples_per_s for p in result.points)
        console.print(
            f"recommended: {rec.config.short()}: the leanest within {result.min_gain:.0%} of the best"
            f" predicted fit ({rec.fit_samples_per_s:,.0f} of {best:,.0f} samples/s;"
            f" starvation {rec.predicted_starvation:.0%})"
        )
    return console_text(buffer)


def write_json(result: SweepResult, path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.as_dict(), f, indent=2)
    return path


def write_heatmap(result: SweepResult, path: str) -> str:
    """A workers x prefetch heatmap of samples/s (the best over ``pin_memory``); the pick is boxed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    workers = sorted({p.config.num_workers for p in result.points})
    prefetch = sorted({p.config.prefetch_factor for p in result.points if p.config.num_workers}) or [1]
    grid = np.full((len(workers), len(prefetch)), np.nan)
    for p in result.points:
        row = workers.index(p.config.num_workers)
        cols = [0] if not p.config.num_workers else [prefetch.index(p.config.prefetch_factor)]
        for col in cols:
            grid[row, col] = np.fmax(grid[row, col], p.samples_per_s)
    # at least wide enough for the two-line title, a one-column grid included
    fig, ax = plt.subplots(figsize=(max(3.6, 1.6 + 1.3 * len(prefetch)), 1.4 + 0.6 * len(workers)))
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis", aspect="auto", origin="lower")
    low, high = np.nanmin(grid), np.nanmax(grid)
    for (row, col), value in np.ndenumerate(grid):
        if np.isnan(value):
            ax.text(col, row, "n/a", ha="center", va="center", color="grey", fontsize=9)
            continue
        bright = high > low and (value - low) / (high - low) > 0.6  # viridis turns yellow: dark text reads
        ax.text(col, row, f"{value:,.0f}", ha="center", va="center", color="black" if bright else "white", fontsize=9)
    rec = result.recommended
    if rec is not None:
        row = workers.index(rec.config.num_workers)
        col = prefetch.index(rec.config.prefetch_factor) if rec.config.num_workers else 0
        ax.add_patch(plt.Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2))
    ax.set_xticks(range(len(prefetch)), [str(p) for p in prefetch])
    ax.set_yticks(range(len(workers)), [f"{w} (main)" if w == 0 else str(w) for w in workers])
    ax.set_xlabel("prefetch_factor")
    ax.set_ylabel("num_workers")
    ax.set_title(f"samples/s, train loader alone\n(step {result.step_ms:.0f} ms)", fontsize=10)
    fig.colorbar(image, ax=ax, label="samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
