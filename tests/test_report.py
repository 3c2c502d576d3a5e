"""What users read: the policy's structured reasons in words, and the one best config in every place."""

from __future__ import annotations

import pytest

from lightning_dltune.config import LoaderConfig
from lightning_dltune.history import best_config
from lightning_dltune.policy import decide
from lightning_dltune.records import Budget, Reason, ReasonKind, Verdict, WindowRecord
from lightning_dltune.report import _WORDS, epoch_line, reason_text, recommend, summary_table
from lightning_dltune.stats import WindowStats


def window(fetch_ms: float, step_ms: float = 10, batches: int = 100, **fields) -> WindowStats:
    return WindowStats(
        batches=batches, samples=32 * batches, fetch_wait_total_s=fetch_ms / 1e3 * batches,
        step_total_s=step_ms / 1e3 * batches, stalls=batches, fetches=batches, **fields,
    )


def record(epoch: int, workers: int, stats: WindowStats) -> WindowRecord:
    config = LoaderConfig(num_workers=workers)
    return WindowRecord(epoch, config, stats, Verdict.IN_BAND, Reason(ReasonKind.NOTE, {"text": ""}), config)


def test_every_reason_kind_has_words():
    assert set(_WORDS) == set(ReasonKind) - {ReasonKind.NOTE}


def test_a_reason_is_worded_with_its_numbers():
    decision = decide(LoaderConfig(), window(41, worker_batch_s=0.041, worker_cpu_fraction=0.1), Budget(32, cpus=64))
    text = reason_text(decision.reason)
    assert text == "starved 80% with 0 workers; a worker needs 41 ms per batch vs 10 ms step: 5 workers"
    assert str(decision.reason) == text


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


def test_the_console_line_and_the_table_show_the_verdict_and_the_reason():
    decision = decide(LoaderConfig(), window(41), Budget(32, cpus=64))
    r = WindowRecord(0, LoaderConfig(), window(41), decision.verdict, decision.reason, decision.config, end_batch=10)
    line = epoch_line(r, tuning=True)
    assert "| data-bound (I/O) |" in line and line.endswith(str(decision.reason))
    table = summary_table([r], r)
    assert "data-bound (I/O)" in table and "recommended: workers=0" in table
