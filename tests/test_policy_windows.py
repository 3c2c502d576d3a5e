"""Continuous control: the policy decided window after window while the pipeline changes under it.

A driver runs the pure :func:`~lightning_dltune.core.policy.decide` on windows of the independent simulator
(:mod:`pipeline_sim`), as the callback would close them anywhere in an epoch, against a *schedule* of
conditions: storage that slows 3x at window ``k``, a CPU hog for windows ``k..k+m``, a +-30 % step jitter
throughout, a heavy-tailed sample cost. The properties are the targets of continuous control; "correct"
is judged from the simulator's own ground truth, never from the policy's model.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import pytest
from ground_truth import ping_pong, settled_correctly, steady_in_band, trail, within_budget
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pipeline_sim import Pipeline, simulate

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.history import REPLAYED_WINDOWS
from lightning_dltune.core.policy import decide
from lightning_dltune.core.records import Budget, PolicySettings, ReasonKind, Verdict, WindowRecord
from lightning_dltune.report.words import reason_text

MB = 1 << 20
DEFAULTS = PolicySettings()
WINDOW_BATCHES = 50  # the tuner's window: at least this many batches ...
WINDOW_SECONDS = 5.0  # ... and at least this long (of steps)
WINDOWS_PER_EPOCH = 8  # every eighth window closes at an epoch end, the others mid-epoch
STEP_JITTER = 0.3  # +-30 % per step, throughout
NOISE = 0.05  # +-5 % production drift per window and per batch

# derandomized: the same examples every run. Shrinking a failure to its minimal example takes minutes
# here: it runs where DLTUNE_SHRINK=1 is set (the examples quoted in TARGET's reasons came from it)
_PHASES = tuple(Phase) if os.environ.get("DLTUNE_SHRINK") else (Phase.explicit, Phase.reuse, Phase.generate)
PROPERTY = settings(
    max_examples=40, deadline=None, derandomize=True, phases=_PHASES, suppress_health_check=[HealthCheck.too_slow]
)


# ------------------------------------------------------------------------------------------------
# The driver


@dataclass(frozen=True)
class Schedule:
    """What the pipeline is from a window on: ``((0, p0), (k, p1), ...)``, starts ascending, the first at 0."""

    phases: tuple[tuple[int, Pipeline], ...]

    def at(self, window: int) -> Pipeline:
        return [pipeline for start, pipeline in self.phases if start <= window][-1]

    @property
    def changes(self) -> list[int]:
        """The windows at which conditions change (the start included: the first change is the fit's start)."""
        return [start for start, _ in self.phases]


def window_batches(pipeline: Pipeline) -> int:
    """Batches in one window: at least ``WINDOW_BATCHES`` and at least ``WINDOW_SECONDS`` of steps."""
    return max(WINDOW_BATCHES, math.ceil(WINDOW_SECONDS / (pipeline.step_s * pipeline.step_slowdown)))


def run_windows(
    schedule: Schedule,
    start: LoaderConfig,
    budget: Budget,
    cores: float,
    windows: int,
    seed: int = 0,
    policy: PolicySettings = DEFAULTS,
) -> list[WindowRecord]:
    """Close ``windows`` windows as the callback would: measure one, decide, switch right away, go on."""
    history: list[WindowRecord] = []
    config, in_epoch, step = start, 0, 0
    for k in range(windows):
        pipeline = schedule.at(k)
        batches = window_batches(pipeline)
        stats = simulate(config, pipeline, cores, batches=batches, seed=seed * 100_003 + k)
        decision = decide(config, stats, budget, history, policy)
        in_epoch, step = in_epoch + batches, step + batches
        epoch_end = (k + 1) % WINDOWS_PER_EPOCH == 0
        history.append(WindowRecord(
            k // WINDOWS_PER_EPOCH, config, stats, decision.verdict, decision.reason, decision.config,
            end_batch=None if epoch_end else in_epoch, step=step, judged_util=decision.judged_util,
        ))
        config = decision.config
        in_epoch = 0 if epoch_end else in_epoch
    return history


def show(records: Sequence[WindowRecord], schedule: Optional[Schedule] = None) -> list[tuple]:
    """What a failing property prints: per window the config, utilization, verdict and reason."""
    out = []
    for k, r in enumerate(records):
        phase = "" if schedule is None else f"phase@{[s for s in schedule.changes if s <= k][-1]}"
        out.append((k, phase, r.config.short(), round(r.stats.utilization, 3), str(r.verdict), reason_text(r.reason)[:120]))
    return out


# ------------------------------------------------------------------------------------------------
# What is drawn


@st.composite
def pipelines(draw, kind: Optional[str] = None) -> Pipeline:
    """I/O- or CPU-bound pipelines behind a 20-100 ms accelerator step, from much faster than it to 20x slower."""
    kind = kind or draw(st.sampled_from(["io", "cpu"]))
    step = draw(st.floats(0.020, 0.100))
    cost = step * draw(st.floats(0.05, 20.0))
    main, side = cost, cost * draw(st.floats(0.0, 0.1))
    cpu_s, io_s = (side, main) if kind == "io" else (main, side)
    return Pipeline(
        cpu_s=cpu_s, io_s=io_s, step_s=step, batch_bytes=draw(st.integers(1, 64)) * MB, noise=NOISE,
        step_jitter=STEP_JITTER, measured=draw(st.sampled_from([True, True, False])),
        main_measured=draw(st.booleans()),
    )


@st.composite
def budgets(draw, cores: int) -> Budget:
    """From the CPU rule (one worker per core but one) up to 64 workers; memory and shm unknown or 64 MB-8 GB."""
    max_workers = draw(st.integers(min(max(1, cores - 1), 64), 64))
    sizes = st.one_of(st.none(), st.integers(64, 8192).map(lambda m: m * MB))
    return Budget(max_workers=max_workers, memory_bytes=draw(sizes), shm_bytes=draw(sizes), cpus=float(cores))


@st.composite
def hogs(draw, cores: int, pipeline: Pipeline) -> Pipeline:
    """The pipeline on a host where a neighbour keeps 1 to all cores busy, maybe slowing the step too."""
    busy = draw(st.integers(1, max(1, cores)))
    slowdown = draw(st.sampled_from([1.0, 1.0, 1.2, 1.5]))
    return replace(pipeline, busy_cores=float(busy), step_slowdown=slowdown)


starts = st.builds(
    LoaderConfig, num_workers=st.integers(0, 16), prefetch_factor=st.integers(1, 8), pin_memory=st.booleans()
)
cores_ = st.integers(2, 32)


@st.composite
def changing(draw, cores: int) -> tuple[Schedule, int]:
    """Storage 3x slower from window ``k1`` on, a CPU hog for windows ``k2..k2+m``; returns the schedule and its length."""
    base = draw(pipelines())
    drift = draw(st.integers(6, 10))
    hog_at = drift + draw(st.integers(4, 8))
    hog_for = draw(st.integers(3, 6))
    slowed = replace(base, io_s=3 * base.io_s)
    schedule = Schedule(((0, base), (drift, slowed), (hog_at, draw(hogs(cores, slowed))), (hog_at + hog_for, slowed)))
    return schedule, hog_at + hog_for + 6


# ------------------------------------------------------------------------------------------------
# The simulator's new conditions


def test_simulator_step_jitter_is_per_batch_and_leaves_production_alone():
    steady = Pipeline(cpu_s=0.004, io_s=0.030, step_s=0.020, noise=0.05)
    jittery = replace(steady, step_jitter=0.3)
    a = simulate(LoaderConfig(num_workers=2), steady, 8, seed=3)
    b = simulate(LoaderConfig(num_workers=2), jittery, 8, seed=3)
    assert a.worker_batch_s == pytest.approx(b.worker_batch_s, rel=0.05)  # the same production draws
    # a mean over 400 steps moves little; single steps spread by about +-30 %
    assert b.step_mean_s == pytest.approx(a.step_mean_s, rel=0.05)
    assert b.step_p95_s > 1.15 * a.step_p95_s


def test_simulator_heavy_tail_falls_at_random_one_batch_in_fifty():
    tail = Pipeline(cpu_s=0.001, io_s=0.010, step_s=0.020, burst_every=50, burst_factor=20, burst_random=True)
    windows = [simulate(LoaderConfig(num_workers=1), tail, 4, batches=500, seed=s) for s in range(4)]
    # one batch in fifty costs 200 ms: the mean worker time grows by ~38 %, and windows differ
    means = [w.worker_batch_s for w in windows]
    assert all(0.011 < m < 0.020 for m in means), means
    assert len(set(means)) > 1


def test_simulator_busy_cores_slow_cpu_work_not_storage_nor_the_step():
    cpu = Pipeline(cpu_s=0.010, io_s=0.0, step_s=0.001)
    alone = simulate(LoaderConfig(num_workers=2), cpu, cores=2)
    crowded = simulate(LoaderConfig(num_workers=2), replace(cpu, busy_cores=2.0), cores=2)
    assert crowded.worker_batch_s > 1.5 * alone.worker_batch_s
    assert crowded.step_mean_s == pytest.approx(alone.step_mean_s)
    io = Pipeline(cpu_s=0.0, io_s=0.010, step_s=0.001)
    assert simulate(LoaderConfig(num_workers=2), replace(io, busy_cores=2.0), cores=2).worker_batch_s == (
        pytest.approx(simulate(LoaderConfig(num_workers=2), io, cores=2).worker_batch_s, rel=0.01)
    )
    # without workers the training process makes the batch, and shares its core with the neighbours too
    inline = simulate(LoaderConfig(num_workers=0), replace(cpu, busy_cores=3.0), cores=2)
    assert inline.fetch_wait_mean_s == pytest.approx(0.020)


def test_simulator_step_slowdown_slows_the_step():
    pipeline = Pipeline(cpu_s=0.001, io_s=0.0, step_s=0.020)
    slowed = simulate(LoaderConfig(num_workers=1), replace(pipeline, step_slowdown=1.5), 4)
    assert slowed.step_mean_s == pytest.approx(0.030)


def test_driver_closes_windows_mid_epoch_and_at_epoch_ends():
    pipeline = Pipeline(cpu_s=0.001, io_s=0.030, step_s=0.050)
    records = run_windows(Schedule(((0, pipeline),)), LoaderConfig(num_workers=0), Budget(8, cpus=8), 8, windows=9)
    assert [r.stats.batches for r in records] == [100] * 9  # 5 s of 50 ms steps
    assert [r.end_batch for r in records[:8]] == [100 * (i + 1) for i in range(7)] + [None]
    assert records[8].epoch == 1 and records[8].end_batch == 100


# ------------------------------------------------------------------------------------------------
# Properties of continuous control


@PROPERTY
@given(data=st.data(), start=starts, cores=cores_, seed=st.integers(0, 1000))
def test_budgets_are_never_exceeded_while_conditions_change(data, start, cores, seed):
    schedule, windows = data.draw(changing(cores))
    budget = data.draw(budgets(cores))
    records = run_windows(schedule, start, budget, cores, windows, seed=seed)
    for r in records:
        assert within_budget(r.next_config, budget, schedule.at(0).batch_bytes), (r.next_config, r.reason)


# A small change near the band's edge can stay 'not clearly outside' over pooled windows for more than 3
# windows (a step 1.2x slower under a hog, 8 workers x 1: raw windows at 100 %, pooled 97 % over 4 windows,
# held; or storage 3x slower met by 11 workers at the edge): the tuner holds, and a window clearly above the
# band that did not wait is called compute-bound by its own numbers (it was called in band, and failed here).
@PROPERTY
@given(data=st.data(), start=starts, cores=cores_, seed=st.integers(0, 1000))
def test_band_or_a_correct_verdict_within_three_windows_of_any_change(data, start, cores, seed):
    schedule, windows = data.draw(changing(cores))
    budget = data.draw(budgets(cores))
    records = run_windows(schedule, start, budget, cores, windows, seed=seed)
    for change in schedule.changes:
        after = range(change, min(change + 3, len(records)))
        assert any(settled_correctly(records[k], schedule.at(k), budget, cores) for k in after), (
            change, show(records, schedule),
        )


@PROPERTY
@given(data=st.data(), start=starts, cores=cores_, seed=st.integers(0, 1000))
def test_storage_three_times_slower_is_answered_within_two_windows(data, start, cores, seed):
    base = data.draw(pipelines("io"))
    budget = data.draw(budgets(cores))
    drift = 10
    schedule = Schedule(((0, base), (drift, replace(base, io_s=3 * base.io_s))))
    records = run_windows(schedule, start, budget, cores, drift + 6, seed=seed)
    settled_before = settled_correctly(records[drift - 1], base, budget, cores)
    if not settled_before:
        return  # not settled on the old conditions: a different property's failure
    slowed = schedule.at(drift)
    reacted = any(
        records[k].next_config != records[k].config or settled_correctly(records[k], slowed, budget, cores)
        for k in (drift, drift + 1)
    )
    assert reacted, show(records, schedule)


@pytest.mark.slow  # 200 windows an example: ~30 s
@settings(max_examples=25, deadline=None, derandomize=True, phases=_PHASES, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), start=starts, cores=cores_, seed=st.integers(0, 1000))
def test_no_ping_pong_over_two_hundred_noisy_windows(data, start, cores, seed):
    pipeline = data.draw(pipelines())
    budget = data.draw(budgets(cores))
    records = run_windows(Schedule(((0, pipeline),)), start, budget, cores, 200, seed=seed)
    configs = trail(records)
    assert ping_pong(configs) is None, [c.short() for c in configs]
    # settled (a config whose noise-free utilization is in the band, give or take the hysteresis): moving
    # away from one is what noise makes a tuner do; moving away from any other config is still converging
    away = [k for k, r in enumerate(records) if r.changed and steady_in_band(pipeline, r.config, cores)]
    assert len(away) <= 2, show([records[k] for k in away])


