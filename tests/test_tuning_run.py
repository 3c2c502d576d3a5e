"""One fit's tuning run, window by window, without a Trainer: records, loader changes, rollback caps, checkpoints."""

from __future__ import annotations

import math
from dataclasses import replace

from fit_workloads import SleepyDataModule

from lightning_dltune.control.run import TuningRun
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.records import Budget, PolicySettings, Verdict, WindowRecord
from lightning_dltune.core.stats import WindowStats
from lightning_dltune.core.windows import NO_BATCH, WindowSchedule

BUDGET = Budget(max_workers=8, cpus=8)


def window(fetch_ms: float, step_ms: float, batches: int = 50, worker_ms: float | None = None) -> WindowStats:
    """A window where every fetch waited ``fetch_ms`` for a ``step_ms`` step."""
    return WindowStats(
        batches=batches,
        samples=32 * batches,
        fetches=batches,
        stalls=batches if fetch_ms else 0,
        fetch_wait_total_s=fetch_ms / 1e3 * batches,
        step_total_s=step_ms / 1e3 * batches,
        fetch_wait_p50_s=fetch_ms / 1e3,
        fetch_wait_p95_s=fetch_ms / 1e3,
        step_p50_s=step_ms / 1e3,
        step_p95_s=step_ms / 1e3,
        worker_batch_s=None if worker_ms is None else worker_ms / 1e3,
        worker_cpu_fraction=None if worker_ms is None else 0.1,
    )


def starved_run(tune: bool = True) -> tuple[TuningRun, SleepyDataModule]:
    datamodule = SleepyDataModule(train_length=400, num_workers=0)
    run = TuningRun(PolicySettings(), WindowSchedule(50, 0.0, first_batches=10), datamodule, tune=tune)
    return run, datamodule


def test_a_starved_window_is_recorded_and_the_next_epoch_builds_the_decided_config():
    run, datamodule = starved_run()
    start = datamodule.loader_config
    record = run.close_window(start, window(40, 10), BUDGET, epoch=0, global_step=50)
    assert record is not None and run.history == [record]
    assert record.verdict == Verdict.DATA_BOUND_IO and record.next_config.num_workers > 0
    assert datamodule.loader_config == record.next_config  # applied from the next epoch start
    assert run.rebuilds == 1 and run.running_config(record) == record.next_config


def test_a_window_without_a_fetch_gets_no_record():
    run, datamodule = starved_run()
    assert run.close_window(datamodule.loader_config, WindowStats(batches=3), BUDGET, epoch=0, global_step=3) is None
    assert run.history == [] and run.rebuilds == 0


def test_monitoring_only_records_what_it_would_try_and_leaves_the_loaders_alone():
    run, datamodule = starved_run(tune=False)
    start = datamodule.loader_config
    record = run.close_window(start, window(40, 10), BUDGET, epoch=0, global_step=50, end_batch=50)
    assert record is not None and record.changed
    assert datamodule.loader_config == start and run.rebuilds == 0
    assert run.running_config(record) == start


def test_every_rank_keeps_rank_zeros_decision_and_next_window_length():
    run, datamodule = starved_run()
    start = datamodule.loader_config

    def rank_zeros(payload):  # what a broadcast from rank zero hands this rank
        decision, _ = payload
        return replace(decision, config=start), 123

    record = run.close_window(start, window(40, 10), BUDGET, epoch=0, global_step=50, broadcast=rank_zeros)
    assert record is not None and record.next_config == start and not record.changed
    assert run.windows.next_length == 123 and run.rebuilds == 0


def test_windows_close_mid_epoch_only_where_every_rank_meets_and_the_loaders_can_switch():
    run, _ = starved_run()
    run.open_window(0, epoch_batches=900, world_size=2, switchable=True)
    assert run.windows.end == 9  # the fit's first window
    run.open_window(0, epoch_batches=math.inf, world_size=2, switchable=True)
    assert run.windows.end == NO_BATCH  # ranks may not meet: the epoch end closes it
    run.open_window(0, epoch_batches=900, world_size=1, switchable=False)
    assert run.windows.end == NO_BATCH  # an iterable stream switches at epoch starts only


def test_new_conditions_are_seen_against_the_same_configs_windows():
    run, datamodule = starved_run()
    config = LoaderConfig(num_workers=4)
    datamodule.set_loader_config(config)
    run.close_window(config, window(0.5, 20, worker_ms=60), BUDGET, epoch=0, global_step=50)
    # one earlier window has no spread to weigh a move against: a move is news only where the loop now starves
    assert not run.closes_at_look(config, window(0.5, 26, worker_ms=60))  # a step 30 % slower, still fed
    assert run.closes_at_look(config, window(30, 20, worker_ms=200))
    for step in (100, 150):
        run.close_window(config, window(0.5, 20, worker_ms=60), BUDGET, epoch=0, global_step=step)
    assert not run.closes_at_look(config, window(0.5, 20, worker_ms=60))
    assert run.closes_at_look(config, window(30, 20, worker_ms=200))  # storage three times slower
    assert not run.closes_at_look(LoaderConfig(num_workers=2), window(30, 20, worker_ms=200))  # no earlier windows


def test_a_give_backs_first_window_closes_where_the_cost_rose_and_starved_the_loop():
    # 8 workers fed the loop on 60 ms batches and gave back to 4 as storage got three times slower: the look
    # compares the workers' cost with the 8 workers' windows (fewer workers make their batches no slower)
    run, _ = starved_run()
    eight, four = LoaderConfig(num_workers=8), LoaderConfig(num_workers=4)
    run.history.extend(
        WindowRecord(
            0, eight, window(0.5 + 0.01 * i, 20, worker_ms=60 + i), Verdict.IN_BAND, "", eight if i < 2 else four
        )
        for i in range(3)
    )
    assert run.closes_at_look(four, window(30, 20, worker_ms=200))
    assert not run.closes_at_look(four, window(30, 20, worker_ms=61))  # starved, the cost the same: the give-back's
    assert not run.closes_at_look(four, window(0.5, 20, worker_ms=200))  # the loop still fed: nothing to act on


def test_the_fits_first_window_closes_at_its_early_look_only_where_0_workers_starve_plainly():
    run, _ = starved_run()
    starved = window(60, 20)  # the loop waits 60 ms a batch for a 20 ms step
    assert run.closes_at_look(LoaderConfig(num_workers=0), starved)
    assert not run.closes_at_look(LoaderConfig(num_workers=2), starved)
    assert not run.closes_at_look(LoaderConfig(num_workers=0), window(5, 20))


def test_a_rolled_back_switch_caps_the_workers_tells_the_listener_and_is_saved():
    run, _ = starved_run()
    told = []
    run.on_rollback = lambda failed, restored, exc: told.append((failed.num_workers, restored.num_workers))
    run.rolled_back(LoaderConfig(num_workers=6), LoaderConfig(num_workers=2), RuntimeError("killed"))
    assert run.worker_cap == 4 and told == [(6, 2)]  # at most halfway back up to the count that failed

    run.close_window(LoaderConfig(), window(40, 10), BUDGET, epoch=0, global_step=50)
    saved = run.state_dict(current=None)
    resumed, _ = starved_run()
    resumed.load_state_dict(saved)
    assert resumed.worker_cap == 4 and resumed.rebuilds == run.rebuilds
    assert resumed.history == run.history and resumed.restored_config == run.history[-1].next_config
    assert resumed.windows.next_length == run.windows.next_length

    older, _ = starved_run()
    older.load_state_dict({"config": None, "rebuilds": 0, "history": []})  # a checkpoint from before the cap
    assert older.worker_cap is None and older.restored_config is None
