"""The band policy's rules: a pure function from what a window looked like to the next loader config.

No torch, no Lightning. The rules use the performance model (:mod:`lightning_dltune.core.model`) and the
fit's history (:mod:`lightning_dltune.core.history`), and return a structured
:class:`~lightning_dltune.core.records.Reason` (a kind and its numbers) that :mod:`lightning_dltune.report.words`
puts into words.

How :func:`decide` thinks, first rule that applies wins:

1. **Budgets.** Never more workers than ``Budget.max_workers``; never a config whose prefetched
   batches (workers x prefetch x measured batch bytes, twice with pinned copies) exceed the memory
   budget (``memory_fraction`` of available RAM or cgroup headroom) or the ``/dev/shm`` budget
   (``shm_fraction`` of its free space): verdict *memory-capped*; prefetch gives way first, then
   workers. Usable CPUs come from the affinity mask and the cgroup quota, shared among the node's
   ranks; after a switch that failed, the worker budget goes at most halfway back up to the count
   that failed.
2. **New conditions, suspected.** One window unlike the config's earlier ones (a worker's time per
   batch off by more than half, the step time by more than a tenth, or, where the loader cannot say
   what a batch costs, starvation by more than 15 points; each also beyond three standard deviations
   of the earlier windows and outside all of them; see :func:`~lightning_dltune.core.history.detect_shift`):
   hold and measure again, since one window is noise (a heavy-tailed cost alone makes lucky and
   unlucky ones). Two in a row that agree are new conditions (storage slowed, a neighbour took the
   CPUs): what was learned before them (pooled windows, undone configs, worker and prefetch ceilings,
   the rebuild count) is dropped (:func:`~lightning_dltune.core.history.recall`) and the rules below
   judge the new windows alone.
3. **Rebuild cap.** After ``max_rebuilds`` changes under the same conditions, nothing changes any more.
4. **Judge the last change, on two windows.** More workers or deeper prefetch that lowered throughput
   by more than ``min_gain``, or a give-back that left the loop starved below the band, is measured
   again (one window is noise until a second agrees), then undone. If the step itself got more than
   25 % slower meanwhile, the machine was busy (contention), not necessarily the config: that undo
   expires after ``RETRY_AFTER_WINDOWS`` (16) windows, doubling each time it repeats. Other undone
   configs are not tried again under the same conditions. A slower step up of several workers is
   retried smaller before the CPUs are called saturated: no CPU limit is declared at a count not
   measured against one worker more.
5. **Below the band and starved:** add throughput, sized by the model rather than by doubling. The
   tuner's loaders measure, inside the workers, the wall and CPU time to make one batch; Little's law
   gives the workers that feed the step (with ``headroom``, 20 %), so one rebuild lands near the
   answer. CPU work slows down once workers outnumber the CPUs and waiting on storage does not: a
   CPU-bound pipeline stops near the core count (*data-bound (CPU saturated)*), an I/O-bound one goes
   past it (*data-bound (I/O)*). Workers also stop where the model says more would gain less than
   ``min_gain``, where the last increase gained less than ``min_gain`` although the model expected at
   least twice that, or at the budget; memory may cap them. Bursty stalls (most fetches find a batch
   ready, the workers make enough on average) get deeper prefetch instead. Where prefetched batches
   are a noticeable share (a quarter) of the memory budget, new workers start at prefetch 1: steady
   starvation needs one batch in flight per worker, and bursts then earn deeper prefetch.
6. **Below the band, not starved:** *compute-bound*; more workers cannot help, nothing changes.
7. **Above the band:** the data side has slack, and slack costs processes and memory: give all of it
   back in one step, the fewest workers the model says keep utilization at the band's top and, where
   the queue never ran dry, prefetch back to the default of 2. Never down to a config that was starved
   under today's conditions, and only on two windows' evidence (slack costs CPU and RAM, starving
   costs throughput; one lucky window of a heavy-tailed cost is not slack).
8. **In the band**, or not clearly outside it: hold.

Noise: a config is judged on its last windows in a row pooled together (up to eight), and "clearly
outside" means beyond the band by ``hysteresis`` (0.02) plus the standard error of those windows'
utilization (twice that above the band), so a config sitting at an edge does not flip back and forth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
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


def memory_over_budget(config: LoaderConfig, batch_bytes: float, budget: Budget) -> Optional[tuple[str, float, float]]:
    """The memory budget the prefetched batches of ``config`` exceed: ``(which, bytes, budget bytes)``.

    ``which`` is ``"memory"`` or ``"/dev/shm"`` (memory is checked first); ``None`` when both fit or are unknown.
    """
    memory, shm = prefetch_bytes(config, batch_bytes)
    if budget.memory_bytes is not None and memory > budget.memory_bytes:
        return "memory", memory, budget.memory_bytes
    if budget.shm_bytes is not None and shm > budget.shm_bytes:
        return "/dev/shm", shm, budget.shm_bytes
    return None


def _over_memory(config: LoaderConfig, batch_bytes: Optional[int], budget: Budget) -> dict:
    """The numbers of a config over a memory budget: its bytes, the budget and which one."""
    over = memory_over_budget(config, batch_bytes or 0, budget)
    if over is None:
        return {"bytes": prefetch_bytes(config, batch_bytes or 0)[0], "budget_bytes": None, "budget": "memory"}
    which, used, allowed = over
    return {"bytes": used, "budget_bytes": allowed, "budget": which}


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
    """The first rule that applies, in the order of the module docstring."""
    if stats.batches <= 0 or stats.step_mean_s <= 0:
        return current, Verdict.IN_BAND, Reason(ReasonKind.NOTHING_MEASURED)

    model = PipelineModel.infer(current.num_workers, stats, budget.cpus, settings.burst_stall_fraction)
    # CPU-heavy production is CPU-bound; unknown production counts as I/O until the CPUs are shown saturated
    data_verdict = Verdict.DATA_BOUND_CPU if model.cpu_known and model.cpu_share >= 0.5 else Verdict.DATA_BOUND_IO
    case = _Case(current, stats, budget, fit, settings, model, data_verdict)
    return (
        _over_budget(case)
        or _suspected_shift(case)
        or _rebuild_cap(case)
        or _judge_last_change(case)
        or _against_the_band(case, latest or stats)
    )


@dataclass(frozen=True)
class _Case:
    """What the rules judge: the config, its (pooled) window, the budget, the fit so far, the knobs, the model."""

    current: LoaderConfig
    stats: WindowStats
    budget: Budget
    fit: FitHistory
    settings: PolicySettings
    model: PipelineModel
    data_verdict: Verdict  # a data-bound window's verdict: CPU saturated where production is CPU-heavy, else I/O

    @property
    def held(self) -> Verdict:
        """The verdict of a hold that no rule explains better: the window's own diagnosis."""
        return _window_verdict(self.stats, self.settings, self.data_verdict)