@pytest.mark.slow  # ~9 s on 2 cores
@PROPERTY
@given(data=st.data(), start=starts, cores=cores_, seed=st.integers(0, 1000))
def test_a_heavy_tailed_sample_cost_does_not_make_it_churn(data, start, cores, seed):
    # one batch in fifty, at random, 20x slower
    pipeline = replace(data.draw(pipelines()), burst_every=50, burst_factor=20.0, burst_random=True)
    budget = data.draw(budgets(cores))
    records = run_windows(Schedule(((0, pipeline),)), start, budget, cores, 100, seed=seed)
    changes = [k for k, r in enumerate(records) if r.changed]
    assert ping_pong(trail(records)) is None, [c.short() for c in trail(records)]
    assert len(changes) <= 4, show(records)  # reach the answer, maybe deepen prefetch, give back once
    assert sum(1 for k in changes if k >= 50) <= 1, show(records)  # and then stay


@PROPERTY
@given(data=st.data(), start=starts, cores=cores_, seed=st.integers(0, 1000))
def test_a_transient_cpu_hog_does_not_leave_a_worse_config(data, start, cores, seed):
    pipeline = data.draw(pipelines())
    budget = data.draw(budgets(cores))
    hog_at, hog_for = 12, data.draw(st.integers(2, 6))
    schedule = Schedule(((0, pipeline), (hog_at, data.draw(hogs(cores, pipeline))), (hog_at + hog_for, pipeline)))
    records = run_windows(schedule, start, budget, cores, hog_at + hog_for + 10, seed=seed)
    before, after = records[hog_at].config, records[-1].next_config
    # judged without the hog, noise-free, by the simulator: the config after may be leaner, not slower, unless
    # it holds the band (giving back down to the band's top is what the band asks for)
    rate_before = pipeline.steady_samples_per_s(before, cores)
    rate_after = pipeline.steady_samples_per_s(after, cores)
    assert steady_in_band(pipeline, after, cores) or rate_after >= (1 - DEFAULTS.min_gain) * rate_before, (
        before.short(), after.short(), round(rate_after / rate_before, 3), show(records, schedule),
    )


