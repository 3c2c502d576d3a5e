"""What a user reads: reasons in words, the per-window console line, the end-of-fit table."""

from __future__ import annotations

import io
from typing import Any, Mapping, Optional, Sequence

from lightning_dltune.core.history import OTHERS
from lightning_dltune.core.records import Reason, ReasonKind, WindowRecord
from lightning_dltune.core.stats import UtilSource

VERBOSE_LINE = 1
"""``verbose`` level of one short line per window and the end-of-fit table."""
VERBOSE_REASON = 2
"""``verbose`` level that also prints each window's numbers and reason on a second line."""

STEP_NOTE = "on_train_batch_start to on_train_batch_end (hook to hook: forward, backward, optimizer, callbacks)"


def is_estimate(record: WindowRecord) -> bool:
    """Whether the window's utilization is the estimate ``1 - starvation`` (no NVML)."""
    return str(record.stats.util_source) == UtilSource.ESTIMATE.value


def window_label(record: WindowRecord) -> str:
    """``epoch 3`` for a window that closed at the epoch end, ``epoch 0 to batch 10`` mid-epoch."""
    return f"epoch {record.epoch}" + (f" to batch {record.end_batch}" if record.end_batch else "")


def utilization_words(record: WindowRecord) -> str:
    """``GPU 91% busy, starved 4%`` (NVML) or ``GPU busy 45% (estimate)`` (that is, starved 55%)."""
    s = record.stats
    if is_estimate(record):
        return f"GPU busy {s.utilization:.0%} (estimate)"
    return f"GPU {s.utilization:.0%} busy, starved {s.starvation_ratio:.0%}"


def config_change(record: WindowRecord) -> str:
    """``workers 0 -> 4, prefetch 2``: the config the window ran, and what changes next (``->``)."""
    before, after = record.config, record.next_config
    workers = f"workers {before.num_workers}" + (
        f" -> {after.num_workers}" if after.num_workers != before.num_workers else ""
    )
    prefetch = f"prefetch {before.prefetch_factor}" + (
        f" -> {after.prefetch_factor}" if after.prefetch_factor != before.prefetch_factor else ""
    )
    other = [
        f"{k} -> {v}"
        for k, v in after.as_dict().items()
        if k not in ("num_workers", "prefetch_factor") and before.as_dict()[k] != v
    ]
    return ", ".join([workers, prefetch, *other])


def window_line(record: WindowRecord, tuning: bool, verbose: int = VERBOSE_LINE) -> str:
    """The console line of one window, about 120 characters: where, config (and change), utilization, verdict.

    ``verbose=2`` adds a second line: throughput, fetch wait against step time (measured hook to
    hook) and the reason in words. Without ``tuning`` a change is what the tuner would try.
    """
    change = "" if tuning or not record.changed else " (would try)"
    line = (
        f"[dltune] {window_label(record)} | {config_change(record)}{change} | {utilization_words(record)}"
        f" | {record.verdict}"
    )
    if verbose < VERBOSE_REASON:
        return line
    s = record.stats
    return (
        f"{line}\n[dltune]   {s.samples_per_s:,.0f} samples/s, fetch wait {_ms(s.fetch_wait_mean_s)} vs step"
        f" {_ms(s.step_mean_s)} (hook to hook); {record_reason(record)}"
    )


def record_reason(record: WindowRecord) -> str:
    """The window's reason in words, saying ``(estimate)`` where its utilization is one."""
    reason = record.reason
    return reason_text(reason, estimate=is_estimate(record)) if isinstance(reason, Reason) else str(reason)


def decision_markdown(record: WindowRecord, tuning: bool) -> str:
    """The decision of one window as TensorBoard text (``dltune/decision``)."""
    verb = "rebuild with" if tuning else "would try"
    action = f"{verb} {record.next_config.short()}" if record.changed else "keep"
    judged = "" if record.judged_util is None else f", judged {record.judged_util:.0%}"
    starved = f", starved {record.stats.starvation_ratio:.0%}" if is_estimate(record) else ""
    return (
        f"**{window_label(record)}**: {record.verdict}, {record.config.short()} → {action}  \n"
        f"{utilization_words(record)}{judged}{starved}, {record.stats.samples_per_s:,.0f} samples/s  \n"
        f"{record_reason(record)}"
    )