def _over_budget(case: _Case) -> Optional[_Rule]:
    """1. Never keep a config over budget, not even after the rebuild cap: an OOM ends the fit."""
    current, stats, budget, settings = case.current, case.stats, case.budget, case.settings
    clamped, limit = clamp_to_budget(current, stats.batch_bytes, budget, settings)
    if clamped == current:
        return None
    if limit == "memory":
        return (
            clamped,
            Verdict.MEMORY_CAPPED,
            Reason(
                ReasonKind.OVER_MEMORY,
                {"config": pair(current), "to": pair(clamped), **_over_memory(current, stats.batch_bytes, budget)},
            ),
        )
    if limit == "workers":
        reason = Reason(
            ReasonKind.OVER_WORKERS,
            {"workers": current.num_workers, "max_workers": budget.max_workers, "to": pair(clamped)},
        )
    else:
        reason = Reason(
            ReasonKind.OVER_PREFETCH,
            {"prefetch": current.prefetch_factor, "max_prefetch": settings.max_prefetch_factor, "to": pair(clamped)},
        )
    return clamped, case.held, reason


def _suspected_shift(case: _Case) -> Optional[_Rule]:
    """2. One window unlike the config's earlier ones: noise (a heavy tail) or new conditions; hold.

    Acting on it pooled with the old windows would size from a blend, and judging a change against them
    would blame the config.
    """
    shift = case.fit.suspect
    if shift is None:
        return None
    return (
        case.current,
        case.held,
        Reason(
            ReasonKind.SHIFT_SUSPECTED,
            {"signal": shift.signal, "before": shift.before, "now": shift.now, "config": pair(case.current)},
        ),
    )