@pytest.mark.slow  # 300 windows: ~10 s on 2 cores
def test_a_decision_late_in_a_long_fit_replays_only_its_latest_windows():
    # a decision's cost must not grow with the fit (benchmarks/decision_cost.py: 16-17 ms at 255 windows and
    # at 2000 on a slow host); what it decides on a long fit is what it decides on that fit's latest REPLAYED_WINDOWS windows
    pipeline = Pipeline(cpu_s=0.004, io_s=0.060, step_s=0.020, noise=NOISE, step_jitter=STEP_JITTER)
    budget = Budget(max_workers=16, cpus=8.0)
    records = run_windows(Schedule(((0, pipeline),)), LoaderConfig(num_workers=0), budget, 8, windows=REPLAYED_WINDOWS + 44)
    for now in (REPLAYED_WINDOWS + 10, len(records) - 1):
        record = records[now]
        latest = records[now + 1 - REPLAYED_WINDOWS : now]
        assert decide(record.config, record.stats, budget, records[:now]) == decide(
            record.config, record.stats, budget, latest
        )
        assert decide(record.config, record.stats, budget, records[:now]).config == record.next_config
    # a replay keeps what the decision before it computed on the same frozen windows: with nothing kept, every
    # decision of the fit is the same
    from lightning_dltune.core import history, stats

    for now in range(0, len(records), 15):
        history._detect_shift.cache_clear()
        stats._pooled.cache_clear()
        record = records[now]
        assert decide(record.config, record.stats, budget, records[:now]).config == record.next_config


