"""What a user reads: the per-epoch console line, the end-of-fit table and the recommendation file."""

from __future__ import annotations

import io
import os
from typing import Optional, Sequence

import yaml

from lightning_dltune.config import LoaderConfig
from lightning_dltune.policy import EpochRecord

RECOMMENDATION_FILE = "dltune_recommendation.yaml"


def epoch_line(record: EpochRecord, tuning: bool) -> str:
    """One console line: config, utilization and its source, starvation, stalls, throughput, verdict, next."""
    s = record.stats
    if not record.changed:
        nxt = "keep"
    else:
        verb = "next" if tuning else "would try"
        nxt = f"{verb}: workers={record.next_config.num_workers} prefetch={record.next_config.prefetch_factor}"
    window = f"epoch {record.epoch}" + (f" (first {record.first_batches} batches)" if record.first_batches else "")
    return (
        f"[dltune] {window} | workers={record.config.num_workers} prefetch={record.config.prefetch_factor}"
        f" | util {s.utilization:.0%} ({s.util_source}) | starvation {s.starvation_ratio:.0%}"
        f" | stalls {s.stalls}/{s.fetches} | {s.samples_per_s:,.0f} samples/s | {record.verdict} | {nxt}"
        f" | {record.reason}"
    )


def recommend(history: Sequence[EpochRecord], min_gain: float = 0.05) -> Optional[EpochRecord]:
    """The epoch whose config to recommend: the cheapest config within ``min_gain`` of the best throughput."""
    measured = [r for r in history if r.stats.batches > 0]
    if not measured:
        return None
    best = max(r.samples_per_s for r in measured)
    near = [r for r in measured if r.samples_per_s >= (1.0 - min_gain) * best]
    return min(near, key=lambda r: (r.config.num_workers, r.config.prefetch_factor, -r.samples_per_s))


def summary_table(history: Sequence[EpochRecord], recommended: Optional[EpochRecord]) -> str:
    """The end-of-fit table of epochs (rendered with rich) and the recommended config."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lightning-dltune: loader tuning", title_justify="left")
    for column in ("epoch", "workers", "prefetch", "util", "source", "starvation", "stalls", "samples/s", "verdict"):
        table.add_column(column, justify="left" if column in ("source", "verdict") else "right")
    for r in history:
        s = r.stats
        table.add_row(
            f"{r.epoch} (first {r.first_batches})" if r.first_batches else str(r.epoch), str(r.config.num_workers), str(r.config.prefetch_factor), f"{s.utilization:.0%}",
            s.util_source, f"{s.starvation_ratio:.0%}", f"{s.stalls}/{s.fetches}", f"{s.samples_per_s:,.0f}", r.verdict,
        )
    buffer = io.StringIO()
    console = Console(file=buffer, width=120, force_terminal=False, color_system=None)
    console.print(table)
    if recommended is not None:
        console.print(
            f"recommended: {recommended.config.short()} "
            f"({recommended.samples_per_s:,.0f} samples/s at epoch {recommended.epoch})"
        )
    return buffer.getvalue().rstrip("\n")


def recommendation_yaml(config: LoaderConfig, note: str = "") -> str:
    """A LightningCLI config fragment: ``--config`` it after your own config to use the recommendation."""
    header = "# lightning-dltune recommendation: pass it after your config, e.g.\n"
    header += "#   dltune fit --config configs/demo.yaml --config dltune_recommendation.yaml\n"
    if note:
        header += f"# {note}\n"
    body = {"data": {"init_args": config.as_dict()}}
    return header + yaml.safe_dump(body, sort_keys=False)


def write_recommendation(directory: str, config: LoaderConfig, note: str = "") -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RECOMMENDATION_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(recommendation_yaml(config, note))
    return path
