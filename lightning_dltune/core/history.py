"""What the policy remembers of a fit, replayed from its window records (the policy keeps no state).

Also the one notion of the **best config**: the leanest config (fewest workers, then the shallowest
prefetch) whose median window throughput under the fit's latest conditions is within ``min_gain`` of the
best median there. The decision, the end-of-fit table and the recommendation all use it
(:func:`best_config`, :func:`median_rate` for the window to cite).
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Callable, Optional, Sequence, TypeVar

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.model import UNLIMITED, PipelineModel
from lightning_dltune.core.records import Budget, PolicySettings, WindowRecord
from lightning_dltune.core.stats import WindowStats, pool_windows

T = TypeVar("T")

POOLED_WINDOWS = 8  # a config is judged on its last this-many windows in a row: noise averages out,
# a real change in the pipeline still shows within a few windows
CONFIRM_WINDOWS = 2  # a change is judged on this many windows of the new config: one noisy window never undoes it
RETRY_AFTER_WINDOWS = 16  # a config undone while the machine was busy (the step slowed: contention) may be tried
# again after this many windows, doubling each time it is undone again; other undos stand until conditions shift
SHIFT_COST = 0.5  # a worker's time per batch that moved by more than this share of its pooled mean ...
SHIFT_STEP = 0.10  # ... or a step time by more than this share (an accelerator's step is steady: a slower one
# means a busier host, whose pooled windows would otherwise read as slack) ...
SHIFT_STARVATION = 0.15  # ... or starvation that moved by more than this (absolute) ...
SHIFT_SIGMAS = 3.0  # ... and by more than this many standard deviations of the pooled windows: new conditions
SHIFT_OTHERS = 0.5  # the CPUs other processes took (a neighbour) moved by more than this many (and the sigmas), on
OTHERS_FELT = 0.85  # cores busy past this share of their time with it or without it (else it takes none we need)
OTHERS_LEFT = 0.25  # a config starved (or outgrown) beside other processes' CPUs that fell by more than this since
# is not starved today (see `_Replay._today`)
SHIFT_FELT = 0.05  # a cost's move, shared among the workers, is at least this share of a step: one the loop cannot
# feel (7 workers' 1.1 ms batches down to 0.4 ms beside a 20 ms step) is no new condition for the loaders
MIXED_COST = 2**0.25  # a window's p95 cost read as its newest batches' must clear its mean by a p95 bin's width
PARTIAL_MOVE = 2 / 3  # a shift's first window that moved less than this of the second's way holds the change inside it
CONFIRM_BATCHES = 10  # a window that confirms a suspected shift holds at least this many batches
_Z95 = 1.6449  # a normal's p95, in standard deviations
REPLAYED_WINDOWS = 256  # a decision replays the fit's latest this-many windows: its cost stays bounded in a long
# fit (12-14 ms), where replaying every window grew with it (352 ms a decision at 2000 windows). At the
# defaults (3-5 s a window) that is the last 13-21 minutes: older undos and ceilings expire, the rebuild cap
# counts the changes in them
CONTENTION_STEP = 0.25  # a step this much slower than before a change: the machine got busier (or our workers
# take the training process's CPU); the change is measured again before it is judged
SPLIT_SLOWER = 2.0  # a change's judged windows disagree where one is not slower (by `min_gain`) and another is
# slower by more than this many times `min_gain`, and ...
SPLIT_OTHERS = SHIFT_OTHERS  # ... what other processes took of the cores moved between them by more than this
# many CPUs: the conditions moved between them, and the change is judged afresh on the windows after them


class ChangeKind(str, Enum):
    MORE_WORKERS = "more_workers"
    MORE_PREFETCH = "more_prefetch"
    GIVE_BACK = "give_back"
    OTHER = "other"


@dataclass(frozen=True)
class LastChange:
    """The change that produced the current config: the config before it, its windows, and how it went so far.

    Args:
        before: the config before the change.
        before_stats: ``before``'s windows pooled (the baseline).
        kind: what the change did.
        gain: relative throughput change, the current config's windows since the change vs ``before_stats``.
        stopped_helping: more workers that the model said would clearly pay, and did not.
        windows: windows of the current config since the change (it is judged once ``CONFIRM_WINDOWS``).
        step_ratio: the current config's step time over ``before``'s (above ``1 + CONTENTION_STEP``: contention).
        util_gain: relative utilization change, like ``gain`` (the data side's speed at the step of the day: a
            step that drifts moves ``gain``, not this).
        rates: the samples per second ``gain`` compares (:func:`judged_rates`), before and since the change.
        tail_s: the heavy tail's stall a batch charged to both sides alike (0: none seen).
        split: each judged window's own ``gain`` where they disagree (see :data:`SPLIT_SLOWER`): the change is
            measured again, on windows after them (empty: they agree, or it is not judged yet).
    """

    before: LoaderConfig
    before_stats: WindowStats
    kind: ChangeKind
    gain: float
    stopped_helping: bool = False
    windows: int = 1
    step_ratio: float = 1.0
    util_gain: float = 0.0
    rates: tuple[float, float] = (0.0, 0.0)
    tail_s: float = 0.0
    split: tuple[float, ...] = ()

    @property
    def confirmed(self) -> bool:
        """Measured on enough windows, which agree, to be judged."""
        return self.windows >= CONFIRM_WINDOWS and not self.split

    @property
    def contention(self) -> bool:
        """The step itself got slower after the change: throughput fell for a reason the data side may not hold."""
        return self.step_ratio > 1.0 + CONTENTION_STEP


@dataclass(frozen=True)
class Shift:
    """New conditions: the newest window's ``signal`` moved from ``before`` (its pooled windows) to ``now``."""

    signal: str  # "batch time", "step time", "starvation", "other processes' CPUs"
    before: float
    now: float
    newest: Optional[float] = None  # a rise inside the window that shows it: the new conditions' cost per batch