def test_a_busy_two_core_host_does_not_lock_in_zero_workers():
    # the demo on a busy 2-core machine: storage-bound batches (the workers wait, they barely compute), a
    # neighbour on both cores for the first windows; after it leaves, workers must be tried on their merit
    pipeline = Pipeline(cpu_s=0.004, io_s=0.040, step_s=0.020, noise=NOISE, step_jitter=STEP_JITTER)
    busy = replace(pipeline, busy_cores=2.0, step_slowdown=1.3)
    schedule = Schedule(((0, busy), (3, pipeline)))
    budget = Budget(max_workers=7, cpus=2.0)
    records = run_windows(schedule, LoaderConfig(num_workers=0), budget, 2, windows=16)
    final = records[-1].next_config
    assert final.num_workers >= 1, show(records, schedule)
    # in the band or above it by the simulator's numbers, once the neighbour has gone
    low = DEFAULTS.band[0] - DEFAULTS.hysteresis
    assert pipeline.steady_utilization(final.num_workers, 2, final.prefetch_factor) >= low, show(records, schedule)


def test_simulator_hands_a_workers_batch_over_in_the_loops_time_and_none_made_in_the_loop():
    pipeline = Pipeline(cpu_s=0.0005, step_s=0.020, handover_s=0.002)
    workers = simulate(LoaderConfig(num_workers=2), pipeline, 2, batches=200)
    alone = simulate(LoaderConfig(num_workers=0), pipeline, 2, batches=200)
    assert workers.stall_fraction == 0.0  # every batch was ready when asked ...
    assert workers.fetch_wait_mean_s == pytest.approx(0.002, rel=0.01)  # ... and the loop still waited for it
    assert alone.fetch_wait_mean_s == pytest.approx(0.0005, rel=0.01)