def _rebuild_cap(case: _Case) -> Optional[_Rule]:
    """3. After ``max_rebuilds`` changes under the same conditions, nothing changes any more."""
    if case.fit.rebuilds < case.settings.max_rebuilds:
        return None
    return (
        case.current,
        case.held,
        Reason(
            ReasonKind.REBUILD_CAP,
            {"rebuilds": case.fit.rebuilds, "config": pair(case.current), "util": case.stats.utilization},
        ),
    )


def _judge_last_change(case: _Case) -> Optional[_Rule]:
    """4. A step up that made it slower, or a give-back that starved the loop: measured again, then undone."""
    current, stats, settings, data_verdict = case.current, case.stats, case.settings, case.data_verdict
    last = case.fit.last_change
    # going back must itself fit today's budget (a change forced by the budget is not undone)
    can_go_back = (
        last is not None
        and last.before not in case.fit.rejected
        and clamp_to_budget(last.before, stats.batch_bytes, case.budget, settings)[0] == last.before
    )
    if last is None or not can_go_back:
        return None
    contention = {"step_ratio": last.step_ratio} if last.contention else {}
    if last.kind in (ChangeKind.MORE_WORKERS, ChangeKind.MORE_PREFETCH) and last.gain < -settings.min_gain:
        numbers = {
            "gain": last.gain,
            "rate_before": last.before_stats.samples_per_s,
            "rate": stats.samples_per_s,
            "from": pair(last.before),
            "to": pair(current),
            **contention,
        }
        if not last.confirmed:  # one window is noise until a second agrees
            return current, case.held, Reason(ReasonKind.CONFIRM_SLOWER, numbers)
        more_workers = last.kind is ChangeKind.MORE_WORKERS
        verdict = Verdict.DATA_BOUND_CPU if more_workers else case.held
        return last.before, verdict, Reason(ReasonKind.UNDO_SLOWER, {**numbers, "windows": last.windows})
    if last.kind is ChangeKind.GIVE_BACK and is_starved(stats, settings):
        numbers = {
            "config": pair(current),
            "util": stats.utilization,
            "low": settings.band[0],
            "starvation": stats.starvation_ratio,
            "to": pair(last.before),
        }
        if not last.confirmed:
            return current, data_verdict, Reason(ReasonKind.CONFIRM_STARVED, numbers)
        return last.before, data_verdict, Reason(ReasonKind.UNDO_GIVE_BACK, numbers)
    return None


def _against_the_band(case: _Case, latest: WindowStats) -> _Rule:
    """5.-8. Where the window sits against the band.

    Clearly outside means by the hysteresis plus the pooled windows' standard error (twice that above the
    band: slack costs only CPU and RAM, starving costs throughput), so that a config sitting near an edge
    does not flip on noise.
    """
    current, stats, fit, settings, model = case.current, case.stats, case.fit, case.settings, case.model
    low, high = settings.band
    util, starvation = stats.utilization, stats.starvation_ratio
    if util < low - settings.hysteresis - fit.util_error:
        if starvation < settings.min_starvation:
            return (
                current,
                Verdict.COMPUTE_BOUND,
                Reason(ReasonKind.COMPUTE_BOUND, {"util": util, "starvation": starvation}),
            )
        return _add_throughput(case)
    if util > high + settings.hysteresis + 2 * fit.util_error:
        return _give_back(current, stats, fit, settings, model)
    if _slack_the_estimate_hides(case, latest):
        return _give_back(current, stats, fit, settings, model)
    return (
        current,
        Verdict.IN_BAND,
        Reason(
            ReasonKind.IN_BAND,
            {
                "util": util,
                "windows": fit.windows,
                "low": low,
                "high": high,
                "inside": low <= util <= high,
                "starvation": starvation,
                "config": pair(current),
            },
        ),
    )