@dataclass(frozen=True)
class FitHistory:
    """The fit so far, as the rules need it. Everything learned before the latest :class:`Shift` is dropped."""

    seen: WindowStats  # the current config's recent windows pooled into one (noise averages out)
    windows: int  # how many windows ``seen`` pools
    util_error: float  # standard error of ``seen``'s utilization (0 for a single window)
    rebuilds: int  # changes since conditions last shifted (the rebuild cap counts these)
    rejected: tuple[LoaderConfig, ...]  # configs undone recently: not tried again until they expire
    starved: tuple[tuple[int, int], ...]  # (workers, prefetch) of configs starved under today's conditions
    worker_ceiling: Optional[int]
    prefetch_ceiling: Optional[int]
    last_change: Optional[LastChange]
    best: Optional[LoaderConfig]
    shift: Optional[Shift] = None  # conditions shifted: the newest two windows agree on it
    suspect: Optional[Shift] = None  # the newest window alone left the config's earlier ones: noise or new conditions
    confirm_batches: Optional[int] = None  # batches enough to confirm ``suspect`` (see :func:`confirm_batches`)
    outgrown: tuple[tuple[int, int], ...] = ()  # (workers, prefetch) that a step up left and paid for, today
    cost_error: float = 0.0  # relative standard error of the data side's cost per batch over ``seen``'s windows
    best_util: float = 0.0  # the highest utilization of windows pooled two or more, under today's conditions
    start_s: float = 0.0  # the newest loader start measured (its first batch's wait): what a rebuild costs the loop


@dataclass
class _Strike:
    """An undone config or a ceiling: when it was set and for how long it stands."""

    value: Any
    at: int
    strikes: int
    busy: bool  # judged while the step itself was slower (contention): the verdict may be the machine's

    def stands(self, now: int) -> bool:
        return not self.busy or now - self.at < RETRY_AFTER_WINDOWS * 2 ** (self.strikes - 1)


@dataclass
class _Streak:
    """The windows of one config in a row, and the change that started it (if the policy made one)."""

    start: int
    config: LoaderConfig
    before: Optional[LoaderConfig] = None
    before_stats: Optional[WindowStats] = None
    kind: ChangeKind = ChangeKind.OTHER
    undo: bool = False  # the streak undoes the streak before it: never judged, or undos would ping-pong
    judged_from: int = -1  # the first window the change is judged on and the config's windows pool from (-1:
    # ``start``); later where its judged windows split


_Window = tuple[LoaderConfig, WindowStats, Optional[LoaderConfig]]  # a window's config, stats, and the config after it


def recall(
    history: Sequence[WindowRecord], current: LoaderConfig, stats: WindowStats, budget: Budget, settings: PolicySettings
) -> FitHistory:
    """Replay ``history`` plus the window just measured (``current``, ``stats``): its latest
    :data:`REPLAYED_WINDOWS` windows, the older ones are not remembered."""
    history = history[len(history) - min(len(history), REPLAYED_WINDOWS - 1) :]
    windows = [(r.config, r.stats, r.next_config) for r in history] + [(current, stats, None)]
    replay = _Replay(windows, budget, settings)
    for i in range(len(windows)):
        replay.step(i)
    return replay.fit_history(history)


