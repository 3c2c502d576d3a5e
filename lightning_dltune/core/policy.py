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
   that failed. Then, where the caller asks for it (validation runs of a few batches), fewer batches
   measured with the config than a judgement needs (its windows pooled) are held: no rule below judges
   them.
2. **New conditions, suspected.** One window unlike the config's earlier ones (a worker's time per
   batch off by more than half, the step time by more than a tenth, or, where the loader cannot say
   what a batch costs, starvation by more than 15 points; each also beyond three standard deviations
   of the earlier windows and outside all of them, and a cost only where a typical batch moved too,
   the workers' p95 time per batch or, with 0 workers, the median fetch: a heavy tail moves the mean
   alone; and a cost only where the loop feels it, the move shared among the workers at least 5 % of a
   step; see :func:`~lightning_dltune.core.history.detect_shift`): hold and measure again, since one
   window is noise (a heavy-tailed cost alone makes lucky and unlucky ones). The window that confirms
   it is short: as many batches as put its mean three standard errors inside half the move
   (``Decision.confirm_batches``, at least 10 and one per worker, at most a regular window), so a
   change is answered in about one window. Two in a row that agree are new conditions (storage slowed,
   a neighbour took the CPUs): what was learned before them (pooled windows, undone configs, worker
   and prefetch ceilings, the rebuild count) is dropped (:func:`~lightning_dltune.core.history.recall`)
   and the rules below judge the new windows alone. So is one window where two measurements agree
   inside it (:func:`~lightning_dltune.core.history.starved_rise`): the workers' own cost per batch rose
   (its typical batch too) and the loop, fed by the config's earlier windows, is clearly below the band
   and waiting on data; holding to confirm costs a starved window for certain, and a step up that did
   not pay is undone. That window mostly holds the change inside it (a look closed it on the starved
   loop): the step up is sized from its newest batches' cost, its p95 over the earlier windows' spread,
   not from its mean of both conditions (:func:`~lightning_dltune.core.history.newest_cost`). Also on
   a give-back's first window, against the windows of the config it left: fewer workers make their
   batches no slower, so the rise is storage's, not the give-back's. The replay
   covers the fit's latest 256 windows (``REPLAYED_WINDOWS``), so that a decision costs the same late in a
   long fit as early: older ones are forgotten as new conditions would forget them.
3. **Rebuild cap.** After ``max_rebuilds`` changes under the same conditions (in those 256 windows),
   nothing changes any more.
4. **Judge the last change, on two windows.** More workers or deeper prefetch that lowered throughput
   by more than ``min_gain``, or a give-back that left the loop starved below the band or clearly cost
   speed (utilization down by more than ``min_gain`` and the hysteresis: the step drifts on its own,
   the utilization does not), is measured again (one window is noise until a second agrees, and a
   give-back's second window must show the loss on its own), then undone; a give-back from a config itself
   below the band's low edge is judged by its speed alone (the config it left did not keep the band
   either). If the step itself got more than 25 % slower meanwhile, the machine was busy (contention), not
   necessarily the config: that undo expires after ``RETRY_AFTER_WINDOWS`` (16) windows, doubling each
   time it repeats. Other undone configs are not tried again under the same conditions. A slower step up
   of several workers is retried smaller before the CPUs are called saturated: no CPU limit is declared at
   a count not measured against one worker more.
