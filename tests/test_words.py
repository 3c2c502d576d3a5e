"""What users read: the policy's structured reasons in words, and the one best config in every place."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.history import best_config
from lightning_dltune.core.policy import decide
from lightning_dltune.core.records import Budget, Reason, ReasonKind, Verdict, WindowRecord
from lightning_dltune.core.stats import UtilSource, WindowStats
from lightning_dltune.report.recommendation import recommend
from lightning_dltune.report.words import _WORDS, decision_markdown, reason_text, summary_table, window_line


def window(fetch_ms: float, step_ms: float = 10, batches: int = 100, **fields) -> WindowStats:
    return WindowStats(
        batches=batches,
        samples=32 * batches,
        fetch_wait_total_s=fetch_ms / 1e3 * batches,
        step_total_s=step_ms / 1e3 * batches,
        stalls=batches,
        fetches=batches,
        **fields,
    )


def record(epoch: int, workers: int, stats: WindowStats) -> WindowRecord:
    config = LoaderConfig(num_workers=workers)
    return WindowRecord(epoch, config, stats, Verdict.IN_BAND, Reason(ReasonKind.NOTE, {"text": ""}), config)


def test_every_reason_kind_has_words():
    assert set(_WORDS) == set(ReasonKind) - {ReasonKind.NOTE}


def test_a_reason_is_worded_with_its_numbers():
    decision = decide(LoaderConfig(), window(41, worker_batch_s=0.041, worker_cpu_fraction=0.1), Budget(32, cpus=64))
    text = reason_text(decision.reason)
    assert text == (
        "starved 80% with 0 workers; a worker needs 41 ms per batch vs a 10 ms step (hook to hook): 5 workers"
    )
    assert reason_text(decision.reason) == text


def test_a_hold_at_the_cpus_says_cpu_bound_only_where_the_cpus_are_measured_busy():
    numbers = {"util": 0.6, "low": 0.85, "starvation": 0.4, "windows": 1, "workers": 7, "cpus": 8, "cpu_share": 0.2}
    busy = reason_text(Reason(ReasonKind.CPUS_SATURATED, {**numbers, "cpu_bound": True}))
    counted = reason_text(Reason(ReasonKind.CPUS_SATURATED, {**numbers, "cpu_bound": False}))
    assert "CPU-bound" in busy and "CPU-bound" not in counted and "holding" in counted


def test_workers_that_stopped_helping_say_cpu_bound_only_where_the_cpus_are_measured_busy():
    stopped = {"from_workers": 1, "workers": 2, "gain": 0.02, "min_gain": 0.05}
    ceiling = {"util": 0.7, "low": 0.85, "starvation": 0.3, "windows": 2, "workers": 2, "ceiling": 2}
    for kind, numbers in ((ReasonKind.STOPPED_HELPING, stopped), (ReasonKind.AT_WORKER_CEILING, ceiling)):
        busy = reason_text(Reason(kind, {**numbers, "cpu_bound": True}))
        idle = reason_text(Reason(kind, {**numbers, "cpu_bound": False}))
        assert "CPU-bound" in busy and "CPU-bound" not in idle and "not busy" in idle
    back = {**stopped, "to": (1, 2)}  # and where they went back to the fewer
    busy = reason_text(Reason(ReasonKind.STOPPED_HELPING, {**back, "cpu_bound": True}))
    idle = reason_text(Reason(ReasonKind.STOPPED_HELPING, {**back, "cpu_bound": False}))
    assert busy.endswith("the pipeline is CPU-bound, back to 1 worker x prefetch 2 (the CPUs are busy)")
    assert idle.endswith("not busy, back to 1 worker x prefetch 2: as fast with less")


def test_a_step_up_sized_by_the_loops_delivery_says_it_is_measured():
    stats = window(41, worker_batch_s=0.041, worker_cpu_fraction=0.1)
    reason = decide(LoaderConfig(), stats, Budget(32, cpus=64)).reason
    text = reason_text(Reason(ReasonKind.MORE_WORKERS, {**reason.values, "sized_by": "delivery"}))
    assert text.endswith("a step up to measure (the CPUs are not busy)")


def test_a_budget_clamp_is_worded_after_the_reason():
    reason = Reason(ReasonKind.NOTHING_MEASURED, {"budget_allows": (2, 1)})
    assert reason_text(reason) == "no training batches measured: holding; the budget allows 2 workers x prefetch 1"


def test_the_best_config_is_the_leanest_within_min_gain_of_the_best_median():
    # 4 workers had one lucky window, but its median is no better than 2 workers'
    history = [
        record(0, 4, window(0.5)),  # 3,048 samples/s
        record(1, 4, window(2.0)),  # 2,667
        record(2, 4, window(2.0)),
        record(3, 2, window(2.1)),  # 2,645: within 5 % of 4 workers' median, and leaner
        record(4, 2, window(2.1)),
        record(5, 0, window(20)),
    ]
    assert best_config(history, min_gain=0.05) == LoaderConfig(num_workers=2)
    assert best_config(history, min_gain=0.0) == LoaderConfig(num_workers=4)
    cited = recommend(history, min_gain=0.05)
    assert cited.config == LoaderConfig(num_workers=2) and cited.samples_per_s == pytest.approx(32 / 0.0121)
    # the decision's best is the same notion
    assert decide(LoaderConfig(num_workers=2), window(2.1), Budget(32, cpus=64), history[:-1]).best == cited.config


def decided(stats: WindowStats, config: LoaderConfig = LoaderConfig(), **where) -> WindowRecord:
    decision = decide(config, stats, Budget(32, cpus=64))
    return WindowRecord(
        0, config, stats, decision.verdict, decision.reason, decision.config, judged_util=decision.judged_util, **where
    )


def nvml(stats: WindowStats, util: float) -> WindowStats:
    return replace(stats, gpu_util=util, util_source=UtilSource.NVML)


def test_the_console_line_is_short_and_the_reason_comes_at_verbose_2():
    r = decided(window(41, worker_batch_s=0.041, worker_cpu_fraction=0.1), end_batch=10, step=10)
    line = window_line(r, tuning=True)
    assert line == (
        "[dltune] epoch 0 to batch 10 | workers 0 -> 5, prefetch 2 | GPU busy 20% (estimate) | data-bound (I/O)"
    )
    first, second = window_line(r, tuning=True, verbose=2).split("\n")
    assert first == line
    assert "samples/s" in second and "step 10 ms (hook to hook)" in second and second.endswith(reason_text(r.reason))


@pytest.mark.parametrize("workers", [1, 8, 16])
@pytest.mark.parametrize("util", [None, 0.62])
def test_console_lines_stay_under_120_characters_and_say_worker_counts_in_english(workers, util):
    stats = window(20, worker_batch_s=0.08, worker_cpu_fraction=0.9)
    stats = stats if util is None else nvml(stats, util)
    for end_batch in (None, 250):
        r = decided(stats, LoaderConfig(num_workers=workers), end_batch=end_batch)
        r = replace(r, epoch=12, next_config=LoaderConfig(num_workers=workers + 4))
        line = window_line(r, tuning=True)
        assert len(line) <= 120, line
        assert "1 workers" not in line + reason_text(r.reason)


def test_an_estimate_says_so_in_the_line_the_reason_and_the_decision_text():
    estimated = decided(window(0.2, worker_batch_s=0.005))  # 98 % busy by 1 - starvation
    for text in (window_line(estimated, tuning=True, verbose=2), decision_markdown(estimated, tuning=True)):
        assert "GPU busy 98% (estimate)" in text and "GPU 98% busy" not in text
    measured = decided(nvml(window(0.2, worker_batch_s=0.005), 0.93))
    for text in (window_line(measured, tuning=True, verbose=2), decision_markdown(measured, tuning=True)):
        assert "GPU 93% busy" in text and "estimate" not in text


def test_the_table_tells_each_windows_story_and_cites_the_median_window():
    first = decided(window(41), end_batch=10, step=10)
    rest = replace(decided(window(41)), step=25, judged_util=0.5)
    later = replace(decided(nvml(window(2), 0.9)), epoch=1, step=50)
    table = summary_table([first, rest, later], first)
    rows = {line.split()[1]: line for line in table.splitlines() if line.strip()[:1].isdigit()}
    assert set(rows) == {"1-10", "11-end", "1-end"}
    assert "~20%" in rows["1-10"] and "~50%" in rows["11-end"] and "data-bound (I/O)" in rows["1-10"]
    assert "90%" in rows["1-end"] and "~" not in rows["1-end"]
    assert "hook to hook" in table and "~: an estimate" in table
    assert "recommended: workers=0" in table and "its median window: epoch 0 to batch 10" in table
    assert max(len(line) for line in table.splitlines()) <= 120
    assert not [line for line in table.splitlines() if line != line.rstrip()]  # no padding to the console width
    cpu_bound = replace(later, verdict=Verdict.DATA_BOUND_CPU, config=LoaderConfig(num_workers=12, prefetch_factor=8))
    row = [line for line in summary_table([cpu_bound], None).splitlines() if "data-bound" in line]
    assert row and row[0].rstrip().endswith("data-bound (CPU saturated)")  # a row is one line


def test_a_move_to_zero_workers_for_the_hand_over_says_how_often_a_batch_was_ready():
    numbers = {"starvation": 0.28, "windows": 2, "workers": 4, "wait_s": 0.008, "batch_s": 0.0049, "gain": 0.13}
    every = reason_text(Reason(ReasonKind.HANDED_OVER, {**numbers, "ready": 1.0, "to": (0, 2)}))
    assert every == (
        "starved 28% over 2 windows though a batch was ready at every fetch: taking one from a worker cost the loop "
        "8.0 ms, making it in the loop should cost ~4.9 ms (+13% expected): 4 workers -> 0 workers"
    )
    nearly = reason_text(Reason(ReasonKind.HANDED_OVER, {**numbers, "ready": 0.97, "to": (0, 2)}))
    assert "though a batch was ready at 97% of fetches: taking one" in nearly
    held = {"starvation": 0.21, "windows": 3, "workers": 0, "ceiling": 0, "cpu_bound": False}
    assert reason_text(Reason(ReasonKind.AT_WORKER_CEILING, held)) == (
        "starved 21% over 3 windows with 0 workers, but taking a batch from a worker cost the loop more than making "
        "it: holding"
    )


def test_a_worker_budget_set_by_a_runs_batches_says_so():
    # a validation run of 2 batches: the policy's budget is 2 workers, and the words say why
    budget = Budget(7, cpus=8).for_runs_of(2)
    over = decide(LoaderConfig(num_workers=5), window(20, step_ms=1, batches=20), budget)
    assert over.config.num_workers == 2
    assert reason_text(over.reason) == "5 workers exceed the 2 a run of 2 batches gives work to: 2 workers x prefetch 2"
    stats = window(40, step_ms=1, batches=20, worker_batch_s=0.04, worker_cpu_fraction=0.05)
    held = decide(LoaderConfig(num_workers=2), stats, budget)
    assert held.config.num_workers == 2 and held.reason.kind is ReasonKind.AT_WORKER_BUDGET
    assert reason_text(held.reason).endswith("but a run of 2 batches gives work to no more workers: holding")
    plain = decide(LoaderConfig(num_workers=2), stats, Budget(2, cpus=8))
    assert reason_text(plain.reason).endswith("but 2 workers is the budget's most")