class _Replay:
    """What a replay of a fit's windows learned so far; :meth:`step` replays one window."""

    def __init__(self, windows: Sequence[_Window], budget: Budget, settings: PolicySettings) -> None:
        self.windows = windows
        self.budget = budget
        self.settings = settings
        self.pooled: list[WindowStats] = []  # each window pooled with the earlier ones of its streak
        self.pooled_count: list[int] = []  # how many windows each of those pools
        self.rejected: dict[LoaderConfig, _Strike] = {}
        self.strikes: dict[LoaderConfig, int] = {}  # how often each config was undone (never forgotten: backoff)
        self.starved: list[tuple[int, int]] = []
        # the CPUs others took as each config starved, and as a step up from it paid: beside a neighbour since gone?
        self.starved_beside: dict[tuple[int, int], Optional[float]] = {}
        self.outgrown_beside: dict[tuple[int, int], Optional[float]] = {}
        self.outgrown: list[tuple[int, int]] = []  # configs a step up left and paid for, under today's conditions
        self.worker_ceiling: Optional[_Strike] = None
        self.prefetch_ceiling: Optional[_Strike] = None
        self.last_change: Optional[LastChange] = None
        self.shift: Optional[Shift] = None
        self.conditions_from = 0  # first window of today's conditions
        self.streaks: list[_Streak] = []

    def step(self, i: int) -> None:
        """Window ``i``: its streak, its pooled windows, and the verdict on the change that started the streak."""
        config = self.windows[i][0]
        streak = self._streak_of(i)
        start = max(streak.start, streak.judged_from, i + 1 - POOLED_WINDOWS)
        self.pooled.append(pool_windows([w for _, w, _ in self.windows[start : i + 1]]))
        self.pooled_count.append(i + 1 - start)
        self._note_starved(self.pooled[i], config)
        if streak.before is None or streak.before_stats is None or streak.undo or streak.start < self.conditions_from:
            return
        self._judge(i, streak, streak.before, streak.before_stats)

    def _streak_of(self, i: int) -> _Streak:
        """The streak window ``i`` belongs to: the one before it goes on, or a new one starts (a change)."""
        config = self.windows[i][0]
        if self.streaks and self.streaks[-1].config == config:
            return self._continued(i, self.streaks[-1])
        streak = _Streak(i, config)
        if self.streaks and self.windows[i - 1][2] == config:  # a change the policy made
            previous = self.streaks[-1]
            streak.before, streak.before_stats = previous.config, self.pooled[i - 1]
            streak.kind = change_kind(previous.config, config)
            streak.undo = previous.before == config and not previous.undo
            if streak.kind is ChangeKind.GIVE_BACK and config.num_workers > 0:
                # fewer workers make their batches no slower: a measured cost that rose and starved the loop is
                # new conditions (storage slowed as the give-back came), not the give-back's verdict
                fed = [w for _, w, _ in self.windows[max(previous.start, i - POOLED_WINDOWS) : i]]
                moved = starved_rise(fed, self.windows[i][1], config.num_workers, self.settings)
                if moved is not None:
                    self._new_conditions(i, moved, i)
                    streak = _Streak(i, config)
        self.streaks.append(streak)
        return streak

    def _continued(self, i: int, streak: _Streak) -> _Streak:
        """``streak`` with window ``i`` added, or a new streak from window ``i - 1`` where conditions shifted.

        New conditions when the last two windows both left the config's earlier ones the same way (one
        window is noise: a heavy-tailed cost alone moves it); the new streak starts with the first of them,
        or with the second where the first moved less than ``PARTIAL_MOVE`` of the second's way (the change
        came inside the first: half old conditions, pooled with the new ones it would blur both the cost
        the next step is sized from and the spread that says whether the loop is clearly outside the band), or
        where the first fed the loop and the second starved it (the first's batches came from the lead the old
        conditions built: its utilization is theirs). Also when window ``i`` alone shows a measured cost that
        rose and starved a loop the earlier ones fed (:func:`starved_rise`): the new streak starts with it.
        """
        config, window = self.windows[i][0], self.windows[i][1]
        prior = [w for _, w, _ in self.windows[max(streak.start, i - 1 - POOLED_WINDOWS) : i - 1]]
        moved = _confirmed_shift(prior, self.windows[i - 1][1], window, config.num_workers)
        if moved is not None:
            first, second = (
                detect_shift(prior, self.windows[i - 1][1], config.num_workers),
                detect_shift(prior, window, config.num_workers),
            )
            partial = first is not None and second is not None and _moved(first) < PARTIAL_MOVE * _moved(second)
            # the first window fed from the lead the old conditions built, the second starved: the first's
            # utilization is the old conditions' (pooled, 95 % and 56 % read as 66 % "not clearly outside the
            # band", and 3 workers ran 78 batches 46 % starved before a step up)
            settings = self.settings
            partial = partial or (is_starved(window, settings) and not is_starved(self.windows[i - 1][1], settings))
        else:
            fed = [w for _, w, _ in self.windows[max(streak.start, i - POOLED_WINDOWS) : i]]
            moved = starved_rise(fed, window, config.num_workers, self.settings)
            if moved is None:
                return streak
            partial = True  # the window alone: the windows before it were fed under the old conditions
        start = i if partial else i - 1
        self._new_conditions(start, moved, i)
        streak = _Streak(start, config)
        self.streaks.append(streak)
        if not partial:
            self.pooled[i - 1] = window_before = self.windows[i - 1][1]
            self._note_starved(window_before, config)
        return streak

    def _new_conditions(self, start: int, shift: Shift, i: int) -> None:
        """Conditions shifted at window ``start`` (seen at window ``i``): what was learned under the old ones is
        stale."""
        self.conditions_from = start
        self.shift = shift if i == len(self.windows) - 1 else None  # the newest window's decision says so
        self.rejected.clear()
        self.starved.clear()
        self.starved_beside.clear()
        self.outgrown_beside.clear()
        self.outgrown.clear()
        self.worker_ceiling = self.prefetch_ceiling = None

    def _note_starved(self, window: WindowStats, config: LoaderConfig) -> None:
        """``config`` is starved under today's conditions while its (pooled) windows are.

        A starved config bars the leaner ones (fewer resources starve more), until a config at or below it is
        measured not starved: its own windows after a first one that its workers' start starved, or a cut from
        an oversubscribed config that ran faster with less.
        """
        held = resources(config)
        if is_starved(window, self.settings):
            if held not in self.starved:
                self.starved.append(held)
            self.starved_beside[held] = window.other_cpus
            return
        w, p = held
        self.starved[:] = [(sw, sp) for sw, sp in self.starved if not (sw >= w and sp >= p)]

    def _judge(self, i: int, streak: _Streak, before: LoaderConfig, before_stats: WindowStats) -> None:
        """The change from ``before`` that started ``streak``, on its windows up to ``i``: undone, capped or kept."""
        settings = self.settings
        config, _, next_config = self.windows[i]
        last = len(self.windows) - 1
        ended = i < last and self.windows[i + 1][0] != config
        first = streak.start if streak.judged_from < 0 else streak.judged_from
        if i < first:
            return
        length = i - first + 1
        judged = self.pooled[i]
        rate_before, rate_after, tail_s = judged_rates(before_stats, judged)
        gain = _gain(rate_before, rate_after)
        slower = gain < -settings.min_gain
        # (a streak that ended there was judged as it ran: a split is the verdict of the window that closes it)
        verdict_due = slower and length == CONFIRM_WINDOWS and not ended
        split = self._split(streak, first, i, before_stats) if verdict_due else ()
        # more workers that did not pay although the model said they clearly would: no more of them
        # (a small expected gain that does not show proves nothing: windows differ by a few percent)
        stopped_helping = (
            streak.kind is ChangeKind.MORE_WORKERS
            and not slower
            and gain < settings.min_gain
            and _expected_gain(before, config, before_stats, self.budget, settings) >= 2 * settings.min_gain
        )
        step_ratio = _ratio(judged.step_mean_s, before_stats.step_mean_s)
        busy = step_ratio > 1.0 + CONTENTION_STEP
        if i == last and length <= CONFIRM_WINDOWS:
            util_gain = _ratio(judged.utilization, before_stats.utilization) - 1.0
            self.last_change = LastChange(
                before,
                before_stats,
                streak.kind,
                gain,
                stopped_helping,
                length,
                step_ratio,
                util_gain,
                (rate_before, rate_after),
                tail_s,
                split,
            )
        if split:  # judged afresh on the windows after these: no verdict, strike or ceiling from them
            streak.judged_from = i + 1
            return
        if i == streak.start and streak.kind is ChangeKind.GIVE_BACK and config.num_workers == 0 < before.num_workers:
            self._handed_over(i, streak, before_stats, busy)
        if ended and next_config == before:  # A -> B -> A: B was undone
            self.strikes[config] = self.strikes.get(config, 0) + 1
            self.rejected[config] = _Strike(config, i, self.strikes[config], busy)
        if length == CONFIRM_WINDOWS or (ended and length < CONFIRM_WINDOWS):  # the change's verdict, once
            went_back = ended and next_config == before
            self._cap(i, streak.kind, before, config, gain, stopped_helping, busy, went_back)
            # (by throughput or by utilization, which the step's own drift leaves alone: half of `min_gain` is help)
            util_gain = _ratio(judged.utilization, before_stats.utilization) - 1.0
            helped = max(gain, util_gain) >= settings.min_gain / 2
            paid = streak.kind in (ChangeKind.MORE_WORKERS, ChangeKind.MORE_PREFETCH) and helped
            if paid and resources(before) not in self.outgrown:
                self.outgrown.append(resources(before))
            if paid:
                self.outgrown_beside[resources(before)] = _max_known(before_stats.other_cpus, judged.other_cpus)

    def _split(self, streak: _Streak, first: int, i: int, before_stats: WindowStats) -> tuple[float, ...]:
        """Each of windows ``first`` to ``i``'s own gain over ``before_stats``, where a step up's windows disagree
        on it (empty where they agree, and once a streak was judged afresh: its second verdict stands).

        One window not slower (by ``min_gain``) and another slower by more than :data:`SPLIT_SLOWER` times
        ``min_gain``, with what other processes took of the cores moving by more than :data:`SPLIT_OTHERS`
        between them: the conditions moved between them (a CPU hog arrived while 4 x 1 was measured against
        2 x 2: +0 % in its first window, -30 % in its second; pooled, -15 % undid it, and the config it went
        back to ran 35 % starved for the rest of the fit, which 4 x 1 would have fed; in replays, -3 % then
        -23 %, and the hog in the first window instead, -20 % then +4 %). A step up that is itself slower is
        slower in each of its windows, but not by the same: the CPU-bound benchmark's 2 x 2 -> 4 x 1 on 2
        cores lost 2 % and 12 % with nothing else on the cores (0.13 and 0.07 of a CPU), and measuring it
        afresh kept the slower config an epoch longer: windows that disagree without a neighbour's move are
        the spread of a step up's windows, and are pooled.
        """
        if streak.judged_from >= 0 or streak.kind not in (ChangeKind.MORE_WORKERS, ChangeKind.MORE_PREFETCH):
            return ()
        min_gain = self.settings.min_gain
        judged = [w for _, w, _ in self.windows[first : i + 1]]
        others = [w.other_cpus for w in judged]
        if None in others or max(others) - min(others) <= SPLIT_OTHERS:  # type: ignore[type-var]
            return ()
        gains = tuple(throughput_gain(before_stats, w) for w in judged)
        if max(gains) >= -min_gain and min(gains) < -SPLIT_SLOWER * min_gain:
            return gains
        return ()

    def _cap(
        self,
        i: int,
        kind: ChangeKind,
        before: LoaderConfig,
        config: LoaderConfig,
        gain: float,
        stopped_helping: bool,
        busy: bool,
        went_back: bool,
    ) -> None:
        """The ceiling a step up from ``before`` to ``config`` that did not pay sets on workers or prefetch."""
        slower = gain < -self.settings.min_gain
        strikes = self.strikes.get(config, 0) + 1
        if kind is ChangeKind.MORE_WORKERS and (slower or stopped_helping):
            # slower after a step up of several workers: try a smaller step up before calling it the CPUs'
            # limit; never declare it at a count that was not measured against one worker more. Workers that
            # stopped helping cap at the count they were added to, or at the count before them where the
            # policy went back there (as fast with less: a smaller step up would only repeat the question)
            step_up = config.num_workers - before.num_workers
            if stopped_helping:
                limit = before.num_workers if went_back else config.num_workers
            else:
                limit = before.num_workers if step_up <= 1 else config.num_workers - 1
            ceiling = self.worker_ceiling
            if ceiling is None or not ceiling.stands(i) or limit < ceiling.value:
                self.worker_ceiling = _Strike(limit, i, strikes, busy)
        if kind is ChangeKind.MORE_PREFETCH and gain < self.settings.min_gain:
            kept = before if slower else config
            ceiling = self.prefetch_ceiling
            if ceiling is None or not ceiling.stands(i) or kept.prefetch_factor < ceiling.value:
                self.prefetch_ceiling = _Strike(kept.prefetch_factor, i, strikes, busy)

    def _handed_over(self, i: int, streak: _Streak, before_stats: WindowStats, busy: bool) -> None:
        """A give-back to 0 workers from below the band, not undone: 0 is the workers' ceiling under today's
        conditions, from its first window on (while it is judged, no step up).

        The workers it left starved the loop too, on each batch's hand-over (no worker count shortens that): a
        step up from 0 would only ask the same question again.
        """
        if before_stats.utilization >= self.settings.band[0]:
            return
        for config, _, next_config in self.windows[i:]:
            if config != streak.config or next_config is None:
                break
            if next_config != config:
                if next_config == streak.before:
                    return  # undone
                break
        self.worker_ceiling = _Strike(0, i, 1, busy)

    def fit_history(self, history: Sequence[WindowRecord]) -> FitHistory:
        """What the rules need of the replayed fit, as of its newest window (``history`` is the fit's records)."""
        windows, now = self.windows, len(self.windows) - 1
        streak = self.streaks[-1]
        suspect, confirm = None, None
        if self.shift is None and now - streak.start >= 2:  # the newest window against the (at least two) before it
            prior = [w for _, w, _ in windows[max(streak.start, now - POOLED_WINDOWS) : now]]
            suspect = detect_shift(prior, windows[now][1], windows[now][0].num_workers)
            if suspect is not None:
                confirm = confirm_batches(prior, windows[now][1], suspect, windows[now][0].num_workers)
        count = min(now - max(streak.start, streak.judged_from) + 1, POOLED_WINDOWS)  # the windows ``seen`` pools
        changes = [r.changed for r in history]
        return FitHistory(
            seen=self.pooled[-1],
            windows=count,
            util_error=_standard_error([w.utilization for _, w, _ in windows[now + 1 - count :]]),
            cost_error=_cost_error([w for _, w, _ in windows[now + 1 - count :]], windows[now][0].num_workers),
            rebuilds=sum(changes[self.conditions_from :]),
            rejected=tuple(c for c, strike in self.rejected.items() if strike.stands(now)),
            starved=self._today(self.starved, self.starved_beside),
            outgrown=self._today(self.outgrown, self.outgrown_beside),
            worker_ceiling=_standing(self.worker_ceiling, now),
            prefetch_ceiling=_standing(self.prefetch_ceiling, now),
            last_change=self.last_change,
            best=_best([(c, w) for c, w, _ in windows[self.conditions_from :]], self.settings.min_gain),
            best_util=self._best_util(),
            start_s=next((w.startup_s for _, w, _ in reversed(windows) if w.startup_s > 0), 0.0),
            shift=self.shift,
            suspect=suspect,
            confirm_batches=confirm,
        )

    def _today(
        self, marks: list[tuple[int, int]], beside: dict[tuple[int, int], Optional[float]]
    ) -> tuple[tuple[int, int], ...]:
        """Configs starved (or outgrown) under today's conditions, less those marked beside a neighbour since gone.

        A neighbour's arrival is new conditions where its CPUs show in a config's own windows, and its leaving as
        a change came does not (7 workers after 4 beside a CPU hog: the hog's 0.6 of a core went with it). The
        configs starved beside it (2 x 2 at 41 %, 4 x 2 at 25 %), and the steps up from them that paid, then
        barred the cut to the workers the CPUs carry for the rest of the fit: 7 workers held at 1.3x the memory
        of 2. The CPUs others take now (the current config's pooled windows) against those they took as a mark
        was set: fewer by more than :data:`OTHERS_LEFT`. A neighbour that stayed also takes less of the cores
        beside more workers (its share of them falls); a config it lifts so is a give-back away, judged like any:
        undone where it starves again.
        """
        now = self.pooled[-1].other_cpus
        if now is None:
            return tuple(marks)
        return tuple(held for held in marks if (then := beside.get(held)) is None or then - now <= OTHERS_LEFT)

    def _best_util(self) -> float:
        """The highest utilization of windows pooled two or more since conditions last shifted (0: none)."""
        since = range(self.conditions_from, len(self.pooled))
        return max((self.pooled[i].utilization for i in since if self.pooled_count[i] >= 2), default=0.0)


