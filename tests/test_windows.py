"""Where windows close: the schedule every rank computes from the same numbers."""

import math

from lightning_dltune.core.stats import WindowStats
from lightning_dltune.core.windows import NO_BATCH, WindowSchedule, starved_start


def paced(per_batch_s: float, batches: int = 50) -> WindowStats:
    return WindowStats(
        batches=batches, samples=32 * batches, fetch_wait_total_s=0.0, step_total_s=per_batch_s * batches
    )


def test_the_fits_first_window_is_short_and_needs_an_epoch_twice_as_long():
    schedule = WindowSchedule(window_batches=50, window_seconds=3.0, first_batches=10)
    schedule.open(0, epoch_batches=900, mid_epoch=True, seen=False)
    assert schedule.end == 9
    schedule.open(0, epoch_batches=19, mid_epoch=True, seen=False)
    assert schedule.end == NO_BATCH  # the epoch end closes it


def test_the_fits_first_window_looks_after_four_batches_and_again_after_six():
    schedule = WindowSchedule(window_batches=50, window_seconds=3.0, first_batches=10)
    schedule.open(0, epoch_batches=900, mid_epoch=True, seen=False, looks=True)
    assert (schedule.end, schedule.look) == (9, 3)
    schedule.looked(3)
    assert schedule.look == 5  # the steps had not settled, or the loop was not plainly starved: two more
    schedule.looked(5)
    assert schedule.look == NO_BATCH  # the next would be past the close
    schedule.open(0, epoch_batches=900, mid_epoch=True, seen=False, looks=False)
    assert schedule.look == NO_BATCH  # monitoring only
    short = WindowSchedule(window_batches=50, window_seconds=3.0, first_batches=6)
    short.open(0, epoch_batches=900, mid_epoch=True, seen=False, looks=True)
    assert (short.end, short.look) == (5, 3)  # a look after 6 would be its close
    short.looked(3)
    assert short.look == NO_BATCH
    shortest = WindowSchedule(window_batches=50, window_seconds=3.0, first_batches=4)
    shortest.open(0, epoch_batches=900, mid_epoch=True, seen=False, looks=True)
    assert (shortest.end, shortest.look) == (3, NO_BATCH)  # no shorter than it is already
    schedule.open(0, epoch_batches=19, mid_epoch=True, seen=False, looks=True)
    assert (schedule.end, schedule.look) == (NO_BATCH, NO_BATCH)  # the epoch end closes it: as it did
    schedule.open(0, epoch_batches=900, mid_epoch=True, seen=False, looks=True)
    schedule.open(9, epoch_batches=900, mid_epoch=True, seen=True, looks=True)
    assert schedule.look == NO_BATCH  # a later window has no early looks left over


def starting(
    fetch_ms: float, step_ms: float = 20.0, batches: int = 6, first_fetch_ms: float | None = None, **kwargs
) -> WindowStats:
    """A first window's stats: ``batches`` fetches of ``fetch_ms`` (the first ``first_fetch_ms``) and steps."""
    first = fetch_ms if first_fetch_ms is None else first_fetch_ms
    return WindowStats(
        batches=batches,
        samples=32 * batches,
        fetch_wait_total_s=(first + fetch_ms * (batches - 1)) / 1000,
        step_total_s=step_ms / 1000 * batches,
        fetch_wait_p50_s=fetch_ms / 1000,
        step_p50_s=step_ms / 1000,
        fetches=batches,
        **kwargs,
    )


def test_only_a_plainly_starved_start_at_0_workers_is_judged_at_the_early_look():
    assert starved_start(starting(fetch_ms=60), num_workers=0)  # 75 % starved: the loop makes its batches
    assert starved_start(starting(fetch_ms=20), num_workers=0)  # half its time waiting
    assert starved_start(starting(fetch_ms=60, batches=3, warmup_batches=1), num_workers=0)  # 3 settled: enough
    assert not starved_start(starting(fetch_ms=8), num_workers=0)  # 71 % busy: the regular first window
    assert not starved_start(starting(fetch_ms=60), num_workers=2)  # workers: their start-up and queue fill
    assert not starved_start(starting(fetch_ms=60, settling=1), num_workers=0)  # the steps still fall
    assert not starved_start(starting(fetch_ms=60, batches=2, warmup_batches=2), num_workers=0)  # mostly warm-up
    # one slow first fetch (a file opened lazily) waits longer than 3 steps: 59 % starved, but no batch since was
    assert not starved_start(starting(fetch_ms=5, batches=3, first_fetch_ms=90), num_workers=0)


def test_a_window_is_window_seconds_at_the_last_pace_but_never_under_window_batches():
    schedule = WindowSchedule(window_batches=50, window_seconds=3.0)
    assert schedule.length_after(paced(0.100)) == 50  # a 100 ms step: 50 batches are 5 s
    assert schedule.length_after(paced(0.020)) == 150  # a 20 ms step: 3 s
    assert schedule.length_after(paced(0.0)) == 50