def batch_ranges(history: Sequence[WindowRecord]) -> list[str]:
    """Each window's batches within its epoch, ``1-10`` or ``11-end`` (counted from 1)."""
    ranges, start, epoch = [], 1, None
    for r in history:
        if r.epoch != epoch:
            start, epoch = 1, r.epoch
        ranges.append(f"{start}-{r.end_batch if r.end_batch else 'end'}")
        start = (r.end_batch or 0) + 1
    return ranges


def console_text(buffer: io.StringIO) -> str:
    """What a Rich console wrote to ``buffer``, without the spaces it pads each line with to its width."""
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip("\n").split("\n"))


def summary_table(history: Sequence[WindowRecord], recommended: Optional[WindowRecord]) -> str:
    """The end-of-fit table, one row per window, and the recommended config (rendered with rich)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="lightning-dltune: loader tuning",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    columns = (
        "epoch",
        "batches",
        "workers",
        "prefetch",
        "GPU busy",
        "judged",
        "starved",
        "step ms",
        "samples/s",
        "verdict",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("batches", "verdict") else "right")
    for r, batches in zip(history, batch_ranges(history)):
        s, est = r.stats, "~" if is_estimate(r) else ""
        judged = "" if r.judged_util is None else f"{est}{r.judged_util:.0%}"
        table.add_row(
            str(r.epoch),
            batches,
            str(r.config.num_workers),
            str(r.config.prefetch_factor),
            f"{est}{s.utilization:.0%}",
            judged,
            f"{s.starvation_ratio:.0%}",
            f"{1e3 * s.step_mean_s:,.0f}",
            f"{s.samples_per_s:,.0f}",
            str(r.verdict),
        )
    buffer = io.StringIO()
    console = Console(file=buffer, width=120, force_terminal=False, color_system=None)
    console.print(table)
    notes = [
        "judged: the GPU busy value the verdict judged (this window pooled with the config's recent ones)",
        f"step ms: mean of {STEP_NOTE}",
    ]
    if any(is_estimate(r) for r in history):
        notes.append("~: an estimate, 1 - starved (no NVML: the GPU is taken to idle while the loop waits for data)")
    for note in notes:
        console.print(note)
    if recommended is not None:
        console.print(
            f"recommended: {recommended.config.short()} "
            f"({recommended.samples_per_s:,.0f} samples/s, its median window: {window_label(recommended)})"
        )
    return console_text(buffer)


# ------------------------------------------------------------------------------------------------
# Reasons in words


def reason_text(reason: Reason, estimate: bool = False) -> str:
    """One sentence for a :class:`~lightning_dltune.core.records.Reason`, with the numbers that drove it.

    ``estimate``: the utilization it cites is ``1 - starvation`` (no NVML) and is worded as one.
    """
    v = {**reason.values, _ESTIMATE: estimate}
    text = _WORDS.get(reason.kind, lambda v: v.get("text", str(reason.kind)))(v)
    if "budget_allows" in v:
        text += f"; the budget allows {_short(v['budget_allows'])}"
    if "shift" in v:
        signal, before, now = v["shift"]
        newest = f", its newest batches ~{_ms(v['shift_newest'])}" if "shift_newest" in v else ""
        moved = f"{signal} {_level(signal, before)} -> {_level(signal, now)}{newest}"
        text = f"conditions changed ({moved}), judged afresh: {text}"
    return text


def _level(signal: str, value: float) -> str:
    if signal == "starvation":
        return f"{value:.0%}"
    return f"{value:.1f}" if signal == OTHERS else _ms(value)


def _contention(v: dict[str, Any]) -> str:
    return f"; the step itself got {v['step_ratio'] - 1:.0%} slower (a busy machine?)" if "step_ratio" in v else ""


def _split(v: dict[str, Any]) -> str:
    if "split" not in v:
        return ": measuring again before going back"
    gains = ", ".join(f"{g:+.0%}" for g in v["split"])
    return f", but its windows disagree ({gains}): the conditions moved, measuring it again on the windows after them"


def _tail(v: dict[str, Any]) -> str:
    return f", a heavy tail's {v['tail_ms']:.0f} ms of stalls a batch counted on both" if "tail_ms" in v else ""


_ESTIMATE = "_estimate"  # not a value of the reason: how to word its utilization


def _busy(v: dict[str, Any]) -> str:
    """``GPU 94% busy``, or ``GPU busy 94% (estimate)`` where there is no NVML."""
    return f"GPU busy {v['util']:.0%} (estimate)" if v.get(_ESTIMATE) else f"GPU {v['util']:.0%} busy"


def _gpu(v: dict[str, Any]) -> str:
    """``GPU 94%``, or ``GPU 94% (estimate)``."""
    return f"GPU {v['util']:.0%}" + (" (estimate)" if v.get(_ESTIMATE) else "")


def _over(windows: int) -> str:
    return f" over {windows} windows" if windows > 1 else ""


def _starved(v: dict[str, Any]) -> str:
    return f"starved {v['starvation']:.0%}{_over(v['windows'])}"


def _workers(n: int) -> str:
    return f"{n} worker" + ("" if n == 1 else "s")


def _batches(n: int) -> str:
    return f"{n} batch" + ("" if n == 1 else "es")


def _worker_budget(v: Mapping[str, Any], max_workers: int) -> str:
    """The worker budget, and why it is that low where a run's batches set it."""
    if v.get("run_batches") is not None:
        return f"the {max_workers} a run of {_batches(v['run_batches'])} gives work to"
    return f"the budget of {max_workers}"