def _standing(ceiling: Optional[_Strike], now: int) -> Optional[int]:
    """A ceiling's value while it stands."""
    return ceiling.value if ceiling is not None and ceiling.stands(now) else None


def detect_shift(prior: Sequence[WindowStats], new: WindowStats, workers: int, part: bool = False) -> Optional[Shift]:
    """Whether ``new`` differs from the same config's ``prior`` windows by more than their noise explains.

    Compared: the data side's cost per batch (a worker's time per batch where the loader says it; the
    fetch wait with 0 workers, where the training process makes the batch inside the fetch), the step
    time, and, where the cost is unknown, starvation; then the CPUs other processes took on the cores
    (:attr:`~lightning_dltune.core.stats.WindowStats.other_cpus`: a neighbour that arrived or left, which
    many workers' batches barely show: 7 workers on 2 cores get 2/9 of a core each beside a CPU hog, 2/8
    without it). A signal moved when it left its pooled mean by more than ``SHIFT_COST`` of it
    (``SHIFT_STEP`` for the step, ``SHIFT_STARVATION`` points for starvation, ``SHIFT_OTHERS`` CPUs for the
    neighbour) and by more than ``SHIFT_SIGMAS`` standard deviations of the prior windows, and lies outside
    all of them. A cost also needs a typical batch to move its way (:func:`_typical_agrees`): a heavy tail
    moves the mean alone; and the loop must feel it: the move shared among the workers (each delivers one
    batch in ``workers``) at least ``SHIFT_FELT`` of a step, and a neighbour's the cores busy past
    ``OTHERS_FELT`` of their time, with it or without it. ``None``: same conditions.

    ``part``: ``new`` is a window so far (a look part-way through it), whose mean is noisier than those of
    the whole windows it is compared with: their standard deviation is scaled by the square root of their
    mean batches over its batches.
    """
    return _detect_shift(tuple(w for w in prior if w.batches > 0), new, workers, part)