@pytest.mark.parametrize("start", [LoaderConfig(num_workers=7, prefetch_factor=8), LoaderConfig(num_workers=2)])
def test_a_cheap_batch_goes_back_to_zero_workers_where_taking_it_from_a_worker_costs_more(start):
    # the benchmark's step-bound workload on 2 cores: a batch made in 0.5 ms, a 20 ms step, and 1.7 ms of the
    # loop's time to take each batch from a worker. Every fetch finds a batch ready, the loop waits 8 % all the
    # same, and no worker count changes that: 0 workers runs at 98 %, any other at 92 % (held at 1 worker before)
    pipeline = Pipeline(
        cpu_s=0.0005, step_s=0.020, handover_s=0.0017, batch_bytes=8 << 10, noise=NOISE, step_jitter=STEP_JITTER
    )
    records = run_windows(Schedule(((0, pipeline),)), start, Budget(max_workers=7, cpus=2.0), 2, windows=10)
    assert [r.config.num_workers for r in records[2:]] == [0] * 8, show(records)  # on two windows' evidence, kept
    best = pipeline.running_samples_per_s(LoaderConfig(num_workers=0), 2)
    assert pipeline.running_samples_per_s(LoaderConfig(num_workers=1), 2) < 0.95 * best


def test_workers_are_kept_where_making_the_batch_in_the_loop_costs_more_than_the_hand_over():
    # a batch of 3 ms made in the loop would cost more than the 1.7 ms hand-over saved: one worker stays
    pipeline = Pipeline(
        cpu_s=0.003, step_s=0.020, handover_s=0.0017, batch_bytes=8 << 10, noise=NOISE, step_jitter=STEP_JITTER
    )
    records = run_windows(Schedule(((0, pipeline),)), LoaderConfig(num_workers=2), Budget(max_workers=7, cpus=2.0), 2, 10)
    assert all(r.config.num_workers >= 1 for r in records), show(records)


def _four_workers_beside_a_hog(io_s: float) -> tuple[Pipeline, list[WindowRecord]]:
    """12 windows from 4 workers on 2 cores, a hog on one: 0.5 ms of CPU and ``io_s`` of storage a batch, an 8 ms
    hand-over from a worker, a 20 ms step."""
    pipeline = Pipeline(
        cpu_s=0.0005,
        io_s=io_s,
        step_s=0.020,
        handover_s=0.008,
        batch_bytes=8 << 10,
        noise=NOISE,
        step_jitter=STEP_JITTER,
        busy_cores=1.0,
    )
    schedule = Schedule(((0, pipeline),))
    return pipeline, run_windows(schedule, LoaderConfig(num_workers=4), Budget(max_workers=7, cpus=2.0), 2, 12)