def test_an_epochs_last_window_takes_a_tail_shorter_than_half_a_window():
    schedule = WindowSchedule(window_batches=50, window_seconds=0.0)
    schedule.open(100, epoch_batches=170, mid_epoch=True, seen=True)
    assert schedule.end == NO_BATCH  # 20 batches would be left: the epoch end closes a 70-batch window
    schedule.open(100, epoch_batches=180, mid_epoch=True, seen=True)
    assert schedule.end == 149  # 30 left: a window of their own
    schedule.open(0, epoch_batches=math.inf, mid_epoch=True, seen=True)
    assert schedule.end == 49  # an epoch of unknown length (one process)


def test_where_the_loaders_cannot_switch_or_ranks_may_not_meet_windows_close_at_epoch_ends():
    schedule = WindowSchedule(window_batches=50, window_seconds=0.0)
    schedule.open(0, epoch_batches=900, mid_epoch=False, seen=True, looks=True)
    assert (schedule.end, schedule.look) == (NO_BATCH, NO_BATCH)


def test_a_long_window_looks_for_new_conditions_every_12_percent_of_window_batches():
    schedule = WindowSchedule(window_batches=50, window_seconds=0.0)
    schedule.open(200, epoch_batches=900, mid_epoch=True, seen=True, looks=True)
    assert (schedule.end, schedule.look) == (249, 205)
    for look in (205, 211, 217, 223, 229, 235, 241):
        schedule.looked(look)
        assert schedule.look == look + 6
    schedule.looked(247)
    assert schedule.look == NO_BATCH  # the next look would be past the close
    schedule.open(200, epoch_batches=900, mid_epoch=True, seen=True, looks=False)
    assert schedule.look == NO_BATCH  # monitoring only: nothing to act on early


def test_a_look_spans_a_24th_of_the_windows_time_at_least():
    # a 20 ms step: the window's 3 s are 150 batches, a look every 7 (an eighth of a second), 21 looks at most
    schedule = WindowSchedule(window_batches=50, window_seconds=3.0)
    schedule.next_length = schedule.length_after(paced(0.020))
    schedule.open(200, epoch_batches=900, mid_epoch=True, seen=True, looks=True)
    assert schedule.look_every == 7 and (schedule.end, schedule.look) == (349, 206)
    # 1 ms steps: 6 batches are 6 ms of the machine's noise; a look spans an eighth of a second (125 batches)
    schedule.next_length = schedule.length_after(paced(0.001))  # 3000 batches
    schedule.open(0, epoch_batches=20, mid_epoch=True, seen=True, looks=True)
    assert schedule.look_every == 125 and schedule.look > 20  # no look in a 20-batch epoch


def test_a_window_that_confirms_a_suspected_change_is_as_short_as_the_decision_asks():
    schedule = WindowSchedule(window_batches=50, window_seconds=3.0)
    assert schedule.length_after(paced(0.020), confirm_batches=20) == 20
    assert schedule.length_after(paced(0.020), confirm_batches=500) == 150  # never longer than a regular window
    assert schedule.length_after(paced(0.020), confirm_batches=None) == 150
    schedule.next_length = schedule.length_after(paced(0.020), confirm_batches=12)
    schedule.open(200, epoch_batches=900, mid_epoch=True, seen=True, looks=True)
    assert (schedule.end, schedule.look) == (211, NO_BATCH)  # two looks long: nothing to look at in between
    schedule.next_length = schedule.length_after(paced(0.020), confirm_batches=20)
    schedule.open(200, epoch_batches=900, mid_epoch=True, seen=True, looks=True)
    assert (schedule.end, schedule.look) == (219, 205)  # longer: it looks like any window


def test_looks_are_at_least_six_batches_apart_and_reach_a_window_the_epoch_end_closes():
    schedule = WindowSchedule(window_batches=10, window_seconds=1.2)
    schedule.next_length = schedule.length_after(paced(0.020))  # 60 batches
    schedule.open(0, epoch_batches=900, mid_epoch=True, seen=True, looks=True)
    assert schedule.look == 5  # not every 2: a look needs the warm-up rule's fewest steps
    # an epoch of 48 batches, a window planned longer: it closes at the epoch end and looks from batch 7
    schedule = WindowSchedule(window_batches=50, window_seconds=3.0)
    schedule.next_length = schedule.length_after(paced(0.020))
    schedule.open(0, epoch_batches=48, mid_epoch=True, seen=True, looks=True)
    assert (schedule.end, schedule.look) == (NO_BATCH, 6)  # a 24th of the 150 batches 3 s take