# each decision replays the fit's windows, judging the same windows against the same earlier ones as the
# decision before it did (all frozen): the answers are kept, a replay asks a few hundred
@functools.lru_cache(maxsize=4096)
def _detect_shift(prior: tuple[WindowStats, ...], new: WindowStats, workers: int, part: bool) -> Optional[Shift]:
    if not prior or new.batches <= 0:
        return None
    noise = max(1.0, math.sqrt(sum(w.batches for w in prior) / len(prior) / new.batches)) if part else 1.0
    costed = False  # starvation speaks only where the batch's cost cannot: it also moves with bursts and stalls
    for name, signal, floor in _signals(workers):
        values = [v for v in (signal(w) for w in prior) if v is not None]
        now = signal(new)
        if not values or now is None or (name == "starvation" and costed):
            continue
        costed = costed or name == "batch time"
        mean = sum(values) / len(values)
        spread = _stdev(values)
        # a share and CPUs move by points (from 0, too); costs move by their share
        absolute = name in ("starvation", OTHERS)
        if not absolute and mean <= 0:
            continue
        margin = max(floor if absolute else floor * mean, SHIFT_SIGMAS * spread * noise)
        felt = name != "batch time" or abs(now - mean) / max(workers, 1) > SHIFT_FELT * new.step_mean_s
        if name == OTHERS:  # a neighbour matters where the cores were busy, with it or without it
            busy = [w.cpu_busy for w in prior if w.cpu_busy is not None]
            felt = new.cpu_busy is not None and max(new.cpu_busy, *busy) >= OTHERS_FELT
        # and outside every earlier window: a heavy-tailed cost makes lucky windows that earlier ones also had
        if felt and abs(now - mean) > margin and (now > max(values) or now < min(values)):
            if _typical_agrees(name, prior, new, workers, now > mean):
                return Shift(name, mean, now)
    return None