def test_more_workers_that_did_not_pay_go_back_to_the_fewer_and_no_smaller_step_asks_again():
    # beside a CPU hog on 2 cores, taking a batch from a worker costs the loop 8 ms whatever the worker count: 4
    # workers of 10 ms batches against a 20 ms step wait 28 %, and the loop's delivery asks for 7. They gain
    # nothing (it held 7 before, "staying at 7"); 4 are as fast with 3 processes fewer, and 5 or 6 would only
    # ask the same question again (made in the loop, a batch would cost it more than the hand-over: 0 is no answer)
    pipeline, records = _four_workers_beside_a_hog(io_s=0.010)
    workers = [r.config.num_workers for r in records]
    assert workers[:3] == [4, 7, 7] and workers[3:] == [4] * 9, show(records)
    back = records[2]
    assert back.reason.kind == ReasonKind.STOPPED_HELPING and back.verdict == Verdict.DATA_BOUND_IO
    assert reason_text(back.reason).endswith("back to 4 workers x prefetch 2: as fast with less")
    assert all(r.reason.kind == ReasonKind.AT_WORKER_CEILING for r in records[3:]), show(records)


def test_a_loop_that_waits_only_on_the_hand_over_goes_to_zero_workers_and_no_step_up_asks_again():
    # the same fit with 5 ms batches: made in the loop (5.5 ms) a batch costs it less than taking it from a worker
    # (8 ms), so 0 workers run 10 % faster than any worker count. Measured on the first window that shows it (no
    # fetch found the queue empty), kept, and no step up from 0 asks the question again
    pipeline, records = _four_workers_beside_a_hog(io_s=0.005)
    assert [r.config.num_workers for r in records] == [4] + [0] * 11, show(records)
    assert records[0].reason.kind == ReasonKind.HANDED_OVER
    assert all(r.reason.kind == ReasonKind.AT_WORKER_CEILING for r in records[1:]), show(records)
    assert reason_text(records[1].reason).endswith("taking a batch from a worker cost the loop more than making it: holding")
    zero, any_workers = (pipeline.running_samples_per_s(LoaderConfig(num_workers=w), 2) for w in (0, 4))
    assert zero > 1.05 * any_workers


# ------------------------------------------------------------------------------------------------
# At scale: a spread of batch times met in order, 8 to 128 cores


def run_at_scale(
    schedule: Schedule, start: LoaderConfig, budget: Budget, cores: float, windows: int, seed: int = 0
) -> list[WindowRecord]:
    """As :func:`run_windows`, with what a loader that goes on running does between windows.

    A window of the config the last one ran is warm (its workers in flight, no start-up fetch), a window after
    a switch starts its workers; a window that only confirms a suspected change is as short as the decision
    asked (``Decision.confirm_batches``, as the callback's schedule takes it).
    """
    history: list[WindowRecord] = []
    config, confirm, step = start, None, 0
    for k in range(windows):
        pipeline = schedule.at(k)
        batches = confirm or window_batches(pipeline)
        goes_on = bool(history) and history[-1].config == config
        warm = 2 * config.num_workers * config.prefetch_factor if goes_on else 0
        stats = simulate(config, pipeline, cores, batches=batches, seed=seed * 100_003 + k, warm=warm)
        decision = decide(config, stats, budget, history, DEFAULTS)
        step += batches
        history.append(WindowRecord(
            k // WINDOWS_PER_EPOCH, config, stats, decision.verdict, decision.reason, decision.config,
            end_batch=step, step=step, judged_util=decision.judged_util,
        ))
        config, confirm = decision.config, decision.confirm_batches
    return history


SCALE_SCENARIOS = ("steady", "40 % spread", "storage x3 mid-run")


def scale_schedule(cores: int, scenario: str) -> tuple[Schedule, int]:
    """An I/O-bound pipeline (3 % CPU) needing about a quarter of the cores' workers, behind a 20 ms step."""
    io = 0.020 * cores / 4
    base = Pipeline(cpu_s=0.03 * io, io_s=io, step_s=0.020, noise=NOISE, step_jitter=0.1, main_measured=True)
    if scenario == "steady":
        return Schedule(((0, base),)), 24
    spread = replace(base, spread=0.4)
    if scenario == "40 % spread":
        return Schedule(((0, spread),)), 24
    return Schedule(((0, spread), (12, replace(spread, io_s=3 * io)))), 30


