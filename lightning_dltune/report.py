"""What a user reads: reasons in words, the per-window console line, the end-of-fit table, the recommendation."""

from __future__ import annotations

import io
import os
from typing import Any, Optional, Sequence

import yaml

from lightning_dltune.config import LoaderConfig
from lightning_dltune.history import best_config, median_rate
from lightning_dltune.records import Reason, ReasonKind, WindowRecord

RECOMMENDATION_FILE = "dltune_recommendation.yaml"


def epoch_line(record: WindowRecord, tuning: bool) -> str:
    """One console line: config, utilization and its source, starvation, stalls, throughput, verdict, next."""
    s = record.stats
    if not record.changed:
        nxt = "keep"
    else:
        verb = "next" if tuning else "would try"
        nxt = f"{verb}: workers={record.next_config.num_workers} prefetch={record.next_config.prefetch_factor}"
    window = f"epoch {record.epoch}" + (f" (to batch {record.end_batch})" if record.end_batch else "")
    return (
        f"[dltune] {window} | workers={record.config.num_workers} prefetch={record.config.prefetch_factor}"
        f" | util {s.utilization:.0%} ({s.util_source}) | starvation {s.starvation_ratio:.0%}"
        f" | stalls {s.stalls}/{s.fetches} | {s.samples_per_s:,.0f} samples/s | {record.verdict} | {nxt}"
        f" | {record.reason}"
    )


def decision_markdown(record: WindowRecord, tuning: bool) -> str:
    """The decision of one window as TensorBoard text (``dltune/decision``)."""
    verb = "rebuild with" if tuning else "would try"
    action = f"{verb} {record.next_config.short()}" if record.changed else "keep"
    window = f"epoch {record.epoch}" + (f", to batch {record.end_batch}" if record.end_batch else "")
    return f"**{window}**: {record.verdict}, {record.config.short()} → {action}  \n{record.reason}"


def recommend(history: Sequence[WindowRecord], min_gain: float = 0.05) -> Optional[WindowRecord]:
    """The window to cite for the recommended config: the median window of :func:`~lightning_dltune.history.best_config`."""
    best = best_config(history, min_gain)
    return None if best is None else median_rate(history, best)