def _typical_agrees(name: str, prior: Sequence[WindowStats], new: WindowStats, workers: int, rising: bool) -> bool:
    """Whether a typical batch moved the way a mean did: a heavy tail moves means alone.

    The data side's cost is a mean, and a rare slow batch (a heavy tail) moves it without new conditions: a
    window that missed it, or met two, is luck. Its typical batch (the workers' p95 time per batch, which a
    tail of a few percent leaves alone; with 0 workers the median fetch, which is a batch made) must move the
    same way, by more than ``SHIFT_COST`` of it and a twentieth of a step. Where the cost is unknown, a heavy
    tail moves starvation the same way: without each window's stalls that only a slow batch explains
    (:attr:`~lightning_dltune.core.stats.WindowStats.tail_wait_s`) it must still move by ``SHIFT_STARVATION``.
    The step time is compared as it is (workers in step deliver in bunches: most fetches find a batch
    ready, however starved).
    """
    if name == "starvation":
        typical = [w.typical_starvation for w in prior]
        moved = new.typical_starvation - sum(typical) / len(typical)
        return (moved > 0) == rising and abs(moved) > SHIFT_STARVATION
    if name != "batch time":
        return True
    if workers > 0:
        before = [w.worker_batch_p95_s for w in prior]
        now = new.worker_batch_p95_s
    else:
        before, now = [w.fetch_wait_p50_s for w in prior], new.fetch_wait_p50_s
    known = [v for v in before if v is not None]
    if now is None or len(known) < len(before):
        return True  # nothing typical to ask
    mean = sum(known) / len(known)
    moved = now - mean
    return (moved > 0) == rising and abs(moved) > SHIFT_COST * mean + 0.05 * new.step_mean_s


def confirm_batches(prior: Sequence[WindowStats], new: WindowStats, shift: Shift, workers: int) -> int:
    """Batches a window needs to confirm ``shift`` (``new`` against ``prior``): at most ``new``'s own, but at
    least :data:`CONFIRM_BATCHES` and one per worker (a look suspects a change on as few as 6 batches, and
    their noise confirmed by as few again read a CPU hog's passing swing in step time as two windows of
    new conditions).

    Enough for its mean of the signal to lie ``SHIFT_SIGMAS`` standard errors inside half the move, the
    spread per batch taken as the larger of what the earlier windows' spread implies (window means over
    their batches: a heavy tail shows there) and what their percentiles say (a normal's ``(p95 - p50) /
    1.645``), scaled by the move (a batch twice as slow varies twice as much); at least ``CONFIRM_BATCHES``
    and one batch per worker. Not the new window's percentiles: a change inside it mixes two conditions,
    whose p95 is the new one's typical batch (130 ms batches after 47 ms ones read as a 36 ms spread, and
    asked for a whole window where 10 batches tell a 3x slowdown).
    """
    fewest = max(CONFIRM_BATCHES, workers)
    move = _moved(shift)
    signal = dict((name, f) for name, f, _ in _signals(workers))[shift.signal]
    known = [(v, w) for v, w in ((signal(w), w) for w in prior) if v is not None and w.batches > 0]
    if move <= 0 or len(known) < 2:
        return max(new.batches, fewest)
    values = [v for v, _ in known]
    per_batch = _stdev(values) * math.sqrt(sum(w.batches for _, w in known) / len(known))
    per_batch = max(per_batch, max(_spread_per_batch(w, shift.signal, workers) for _, w in known))
    if shift.signal != "starvation" and shift.before > 0:
        per_batch *= max(1.0, shift.now / shift.before)
    needed = math.ceil((2.0 * SHIFT_SIGMAS * per_batch / move) ** 2)
    return max(fewest, min(new.batches, needed))


def _spread_per_batch(window: WindowStats, signal: str, workers: int) -> float:
    """A signal's standard deviation per batch from the window's percentiles (0 where it has none)."""
    if signal == "step time":
        return max(window.step_p95_s - window.step_p50_s, 0.0) / _Z95
    if signal == "batch time" and window.worker_batch_s is not None and window.worker_batch_p95_s is not None:
        return max(window.worker_batch_p95_s - window.worker_batch_s, 0.0) / _Z95
    if signal == "batch time" and workers == 0:
        return max(window.fetch_wait_p95_s - window.fetch_wait_p50_s, 0.0) / _Z95
    return 0.0


def same_conditions(history: Sequence[WindowRecord], config: LoaderConfig) -> list[WindowStats]:
    """The latest windows that ran ``config`` in a row, up to ``POOLED_WINDOWS``, if the next window runs it too.

    What a window of ``config`` opening now is compared with to spot new conditions (:func:`detect_shift`).
    """
    if not history or history[-1].next_config != config:
        return []
    return _latest_streak(history, config)


def given_back_from(history: Sequence[WindowRecord], config: LoaderConfig) -> list[WindowStats]:
    """The latest windows of the config that a give-back to ``config`` (with workers) left, if the newest did.

    What the give-back's first window is compared with to spot a cost that rose and starved the loop as it
    came (:func:`starved_rise`): fewer workers make their batches no slower.
    """
    if not history or history[-1].next_config != config or config.num_workers == 0:
        return []
    before = history[-1].config
    if change_kind(before, config) is not ChangeKind.GIVE_BACK:
        return []
    return _latest_streak(history, before)


def _latest_streak(history: Sequence[WindowRecord], config: LoaderConfig) -> list[WindowStats]:
    streak: list[WindowStats] = []
    for record in reversed(history):
        if record.config != config or len(streak) == POOLED_WINDOWS:
            break
        streak.append(record.stats)
    return streak[::-1]


