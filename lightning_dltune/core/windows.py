"""Where the tuner's measurement windows close: arithmetic on batch indices, no torch, no Lightning.

A window holds at least ``window_batches`` batches and ``window_seconds`` seconds at the last window's
pace; the fit's first one is shorter (``first_batches``: judge the start config early). Windows close
anywhere in an epoch and at every epoch end; an epoch's last window takes the tail when the tail would
be shorter than half a window. A window longer than twice :attr:`WindowSchedule.look_every` (12 % of
``window_batches``, at least 6 batches and a 24th of the window) also *looks* that often (the callback
closes it early there when conditions changed); the fit's first window
looks after each of :data:`EARLY_LOOKS` batches, and closes there where the start config starves plainly
(:func:`starved_start`). A window that only confirms a suspected change is as short as the decision
says is enough (``length_after``).

Every input is the same on every DDP rank (the epoch's length, the broadcast length of the next
window), so every rank closes the same window at the same batch index.

Example::

    schedule = WindowSchedule(window_batches=50, window_seconds=3.0, first_batches=10)
    schedule.open(0, epoch_batches=900, mid_epoch=True, seen=False)
    schedule.end  # 9: the first window closes after batch index 9
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

from lightning_dltune.core.stats import WindowStats

NO_BATCH = -1  # "at the epoch end" for a close, "never" for a look
_MOST_BATCHES = 1 << 20  # a window's length in batches is capped here (a step of microseconds)
WARMUP_FACTOR = 1.5  # a step this much slower than the window's settled pace is warm-up, not evidence ...
WARMUP_FLOOR_S = 0.005  # ... and at least this much slower (a few ms of noise on a sub-ms step is not warm-up)
_FALLING = 0.67  # the last third of the settled steps this much faster than their first third: the pace still falls
_MOST_SETTLING = 4  # a window whose pace still falls goes on to at most this many times its planned length
LOOK_FRACTION = 0.12  # a long window looks for new conditions every this share of ``window_batches`` ...
LOOK_FEWEST = 6  # ... and at least this many batches apart ...
LOOK_PARTS = 24  # ... and no more looks than this in a window's planned length (its time: an eighth of 3 s)
EARLY_LOOKS = (4, 6)  # the fit's first window looks after these many batches (4: the warm-up rule's fewest steps) ...
EARLY_STARVATION = 0.5  # ... and closes there from 0 workers where the loop waited at least this share of its time
_EARLY_FEWEST = 3  # ... on at least this many batches after the warm-up
_WARMUP_FEWEST = 4  # a window of fewer steps is taken as it is: no warm-up told from it
VAL_FEWEST_BATCHES = 8  # a validation decision needs this many batches of its config, its runs pooled


def warmup_steps(steps: Sequence[float]) -> tuple[int, bool]:
    """The leading warm-up steps of a window's step times, and whether the pace was still falling at its end.

    First steps are slow for reasons that are no evidence about the loaders (lazy initialization, the
    first backward pass, allocator and kernel autotuning). The settled pace is the median of the window's
    last third; warm-up is the run of steps before the first two in a row within :data:`WARMUP_FACTOR` of it
    (or :data:`WARMUP_FLOOR_S` above it, whichever is more).
    The pace still falls when over half the window was warm-up, or when the last third of the rest is
    faster than :data:`_FALLING` times its first third (and by :data:`WARMUP_FLOOR_S`). Windows of fewer
    than :data:`_WARMUP_FEWEST` steps are taken as they are (with 4 or 5 the settled pace is the last
    step's, and a falling pace is not told from them). The early decision comes later only where the pace
    still falls.
    """
    n = len(steps)
    if n < _WARMUP_FEWEST:
        return 0, False
    third = n // 3
    settled = statistics.median_high(steps[n - third :])
    limit = max(WARMUP_FACTOR * settled, settled + WARMUP_FLOOR_S)
    k = 0
    while k < n - 1 and not (steps[k] <= limit and steps[k + 1] <= limit):
        k += 1
    if k >= n - 1:
        return 0, False
    rest = steps[k:]
    part = len(rest) // 3
    if part < 2:
        return k, k > n // 2
    early, late = statistics.median_high(rest[:part]), statistics.median_high(rest[-part:])
    return k, k > n // 2 or (late < _FALLING * early and early - late > WARMUP_FLOOR_S)


def starved_start(stats: WindowStats, num_workers: int) -> bool:
    """Whether the fit's first window is judged at an early look (after each of :data:`EARLY_LOOKS` batches).

    Only at 0 workers: the loop makes every batch itself, so each fetch wait is one batch's making, with no
    queue to fill and no workers to start; a few batches tell it as well as ten. The window must have
    settled (at least :data:`_EARLY_FEWEST` batches after its warm-up, the step time no longer falling),
    the loop waited at least :data:`EARLY_STARVATION` of its time for data (it waited longer than it
    computed, far below any band), and so did its median batch (one slow first fetch, a lazily opened
    file, is no starvation). From 0 workers at 21-34 % busy (the demo, the I/O-bound benchmark) that is
    6 batches fewer made in the training process than the regular first window's 10; where the first
    steps are slow (the demo's first look on a busy machine), the look after 6 batches judges it.
    """
    return (
        num_workers == 0
        and not stats.settling
        and stats.batches >= _EARLY_FEWEST
        and stats.starvation_ratio >= EARLY_STARVATION
        and stats.fetch_wait_p50_s >= stats.step_p50_s
    )


@dataclass
class WindowSchedule:
    """The open window's closing batch and next look, and the next window's length.

    Args:
        window_batches: fewest batches in a window.
        window_seconds: shortest window in seconds, at the last window's pace.
        first_batches: the fit's first window (``0``: a regular one).
    """

    window_batches: int
    window_seconds: float
    first_batches: int = 0
    next_length: int = field(init=False)
    end: int = NO_BATCH  # batch index of the epoch at which the open window closes
    look: int = NO_BATCH  # batch index of the open window's next look for new conditions
    _early: list[int] = field(init=False, default_factory=list)  # the fit's first window's later early looks

    def __post_init__(self) -> None:
        self.next_length = self.first_batches or self.window_batches

    def length_after(self, stats: WindowStats, confirm_batches: Optional[int] = None) -> int:
        """The next window's batches after ``stats``: ``window_seconds`` at its pace, at least ``window_batches``.

        ``confirm_batches``: the decision only asks the next window to confirm what ``stats`` suspected (new
        conditions, :attr:`~lightning_dltune.core.records.Decision.confirm_batches`): that many batches are
        enough (at least one, at most a regular window), so a change is answered in about one window.
        """
        per_batch = (stats.fetch_wait_total_s + stats.step_total_s) / max(stats.batches, 1)
        by_time = math.ceil(self.window_seconds / per_batch) if per_batch > 0 else 0
        regular = max(self.window_batches, min(by_time, _MOST_BATCHES))
        if confirm_batches is not None:
            return max(1, min(confirm_batches, regular))
        return regular

    def goes_on(self, stats: WindowStats, seen: bool) -> bool:
        """Whether a window that closes mid-epoch goes on rather than be judged: while its pace still falls
        (``stats.settling``), or while its config made fewer batches than planned after the batches a switch
        drained from the config before (``stats.drained_batches``); up to :data:`_MOST_SETTLING` times its
        planned length."""
        planned = self.window_batches if seen else (self.first_batches or self.window_batches)
        drained = stats.drained_batches > 0 and stats.batches < planned
        return (bool(stats.settling) or drained) and stats.all_batches < _MOST_SETTLING * planned

    def open(self, first_batch: int, epoch_batches: float, mid_epoch: bool, seen: bool, looks: bool = False) -> None:
        """A window opens at batch index ``first_batch`` of an epoch of ``epoch_batches`` (``inf``: unknown).

        Args:
            mid_epoch: whether it may close before the epoch end (every rank reaches the batch, and the
                loaders can switch there).
            seen: whether the fit already closed a window (else this is the first, ``first_batches`` long).
            looks: whether a window longer than twice :attr:`look_every` looks for new conditions every
                :attr:`look_every` batches (the fit's first one, closing mid-epoch, after each of
                :data:`EARLY_LOOKS` batches shorter than it).
        """
        self.end = self.look = NO_BATCH
        self._early = []
        if not mid_epoch:
            return
        length = self.next_length
        if looks and seen and length > 2 * self.look_every:  # a short (confirming) window is all one look
            self.look = first_batch + self.look_every - 1
        end = first_batch + length - 1
        tail = math.ceil(length / 2) if seen else length  # the first window: an epoch at least twice as long
        if math.isfinite(epoch_batches) and epoch_batches - (end + 1) < tail:
            return
        self.end = end
        if looks and not seen:  # it closes mid-epoch: maybe sooner
            self._early = [first_batch + n - 1 for n in EARLY_LOOKS if n < length]
            self.look = self._early.pop(0) if self._early else NO_BATCH

    @property
    def look_every(self) -> int:
        """Batches between a long window's looks: 12 % of ``window_batches``, at least :data:`LOOK_FEWEST`,
        and at least a 24th of the window's planned length (an eighth of a second at the default ``window_seconds``).

        A slowdown inside a long window shows once the window's mean moved. Looking every half
        ``window_batches`` (25 at the default) saw storage 3x slower at an epoch start at batch 25, half of a
        48-batch epoch at the old pace; looking every 10-13 saw it at batch 10-13 (the slowed phase 7.4-7.8 s
        against 8.2-9.0 s in replays), and every 6 sees it at batch 6 (6.7-7.0 s against 6.9-7.1 s at every 12,
        from 16 x 8; in two full benchmark runs on one host, slow-at-epoch 1.03 / 1.07 and 1.06 / 1.08 of its
        phase oracle's time against 1.06 / 1.11, within the runs' own spread). A look weighs its fewer
        batches' noise (see ``detect_shift(part=True)``), so looking more often did not make the simulated
        heavy-tailed or noisy pipelines churn, nor any look of the benchmark's five steady workloads see a
        change; but 6 sub-millisecond steps are milliseconds of the machine's noise: a look spans a share of
        the window's time too (the planned length is ``window_seconds`` at the last window's pace), which
        also bounds the looks (each a collective across ranks) to at most 24 a window, 8 a second at the
        default ``window_seconds``.
        """
        return max(
            LOOK_FEWEST, math.ceil(LOOK_FRACTION * self.window_batches), math.ceil(self.next_length / LOOK_PARTS)
        )

    def looked(self, batch_idx: int) -> None:
        """The look at ``batch_idx`` found the same conditions: the next one, if the window goes on that long."""
        if self._early:
            self.look = self._early.pop(0)
            return
        self.look = batch_idx + self.look_every
        if self.end != NO_BATCH and self.look >= self.end:
            self.look = NO_BATCH