def _slack_the_estimate_hides(case: _Case, latest: WindowStats) -> bool:
    """Slack in the band, where the estimate cannot show it.

    The estimate (1 - starvation) cannot climb past the band when every fetch pays a fixed hand-over
    cost (a batch unpickled from a worker): a queue that never ran dry in the last window (the first
    window of a config also holds its workers' start), fed by workers with twice the needed capacity,
    is slack all the same.
    """
    current, stats, model = case.current, case.stats, case.model
    return (
        current.num_workers > 0
        and stats.util_source != UtilSource.NVML
        and stats.utilization >= case.settings.band[0]
        and latest.fetches > 0
        and latest.stall_fraction <= _DRY_QUEUE
        and model.capacity(current.num_workers) >= 2 * case.settings.headroom * model.demand
    )


def _window_verdict(stats: WindowStats, settings: PolicySettings, data_verdict: Verdict) -> Verdict:
    """The diagnosis of a window on its own (for holds that no rule explains better)."""
    low, high = settings.band
    if stats.utilization < low - settings.hysteresis:
        return data_verdict if stats.starvation_ratio >= settings.min_starvation else Verdict.COMPUTE_BOUND
    if stats.utilization > high + settings.hysteresis and stats.starvation_ratio < settings.min_starvation:
        return Verdict.COMPUTE_BOUND
    return Verdict.IN_BAND


def _add_throughput(case: _Case) -> _Rule:
    """5. Below the band and starved: deeper prefetch for bursts, more workers for steady starvation."""
    stats, fit = case.stats, case.fit
    starved = {"starvation": stats.starvation_ratio, "windows": fit.windows, "workers": case.current.num_workers}
    return _stopped_helping(case) or _deeper_prefetch(case, starved) or _more_workers(case, starved)


def _stopped_helping(case: _Case) -> Optional[_Rule]:
    """The last step up of workers gained less than ``min_gain`` where the model expected twice that: no more."""
    current, last = case.current, case.fit.last_change
    if last is None or last.kind is not ChangeKind.MORE_WORKERS or not last.stopped_helping:
        return None
    numbers = {
        "from_workers": last.before.num_workers,
        "workers": current.num_workers,
        "gain": last.gain,
        "min_gain": case.settings.min_gain,
    }
    if not last.confirmed:
        return current, case.data_verdict, Reason(ReasonKind.CONFIRM_NO_GAIN, numbers)
    return current, Verdict.DATA_BOUND_CPU, Reason(ReasonKind.STOPPED_HELPING, numbers)


def _deeper_prefetch(case: _Case, starved: dict) -> Optional[_Rule]:
    """Bursty: the workers make enough on average, yet some fetches wait: deeper prefetch absorbs bursts."""
    current, stats, fit, settings, model = case.current, case.stats, case.fit, case.settings, case.model
    workers, prefetch = current.num_workers, current.prefetch_factor
    capacity_ratio = model.capacity(workers) / model.demand if workers else 0.0
    # (where the loader cannot say what a batch costs, workers that finish together also leave most fetches a
    # batch ready: only a loop that waits less than a quarter of its time is taken for bursty then)
    bursty = (
        workers > 0
        and stats.stall_fraction < settings.burst_stall_fraction
        and (capacity_ratio >= 1.0 if stats.worker_batch_s is not None else stats.starvation_ratio < _BURSTY_UNKNOWN)
    )
    prefetch_top = min(settings.max_prefetch_factor, fit.prefetch_ceiling or settings.max_prefetch_factor)
    if not bursty or prefetch >= prefetch_top:
        return None
    stall_s = stats.fetch_wait_total_s / max(stats.stalls, 1)
    # a batch is handed out ~workers x prefetch steps before it is needed: grow that lead by one stall
    extra = math.ceil(stall_s * settings.headroom / model.step_mean_s / workers)
    deeper = current.replace(prefetch_factor=min(prefetch_top, prefetch + max(1, extra)))
    clamped, _ = clamp_to_budget(deeper, stats.batch_bytes, case.budget, settings)
    if clamped.prefetch_factor <= prefetch or clamped in fit.rejected:
        return None
    return (
        clamped,
        case.data_verdict,
        Reason(
            ReasonKind.DEEPER_PREFETCH,
            {
                **starved,
                "stall_fraction": stats.stall_fraction,
                "stall_s": stall_s,
                "capacity_ratio": capacity_ratio if stats.worker_batch_s is not None else None,
                "prefetch": prefetch,
                "to_prefetch": clamped.prefetch_factor,
            },
        ),
    )