def starved_rise(
    prior: Sequence[WindowStats], new: WindowStats, workers: int, settings: PolicySettings, part: bool = False
) -> Optional[Shift]:
    """New conditions on one window: the data side's measured cost rose and starved a loop that ``prior`` fed.

    One window is noise until a second agrees (a heavy tail makes lucky and unlucky ones), but here two
    measurements agree inside it: the workers' own time per batch rose past its noise, its typical batch with
    it (:func:`detect_shift`), and the loop, fed in the config's earlier windows (at least two, pooled), is
    clearly below the band and waiting on data. Holding to confirm costs a starved window's throughput for
    certain; a step up the next windows show did not pay is undone. ``part``: ``new`` is a window so far (a
    look, see :func:`detect_shift`). ``None`` otherwise.
    """
    if len(prior) < 2 or not is_starved(new, settings) or is_starved(pool_windows(list(prior)), settings):
        return None
    shift = detect_shift(prior, new, workers, part=part)
    if shift is None or shift.signal != "batch time" or shift.now <= shift.before:
        return None
    newest = newest_cost(prior, new) if workers > 0 else None
    return replace(shift, newest=newest) if newest is not None else shift


def newest_cost(prior: Sequence[WindowStats], new: WindowStats) -> Optional[float]:
    """The new conditions' cost per batch where ``new`` holds a rise in it, ``None`` where its mean says it.

    A window that shows a rise on its own was mostly closed by a look at the change (the loop starved part-way):
    its batches made before the change and after it average to a cost between the two, and workers sized for
    that average starve under the new one (storage 3x slower half-way through an epoch: 46 ms before, 120 ms
    after, a window averaging 69-81 ms sized 5 workers where 7 feed the step; 5 then ran at 88 %, in the band,
    and held, 12 % slower than 6 for the rest of the epoch). Its slowest batches are the new conditions': the
    window's p95 time per batch over the earlier windows' p95-to-mean ratio (their spread under the old
    conditions, which the new keep) is the new mean, where that is clearly above the window's (by more than
    :data:`MIXED_COST`, the width of the bin a p95 is read from). Needs the workers' p95 in every window.
    """
    ratios = [w.worker_batch_p95_s / w.worker_batch_s for w in prior if w.worker_batch_s and w.worker_batch_p95_s]
    if len(ratios) < len(prior) or not ratios or not new.worker_batch_s or not new.worker_batch_p95_s:
        return None
    newest = new.worker_batch_p95_s / (sum(ratios) / len(ratios))
    return newest if newest > MIXED_COST * new.worker_batch_s else None


def _moved(shift: Shift) -> float:
    return abs(shift.now - shift.before)


def _confirmed_shift(
    prior: Sequence[WindowStats], first: WindowStats, second: WindowStats, workers: int
) -> Optional[Shift]:
    """A shift both ``first`` and ``second`` show against ``prior`` (at least two windows), in the same direction."""
    if len(prior) < 2:
        return None
    a, b = detect_shift(prior, first, workers), detect_shift(prior, second, workers)
    if a is None or b is None or a.signal != b.signal or (a.now > a.before) != (b.now > b.before):
        return None
    return Shift(b.signal, b.before, (a.now + b.now) / 2)


OTHERS = "other processes' CPUs"  # a signal's name (see :data:`SHIFT_OTHERS`)


def _signals(workers: int) -> list[tuple[str, Callable[[WindowStats], Optional[float]], float]]:
    def cost(w: WindowStats) -> Optional[float]:
        if w.worker_batch_s is not None:
            return w.worker_batch_s
        return w.fetch_wait_mean_s if workers == 0 else None

    return [
        ("batch time", cost, SHIFT_COST),
        ("step time", lambda w: w.step_mean_s, SHIFT_STEP),
        ("starvation", lambda w: w.starvation_ratio, SHIFT_STARVATION),
        (OTHERS, lambda w: w.other_cpus, SHIFT_OTHERS),
    ]