def summary_table(history: Sequence[WindowRecord], recommended: Optional[WindowRecord]) -> str:
    """The end-of-fit table of epochs (rendered with rich) and the recommended config."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lightning-dltune: loader tuning", title_justify="left")
    for column in ("epoch", "workers", "prefetch", "util", "source", "starvation", "stalls", "samples/s", "verdict"):
        table.add_column(column, justify="left" if column in ("source", "verdict") else "right")
    for r in history:
        s = r.stats
        table.add_row(
            f"{r.epoch} (to {r.end_batch})" if r.end_batch else str(r.epoch), str(r.config.num_workers), str(r.config.prefetch_factor), f"{s.utilization:.0%}",
            s.util_source, f"{s.starvation_ratio:.0%}", f"{s.stalls}/{s.fetches}", f"{s.samples_per_s:,.0f}", r.verdict,
        )
    buffer = io.StringIO()
    console = Console(file=buffer, width=120, force_terminal=False, color_system=None)
    console.print(table)
    if recommended is not None:
        console.print(
            f"recommended: {recommended.config.short()} "
            f"({recommended.samples_per_s:,.0f} samples/s, its median window, epoch {recommended.epoch})"
        )
    return buffer.getvalue().rstrip("\n")


def recommendation_yaml(config: LoaderConfig, note: str = "") -> str:
    """A LightningCLI config fragment: ``--config`` it after your own config to use the recommendation.

    The values sit directly under ``data:``, the form that both ``dltune fit`` (the datamodule given
    as ``class_path``/``init_args``) and a user's own ``LightningCLI(Model, DataModule)`` accept.
    """
    header = "# lightning-dltune recommendation: pass it after your config, e.g.\n"
    header += "#   dltune fit --config configs/demo.yaml --config dltune_recommendation.yaml\n"
    header += "#   python train.py fit --config my.yaml --config dltune_recommendation.yaml   (your own LightningCLI)\n"
    if note:
        header += f"# {note}\n"
    body = {"data": config.as_dict()}
    return header + yaml.safe_dump(body, sort_keys=False)


def write_recommendation(directory: str, config: LoaderConfig, note: str = "") -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RECOMMENDATION_FILE)
    with open(path, "w", encoding="utf-8") as f:
        f.write(recommendation_yaml(config, note))
    return path


# ------------------------------------------------------------------------------------------------
# Reasons in words


def reason_text(reason: Reason) -> str:
    """One sentence for a :class:`~lightning_dltune.records.Reason`, with the numbers that drove it."""
    v = reason.values
    text = _WORDS.get(reason.kind, lambda v: v.get("text", str(reason.kind)))(v)
    if "budget_allows" in v:
        text += f"; the budget allows {_short(v['budget_allows'])}"
    if "shift" in v:
        signal, before, now = v["shift"]
        text = f"conditions changed ({signal} {_level(signal, before)} -> {_level(signal, now)}), judged afresh: {text}"
    return text


def _level(signal: str, value: float) -> str:
    return f"{value:.0%}" if signal == "starvation" else _ms(value)


def _contention(v: dict[str, Any]) -> str:
    return f"; the step itself got {v['step_ratio'] - 1:.0%} slower (a busy machine?)" if "step_ratio" in v else ""


def _over(windows: int) -> str:
    return f" over {windows} windows" if windows > 1 else ""


def _starved(v: dict[str, Any]) -> str:
    return f"starved {v['starvation']:.0%}{_over(v['windows'])}"


def _short(config: Sequence[int]) -> str:
    workers, prefetch = config
    return "0 workers" if workers == 0 else f"{workers} workers x prefetch {prefetch}"


def _change(before: Sequence[int], after: Sequence[int]) -> str:
    parts = []
    if before[0] != after[0]:
        parts.append(f"workers {before[0]} -> {after[0]}")
    if before[1] != after[1] and after[0]:
        parts.append(f"prefetch {before[1]} -> {after[1]}")
    return ", ".join(parts) or "the change"


def _ms(seconds: float) -> str:
    ms = seconds * 1000.0
    return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} GB"


def _memory(v: dict[str, Any]) -> str:
    if v.get("budget_bytes") is None:
        return "more than the memory budget"
    return f"{_bytes(v['bytes'])} of batches, over the {_bytes(v['budget_bytes'])} {v['budget']} budget"


def _cost(v: dict[str, Any]) -> str:
    return f"a worker needs {_ms(v['batch_s'])} per batch vs {_ms(v['step_s'])} step"


def _cpus(v: dict[str, Any]) -> str:
    return f"{v['cpus']:g} CPUs ({v['cpu_share']:.0%} CPU per batch)"


def _bursts(v: dict[str, Any]) -> str:
    enough = (
        f"{v['workers']} workers make {v['capacity_ratio']:.1f}x what the step eats"
        if v.get("capacity_ratio") is not None
        else "most fetches find a batch ready"
    )
    return (
        f"{_starved(v)} in bursts ({v['stall_fraction']:.0%} of fetches stall, {_ms(v['stall_s'])} each) though "
        f"{enough}: prefetch {v['prefetch']} -> {v['to_prefetch']}"
    )


def _in_band(v: dict[str, Any]) -> str:
    where = f"band {v['low']:.0%}-{v['high']:.0%}"
    if not v["inside"]:
        where = f"not clearly outside the {where}"
    return f"GPU {v['util']:.0%} busy{_over(v['windows'])} ({where}), starved {v['starvation']:.0%}: holding {_short(v['config'])}"


def _more_workers(v: dict[str, Any]) -> str:
    note = f", prefetch {v['prefetch']} -> {v['to_prefetch']} to fit memory" if v["to_prefetch"] != v["prefetch"] else ""
    return f"{_starved(v)} with {v['workers']} workers; {_cost(v)}: {v['to_workers']} workers{note}"


def _slack(v: dict[str, Any]) -> str:
    return f"GPU {v['util']:.0%} busy{_over(v['windows'])}, starved {v['starvation']:.1%}"


_WORDS = {
    ReasonKind.NOTHING_MEASURED: lambda v: "no training batches measured: holding",
    ReasonKind.OVER_MEMORY: lambda v: f"{_short(v['config'])} would hold {_memory(v)}: {_short(v['to'])}",
    ReasonKind.OVER_WORKERS: lambda v: (
        f"{v['workers']} workers pass the budget of {v['max_workers']}: {_short(v['to'])}"
    ),
    ReasonKind.OVER_PREFETCH: lambda v: (
        f"prefetch {v['prefetch']} passes the most allowed, {v['max_prefetch']}: {_short(v['to'])}"
    ),
    ReasonKind.REBUILD_CAP: lambda v: (
        f"rebuild cap hit ({v['rebuilds']} changes): holding {_short(v['config'])} at GPU {v['util']:.0%}"
    ),
    ReasonKind.UNDO_SLOWER: lambda v: (
        f"throughput fell {-v['gain']:.0%} ({v['rate_before']:.0f} -> {v['rate']:.0f} samples/s) after "
        f"{_change(v['from'], v['to'])}{_contention(v)}: going back"
    ),
    ReasonKind.UNDO_GIVE_BACK: lambda v: (
        f"giving back to {_short(v['config'])} dropped GPU to {v['util']:.0%} (band from {v['low']:.0%}), "
        f"starved {v['starvation']:.0%}: back to {_short(v['to'])}"
    ),
    ReasonKind.CONFIRM_SLOWER: lambda v: (
        f"throughput fell {-v['gain']:.0%} ({v['rate_before']:.0f} -> {v['rate']:.0f} samples/s) after "
        f"{_change(v['from'], v['to'])}{_contention(v)}: measuring again before going back"
    ),
    ReasonKind.CONFIRM_STARVED: lambda v: (
        f"giving back to {_short(v['config'])} dropped GPU to {v['util']:.0%}, starved {v['starvation']:.0%}: "
        "measuring again before going back"
    ),
    ReasonKind.CONFIRM_NO_GAIN: lambda v: (
        f"adding workers {v['from_workers']} -> {v['workers']} gained {v['gain']:+.0%} so far: measuring again"
    ),
    ReasonKind.COMPUTE_BOUND: lambda v: (
        f"GPU {v['util']:.0%} busy but starved only {v['starvation']:.1%}: the step is the bottleneck, "
        "more workers cannot help"
    ),
    ReasonKind.STOPPED_HELPING: lambda v: (
        f"adding workers {v['from_workers']} -> {v['workers']} gained {v['gain']:+.0%} (< {v['min_gain']:.0%}): "
        f"the pipeline is CPU-bound, staying at {v['workers']}"
    ),
    ReasonKind.DEEPER_PREFETCH: _bursts,
    ReasonKind.AT_WORKER_CEILING: lambda v: (
        f"{_starved(v)} with {v['workers']} workers, but adding workers stopped helping at {v['ceiling']}: "
        "the pipeline is CPU-bound"
    ),
    ReasonKind.OVERSUBSCRIBED: lambda v: (
        f"{_starved(v)}; {v['workers']} workers oversubscribe the {_cpus(v)}: the pipeline is CPU-bound, "
        f"{v['workers']} -> {v['to_workers']}"
    ),
    ReasonKind.CPUS_SATURATED: lambda v: (
        f"{_starved(v)}, but {v['workers']} workers already keep the {_cpus(v)} busy: the pipeline is CPU-bound"
    ),
    ReasonKind.AT_WORKER_BUDGET: lambda v: f"{_starved(v)}; {_cost(v)}, but {v['workers']} workers is the budget's most",
    ReasonKind.NO_MODELLED_GAIN: lambda v: (
        f"{_starved(v)}; {_cost(v)}, and {v['wanted']} workers would gain only {v['gain']:+.0%} on "
        f"{v['cpus']:g} CPUs: the pipeline is CPU-bound"
    ),
    ReasonKind.MEMORY_CAPPED_HOLD: lambda v: (
        f"{_starved(v)} with {v['workers']} workers and wants {v['wanted']}, but even {_short(v['config'])} "
        f"would hold {_memory(v)}: holding"
    ),
    ReasonKind.MORE_WORKERS_UNDONE: lambda v: f"{_starved(v)}; {_cost(v)}, but more workers were tried and undone: holding",
    ReasonKind.MEMORY_CAPPED_WORKERS: lambda v: (
        f"{_starved(v)} with {v['workers']} workers and wants {v['wanted']}, but {v['wanted']} workers would "
        f"hold {_memory(v)}: {_short(v['to'])}"
    ),
    ReasonKind.MORE_WORKERS: _more_workers,
    ReasonKind.GIVE_BACK_WORKERS: lambda v: (
        f"{_slack(v)}: the data side has slack, {v['to_workers']} workers should keep ~{v['predicted']:.0%}: "
        f"giving back {v['workers']} -> {v['to_workers']} workers"
        + (f", prefetch {v['prefetch']} -> {v['to_prefetch']}" if v.get("to_prefetch", v.get("prefetch")) != v.get("prefetch") else "")
    ),
    ReasonKind.GIVE_BACK_PREFETCH: lambda v: (
        f"{_slack(v)}: the data side has slack: prefetch {v['prefetch']} -> {v['to_prefetch']}"
    ),
    ReasonKind.SLACK_UNCONFIRMED: lambda v: f"{_slack(v)}: slack seen once, giving back after another window confirms it",
    ReasonKind.LEANEST: lambda v: f"{_slack(v)}: {_short(v['config'])} is the least that keeps the band, holding",
    ReasonKind.IN_BAND: _in_band,
}