5. **Below the band and starved:** add throughput, sized by the model rather than by doubling. The tuner's
   loaders measure, inside the workers, the wall and CPU time to make one batch and its p95; Little's law
   gives the workers that feed the step (with ``headroom``, 20 %), the p95 adding what in-order delivery
   costs (the loop waits for the slowest outstanding batch: see :mod:`~lightning_dltune.core.model`), so
   one rebuild lands near the answer. CPU work slows down once workers outnumber the CPUs and waiting on
   storage does not: a CPU-bound pipeline stops near the core count, an I/O-bound one goes past it. **The
   measurement decides:** where the model sees no gain, or stops at the CPUs it counts, yet the CPUs were
   not measured busy, one step up is measured instead, sized by the loop's own delivery (each worker
   delivering what it did in the window), if that step is expected to gain twice ``min_gain`` (past the
   model's CPU limit with an unknown CPU share, one worker at a time); not where a neighbour keeps the
   cores busy (other processes take a quarter CPU or more and the cores are 85 % busy with them): more
   workers there only take its share, and oversubscribe the cores once it leaves. **On CPUs measured busy** the model
   cannot say what sharing the work out otherwise costs (a batch's CPU cost and in-order delivery's idling
   depend on it), so that is measured too, once under the same conditions: past the CPUs' count, prefetch
   goes to 1 first (the queue is empty whatever its depth: deeper only holds memory), then the workers the
   CPUs carry, two batches in flight each (at one, in-order delivery idles them); at it, the workers x
   prefetch batches in flight go to one a worker over more workers (at most twice as many; at prefetch 1
   there is nothing to share out, and it holds). A cut taken below the band's low edge is judged by its speed beyond
   the noise of its windows, a step up on busy CPUs that gains less than ``min_gain`` goes back. The same
   cut is measured at the worker budget's most where the workers' measured CPU share says the CPUs carry
   fewer workers though they came out under busy: nothing up is left to measure there. Past the workers
   the CPUs carry (on that evidence) stalls are the contention's, and get the cut, not deeper prefetch. Workers
   also stop where the last increase gained less than ``min_gain`` although the model (or, for a measured
   step, the delivery) expected at least twice that, or at the budget; memory may cap them. Such an increase
   goes back to the workers before it, as fast with less (unless it paid half of ``min_gain``), and those
   are the ceiling under today's conditions: no smaller step up asks the same question again. That stop is
   called CPU-bound only where the CPUs were measured busy; where they were not, bursty stalls still get
   deeper prefetch first (a first window that met no slow batch makes a step up look as if it did not
   pay). Bursty stalls
   (most fetches find a batch ready, some find none, the workers make enough on average) get deeper
   prefetch instead; a wait without a single stall is each batch's hand-over, which no depth and no worker
   count shortens. Where making a batch in the loop would cost it clearly less than that (0 workers' rate by
   the model, at a cost two standard errors above the windows' mean, over the loop's measured rate by
   ``min_gain``), 0 workers are measured: judged by their speed like any give-back from below the band, and,
   kept, 0 is the workers' ceiling under today's conditions (a step up would ask the same question again);
   never after a step up from 0 workers paid, and only where the loader measured a batch's cost. Where
   prefetched batches are a noticeable share (a quarter) of the memory budget, new workers start at
   prefetch 1: steady starvation needs one batch in flight per worker, and bursts then earn deeper
   prefetch.
6. **Below the band, not starved:** *compute-bound*; more workers cannot help, nothing changes.
7. **Above the band:** the data side has slack, and slack costs processes and memory: give all of it back
   in one step, the fewest workers the model says keep utilization at the band's top by the hysteresis and
   lose at most half of ``min_gain`` (judged at a cost two standard errors above the windows' mean, and
   against the best utilization measured under today's conditions, so give-backs in a row do not add up)
   and, where the queue never ran dry, prefetch back to the default of 2. Never down to a config that was
   starved under today's conditions (until a config at or below it is measured not starved: a first
   window its workers' start starved is no bar once the next ones keep the band), nor to one a step up
   paid to leave, nor, under a heavy tail (the slowest batch seen over three times the p95: the mean and
   the p95 miss it), to a shorter lead than twice the slowest batch (the lead: workers x prefetch batches
   in the loop's time, what absorbs a slow batch), and only on two windows' evidence (slack costs CPU and
   RAM, starving costs throughput; one lucky window of a heavy-tailed cost is not slack). Where the model
   clearly underrates the current config (the loop ran faster than it predicts), never fewer workers than
   make the measured rate at their mean cost. The estimate (1 - starvation) cannot climb past the band where
   every fetch pays a fixed hand-over cost: a queue that never ran dry, fed by workers with twice the
   capacity needed, is slack in the band all the same, and is given back by the throughput it keeps alone
   (not by the band's top, which the estimate cannot reach). Fewer workers pay that hand-over alike and 0
   workers not at all (no batch leaves the training process): there the rate the loop measured, which the
   model has no term for the hand-over in, is what 0 workers must keep, so a batch cheaper to make in the
   loop than to take from a worker goes back to 0 workers (a 0.5 ms batch behind a 20 ms step held 1 worker
   at 92 % busy, where 0 workers run at 98 %).
8. **In the band**, or not clearly outside it: hold, with four exceptions. Window after window below the
   band's low edge (four or more pooled, below it by twice their standard error) adds throughput as in 5
   where the step is expected to gain twice ``min_gain``. On CPUs measured busy with more workers than they
   carry, the workers they carry (never fewer than could make the measured rate at their CPU time alone),
   on two windows' evidence, where the training process was measured using less than half a CPU: the model,
   sizing fewer workers from a batch's wall time that the contention inflated, cannot see them make as
   much, the CPUs can (the cut is judged like a give-back of 7). At the worker budget and starved, bursty
   stalls earn deeper prefetch as in 5. And where the loader measured a batch's cost and CPU share and the
   model explains the window (it does not see more throughput than was measured, or the loop waited only on
   each batch's hand-over: a batch ready at nearly every fetch, every fetch waiting about alike), the
   fewest workers that keep the same throughput by the rules of 7 (without the band's top) are the leanest
   config: workers the CPUs cannot carry go, on two windows' evidence. The two that add throughput there
   are refinements, taken only where the fit lasts long enough to pay for the rebuild twice over: at most
   the loop's wait a batch is won back, over the fit's batches left, and a rebuild costs a loader start as
   measured plus one batch's making (the lead the loop had refills); a deeper prefetch at the last quarter
   of a one-epoch fit held 1 point of utilization for a rebuild that stalled its 25 batches at 62 % busy.

**Verdicts follow the numbers.** *Data-bound (CPU saturated)* needs CPU evidence: the workers' measured
CPU use (batches per second x their wall time per batch x its CPU share) plus the training process's
(measured, else a whole CPU) at 85 % of the usable CPUs or more; measured steps that stopped paying
(a ceiling) and undone slower steps up count as evidence too, and so does, where the loader cannot say
its CPU share, the model's CPU limit once one more worker could not show its gain. Without evidence a
data-bound window is *data-bound (I/O)*. No window above the band is data-bound, whatever a rule
concluded: it is *compute-bound* (or *in band* where it still waited on data); and one clearly above it
(by the hysteresis) that did not wait is *compute-bound* though its config's pooled windows were not
clearly outside the band (the hold is the same: the verdict describes the window).

Noise: a config is judged on its last windows in a row pooled together (up to eight), and "clearly
outside" means beyond the band by ``hysteresis`` (0.02) plus the standard error of those windows'
utilization (twice that above the band), so a config sitting at an edge does not flip back and forth.

The best config (:func:`~lightning_dltune.core.history.best_config`: the end-of-fit table and the
recommendation) is the leanest whose median window throughput under the fit's latest conditions is
within ``min_gain`` of the best median there: never slower than a config measured under the same
conditions by more than ``min_gain``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.history import ChangeKind, FitHistory, change_kind, is_starved, recall, resources
from lightning_dltune.core.model import UNLIMITED, PipelineModel, batches_allowed, cores_used, prefetch_bytes
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
_TAIL = 3.0  # a slowest batch past this many times the p95 is a heavy tail's (a log-normal spread of 40 %: ~1.3)
_EDGE_WINDOWS = 4  # windows pooled below the band's low edge (within the hysteresis) that are no noise
_SATURATED = 0.85  # CPU use (production plus the training process) past this share of the usable CPUs: saturated
_BUSY_MAIN = 0.5  # a training process using this many CPUs or more: the workers' wait is not read as contention
_NEIGHBOUR = 0.25  # other processes taking this many CPUs or more are named where the job's leave the CPUs free
_PAYBACK = 2.0  # the most a refinement in the band can win back must be this many times its rebuild's cost

_Rule = tuple[LoaderConfig, Verdict, Reason]


def decide(
    current: LoaderConfig,
    stats: WindowStats,
    budget: Budget,
    history: Sequence[WindowRecord] = (),
    settings: PolicySettings = PolicySettings(),
    fewest_batches: int = 0,
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
        fewest_batches: the batches a judgement needs, the window pooled with its config's earlier ones under
            the same conditions; fewer are held (budgets still apply). Validation runs of a few batches.

    Returns:
        The next config (``current`` itself when nothing changes), the verdict, the structured reason,
        and the best config seen so far (this window included; see
        :func:`~lightning_dltune.core.history.best_config`).
    """
    fit = recall(history, current, stats, budget, settings)
    if stats.batches <= 0 or stats.step_total_s <= 0:
        config, verdict, reason = current, Verdict.IN_BAND, Reason(ReasonKind.NOTHING_MEASURED)
    else:
        config, verdict, reason = _apply_rules(current, fit.seen, budget, fit, settings, stats, fewest_batches)
    clamped, limit = clamp_to_budget(config, stats.batch_bytes, budget, settings)
    if clamped != config:  # a last guard: no rule may pick a config over budget
        config, verdict = clamped, Verdict.MEMORY_CAPPED if limit == "memory" else verdict
        reason = replace(reason, values={**reason.values, "budget_allows": pair(clamped)})
    if fit.shift is not None:
        reason = replace(reason, values={**reason.values, "shift": (fit.shift.signal, fit.shift.before, fit.shift.now)})
        if fit.shift.newest is not None:
            reason = replace(reason, values={**reason.values, "shift_newest": fit.shift.newest})
    confirm = fit.confirm_batches if reason.kind is ReasonKind.SHIFT_SUSPECTED else None
    return Decision(
        config=config,
        verdict=_consistent(verdict, stats, settings),
        reason=reason,
        best=fit.best,
        judged_util=fit.seen.utilization,
        confirm_batches=confirm,
    )


def _consistent(verdict: Verdict, stats: WindowStats, settings: PolicySettings) -> Verdict:
    """The verdict, unless the window's own utilization contradicts it: no window above the band is data-bound,
    and one clearly above it (by the hysteresis) that did not wait on data is compute-bound, though its config's
    pooled windows were not clearly outside the band (the hold is the same; the window is what the verdict
    describes)."""
    above, fed = stats.utilization > settings.band[1], stats.starvation_ratio < settings.min_starvation
    if verdict in (Verdict.DATA_BOUND_IO, Verdict.DATA_BOUND_CPU) and above:
        return Verdict.COMPUTE_BOUND if fed else Verdict.IN_BAND
    if verdict is Verdict.IN_BAND and fed and stats.utilization > settings.band[1] + settings.hysteresis:
        return Verdict.COMPUTE_BOUND
    return verdict


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
    fewest_batches: int = 0,
) -> _Rule:
    """The first rule that applies, in the order of the module docstring."""
    if stats.batches <= 0 or stats.step_mean_s <= 0:
        return current, Verdict.IN_BAND, Reason(ReasonKind.NOTHING_MEASURED)

    costed = stats  # a rise inside the window that shows it: the model sizes for the new conditions' cost
    if fit.shift is not None and fit.shift.newest is not None and current.num_workers > 0:
        costed = replace(stats, worker_batch_s=fit.shift.newest)
    model = PipelineModel.infer(
        current.num_workers, costed, budget.cpus, settings.burst_stall_fraction, current.prefetch_factor
    )
    # CPU saturation is a measurement, not the model's belief: production's and the training process's CPU use
    # near the usable CPUs. Without it a data-bound window counts as I/O-bound
    used = cores_used(stats, current.num_workers)
    cpu_bound = used is not None and used >= _SATURATED * budget.cpus
    data_verdict = Verdict.DATA_BOUND_CPU if cpu_bound else Verdict.DATA_BOUND_IO
    case = _Case(current, stats, budget, fit, settings, model, data_verdict, latest or stats)
    return (
        _over_budget(case)
        or _too_few(case, fewest_batches)
        or _suspected_shift(case)
        or _rebuild_cap(case)
        or _judge_last_change(case)
        or _against_the_band(case, case.latest)
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
    data_verdict: Verdict  # a data-bound window's verdict: CPU saturated where the CPUs were measured busy, else I/O
    latest: WindowStats  # the window just measured, on its own

    @property
    def cpu_bound(self) -> bool:
        """Whether the window's CPU use was measured near the usable CPUs."""
        return self.data_verdict is Verdict.DATA_BOUND_CPU

    @property
    def held(self) -> Verdict:
        """The verdict of a hold that no rule explains better: the window's own diagnosis."""
        return _window_verdict(self.stats, self.settings, self.data_verdict)

    def allowed(self, config: LoaderConfig, starved_below: bool = True) -> bool:
        """Not undone recently, nor down to (or below) a config starved under today's conditions (unless
        ``starved_below`` is off) or one that a step up paid to leave (going back there would undo a step that
        paid: ping-pong)."""
        w, p = resources(config)
        below = (*(self.fit.starved if starved_below else ()), *self.fit.outgrown)
        return config not in self.fit.rejected and not any(w <= sw and p <= sp for sw, sp in below)

    def keeps_the_lead(self, config: LoaderConfig) -> bool:
        """Whether a give-back to ``config`` keeps the lead that absorbs a heavy tail's slow batches.

        A batch is handed to a worker workers x prefetch batches before the loop needs it: that lead (in the
        loop's time) absorbs a slow batch, and one slower than it stalls the loop. Where the slowest batch
        seen under today's conditions (pooled windows: the largest) is over ``_TAIL`` times the p95, a heavy
        tail that the mean and the p95 (which the model sizes from) do not see, a give-back keeps a lead of
        twice the slowest batch (it may be followed by another on the same worker), or the current lead
        where that is shorter. Without workers every batch is made in the loop's time: the mean counts each.
        """
        stats = self.stats
        slowest, p95 = stats.worker_batch_max_s, stats.worker_batch_p95_s or stats.worker_batch_s
        if slowest is None or not p95 or slowest <= _TAIL * p95 or stats.batches <= 0 or config.num_workers == 0:
            return True
        pace = stats.busy_s / stats.batches
        lead = lambda c: c.num_workers * c.prefetch_factor * pace  # noqa: E731
        return lead(config) >= min(2.0 * slowest, lead(self.current))


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
            {
                "workers": current.num_workers,
                "max_workers": budget.max_workers,
                "run_batches": budget.run_batches,
                "to": pair(clamped),
            },
        )
    else:
        reason = Reason(
            ReasonKind.OVER_PREFETCH,
            {"prefetch": current.prefetch_factor, "max_prefetch": settings.max_prefetch_factor, "to": pair(clamped)},
        )
    return clamped, case.held, reason


def _too_few(case: _Case, fewest: int) -> Optional[_Rule]:
    """1b. Fewer batches than ``fewest`` measured with this config (its windows pooled): hold, no rule judges.

    Validation runs can be a few batches (``limit_val_batches``, a small held-out set): the starvation of
    two of them is the workers' start and noise, not the loaders' speed. They pool until they are enough.
    """
    stats = case.stats
    if stats.batches >= fewest:
        return None
    numbers = {"batches": stats.batches, "fewest": fewest, "windows": case.fit.windows, "config": pair(case.current)}
    verdict = _window_verdict(case.latest, case.settings, case.data_verdict)  # the run's own diagnosis
    return case.current, verdict, Reason(ReasonKind.FEW_BATCHES, numbers)


def _suspected_shift(case: _Case) -> Optional[_Rule]:
    """2. One window unlike the config's earlier ones: noise (a heavy tail) or new conditions; hold.

    Acting on it pooled with the old windows would size from a blend, and judging a change against them
    would blame the config. The next window only confirms: :func:`decide` asks for a short one.
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
    """4. A step up that made it slower, or a give-back that starved the loop or cost speed: measured again, undone."""
    current, stats, settings = case.current, case.stats, case.settings
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
            "rate_before": last.rates[0],
            "rate": last.rates[1],
            **({"tail_ms": 1e3 * last.tail_s} if last.tail_s > 0 else {}),
            "from": pair(last.before),
            "to": pair(current),
            **contention,
            **({"split": list(last.split)} if last.split else {}),
        }
        if not last.confirmed:  # one window is noise until a second agrees (and two that disagree, until two more)
            return current, case.held, Reason(ReasonKind.CONFIRM_SLOWER, numbers)
        return last.before, case.held, Reason(ReasonKind.UNDO_SLOWER, {**numbers, "windows": last.windows})
    # a cut taken below the band's low edge (on a starved window, at measured saturation, or one the band's edge
    # held only by noise) is judged by its speed alone: the config it left did not keep the band either, so a
    # window below it is no news. Its memory saved is certain where its loss is noise: lost beyond twice the
    # standard error of its windows' utilization too
    cut_below_band = last.before_stats.utilization < settings.band[0]
    starved = is_starved(stats, settings) and not cut_below_band
    noise = 2 * case.fit.util_error / max(stats.utilization, 1e-9) if cut_below_band else 0.0
    # a give-back keeps the data side's speed (the utilization: the step drifts on its own): undone where it clearly
    # lost more than `min_gain` of it (by the hysteresis too: the model aims at half of it), unless the step itself
    # slowed meanwhile
    lost = settings.min_gain + settings.hysteresis + noise
    slower = last.util_gain < -lost and not last.contention
    if last.kind is ChangeKind.GIVE_BACK and last.confirmed and (starved or slower):
        # one window is noise until a second agrees: the latest, on its own, must show the loss too (a
        # neighbour that slowed the give-back's first window only, and left, is no reason to go back)
        latest = case.latest
        gone = latest.utilization / max(last.before_stats.utilization, 1e-9) - 1.0 >= -lost
        if gone and not (is_starved(latest, settings) and not cut_below_band):
            starved = slower = False
    if last.kind is ChangeKind.GIVE_BACK and (starved or slower):
        numbers = {
            "config": pair(current),
            "util": stats.utilization,
            "low": settings.band[0],
            "starvation": stats.starvation_ratio,
            "to": pair(last.before),
            "gain": last.util_gain,
        }
        verdict = case.data_verdict if starved else case.held
        if not last.confirmed:
            return current, verdict, Reason(ReasonKind.CONFIRM_STARVED, numbers)
        return last.before, verdict, Reason(ReasonKind.UNDO_GIVE_BACK, numbers)
    return None


def _against_the_band(case: _Case, latest: WindowStats) -> _Rule:
    """5.-8. Where the window sits against the band.

    Clearly outside means by the hysteresis plus the pooled windows' standard error (twice that above the
    band: slack costs only CPU and RAM, starving costs throughput), so that a config sitting near an edge
    does not flip on noise.
    """
    current, stats, fit, settings = case.current, case.stats, case.fit, case.settings
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
    clearly_above = util > high + settings.hysteresis + 2 * fit.util_error
    if clearly_above or _slack_the_estimate_hides(case, latest):
        return _give_back(case, above=clearly_above)
    unpaid = None  # a refinement that adds throughput, but which the fit ends too soon to pay for
    for rule in (_below_the_edge, _oversubscribed_in_band, _deeper_at_the_budget, _leaner_in_band):
        taken = rule(case)
        refines = rule in (_below_the_edge, _deeper_at_the_budget)
        too_late = None if taken is None or not refines else _unpaid(case, taken[0])
        if taken is not None and too_late is None:
            return taken
        unpaid = unpaid or too_late
    return _hold_in_band(case, unpaid)


def _hold_in_band(case: _Case, unpaid: Optional[dict] = None) -> _Rule:
    """8. Hold (``unpaid``: the numbers of a refinement the fit ends too soon to pay for)."""
    low, high = case.settings.band
    util = case.stats.utilization
    numbers = {
        "util": util,
        "windows": case.fit.windows,
        "low": low,
        "high": high,
        "inside": low <= util <= high,
        "starvation": case.stats.starvation_ratio,
        "config": pair(case.current),
    }
    if unpaid is not None:
        numbers["unpaid"] = unpaid
    return case.current, Verdict.IN_BAND, Reason(ReasonKind.IN_BAND, numbers)


def _unpaid(case: _Case, target: LoaderConfig) -> Optional[dict]:
    """The numbers of a refinement in the band (``target``) that the fit ends too soon to pay for; ``None``: it pays,
    or the fit's length is unknown.

    A move there wins back at most the loop's wait a batch (the pooled windows' fetch wait) over the fit's batches
    left. A rebuild costs the loop a loader start, as the newest one measured (the wait for its first batch), plus
    one batch's making: the lead the loop had ahead is gone and refills. The move is taken where the most it can
    win is :data:`_PAYBACK` times that cost or more.
    """
    left, stats = case.budget.batches_left, case.stats
    if left is None or stats.batches <= 0:
        return None
    gain = stats.fetch_wait_total_s / stats.batches * left
    cost = case.fit.start_s + (stats.worker_batch_s or 0.0)
    if gain >= _PAYBACK * cost:
        return None
    return {"to": pair(target), "gain_s": gain, "cost_s": cost, "left": left}


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
    # past the workers the CPUs carry, stalls come from the contention: no deeper prefetch, the cut of 5 first
    bursts = None if _oversubscribed(case) else _deeper_prefetch(case, starved)
    handed_over = _handed_over(case, starved)
    if handed_over is not None:
        return handed_over
    stopped = _stopped_helping(case)
    if stopped is not None and stopped[2].kind is ReasonKind.STOPPED_HELPING and not case.cpu_bound:
        # more workers did not pay, yet nothing measured the CPUs busy: no saturation, and bursts that stall the
        # loop still earn deeper prefetch (a burst every tenth batch held 1 worker x prefetch 2 an epoch longer)
        return bursts or stopped
    return stopped or bursts or _more_workers(case, starved)


def _handed_over(case: _Case, starved: dict) -> Optional[_Rule]:
    """Starved with a batch ready at (nearly) every fetch: the loop waits on each batch's hand-over from a worker.

    No worker count or prefetch depth shortens that wait (every worker's batch is unpickled out of shared
    memory in the loop's time); 0 workers do not pay it, the loop makes each batch itself instead. Where that
    costs clearly less (the loop's measured rate below what 0 workers make by the model, at a cost two standard
    errors above the windows' mean, by ``min_gain``), 0 workers are measured on the first window that shows it (a
    starved window costs throughput for certain): judged by their speed like any give-back from below the band
    (a wrong move is undone on its second window), and, kept, the workers' ceiling under today's
    conditions (:mod:`~lightning_dltune.core.history`). Only where the loader measured a batch's cost and CPU
    share, never back to 0 workers after a step up from them paid, nor to 0 workers undone.
    """
    current, stats, fit, model, settings = case.current, case.stats, case.fit, case.model, case.settings
    if current.num_workers == 0 or stats.worker_batch_s is None or not model.cpu_known:
        return None
    stalled = max(stats.stall_fraction, case.latest.stall_fraction)
    if stalled > _DRY_QUEUE or model.rate <= 0:
        return None
    in_loop_s = (model.cpu_s + model.io_s) * (1.0 + 2.0 * fit.cost_error)
    gain = 1.0 / ((in_loop_s + model.step_mean_s) * model.rate) - 1.0  # 0 workers' rate over the loop's
    zero = current.replace(num_workers=0)
    if gain < settings.min_gain or not case.allowed(zero, starved_below=False):
        return None
    numbers = {**starved, "ready": 1.0 - stalled, "wait_s": stats.fetch_wait_mean_s, "batch_s": in_loop_s, "gain": gain}
    return zero, case.data_verdict, Reason(ReasonKind.HANDED_OVER, {**numbers, "to": pair(zero)})


def _stopped_helping(case: _Case) -> Optional[_Rule]:
    """The last step up of workers gained less than ``min_gain`` where the model expected twice that: no more.

    The workers it added only hold memory (and, on CPUs measured busy, fight over the cores, whatever was
    expected of them): they go back, the config before being as fast with less (unless the step paid half of
    ``min_gain``: going back would undo a step that paid). The config before is then the workers' ceiling
    under today's conditions (:mod:`~lightning_dltune.core.history`): no smaller step up is tried instead.
    """
    current, last, settings = case.current, case.fit.last_change, case.settings
    if last is None or last.kind is not ChangeKind.MORE_WORKERS:
        return None
    give_back = (
        (case.cpu_bound or last.stopped_helping)
        and last.gain < settings.min_gain
        and case.allowed(last.before, starved_below=False)
    )
    if not (last.stopped_helping or give_back):
        return None
    numbers = {
        "from_workers": last.before.num_workers,
        "workers": current.num_workers,
        "gain": last.gain,
        "min_gain": settings.min_gain,
        # CPU saturation only where the CPUs were measured busy: else the workers' limit is storage's or the loop's
        "cpu_bound": case.cpu_bound,
    }
    if not last.confirmed:
        return current, case.data_verdict, Reason(ReasonKind.CONFIRM_NO_GAIN, numbers)
    if give_back:
        return last.before, case.data_verdict, Reason(ReasonKind.STOPPED_HELPING, {**numbers, "to": pair(last.before)})
    return current, case.data_verdict, Reason(ReasonKind.STOPPED_HELPING, numbers)


def _deeper_prefetch(case: _Case, starved: dict) -> Optional[_Rule]:
    """Bursty: the workers make enough on average, yet some fetches wait: deeper prefetch absorbs bursts."""
    current, stats, fit, settings, model = case.current, case.stats, case.fit, case.settings, case.model
    workers, prefetch = current.num_workers, current.prefetch_factor
    capacity_ratio = model.mean_capacity(workers) / model.demand if workers else 0.0
    # (where the loader cannot say what a batch costs, workers that finish together also leave most fetches a
    # batch ready: only a loop that waits less than a quarter of its time is taken for bursty then). Bursts are
    # stalls: where no fetch found the queue empty, the wait is each batch's hand-over, which no depth shortens
    bursty = (
        workers > 0
        and stats.stalls > 0
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
    """Steady: Little's law says how many workers keep up with the step, plus headroom.

    Where the model sees no gain (or stops at the CPUs it believes busy) but the CPUs were measured far from
    busy, the loop's own delivery sizes one step up instead: the measurement decides.
    """
    current, budget, fit, model, settings = case.current, case.budget, case.fit, case.model, case.settings
    workers = current.num_workers
    ceiling = fit.worker_ceiling if fit.worker_ceiling is not None else UNLIMITED
    reach = min(budget.max_workers, ceiling)  # the most workers a measured step may try
    limit = min(reach, model.cpu_limit())  # the most the model sizes for
    cost = {"batch_s": model.batch_mean_s, "step_s": model.step_mean_s}
    if workers >= limit:
        return _at_worker_limit(case, starved, cost, limit, ceiling)
    wanted = model.workers_for(settings.headroom * model.demand, workers + 1, limit) or limit
    wanted = max(wanted, workers + 1)
    gain = model.throughput(wanted) / model.throughput(workers) - 1.0
    if gain >= settings.min_gain:
        return _step_up(case, starved, cost, wanted)
    measured = (
        _saturated_probe(case, starved, cost, reach) if case.cpu_bound else _measured_step(case, starved, cost, reach)
    )
    # contention eats what more workers would add: the model says they cannot help (and the CPUs agree)
    if measured is not None:
        return measured
    verdict = _modelled_cpu_verdict(case)
    cpu_bound = verdict is Verdict.DATA_BOUND_CPU
    numbers = {**starved, **cost, "wanted": wanted, "gain": gain, "cpus": budget.cpus, "cpu_bound": cpu_bound}
    neighbour = _busy_beside_a_neighbour(case)
    if neighbour is not None:
        numbers["others"] = neighbour
    return current, verdict, Reason(ReasonKind.NO_MODELLED_GAIN, numbers)


def _busy_beside_a_neighbour(case: _Case) -> Optional[float]:
    """The CPUs other processes took where, with them, the cores were busy (past :data:`_SATURATED`) though this
    job's own use was not; ``None`` otherwise, and where the window did not read the cores.

    There the CPUs are not free: a step up sized by the loop's delivery (:func:`_measured_step`) would only
    take the cores a larger share from the neighbour, and oversubscribe them once it leaves. In the tuning
    benchmark's noisy-neighbour workload (a CPU hog for one epoch on 2 cores) 4 -> 7 workers was such a step,
    taken as the hog's epoch ended: it held 7 x 2 for four epochs at 1.42 times the best config's memory
    (1.11 of its time), or measured -1 % and went back after an epoch at 888 samples/s against 1,250.
    """
    others, busy = case.stats.other_cpus, case.stats.cpu_busy
    if case.cpu_bound or others is None or busy is None or others < _NEIGHBOUR or busy < _SATURATED:
        return None
    return others


def _measured_step(case: _Case, starved: dict, cost: dict, reach: int) -> Optional[_Rule]:
    """A step up sized by the loop's delivery (each worker delivering what it did), for the gain check to judge.

    Past the model's CPU limit, where production's CPU share is unknown (it counts as CPU work), one worker
    at a time: a CPU-bound pipeline there pays for a bigger step in contention. ``None`` where the step is
    expected to gain less than twice ``min_gain``: no window could tell that gain from noise, and where a
    neighbour keeps the cores busy (:func:`_busy_beside_a_neighbour`): the CPUs are not free.
    """
    if _busy_beside_a_neighbour(case) is not None:
        return None
    model, workers = case.model, case.current.num_workers
    wanted = model.measured_step(case.settings.headroom)
    if not model.cpu_known:
        wanted = min(wanted, max(workers + 1, model.cpu_limit()))
    wanted = min(wanted, reach)
    expected = model.measured_throughput(wanted) / model.measured_throughput(workers) - 1.0
    if wanted <= workers or expected < 2 * case.settings.min_gain:
        return None
    return _step_up(case, starved, cost, wanted, sized_by="delivery")


def _oversubscribed(case: _Case) -> bool:
    """More workers than the CPUs the model counts carry, where that is evidence: the CPUs measured busy, or at
    the budget's most (nothing up to measure) with the loader's measured CPU share."""
    workers, model = case.current.num_workers, case.model
    evidence = case.cpu_bound or (workers >= case.budget.max_workers and model.cpu_known)
    return evidence and workers > model.cpu_limit()


def _oversubscribed_cut(case: _Case, cpu_limit: int) -> Optional[LoaderConfig]:
    """Past saturation, starved: first prefetch to 1 (the queue is empty whatever its depth: batches in flight
    beyond one a worker only hold memory), then the workers the CPUs carry (the rest fight over the cores).

    The workers the CPUs carry keep two batches in flight each (the default prefetch) where more than that
    were in flight: at one each, in-order delivery idles a worker whose batch is done before the one the loop
    waits on (the benchmark's JPEG pipeline on 2 CPUs: 2 x 1 ran 23 % slower than 2 x 2).

    Taken although the loop starved at more resources: a cut at measured saturation is judged by its speed
    (:func:`_judge_last_change`), and not while the last change is still being judged.
    """
    current = case.current
    if _change_being_judged(case):
        return None
    cuts = [current.replace(prefetch_factor=1)] if current.prefetch_factor > 1 else []
    in_flight = current.num_workers * current.prefetch_factor
    carried = 2 if in_flight >= 2 * cpu_limit else 1
    cuts.append(current.replace(num_workers=cpu_limit, prefetch_factor=carried))
    return next((cut for cut in cuts if case.allowed(cut, starved_below=False)), None)


def _saturated_probe(case: _Case, starved: dict, cost: dict, reach: int) -> Optional[_Rule]:
    """Starved on CPUs measured busy: the same batches in flight shared over more workers, measured once.

    Saturation says the cores are busy, not that the work cannot run faster shared out otherwise: a
    batch's CPU cost and in-order delivery's idling both depend on how many workers make how many batches
    each, and contention's cost is not modelled. So the workers x prefetch batches in flight go to one each
    over more workers (at most twice as many), within the budget. The step is judged like any step up: kept
    where it pays ``min_gain``, given back where it does not (see :func:`_stopped_helping`), undone where it
    is slower, and not tried again under the same conditions.

    At prefetch 1 the batches are already one a worker: there is nothing to share out, and one more worker
    on busy cores only adds contention (the benchmark's JPEG pipeline on 2 CPUs, 4 x 1 -> 5 x 1 measured
    4-10 % slower and cost two rebuilds), so it holds.
    """
    current, fit, stats, settings = case.current, case.fit, case.stats, case.settings
    workers, prefetch = current.num_workers, current.prefetch_factor
    if not case.cpu_bound or workers < 1 or prefetch < 2 or workers >= reach or fit.worker_ceiling is not None:
        return None
    if _change_being_judged(case):
        return None
    wanted = min(reach, 2 * workers, workers * prefetch)
    target, _ = clamp_to_budget(
        current.replace(num_workers=wanted, prefetch_factor=1), stats.batch_bytes, case.budget, settings
    )
    if target.num_workers <= workers or target in fit.rejected:
        return None
    numbers = {**starved, **cost, "to_workers": target.num_workers, "prefetch": prefetch, "to_prefetch": 1}
    return target, case.data_verdict, Reason(ReasonKind.MORE_WORKERS, {**numbers, "sized_by": "probe"})


def _change_being_judged(case: _Case) -> bool:
    """The last change is not yet measured on enough windows to be judged."""
    last = case.fit.last_change
    return last is not None and not last.confirmed


def _modelled_cpu_verdict(case: _Case) -> Verdict:
    """The verdict of a hold at the CPUs the model counts: CPU saturated where measured busy, or where the loader
    cannot say its CPU share (the model counts it as CPU work, and one more worker could not show its gain)."""
    return Verdict.DATA_BOUND_CPU if case.cpu_bound or not case.model.cpu_known else case.data_verdict


def _step_up(case: _Case, starved: dict, cost: dict, wanted: int, sized_by: str = "model") -> _Rule:
    """To ``wanted`` workers, within the memory budget and past undone configs."""
    current, stats, budget, fit, settings = case.current, case.stats, case.budget, case.fit, case.settings
    workers = current.num_workers
    target, why = clamp_to_budget(current.replace(num_workers=wanted), stats.batch_bytes, budget, settings)
    while target in fit.rejected and target.num_workers > workers:
        target = target.replace(num_workers=target.num_workers - 1)
    if target.num_workers <= workers:
        if why == "memory":
            return _memory_capped_hold(case, starved, wanted)
        return current, case.data_verdict, Reason(ReasonKind.MORE_WORKERS_UNDONE, {**starved, **cost})
    if why == "memory" and target.num_workers < wanted:
        return _memory_capped_workers(case, starved, wanted, target)
    target = _light_prefetch(target, stats.batch_bytes, budget)
    numbers = {
        **starved,
        **cost,
        "to_workers": target.num_workers,
        "prefetch": current.prefetch_factor,
        "to_prefetch": target.prefetch_factor,
        "sized_by": sized_by,
    }
    others = stats.other_cpus
    if sized_by == "delivery" and others is not None and others >= _NEIGHBOUR:
        numbers["others"] = others  # the job's processes leave the CPUs free, a neighbour does not
    return target, case.data_verdict, Reason(ReasonKind.MORE_WORKERS, numbers)


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
    """Already at the most workers: the ceiling more workers met before, the CPUs' saturation, or the budget.

    The model's CPU limit holds only where the CPUs were measured busy; else one step past it is measured.
    """
    current, fit, model = case.current, case.fit, case.model
    workers, cpu_limit = current.num_workers, model.cpu_limit()
    reach = min(case.budget.max_workers, ceiling)
    cpus = {"cpus": case.budget.cpus, "cpu_share": model.cpu_share}
    if limit == ceiling:
        return (
            current,
            case.data_verdict,
            Reason(
                ReasonKind.AT_WORKER_CEILING, {**starved, "ceiling": fit.worker_ceiling, "cpu_bound": case.cpu_bound}
            ),
        )
    measured = None
    if limit == cpu_limit and not case.cpu_bound and workers < reach:
        measured = _measured_step(case, starved, cost, reach)
    if measured is not None or limit != cpu_limit:
        return measured or (current, case.data_verdict, _at_worker_budget(case, starved, cost))
    cut = _oversubscribed_cut(case, cpu_limit) if _oversubscribed(case) else None
    if cut is not None:
        verdict = _modelled_cpu_verdict(case)
        numbers = {**starved, **cpus, "prefetch": current.prefetch_factor, "to": pair(cut), "cpu_bound": case.cpu_bound}
        return cut, verdict, Reason(ReasonKind.OVERSUBSCRIBED, numbers)
    probe = _saturated_probe(case, starved, cost, reach)
    if probe is not None:
        return probe
    if case.cpu_bound or workers >= reach or not model.cpu_known:
        verdict = _modelled_cpu_verdict(case)
        numbers = {**starved, **cpus, "cpu_bound": verdict is Verdict.DATA_BOUND_CPU}
        neighbour = _busy_beside_a_neighbour(case)
        if neighbour is not None:
            numbers["others"] = neighbour
        return current, verdict, Reason(ReasonKind.CPUS_SATURATED, numbers)
    return current, case.data_verdict, _at_worker_budget(case, starved, cost)


def _at_worker_budget(case: _Case, starved: dict, cost: dict) -> Reason:
    """Holding at the worker budget's most (and, where a run's batches set it, how many those are)."""
    return Reason(ReasonKind.AT_WORKER_BUDGET, {**starved, **cost, "run_batches": case.budget.run_batches})


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


def _give_back(case: _Case, above: bool = True) -> _Rule:
    """7. Above the band: the fewest workers (and, where the queue never ran dry, prefetch back to the default)
    the model says keep the band's top and the throughput, on two windows' evidence.

    ``above`` off: slack the estimate hides in the band (:func:`_slack_the_estimate_hides`); the estimate
    cannot climb past the band's top there, so only the throughput is to be kept.
    """
    current, stats, fit = case.current, case.stats, case.fit
    util, starvation = stats.utilization, stats.starvation_ratio
    workers, prefetch = current.num_workers, current.prefetch_factor
    verdict = Verdict.COMPUTE_BOUND if starvation < case.settings.min_starvation else Verdict.IN_BAND
    seen = {"util": util, "windows": fit.windows, "starvation": starvation}
    # slack costs only CPU and RAM, starving costs throughput: give back on two windows' evidence, not one
    confirmed = fit.windows >= 2
    # prefetch deeper than the DataLoader's default only absorbs bursts, and there is no model for those: it goes
    # back to the default in one notch only where the queue hardly ever ran dry and the loop hardly waited, on
    # confirmed slack (it saves memory only: no hurry)
    queue_idle = stats.stall_fraction <= _DRY_QUEUE and starvation <= _DRY_QUEUE / 5
    shallower = min(prefetch, _DEFAULT_PREFETCH) if workers and queue_idle and confirmed else prefetch
    leaner = _leanest_keeping(case, shallower, above=above) if confirmed else None
    if leaner is not None:
        return leaner[0], verdict, _give_back_reason(case, leaner, seen)
    candidate = current.replace(prefetch_factor=shallower)
    if shallower < prefetch and case.allowed(candidate) and case.keeps_the_lead(candidate):
        return (
            candidate,
            verdict,
            Reason(ReasonKind.GIVE_BACK_PREFETCH, {**seen, "prefetch": prefetch, "to_prefetch": shallower}),
        )
    if not confirmed and workers and prefetch > _DEFAULT_PREFETCH and queue_idle:
        return current, verdict, Reason(ReasonKind.SLACK_UNCONFIRMED, seen)
    if not confirmed and workers and case.allowed(current.replace(num_workers=workers - 1)):
        return current, verdict, Reason(ReasonKind.SLACK_UNCONFIRMED, seen)
    return current, verdict, Reason(ReasonKind.LEANEST, {**seen, "config": pair(current)})


def _below_the_edge(case: _Case) -> Optional[_Rule]:
    """8. Below the band within the hysteresis, window after window: add throughput where it clearly pays.

    The hysteresis keeps noise at the edge from flipping a config; several windows pooled below the band's
    low edge by twice their standard error are no noise. Only a step the model (or the loop's delivery)
    expects to gain twice ``min_gain`` is taken, one the gain check can judge.
    """
    stats, fit, settings, model = case.stats, case.fit, case.settings, case.model
    low = settings.band[0]
    if fit.windows < _EDGE_WINDOWS or stats.utilization >= low - 2 * fit.util_error:
        return None
    if stats.starvation_ratio < settings.min_starvation:
        return None
    rule = _add_throughput(case)
    config = rule[0]
    if config == case.current or change_kind(case.current, config) not in (
        ChangeKind.MORE_WORKERS,
        ChangeKind.MORE_PREFETCH,
    ):
        return None
    now = model.throughput(case.current.num_workers)
    expected = max(model.throughput(config.num_workers, config.prefetch_factor) / now, 1.0) - 1.0
    if config.num_workers > case.current.num_workers:
        expected = max(expected, model.measured_throughput(config.num_workers) / model.rate - 1.0)
    return rule if expected >= 2 * settings.min_gain else None


def _deeper_at_the_budget(case: _Case) -> Optional[_Rule]:
    """8. In the band but starved, at the most workers the budget allows: deeper prefetch where stalls are bursts.

    More workers are not the answer there, and with a spread of batch times the loop waits for the slowest
    outstanding one: batches held ahead absorb it (on two windows' evidence; the gain check judges the step).
    """
    current, stats, fit = case.current, case.stats, case.fit
    if fit.windows < 2 or current.num_workers < case.budget.max_workers:
        return None
    if stats.starvation_ratio < case.settings.min_starvation:
        return None
    starved = {"starvation": stats.starvation_ratio, "windows": fit.windows, "workers": current.num_workers}
    return _deeper_prefetch(case, starved)


def _oversubscribed_in_band(case: _Case) -> Optional[_Rule]:
    """8. In the band on CPUs measured busy, with more workers than the CPUs carry: the workers they carry.

    Where the model explains the window, the leanest config it says keeps the throughput
    (:func:`_leaner_in_band`). Where it does not, it sized fewer workers from a batch's wall time that the
    many's contention inflated, and cannot see them make as much on the same busy cores (7 workers on 2 CPUs
    held in the band at 1.2-1.3 times the memory of 2). The CPUs can: past their count workers add processes,
    memory and contention, not throughput. So the workers the CPUs carry (at the same prefetch; never fewer
    than could make the measured rate, with the headroom, were each batch only its CPU time), on two
    windows' evidence, not while the last change is judged, never down to a config starved under today's
    conditions nor to a shorter lead than a heavy tail needs, and judged like any give-back: undone where it
    leaves the loop starved or clearly slower. No deeper prefetch first: stalls there are the contention's.

    Only where the training process was measured using less than half a CPU: the cut reads the workers' time
    off a core as waiting for one. Where the training process holds a core itself (a step computed on the
    CPU), the workers share what it leaves and their measured share cannot tell that wait from storage's:
    the demo's JPEG pipeline, its training process using a whole CPU for a real backward pass, was cut
    5 -> 2 and 7 -> 2 there and ran 74-81 % busy until the cut was undone.
    """
    current, model, fit = case.current, case.model, case.fit
    if not case.cpu_bound or not model.cpu_known or fit.windows < 2:
        return None
    if not model.main_known or model.main >= _BUSY_MAIN:
        return None  # the workers' wait may be storage as much as a core: left to the model's give-backs
    cpu_limit = model.cpu_limit()
    if current.num_workers <= cpu_limit:
        return None
    leaner = _leaner_in_band(case)
    if leaner is not None:
        return leaner
    # never fewer than could make the measured rate (with the headroom) were every batch only its CPU time: each
    # worker makes at most one batch per CPU time, so fewer cannot keep the throughput whatever the contention
    floor = math.ceil(case.settings.headroom * model.rate * model.cpu_s - 1e-9)
    target = max(cpu_limit, floor, 1)
    if target >= current.num_workers:
        return None
    cut = current.replace(num_workers=target)
    if _change_being_judged(case) or not case.allowed(cut) or not case.keeps_the_lead(cut):
        return None
    numbers = {
        "starvation": case.stats.starvation_ratio,
        "windows": fit.windows,
        "workers": current.num_workers,
        "cpus": case.budget.cpus,
        "cpu_share": model.cpu_share,
        "prefetch": current.prefetch_factor,
        "to": pair(cut),
        "cpu_bound": True,
    }
    return cut, case.held, Reason(ReasonKind.OVERSUBSCRIBED, numbers)


def _leaner_in_band(case: _Case) -> Optional[_Rule]:
    """8. In the band: fewer workers where the model says they keep the same throughput (on two windows).

    Only where the loader measured what a batch costs and its CPU share: a cost inferred from the loop's clock
    (CPU work where unknown) says fewer workers contend less, a guess that is no evidence for giving back.
    """
    stats, model, settings = case.stats, case.model, case.settings
    if case.fit.windows < 2 or case.current.num_workers == 0 or stats.worker_batch_s is None:
        return None
    # and only where the model explains the window: one that sees no starvation in a starved loop is off, unless
    # a batch was ready at (nearly) every fetch and every fetch waited about alike: that loop waited on each
    # batch's hand-over, which the model has no term for and fewer workers pay alike (the benchmark's 12 MB
    # batches: 5 x 1 at 93 % busy, the model's 47 batches a second against the 43.5 measured, held the band at
    # 1.2-2.1x the oracle's memory beside 4 x 1). A mean wait made of a few long stalls is no hand-over, nor is
    # one beside a training process that holds a core itself (measured at half a CPU or more): its own work for
    # the CPUs shows in every fetch alike (the demo's real backward pass gave 5 -> 2 workers back, 72 % busy)
    handed_over = (
        stats.stall_fraction <= _DRY_QUEUE
        and stats.fetch_wait_p50_s >= 0.5 * stats.fetch_wait_mean_s
        and model.main_known
        and model.main < _BUSY_MAIN
    )
    if not model.cpu_known or (
        not handed_over and model.throughput(case.current.num_workers) > (1 + settings.min_gain / 2) * model.rate
    ):
        return None
    leaner = _leanest_keeping(case, case.current.prefetch_factor, above=False)
    if leaner is None:
        return None
    seen = {"util": stats.utilization, "windows": case.fit.windows, "starvation": stats.starvation_ratio}
    return leaner[0], Verdict.IN_BAND, _give_back_reason(case, leaner, seen)


def _leanest_keeping(case: _Case, prefetch: int, above: bool) -> Optional[tuple[LoaderConfig, float]]:
    """The fewest workers (at ``prefetch``) the model says keep the throughput, and the utilization predicted.

    Keeping means losing at most half of ``min_gain`` by the model (the confirming windows undo a give-back
    that clearly lost ``min_gain``: the margin keeps that from being a coin toss), also against the best
    utilization measured under today's conditions or in the latest window (give-backs in a row do not add up,
    and a config's first window, its workers starting, does not lower the bar), and, from above the
    band, staying above the band's top by the hysteresis (a model a few points off still keeps the band). Never
    a config undone, nor one at or below a config starved today.
    """
    current, stats, model, settings = case.current, case.stats, case.model, case.settings
    workers = current.num_workers
    now = model.throughput(workers)
    keep = 1.0 - settings.min_gain / 2
    underrated = model.rate > (1.0 + settings.min_gain / 2) * now
    best = max(stats.utilization, case.latest.utilization, case.fit.best_util)
    # the fewer workers are judged at a cost two standard errors above the windows' mean: a lucky pair of windows
    # (production that drifted fast) is not slack
    doubt = 1.0 + 2.0 * case.fit.cost_error
    cautious = replace(model, cpu_s=model.cpu_s * doubt, io_s=model.io_s * doubt)
    # a loop that waited although its batches were ready when asked paid each batch's hand-over from a worker
    # (unpickled out of shared memory), which the model has no term for and fewer workers pay alike; with 0
    # workers no batch leaves the training process: there the measured rate, not the model's, is what to keep
    handed_over = stats.stall_fraction <= _DRY_QUEUE and 0.0 < model.rate < now
    for fewer in range(0, workers):
        candidate = current.replace(num_workers=fewer, prefetch_factor=prefetch if fewer else current.prefetch_factor)
        yardstick = model.rate if handed_over and not fewer else now
        kept = cautious.throughput(fewer, candidate.prefetch_factor) / yardstick
        predicted = stats.utilization * kept
        if kept < keep or predicted < keep * best or (above and predicted < settings.band[1] + settings.hysteresis):
            continue
        # where the model clearly underrates the current config, a ratio of its throughputs hides that (at 7
        # workers on 2 CPUs the spread contention put on their batches made it see half the rate the loop ran
        # at, and 1 worker looked as fast): then never fewer than make, at their mean cost, the rate measured
        bound = cautious.mean_capacity(fewer) if fewer else cautious.throughput(0)
        if underrated and bound < keep * model.rate:
            continue
        if case.allowed(candidate) and case.keeps_the_lead(candidate):
            return candidate, predicted
    return None


def _give_back_reason(case: _Case, leaner: tuple[LoaderConfig, float], seen: dict) -> Reason:
    config, predicted = leaner
    current = case.current
    if config.num_workers == current.num_workers:
        return Reason(
            ReasonKind.GIVE_BACK_PREFETCH,
            {**seen, "prefetch": current.prefetch_factor, "to_prefetch": config.prefetch_factor},
        )
    numbers = {
        **seen,
        "workers": current.num_workers,
        "to_workers": config.num_workers,
        "predicted": min(predicted, 1.0),
        "prefetch": current.prefetch_factor,
        "to_prefetch": config.prefetch_factor,
    }
    return Reason(ReasonKind.GIVE_BACK_WORKERS, numbers)