def ratio_to_best_static(records: Sequence[WindowRecord], pipeline: Pipeline, cores: int, max_workers: int) -> float:
    """The last six windows' configs, each at the simulator's own long-run rate, over the best static config's."""
    last = records[-6:]
    rates = [pipeline.running_samples_per_s(r.config, cores) for r in last]
    return sum(rates) / len(rates) / pipeline.best_static(cores, max_workers)


def test_simulator_spread_is_a_mean_one_factor_per_batch_from_its_own_stream():
    plain = Pipeline(cpu_s=0.001, io_s=0.030, step_s=0.020, noise=0.05)
    spread = replace(plain, spread=0.4)
    a = simulate(LoaderConfig(num_workers=1), plain, 8, batches=2000, seed=3)
    b = simulate(LoaderConfig(num_workers=1), spread, 8, batches=2000, seed=3)
    assert b.worker_batch_s == pytest.approx(a.worker_batch_s, rel=0.05)  # mean 1
    assert b.worker_batch_p95_s > 1.5 * a.worker_batch_p95_s  # a log-normal 40 % spread: p95 ~1.7x the mean
    assert b.step_mean_s == pytest.approx(a.step_mean_s)  # the other draws do not move


def test_simulator_meets_the_spread_in_order_and_prefetch_absorbs_it():
    # 36 workers x 300 ms make 120 batches/s on average for a step that eats 100: the mean says plenty
    pipeline = Pipeline(cpu_s=0.009, io_s=0.291, step_s=0.010, spread=0.4)
    shallow = pipeline.running_samples_per_s(LoaderConfig(num_workers=36, prefetch_factor=1), 128) / 32
    deep = pipeline.running_samples_per_s(LoaderConfig(num_workers=36, prefetch_factor=4), 128) / 32
    assert shallow < 75 < 95 < deep  # in order, the loop waits for the slowest of the batches outstanding


def test_simulator_warm_window_has_no_start_up_and_goes_on_where_the_loader_is():
    pipeline = Pipeline(cpu_s=0.002, io_s=0.040, step_s=0.010)
    cold = simulate(LoaderConfig(num_workers=8), pipeline, 16, batches=100)
    warm = simulate(LoaderConfig(num_workers=8), pipeline, 16, batches=100, warm=32)
    assert cold.startup_s > 0 and warm.startup_s == 0.0
    assert warm.batches == cold.batches == 100


@pytest.mark.slow  # ~10 s on 2 cores
@pytest.mark.parametrize("cores", [8, 16, 64, 128])
def test_at_scale_the_last_windows_run_within_five_percent_of_the_best_static_config(cores):
    budget = Budget(max_workers=cores - 1, cpus=float(cores))
    for scenario in SCALE_SCENARIOS:
        schedule, windows = scale_schedule(cores, scenario)
        records = run_at_scale(schedule, LoaderConfig(num_workers=0), budget, cores, windows)
        final = schedule.at(windows - 1)
        ratio = ratio_to_best_static(records, final, cores, budget.max_workers)
        assert ratio >= 0.95, (scenario, round(ratio, 3), show(records, schedule))
        # and no verdict contradicts its own window
        for r in records:
            if r.stats.utilization > DEFAULTS.band[1]:
                assert r.verdict not in (Verdict.DATA_BOUND_IO, Verdict.DATA_BOUND_CPU), (scenario, show([r]))


@pytest.mark.slow
def test_at_scale_storage_three_times_slower_is_answered_in_the_window_that_shows_it():
    # the workers measure their batches 3x slower and the loop, fed before, starves: two measurements agree
    # inside one window, so no second window is held to confirm it (it cost a starved window before)
    schedule, windows = scale_schedule(64, "storage x3 mid-run")
    records = run_at_scale(schedule, LoaderConfig(num_workers=0), Budget(max_workers=63, cpus=64.0), 64, windows)
    shown = records[12]
    assert shown.reason.kind == ReasonKind.MORE_WORKERS, show(records, schedule)
    assert shown.reason.values["shift"][0] == "batch time"
    assert shown.next_config.num_workers > shown.config.num_workers
    assert not any(r.reason.kind == ReasonKind.SHIFT_SUSPECTED for r in records[12:])
