"""The band policy's rules: a pure function from what a window looked like to the next loader config.

No torch, no Lightning. The rules use the performance model (:mod:`lightning_dltune.core.model`) and the
fit's history (:mod:`lightning_dltune.core.history`), and return a structured
:class:`~lightning_dltune.core.records.Reason` (a kind and its numbers) that :mod:`lightning_dltune.report.words`
puts into words.

How :func:`decide` thinks, first rule that applies wins:

1. **Budgets.** A config over ``Budget.max_workers``, the prefetch memory budget or the ``/dev/shm``
   budget is never kept nor picked (prefetch gives way first, then workers).
2. **New conditions, suspected.** One window unlike the config's earlier ones (a worker's time per
   batch off by more than half, the step time by more than a tenth, each beyond three standard
   deviations; see :func:`~lightning_dltune.core.history.detect_shift`): hold and measure again. Two in a
   row that agree are new conditions: what was learned before them is dropped
   (:func:`~lightning_dltune.core.history.recall`) and the rules below judge them alone.
3. **Rebuild cap.** After ``max_rebuilds`` changes under the same conditions, nothing changes any more.
4. **Judge the last change, on two windows.** More workers or deeper prefetch that lowered throughput
   by more than ``min_gain``, or a give-back that left the loop starved below the band, is measured
   again, then undone. An undone config is not tried again under the same conditions (one undone while
   the step itself slowed, contention, is retried after ``RETRY_AFTER_WINDOWS``); a slower step up
   of several workers is retried smaller.
5. **Below the band and starved:** add throughput, sized by the model so that one rebuild lands near
   the answer. Bursty stalls (most fetches find a batch ready, the workers make enough on average) get
   deeper prefetch; steady starvation gets workers (at prefetch 1 where prefetched batches weigh on
   the memory budget). Workers stop at the CPU saturation point, where the model says more would gain
   less than ``min_gain``, where the last increase gained less than ``min_gain`` although the model
   expected at least twice that, or at the budget; memory may cap them.
6. **Below the band, not starved:** compute-bound; workers cannot help.
7. **Above the band:** the data side has slack; give all of it back in one step: the fewest workers
   the model says keep utilization at the band's top, and prefetch back to the default of 2 where the
   queue never ran dry. Never down to a config that was starved under today's conditions, and only on
   two windows' evidence (slack costs CPU and RAM, starving costs throughput; one lucky window of a
   heavy-tailed cost is not slack).
8. **In the band**, or not clearly outside it: hold.

Noise: a config is judged on its last windows in a row pooled together (up to eight), and "clearly
outside" means beyond the band by ``hysteresis`` plus the standard error of those windows' utilization
(twice that above the band), so a config sitting at an edge does not flip back and forth.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Sequence

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.history import ChangeKind, FitHistory, is_starved, recall, resources
from lightning_dltune.core.model import UNLIMITED, PipelineModel, batches_allowed, prefetch_bytes
from lightning_dltune.core.records import (
    Budget,
    Decision,
    PolicySettings,
    Reason,
    ReasonKind,
    Verdict,
    WindowRecord,
    pair,
)
from lightning_dltune.core.stats import UtilSource, WindowStats

_DEFAULT_PREFETCH = 2  # torch's: prefetch is not given back below it (one batch per worker saves little)
_DRY_QUEUE = 0.05  # prefetch is given back only where at most this fraction of fetches found no batch ready
# (and the loop waited at most a fifth of that fraction of its time)

_BURSTY_UNKNOWN = 0.25  # where the loader cannot say what a batch costs, bursts explain at most this starvation
_HEAVY_MEMORY_SHARE = 0.25  # prefetched batches holding more than this share of the memory budget are a cost

_Rule = tuple[LoaderConfig, Verdict, Reason]


def decide(
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    history: Sequence[WindowRecord] = (),
    settings: PolicySettings = PolicySettings(),
) -> Decision:
    """Decide the next loader config from the window just measured.

    Deterministic: the same inputs give the same decision, so every DDP rank can run it on the same
    reduced numbers. The rules are listed in the module docstring.

    Args:
        current: the config the window ran with.
        stats: the window just measured.
        budget: what this rank's loaders may use.
        history: earlier windows of this fit, oldest first.
        settings: the policy's knobs.

    Returns:
        The next config (``current`` itself when nothing changes), the verdict, the structured reason,
        and the best config seen so far (this window included; see
        :func:`~lightning_dltune.core.history.best_config`).
    """
    fit = recall(history, current, stats, budget, settings)
    if stats.batches <= 0 or stats.step_total_s <= 0:
        config, verdict, reason = current, Verdict.IN_BAND, Reason(ReasonKind.NOTHING_MEASURED)
    else:
        config, verdict, reason = _apply_rules(current, fit.seen, budget, fit, settings, latest=stats)
    clamped, limit = clamp_to_budget(config, stats.batch_bytes, budget, settings)
    if clamped != config:  # a last guard: no rule may pick a config over budget
        config, verdict = clamped, Verdict.MEMORY_CAPPED if limit == "memory" else verdict
        reason = replace(reason, values={**reason.values, "budget_allows": pair(clamped)})
    if fit.shift is not None:
        reason = replace(reason, values={**reason.values, "shift": (fit.shift.signal, fit.shift.before, fit.shift.now)})
    return Decision(config=config, verdict=verdict, reason=reason, best=fit.best, judged_util=fit.seen.utilization)


def clamp_to_budget(
    config: LoaderConfig, batch_bytes: Optional[int], budget: Budget, settings: PolicySettings
) -> tuple[LoaderConfig, Optional[str]]:
    """The largest config not above ``config`` within budgets: prefetch gives way first, then workers.

    Returns:
        The config and what limited it: ``"workers"``, ``"memory"`` or ``None``.
    """
    workers = min(config.num_workers, max(budget.max_workers, 0))
    prefetch = min(config.prefetch_factor, settings.max_prefetch_factor)
    limit = "workers" if workers < config.num_workers else None
    allowed = batches_allowed(config, batch_bytes, budget.memory_bytes, budget.shm_bytes)
    if allowed is not None and workers and workers * prefetch > allowed:
        limit = "memory"
        if allowed >= workers:
            prefetch = allowed // workers
        else:
            workers, prefetch = allowed, 1 if allowed else prefetch
    return config.replace(num_workers=workers, prefetch_factor=prefetch), limit


def _over_memory(config: LoaderConfig, batch_bytes: Optional[int], budget: Budget) -> dict:
    """The numbers of a config over a memory budget: its bytes, the budget and which one."""
    memory, shm = prefetch_bytes(config, batch_bytes or 0)
    if budget.memory_bytes is not None and memory > budget.memory_bytes:
        return {"bytes": memory, "budget_bytes": budget.memory_bytes, "budget": "memory"}
    if budget.shm_bytes is not None and shm > budget.shm_bytes:
        return {"bytes": shm, "budget_bytes": budget.shm_bytes, "budget": "/dev/shm"}
    return {"bytes": memory, "budget_bytes": None, "budget": "memory"}


# ------------------------------------------------------------------------------------------------
# The rules


def _apply_rules(
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    fit: FitHistory,
    settings: PolicySettings,
    latest: Optional[WindowStats] = None,
) -> _Rule:
    low, high = settings.band
    util, starvation = stats.utilization, stats.starvation_ratio
    if stats.batches <= 0 or stats.step_mean_s <= 0:
        return current, Verdict.IN_BAND, Reason(ReasonKind.NOTHING_MEASURED)

    model = PipelineModel.infer(current.num_workers, stats, budget.cpus, settings.burst_stall_fraction)
    # CPU-heavy production is CPU-bound; unknown production counts as I/O until the CPUs are shown saturated
    data_verdict = Verdict.DATA_BOUND_CPU if model.cpu_known and model.cpu_share >= 0.5 else Verdict.DATA_BOUND_IO

    # 1. never keep a config over budget, not even after the rebuild cap: an OOM ends the fit
    clamped, limit = clamp_to_budget(current, stats.batch_bytes, budget, settings)
    if clamped != current:
        if limit == "memory":
            return clamped, Verdict.MEMORY_CAPPED, Reason(ReasonKind.OVER_MEMORY, {
                "config": pair(current), "to": pair(clamped), **_over_memory(current, stats.batch_bytes, budget),
            })
        if limit == "workers":
            reason = Reason(ReasonKind.OVER_WORKERS, {
                "workers": current.num_workers, "max_workers": budget.max_workers, "to": pair(clamped),
            })
        else:
            reason = Reason(ReasonKind.OVER_PREFETCH, {
                "prefetch": current.prefetch_factor, "max_prefetch": settings.max_prefetch_factor,
                "to": pair(clamped),
            })
        return clamped, _window_verdict(stats, settings, data_verdict), reason

    # 2. one window unlike the config's earlier ones: noise (a heavy tail) or new conditions; acting on it pooled
    # with the old windows would size from a blend, and judging a change against them would blame the config
    if fit.suspect is not None:
        shift = fit.suspect
        return current, _window_verdict(stats, settings, data_verdict), Reason(ReasonKind.SHIFT_SUSPECTED, {
            "signal": shift.signal, "before": shift.before, "now": shift.now, "config": pair(current),
        })

    # 3. the rebuild cap
    if fit.rebuilds >= settings.max_rebuilds:
        return current, _window_verdict(stats, settings, data_verdict), Reason(ReasonKind.REBUILD_CAP, {
            "rebuilds": fit.rebuilds, "config": pair(current), "util": util,
        })

    # 4. judge the last change
    last = fit.last_change
    # going back must itself fit today's budget (a change forced by the budget is not undone)
    can_go_back = (
        last is not None
        and last.before not in fit.rejected
        and clamp_to_budget(last.before, stats.batch_bytes, budget, settings)[0] == last.before
    )
    if last is not None and can_go_back:
        contention = {"step_ratio": last.step_ratio} if last.contention else {}
        if last.kind in (ChangeKind.MORE_WORKERS, ChangeKind.MORE_PREFETCH) and last.gain < -settings.min_gain:
            numbers = {"gain": last.gain, "rate_before": last.before_stats.samples_per_s,
                       "rate": stats.samples_per_s, "from": pair(last.before), "to": pair(current), **contention}
            if not last.confirmed:  # one window is noise until a second agrees
                return current, _window_verdict(stats, settings, data_verdict), Reason(
                    ReasonKind.CONFIRM_SLOWER, numbers)
            more_workers = last.kind is ChangeKind.MORE_WORKERS
            verdict = Verdict.DATA_BOUND_CPU if more_workers else _window_verdict(stats, settings, data_verdict)
            return last.before, verdict, Reason(ReasonKind.UNDO_SLOWER, {**numbers, "windows": last.windows})
        if last.kind is ChangeKind.GIVE_BACK and is_starved(stats, settings):
            numbers = {"config": pair(current), "util": util, "low": low, "starvation": starvation,
                       "to": pair(last.before)}
            if not last.confirmed:
                return current, data_verdict, Reason(ReasonKind.CONFIRM_STARVED, numbers)
            return last.before, data_verdict, Reason(ReasonKind.UNDO_GIVE_BACK, numbers)

    # 5.-8. where the window sits against the band: clearly outside means by the hysteresis plus the pooled
    # windows' standard error (twice that above the band: slack costs only CPU and RAM, starving costs
    # throughput), so that a config sitting near an edge does not flip on noise
    if util < low - settings.hysteresis - fit.util_error:
        if starvation < settings.min_starvation:
            return current, Verdict.COMPUTE_BOUND, Reason(ReasonKind.COMPUTE_BOUND, {
                "util": util, "starvation": starvation,
            })
        return _add_throughput(current, stats, budget, fit, settings, model, data_verdict)
    if util > high + settings.hysteresis + 2 * fit.util_error:
        return _give_back(current, stats, fit, settings, model)
    # The estimate (1 - starvation) cannot climb past the band when every fetch pays a fixed hand-over
    # cost (a batch unpickled from a worker): a queue that never ran dry in the last window (the first
    # window of a config also holds its workers' start), fed by workers with twice the needed capacity,
    # is slack all the same.
    latest = latest or stats
    if (
        current.num_workers > 0
        and stats.util_source != UtilSource.NVML
        and util >= low
        and latest.fetches > 0
        and latest.stall_fraction <= _DRY_QUEUE
        and model.capacity(current.num_workers) >= 2 * settings.headroom * model.demand
    ):
        return _give_back(current, stats, fit, settings, model)
    return current, Verdict.IN_BAND, Reason(ReasonKind.IN_BAND, {
        "util": util, "windows": fit.windows, "low": low, "high": high, "inside": low <= util <= high,
        "starvation": starvation, "config": pair(current),
    })


def _window_verdict(stats: WindowStats, settings: PolicySettings, data_verdict: Verdict) -> Verdict:
    """The diagnosis of a window on its own (for holds that no rule explains better)."""
    low, high = settings.band
    if stats.utilization < low - settings.hysteresis:
        return data_verdict if stats.starvation_ratio >= settings.min_starvation else Verdict.COMPUTE_BOUND
    if stats.utilization > high + settings.hysteresis and stats.starvation_ratio < settings.min_starvation:
        return Verdict.COMPUTE_BOUND
    return Verdict.IN_BAND


def _add_throughput(
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    fit: FitHistory,
    settings: PolicySettings,
    model: PipelineModel,
    data_verdict: Verdict,
) -> _Rule:
    workers, prefetch = current.num_workers, current.prefetch_factor
    starved = {"starvation": stats.starvation_ratio, "windows": fit.windows, "workers": workers}
    last = fit.last_change
    if last is not None and last.kind is ChangeKind.MORE_WORKERS and last.stopped_helping:
        numbers = {"from_workers": last.before.num_workers, "workers": workers, "gain": last.gain,
                   "min_gain": settings.min_gain}
        if not last.confirmed:
            return current, data_verdict, Reason(ReasonKind.CONFIRM_NO_GAIN, numbers)
        return current, Verdict.DATA_BOUND_CPU, Reason(ReasonKind.STOPPED_HELPING, numbers)

    # bursty: the workers make enough on average, yet some fetches wait: deeper prefetch absorbs bursts
    capacity_ratio = model.capacity(workers) / model.demand if workers else 0.0
    # (where the loader cannot say what a batch costs, workers that finish together also leave most fetches a
    # batch ready: only a loop that waits less than a quarter of its time is taken for bursty then)
    bursty = (
        workers > 0
        and stats.stall_fraction < settings.burst_stall_fraction
        and (capacity_ratio >= 1.0 if stats.worker_batch_s is not None else stats.starvation_ratio < _BURSTY_UNKNOWN)
    )
    prefetch_top = min(settings.max_prefetch_factor, fit.prefetch_ceiling or settings.max_prefetch_factor)
    if bursty and prefetch < prefetch_top:
        stall_s = stats.fetch_wait_total_s / max(stats.stalls, 1)
        # a batch is handed out ~workers x prefetch steps before it is needed: grow that lead by one stall
        extra = math.ceil(stall_s * settings.headroom / model.step_mean_s / workers)
        deeper = current.replace(prefetch_factor=min(prefetch_top, prefetch + max(1, extra)))
        clamped, _ = clamp_to_budget(deeper, stats.batch_bytes, budget, settings)
        if clamped.prefetch_factor > prefetch and clamped not in fit.rejected:
            return clamped, data_verdict, Reason(ReasonKind.DEEPER_PREFETCH, {
                **starved, "stall_fraction": stats.stall_fraction, "stall_s": stall_s,
                "capacity_ratio": capacity_ratio if stats.worker_batch_s is not None else None,
                "prefetch": prefetch, "to_prefetch": clamped.prefetch_factor,
            })

    # steady: Little's law says how many workers keep up with the step, plus headroom
    cpu_limit = model.cpu_limit()
    ceiling = fit.worker_ceiling if fit.worker_ceiling is not None else UNLIMITED
    limit = min(budget.max_workers, cpu_limit, ceiling)
    cost = {"batch_s": model.batch_mean_s, "step_s": model.step_mean_s}
    cpus = {"cpus": budget.cpus, "cpu_share": model.cpu_share}
    if workers >= limit:
        if limit == ceiling:
            return current, Verdict.DATA_BOUND_CPU, Reason(ReasonKind.AT_WORKER_CEILING, {
                **starved, "ceiling": fit.worker_ceiling,
            })
        if limit == cpu_limit:
            fewer = current.replace(num_workers=cpu_limit)
            if workers > cpu_limit and fewer not in fit.rejected:
                # past saturation extra workers only hold memory and fight over the cores
                return fewer, Verdict.DATA_BOUND_CPU, Reason(ReasonKind.OVERSUBSCRIBED, {
                    **starved, **cpus, "to_workers": cpu_limit,
                })
            return current, Verdict.DATA_BOUND_CPU, Reason(ReasonKind.CPUS_SATURATED, {**starved, **cpus})
        return current, data_verdict, Reason(ReasonKind.AT_WORKER_BUDGET, {**starved, **cost})
    wanted = model.workers_for(settings.headroom * model.demand, workers + 1, limit) or limit
    wanted = max(wanted, workers + 1)
    gain = model.throughput(wanted) / model.throughput(workers) - 1.0
    if gain < settings.min_gain:
        # contention eats what more workers would add: the model already says they cannot help
        return current, Verdict.DATA_BOUND_CPU, Reason(ReasonKind.NO_MODELLED_GAIN, {
            **starved, **cost, "wanted": wanted, "gain": gain, "cpus": budget.cpus,
        })
    target, why = clamp_to_budget(current.replace(num_workers=wanted), stats.batch_bytes, budget, settings)
    while target in fit.rejected and target.num_workers > workers:
        target = target.replace(num_workers=target.num_workers - 1)
    if target.num_workers <= workers:
        if why == "memory":
            one_more = current.replace(num_workers=workers + 1, prefetch_factor=1)
            return current, Verdict.MEMORY_CAPPED, Reason(ReasonKind.MEMORY_CAPPED_HOLD, {
                **starved, "wanted": wanted, "config": pair(one_more),
                **_over_memory(one_more, stats.batch_bytes, budget),
            })
        return current, data_verdict, Reason(ReasonKind.MORE_WORKERS_UNDONE, {**starved, **cost})
    if why == "memory" and target.num_workers < wanted:
        wanted_config = current.replace(num_workers=wanted, prefetch_factor=1)
        return target, Verdict.MEMORY_CAPPED, Reason(ReasonKind.MEMORY_CAPPED_WORKERS, {
            **starved, "wanted": wanted, "to": pair(target), **_over_memory(wanted_config, stats.batch_bytes, budget),
        })
    # memory as a cost: steady starvation needs one batch in flight per worker (a worker gets its next batch
    # when the loop takes its last one, W steps ahead), so where prefetched batches are a noticeable share of
    # the memory budget the new workers start with prefetch 1; bursts, if any, then earn deeper prefetch
    if target.prefetch_factor > 1 and stats.batch_bytes and budget.memory_bytes:
        if prefetch_bytes(target, stats.batch_bytes)[0] > _HEAVY_MEMORY_SHARE * budget.memory_bytes:
            target = target.replace(prefetch_factor=1)
    verdict = data_verdict
    if target.num_workers == cpu_limit and model.capacity(target.num_workers) < model.demand:
        verdict = Verdict.DATA_BOUND_CPU  # the most the CPUs carry still falls short
    return target, verdict, Reason(ReasonKind.MORE_WORKERS, {
        **starved, **cost, "to_workers": target.num_workers, "prefetch": prefetch,
        "to_prefetch": target.prefetch_factor,
    })


def _give_back(
    current: LoaderConfig, stats: WindowStats, fit: FitHistory, settings: PolicySettings, model: PipelineModel
) -> _Rule:
    high = settings.band[1]
    util, starvation = stats.utilization, stats.starvation_ratio
    workers, prefetch = current.num_workers, current.prefetch_factor
    verdict = Verdict.COMPUTE_BOUND if starvation < settings.min_starvation else Verdict.IN_BAND
    seen = {"util": util, "windows": fit.windows, "starvation": starvation}
    # slack costs only CPU and RAM, starving costs throughput: give back on two windows' evidence, not one
    confirmed = fit.windows >= 2

    def allowed(config: LoaderConfig) -> bool:
        # never back to a config that was undone, nor down to one that was starved before
        w, p = resources(config)
        return config not in fit.rejected and not any(w <= sw and p <= sp for sw, sp in fit.starved)

    # prefetch deeper than the DataLoader's default only absorbs bursts, and there is no model for those: it goes
    # back to the default in one notch only where the queue hardly ever ran dry and the loop hardly waited, on
    # confirmed slack (it saves memory only: no hurry)
    queue_idle = stats.stall_fraction <= _DRY_QUEUE and starvation <= _DRY_QUEUE / 5
    shallower = min(prefetch, _DEFAULT_PREFETCH) if workers and queue_idle and confirmed else prefetch

    def keeps_band(fewer: int, predicted: float) -> bool:
        # on confirmed slack only: one lucky window (no slow batch of a heavy tail in it) is not slack; then down
        # to the band's top (a model a few points off still keeps the band)
        return confirmed and predicted >= high

    # all the slack the model sees goes back in one step (workers and, where idle, prefetch): slack costs
    # processes and memory for nothing
    now = model.throughput(workers)
    for fewer in range(0, workers):
        candidate = current.replace(num_workers=fewer, prefetch_factor=shallower if fewer else prefetch)
        predicted = util * model.throughput(fewer) / now
        if keeps_band(fewer, predicted) and allowed(candidate):
            return candidate, verdict, Reason(ReasonKind.GIVE_BACK_WORKERS, {
                **seen, "workers": workers, "to_workers": fewer, "predicted": min(predicted, 1.0),
                "prefetch": prefetch, "to_prefetch": candidate.prefetch_factor,
            })
    candidate = current.replace(prefetch_factor=shallower)
    if shallower < prefetch and allowed(candidate):
        return candidate, verdict, Reason(ReasonKind.GIVE_BACK_PREFETCH, {
            **seen, "prefetch": prefetch, "to_prefetch": shallower,
        })
    if not confirmed and workers and prefetch > _DEFAULT_PREFETCH and queue_idle:
        return current, verdict, Reason(ReasonKind.SLACK_UNCONFIRMED, seen)
    if not confirmed and workers and allowed(current.replace(num_workers=workers - 1)):
        return current, verdict, Reason(ReasonKind.SLACK_UNCONFIRMED, seen)
    return current, verdict, Reason(ReasonKind.LEANEST, {**seen, "config": pair(current)})