def _max_known(*values: Optional[float]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _ratio(now: float, before: float) -> float:
    return now / before if before > 0 else 1.0


def best_config(history: Sequence[WindowRecord], min_gain: float = 0.05) -> Optional[LoaderConfig]:
    """The leanest config whose median window throughput under the fit's latest conditions is within ``min_gain``
    of the best median there.

    Leanest: fewest workers, then shallowest prefetch. Latest conditions: the windows since conditions last
    shifted (:func:`latest_conditions`); a config measured only before is not compared with those measured
    after, so the best is never slower than a config measured under the same conditions by more than
    ``min_gain``. ``None`` for a history with nothing measured.
    """
    return _best([(r.config, r.stats) for r in history[latest_conditions(history) :]], min_gain)


def latest_conditions(history: Sequence[WindowRecord]) -> int:
    """Index of the first window of ``history`` under its latest conditions (0 where they never shifted).

    The same replay the policy runs (:func:`recall`): two windows in a row of one config that left its
    earlier windows the same way start new conditions.
    """
    if not history:
        return 0
    windows = [(r.config, r.stats, r.next_config) for r in history]
    replay = _Replay(windows, Budget(max_workers=UNLIMITED), PolicySettings())
    for i in range(len(windows)):
        replay.step(i)
    return replay.conditions_from


def median_rate(history: Sequence[WindowRecord], config: LoaderConfig) -> Optional[WindowRecord]:
    """The record of ``config`` whose throughput is the median of its windows (the lower one for an even count).

    Of its windows under the fit's latest conditions where it ran then (as :func:`best_config` compares it),
    else of all.
    """
    latest = [r for r in history[latest_conditions(history) :] if r.config == config and r.stats.batches > 0]
    records = latest or [r for r in history if r.config == config and r.stats.batches > 0]
    if not records:
        return None
    middle = statistics.median_low([r.samples_per_s for r in records])
    return next(r for r in records if r.samples_per_s == middle)


def _best(windows: Sequence[tuple[LoaderConfig, WindowStats]], min_gain: float) -> Optional[LoaderConfig]:
    rates: dict[LoaderConfig, list[float]] = {}
    for config, window in windows:
        if window.batches > 0:
            rates.setdefault(config, []).append(window.samples_per_s)
    medians = [(config, statistics.median(values)) for config, values in rates.items()]
    return leanest_near_best(medians, min_gain, _leaner_then_faster)


def _leaner_then_faster(config: LoaderConfig, rate: float) -> tuple[int, int, float]:
    """The fit's order of configs: fewest workers, then the shallowest prefetch, then the faster."""
    return (*resources(config), -rate)


def leanest_near_best(
    rated: Sequence[tuple[T, float]], min_gain: float, order: Callable[[T, float], tuple]
) -> Optional[T]:
    """The leanest of ``rated`` (things with their rates) whose rate is within ``min_gain`` of the best rate.

    ``order`` ranks a thing with its rate, leanest first; of those it ranks alike, the first in ``rated``
    wins. ``None`` when nothing is rated. The fit ranks configs by :func:`_leaner_then_faster`; the sweep
    (:func:`lightning_dltune.cli.sweep.leanest_within`) also counts pinned copies.
    """
    if not rated:
        return None
    top = max(rate for _, rate in rated)
    near = [(thing, rate) for thing, rate in rated if rate >= (1.0 - min_gain) * top]
    return min(near, key=lambda pair: order(*pair))[0]


def resources(config: LoaderConfig) -> tuple[int, int]:
    """(workers, prefetch) a config holds; prefetch means nothing without workers."""
    return config.num_workers, config.prefetch_factor if config.num_workers else 0


def change_kind(before: LoaderConfig, after: LoaderConfig) -> ChangeKind:
    (w0, p0), (w1, p1) = resources(before), resources(after)
    if w1 > w0:
        return ChangeKind.MORE_WORKERS
    if w1 == w0 and p1 > p0:
        return ChangeKind.MORE_PREFETCH
    if w1 <= w0 and p1 <= p0 and (w1, p1) != (w0, p0):
        return ChangeKind.GIVE_BACK
    return ChangeKind.OTHER


def throughput_gain(before: WindowStats, after: WindowStats) -> float:
    """How much faster ``after`` ran than ``before`` (:func:`judged_rates`)."""
    rate_before, rate_after, _ = judged_rates(before, after)
    return _gain(rate_before, rate_after)


def _gain(rate_before: float, rate_after: float) -> float:
    if rate_before <= 0:
        return math.inf if rate_after > 0 else 0.0
    return rate_after / rate_before - 1.0


def judged_rates(before: WindowStats, after: WindowStats) -> tuple[float, float, float]:
    """Samples per second of ``before`` and ``after`` as a change is judged, and the heavy tail's share (s a batch).

    A heavy tail's slow batch stalls the loop for most of its time (:attr:`WindowStats.tail_wait_s`), and how
    many a window meets is luck: two windows of one config differ twofold by it. Both sides are charged the
    tail's stall per batch of both together (a batch's cost is the data's, not the config's); what is
    compared is the rest. (The lead a config holds shortens each such stall a little: that is not judged.)
    Without a tail on either side, the rates as measured and 0.
    """
    batches = before.batches + after.batches
    tail = min(before.tail_wait_s, before.fetch_wait_total_s) + min(after.tail_wait_s, after.fetch_wait_total_s)
    if tail <= 0 or batches <= 0:
        return before.samples_per_s, after.samples_per_s, 0.0
    share = tail / batches
    return _tail_evened_rate(before, share), _tail_evened_rate(after, share), share


def _tail_evened_rate(window: WindowStats, tail_per_batch_s: float) -> float:
    """Samples per second of ``window`` had its heavy tail held it ``tail_per_batch_s`` a batch."""
    busy = window.busy_s - min(window.tail_wait_s, window.fetch_wait_total_s) + window.batches * tail_per_batch_s
    return window.samples / busy if busy > 0 else 0.0


def is_starved(window: WindowStats, settings: PolicySettings) -> bool:
    """Clearly below the band and waiting on data."""
    low = settings.band[0] - settings.hysteresis
    return window.batches > 0 and window.utilization < low and window.starvation_ratio >= settings.min_starvation


def _expected_gain(
    before: LoaderConfig, after: LoaderConfig, seen: WindowStats, budget: Budget, settings: PolicySettings
) -> float:
    """The throughput gain expected of moving to ``after``, by the model of ``before``'s windows.

    A step up the model expected less than ``min_gain`` of was the measurement's (the loop starved, the CPUs
    free): it is judged by what the loop's own delivery expected of it.
    """
    if seen.batches <= 0 or seen.step_mean_s <= 0:
        return 0.0
    model = PipelineModel.infer(
        before.num_workers, seen, budget.cpus, settings.burst_stall_fraction, before.prefetch_factor
    )
    now = model.throughput(before.num_workers)
    gain = model.throughput(after.num_workers, after.prefetch_factor) / now - 1.0
    if gain < settings.min_gain and is_starved(seen, settings):
        measured = model.measured_throughput(after.num_workers) / model.measured_throughput(before.num_workers)
        gain = max(gain, measured - 1.0)
    return gain


def _cost_error(windows: Sequence[WindowStats], workers: int) -> float:
    """Relative standard error of the data side's cost per batch over ``windows`` (0 for fewer than two).

    Where the workers measured a batch's cost, only the windows that did count: a window whose batches were
    all made before it opened (the loader's lead) measured none, and the cost the loop's clock implies is
    another quantity (an upper bound), not a sample of the same one.
    """

    def cost(w: WindowStats) -> float:
        if w.worker_batch_s is not None:
            return w.worker_batch_s
        return w.fetch_wait_mean_s if workers == 0 else workers * (w.fetch_wait_mean_s + w.step_mean_s)

    measured = [w for w in windows if w.batches > 0 and w.worker_batch_s is not None]
    values = [cost(w) for w in (measured or windows) if w.batches > 0]
    mean = sum(values) / len(values) if values else 0.0
    return _standard_error(values) / mean if mean > 0 else 0.0


def _stdev(values: Sequence[float]) -> float:
    """Sample standard deviation of ``values`` (0 for fewer than two), in floats: ``statistics.stdev``'s exact
    fractions cost a replay of a few hundred windows most of its time."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(max(0.0, sum((v - mean) ** 2 for v in values) / (n - 1)))


def _standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of ``values`` (0 for fewer than two)."""
    return _stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