def _short(config: Sequence[int]) -> str:
    workers, prefetch = config
    if workers == 0:
        return "0 workers"
    return f"{_workers(workers)} x prefetch {prefetch}"


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


def byte_text(n: float) -> str:
    """Bytes as a short MiB (or KiB) string: ``1,234 MiB``, ``180 KiB``."""
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def _memory(v: dict[str, Any]) -> str:
    if v.get("budget_bytes") is None:
        return "more than the memory budget"
    return over_memory_text(v["bytes"], v["budget_bytes"], v["budget"])


def over_memory_text(used: float, allowed: float, budget: str) -> str:
    """``12 MiB of batches, over the 8 MiB /dev/shm budget`` (``budget``: ``memory`` or ``/dev/shm``)."""
    return f"{byte_text(used)} of batches, over the {byte_text(allowed)} {budget} budget"


def _cost(v: dict[str, Any]) -> str:
    return f"a worker needs {_ms(v['batch_s'])} per batch vs a {_ms(v['step_s'])} step (hook to hook)"


def _cpus(v: dict[str, Any]) -> str:
    return f"{v['cpus']:g} CPUs ({v['cpu_share']:.0%} CPU per batch)"


def _bursts(v: dict[str, Any]) -> str:
    enough = (
        f"{_workers(v['workers'])} make {v['capacity_ratio']:.1f}x what the step eats"
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
    held = f"{_busy(v)}{_over(v['windows'])} ({where}), starved {v['starvation']:.0%}: holding {_short(v['config'])}"
    unpaid = v.get("unpaid")
    if unpaid is None:
        return held
    if not unpaid["left"]:
        return f"{held} (the fit ends here: {_short(unpaid['to'])} would not pay for a rebuild)"
    return (
        f"{held} ({_short(unpaid['to'])} would win back at most {unpaid['gain_s']:.2f} s of waiting in the fit's"
        f" {unpaid['left']} batches left, under twice a rebuild's {unpaid['cost_s']:.2f} s)"
    )


def _more_workers(v: dict[str, Any]) -> str:
    if v.get("sized_by") == "probe":  # the CPUs are busy; whether sharing the work out otherwise pays is measured
        note = f" x prefetch 1 (one batch in flight a worker, {v['workers'] * v['prefetch']} in flight before),"
        note += " measured once: the CPUs are busy, but how the work shares out is not modelled"
        return (
            f"{_starved(v)} with {_short((v['workers'], v['prefetch']))}; {_cost(v)}: {_workers(v['to_workers'])}{note}"
        )
    note = (
        f", prefetch {v['prefetch']} -> {v['to_prefetch']} to fit memory" if v["to_prefetch"] != v["prefetch"] else ""
    )
    if v.get("sized_by") == "delivery":  # the model saw no gain; the loop's own delivery says try one step up
        if "others" in v:  # the cores have room, though other processes take some of them
            note += f", a step up to measure (this job leaves the CPUs free; other processes take {v['others']:.1f})"
        else:
            note += ", a step up to measure (the CPUs are not busy)"
    return f"{_starved(v)} with {_workers(v['workers'])}; {_cost(v)}: {_workers(v['to_workers'])}{note}"


def _oversubscribed(v: dict[str, Any]) -> str:
    head = f"{_starved(v)}; {_workers(v['workers'])} oversubscribe the {_cpus(v)}: the pipeline is CPU-bound, "
    if not v.get("cpu_bound", True):  # the budget's most, the CPUs not measured busy: the cut is a measurement
        head = (
            f"{_starved(v)}; {_workers(v['workers'])}, the budget's most, are more than the {_cpus(v)} are counted "
            "to carry: measuring "
        )
    if "to" not in v:  # a reason recorded before the cut carried its config
        return head + f"{v['workers']} -> {v['to_workers']}"
    to_workers, to_prefetch = v["to"]
    if to_workers == v["workers"]:
        return head + f"prefetch {v['prefetch']} -> {to_prefetch} (the queue is empty whatever its depth)"
    return head + f"{_short((v['workers'], v['prefetch']))} -> {_short(v['to'])}"


def _lost(v: dict[str, Any]) -> str:
    """The utilization a give-back lost, where it is known (``gain``: the change in utilization)."""
    gain = v.get("gain")
    return f", {-gain:.0%} of the utilization lost" if gain is not None and gain < 0 else ""


def _slack(v: dict[str, Any]) -> str:
    return f"{_busy(v)}{_over(v['windows'])}, starved {v['starvation']:.1%}"


_WORDS = {
    ReasonKind.NOTHING_MEASURED: lambda v: "no training batches measured: holding",
    ReasonKind.FEW_BATCHES: lambda v: (
        f"{v['batches']} batch{'' if v['batches'] == 1 else 'es'} measured with {_short(v['config'])}"
        f"{' over ' + str(v['windows']) + ' runs' if v['windows'] > 1 else ''}, {v['fewest']} needed to judge: holding"
    ),
    ReasonKind.OVER_MEMORY: lambda v: f"{_short(v['config'])} would hold {_memory(v)}: {_short(v['to'])}",
    ReasonKind.OVER_WORKERS: lambda v: (
        f"{_workers(v['workers'])} exceed {_worker_budget(v, v['max_workers'])}: {_short(v['to'])}"
    ),
    ReasonKind.OVER_PREFETCH: lambda v: (
        f"prefetch {v['prefetch']} exceeds the most allowed, {v['max_prefetch']}: {_short(v['to'])}"
    ),
    ReasonKind.REBUILD_CAP: lambda v: (
        f"rebuild cap hit ({v['rebuilds']} changes): holding {_short(v['config'])} at {_gpu(v)}"
    ),
    ReasonKind.UNDO_SLOWER: lambda v: (
        f"throughput fell {-v['gain']:.0%} ({v['rate_before']:.0f} -> {v['rate']:.0f} samples/s{_tail(v)}) after "
        f"{_change(v['from'], v['to'])}{_contention(v)}: going back"
    ),
    ReasonKind.UNDO_GIVE_BACK: lambda v: (
        f"giving back to {_short(v['config'])} dropped {_gpu(v)} (band from {v['low']:.0%}), "
        f"starved {v['starvation']:.0%}{_lost(v)}: back to {_short(v['to'])}"
    ),
    ReasonKind.SHIFT_SUSPECTED: lambda v: (
        f"{v['signal']} {_level(v['signal'], v['before'])} -> {_level(v['signal'], v['now'])} in this window alone: "
        f"holding {_short(v['config'])}, measuring again before acting"
    ),
    ReasonKind.CONFIRM_SLOWER: lambda v: (
        f"throughput fell {-v['gain']:.0%} ({v['rate_before']:.0f} -> {v['rate']:.0f} samples/s{_tail(v)}) after "
        f"{_change(v['from'], v['to'])}{_contention(v)}{_split(v)}"
    ),
    ReasonKind.CONFIRM_STARVED: lambda v: (
        f"giving back to {_short(v['config'])} dropped {_gpu(v)}, starved {v['starvation']:.0%}{_lost(v)}: "
        "measuring again before going back"
    ),
    ReasonKind.CONFIRM_NO_GAIN: lambda v: (
        f"adding workers {v['from_workers']} -> {v['workers']} gained {v['gain']:+.0%} so far: measuring again"
    ),
    ReasonKind.COMPUTE_BOUND: lambda v: (
        f"{_busy(v)} but starved only {v['starvation']:.1%}: the step is the bottleneck, more workers cannot help"
    ),
    ReasonKind.STOPPED_HELPING: lambda v: (
        f"adding workers {v['from_workers']} -> {v['workers']} gained {v['gain']:+.0%} (< {v['min_gain']:.0%}): "
        + (
            f"the pipeline is CPU-bound, back to {_short(v['to'])} (the CPUs are busy)"
            if "to" in v and v.get("cpu_bound", True)
            else f"more workers do not pay here though the CPUs are not busy, back to {_short(v['to'])}: as fast "
            "with less"
            if "to" in v
            else f"the pipeline is CPU-bound, staying at {v['workers']}"
            if v.get("cpu_bound", True)
            else f"more workers do not pay here though the CPUs are not busy, staying at {v['workers']}"
        )
    ),
    ReasonKind.DEEPER_PREFETCH: _bursts,
    ReasonKind.AT_WORKER_CEILING: lambda v: (
        f"{_starved(v)} with 0 workers, but taking a batch from a worker cost the loop more than making it: holding"
        if v["ceiling"] == 0
        else f"{_starved(v)} with {_workers(v['workers'])}, but adding workers stopped helping at {v['ceiling']}"
        + (": the pipeline is CPU-bound" if v.get("cpu_bound", True) else " (the CPUs are not busy): holding")
    ),
    ReasonKind.OVERSUBSCRIBED: _oversubscribed,
    ReasonKind.CPUS_SATURATED: lambda v: (
        f"{_starved(v)}, but the {v['cpus']:g} CPUs are busy, other processes take {v['others']:.1f} of them: holding "
        f"{_workers(v['workers'])}"
        if "others" in v
        else f"{_starved(v)}, but {_workers(v['workers'])} already keep the {_cpus(v)} busy: the pipeline is CPU-bound"
        if v.get("cpu_bound", True)
        else f"{_starved(v)}, and {_workers(v['workers'])} are as many as the {_cpus(v)} are counted to take: holding"
    ),
    ReasonKind.AT_WORKER_BUDGET: lambda v: (
        f"{_starved(v)}; {_cost(v)}, but "
        + (
            f"a run of {_batches(v['run_batches'])} gives work to no more workers: holding"
            if v.get("run_batches") is not None
            else f"{_workers(v['workers'])} is the budget's most"
        )
    ),
    ReasonKind.NO_MODELLED_GAIN: lambda v: (
        f"{_starved(v)}; {_cost(v)}, and {_workers(v['wanted'])} would gain only {v['gain']:+.0%} on "
        f"{v['cpus']:g} CPUs: "
        + (
            f"the cores are busy, other processes take {v['others']:.1f} of them"
            if "others" in v
            else "the pipeline is CPU-bound"
            if v.get("cpu_bound", True)
            else "too little for a window to tell from noise"
        )
    ),
    ReasonKind.MEMORY_CAPPED_HOLD: lambda v: (
        f"{_starved(v)} with {_workers(v['workers'])} and wants {v['wanted']}, but even {_short(v['config'])} "
        f"would hold {_memory(v)}: holding"
    ),
    ReasonKind.HANDED_OVER: lambda v: (
        f"{_starved(v)} though a batch was ready at "
        + ("every fetch" if v.get("ready", 1.0) >= 1.0 else f"{v['ready']:.0%} of fetches")
        + ": taking one from a worker cost the loop "
        f"{_ms(v['wait_s'])}, making it in the loop should cost ~{_ms(v['batch_s'])} ({v['gain']:+.0%} expected): "
        f"{_workers(v['workers'])} -> 0 workers"
    ),
    ReasonKind.MORE_WORKERS_UNDONE: lambda v: (
        f"{_starved(v)}; {_cost(v)}, but more workers were tried and undone: holding"
    ),
    ReasonKind.MEMORY_CAPPED_WORKERS: lambda v: (
        f"{_starved(v)} with {_workers(v['workers'])} and wants {v['wanted']}, but {_workers(v['wanted'])} would "
        f"hold {_memory(v)}: {_short(v['to'])}"
    ),
    ReasonKind.MORE_WORKERS: _more_workers,
    ReasonKind.GIVE_BACK_WORKERS: lambda v: (
        f"{_slack(v)}: the data side has slack, {_workers(v['to_workers'])} should keep ~{v['predicted']:.0%}: "
        f"giving back {v['workers']} -> {_workers(v['to_workers'])}"
        + (
            f", prefetch {v['prefetch']} -> {v['to_prefetch']}"
            if v.get("to_prefetch", v.get("prefetch")) != v.get("prefetch")
            else ""
        )
    ),
    ReasonKind.GIVE_BACK_PREFETCH: lambda v: (
        f"{_slack(v)}: the data side has slack: prefetch {v['prefetch']} -> {v['to_prefetch']}"
    ),
    ReasonKind.SLACK_UNCONFIRMED: lambda v: (
        f"{_slack(v)}: slack seen once, giving back after another window confirms it"
    ),
    ReasonKind.LEANEST: lambda v: f"{_slack(v)}: {_short(v['config'])} is the least that keeps the band, holding",
    ReasonKind.IN_BAND: _in_band,
}