def _more_workers(case: _Case, starved: dict) -> _Rule:
    """Steady: Little's law says how many workers keep up with the step, plus headroom."""
    current, stats, budget, fit, model = case.current, case.stats, case.budget, case.fit, case.model
    settings, data_verdict = case.settings, case.data_verdict
    workers = current.num_workers
    cpu_limit = model.cpu_limit()
    ceiling = fit.worker_ceiling if fit.worker_ceiling is not None else UNLIMITED
    limit = min(budget.max_workers, cpu_limit, ceiling)
    cost = {"batch_s": model.batch_mean_s, "step_s": model.step_mean_s}
    if workers >= limit:
        return _at_worker_limit(case, starved, cost, limit, ceiling)
    wanted = model.workers_for(settings.headroom * model.demand, workers + 1, limit) or limit
    wanted = max(wanted, workers + 1)
    gain = model.throughput(wanted) / model.throughput(workers) - 1.0
    if gain < settings.min_gain:
        # contention eats what more workers would add: the model already says they cannot help
        return (
            current,
            Verdict.DATA_BOUND_CPU,
            Reason(
                ReasonKind.NO_MODELLED_GAIN, {**starved, **cost, "wanted": wanted, "gain": gain, "cpus": budget.cpus}
            ),
        )
    target, why = clamp_to_budget(current.replace(num_workers=wanted), stats.batch_bytes, budget, settings)
    while target in fit.rejected and target.num_workers > workers:
        target = target.replace(num_workers=target.num_workers - 1)
    if target.num_workers <= workers:
        if why == "memory":
            return _memory_capped_hold(case, starved, wanted)
        return current, data_verdict, Reason(ReasonKind.MORE_WORKERS_UNDONE, {**starved, **cost})
    if why == "memory" and target.num_workers < wanted:
        return _memory_capped_workers(case, starved, wanted, target)
    target = _light_prefetch(target, stats.batch_bytes, budget)
    verdict = data_verdict
    if target.num_workers == cpu_limit and model.capacity(target.num_workers) < model.demand:
        verdict = Verdict.DATA_BOUND_CPU  # the most the CPUs carry still falls short
    return (
        target,
        verdict,
        Reason(
            ReasonKind.MORE_WORKERS,
            {
                **starved,
                **cost,
                "to_workers": target.num_workers,
                "prefetch": current.prefetch_factor,
                "to_prefetch": target.prefetch_factor,
            },
        ),
    )


def _memory_capped_hold(case: _Case, starved: dict, wanted: int) -> _Rule:
    """Starved, but not even one more worker (at prefetch 1) fits the memory budget: hold."""
    current, batch_bytes = case.current, case.stats.batch_bytes
    one_more = current.replace(num_workers=current.num_workers + 1, prefetch_factor=1)
    numbers = {"wanted": wanted, "config": pair(one_more), **_over_memory(one_more, batch_bytes, case.budget)}
    return current, Verdict.MEMORY_CAPPED, Reason(ReasonKind.MEMORY_CAPPED_HOLD, {**starved, **numbers})


def _memory_capped_workers(case: _Case, starved: dict, wanted: int, target: LoaderConfig) -> _Rule:
    """Fewer workers than Little's law wants, as many as the memory budget allows."""
    wanted_config = case.current.replace(num_workers=wanted, prefetch_factor=1)
    numbers = {"wanted": wanted, "to": pair(target), **_over_memory(wanted_config, case.stats.batch_bytes, case.budget)}
    return target, Verdict.MEMORY_CAPPED, Reason(ReasonKind.MEMORY_CAPPED_WORKERS, {**starved, **numbers})


def _at_worker_limit(case: _Case, starved: dict, cost: dict, limit: int, ceiling: int) -> _Rule:
    """Already at the most workers: the ceiling more workers met before, the CPUs' saturation, or the budget."""
    current, fit, model = case.current, case.fit, case.model
    workers, cpu_limit = current.num_workers, model.cpu_limit()
    cpus = {"cpus": case.budget.cpus, "cpu_share": model.cpu_share}
    if limit == ceiling:
        return (
            current,
            Verdict.DATA_BOUND_CPU,
            Reason(ReasonKind.AT_WORKER_CEILING, {**starved, "ceiling": fit.worker_ceiling}),
        )
    if limit == cpu_limit:
        fewer = current.replace(num_workers=cpu_limit)
        if workers > cpu_limit and fewer not in fit.rejected:
            # past saturation extra workers only hold memory and fight over the cores
            return (
                fewer,
                Verdict.DATA_BOUND_CPU,
                Reason(ReasonKind.OVERSUBSCRIBED, {**starved, **cpus, "to_workers": cpu_limit}),
            )
        return current, Verdict.DATA_BOUND_CPU, Reason(ReasonKind.CPUS_SATURATED, {**starved, **cpus})
    return current, case.data_verdict, Reason(ReasonKind.AT_WORKER_BUDGET, {**starved, **cost})


def _light_prefetch(target: LoaderConfig, batch_bytes: Optional[int], budget: Budget) -> LoaderConfig:
    """``target`` at prefetch 1 where its prefetched batches are a noticeable share of the memory budget.

    Memory as a cost: steady starvation needs one batch in flight per worker (a worker gets its next batch
    when the loop takes its last one, W steps ahead), so the new workers start with prefetch 1; bursts, if
    any, then earn deeper prefetch.
    """
    if target.prefetch_factor > 1 and batch_bytes and budget.memory_bytes:
        if prefetch_bytes(target, batch_bytes)[0] > _HEAVY_MEMORY_SHARE * budget.memory_bytes:
            return target.replace(prefetch_factor=1)
    return target


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

    def keeps_band(predicted: float) -> bool:
        # on confirmed slack only: one lucky window (no slow batch of a heavy tail in it) is not slack; then down
        # to the band's top (a model a few points off still keeps the band)
        return confirmed and predicted >= high

    # all the slack the model sees goes back in one step (workers and, where idle, prefetch): slack costs
    # processes and memory for nothing
    now = model.throughput(workers)
    for fewer in range(0, workers):
        candidate = current.replace(num_workers=fewer, prefetch_factor=shallower if fewer else prefetch)
        predicted = util * model.throughput(fewer) / now
        if keeps_band(predicted) and allowed(candidate):
            return (
                candidate,
                verdict,
                Reason(
                    ReasonKind.GIVE_BACK_WORKERS,
                    {
                        **seen,
                        "workers": workers,
                        "to_workers": fewer,
                        "predicted": min(predicted, 1.0),
                        "prefetch": prefetch,
                        "to_prefetch": candidate.prefetch_factor,
                    },
                ),
            )
    candidate = current.replace(prefetch_factor=shallower)
    if shallower < prefetch and allowed(candidate):
        return (
            candidate,
            verdict,
            Reason(ReasonKind.GIVE_BACK_PREFETCH, {**seen, "prefetch": prefetch, "to_prefetch": shallower}),
        )
    if not confirmed and workers and prefetch > _DEFAULT_PREFETCH and queue_idle:
        return current, verdict, Reason(ReasonKind.SLACK_UNCONFIRMED, seen)
    if not confirmed and workers and allowed(current.replace(num_workers=workers - 1)):
        return current, verdict, Reason(ReasonKind.SLACK_UNCONFIRMED, seen)
    return current, verdict, Reason(ReasonKind.LEANEST, {**seen, "config": pair(current)})
