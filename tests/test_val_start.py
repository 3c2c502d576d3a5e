"""The validation side's first config, sized from a training window (pure logic: no torch, no Lightning).

A validation step is taken as a third of the training step (one forward pass; a backward pass costs about
two): the first validation run gets the workers that feed it, never fewer than the training config's.
"""

from __future__ import annotations

from test_policy import MB, cfg, window

from lightning_dltune.core.records import Budget, PolicySettings
from lightning_dltune.core.val_start import VAL_STEP_SHARE, first_val_config

SETTINGS = PolicySettings()
ROOMY = Budget(max_workers=32, cpus=16)


def test_storage_bound_batches_get_the_workers_a_third_of_the_step_needs():
    # 1 worker makes a 20 ms batch (waiting on storage) for a 30 ms training step: in band, a 10 ms validation
    # step needs 20 / 10 x 1.2 headroom = 2.4: 3 workers
    stats = window(0.5, 30, stall_fraction=0.1, worker_ms=20, cpu_fraction=0.05)
    assert VAL_STEP_SHARE == 1 / 3
    assert first_val_config(cfg(1), stats, cfg(1), ROOMY, SETTINGS) == cfg(3)


def test_the_start_keeps_the_config_the_validation_loaders_follow_but_its_workers():
    stats = window(0.5, 30, stall_fraction=0.1, worker_ms=20, cpu_fraction=0.05)
    follows = cfg(1, 4, pin_memory=True)  # the training side's next config
    assert first_val_config(cfg(1), stats, follows, ROOMY, SETTINGS) == cfg(3, 4, pin_memory=True)


def test_a_training_config_that_feeds_the_shorter_step_too_is_followed():
    # 8 workers for a 20 ms batch and a 30 ms step: 12 batches a step's time, plenty for a 10 ms step
    stats = window(0.1, 30, stall_fraction=0.0, worker_ms=20, cpu_fraction=0.05)
    assert first_val_config(cfg(8), stats, cfg(8), ROOMY, SETTINGS) is None


def test_cheap_batches_made_in_the_training_process_need_no_workers():
    stats = window(1, 30, stall_fraction=1.0)  # 0 workers: 1 ms a batch in the fetch
    assert first_val_config(cfg(0), stats, cfg(0), ROOMY, SETTINGS) is None


def test_busy_cpus_and_the_budget_bound_the_start():
    # CPU-bound batches at the CPUs' count: no more workers than the CPUs carry
    stats = window(5, 30, stall_fraction=0.5, worker_ms=60, cpu_fraction=1.0)
    assert first_val_config(cfg(2), stats, cfg(2), Budget(max_workers=32, cpus=2), SETTINGS) is None
    # 64 MB batches x prefetch 2 in 512 MB: at most 4 workers, not the 8 a 10 ms step would want
    heavy = window(0.5, 30, stall_fraction=0.1, worker_ms=60, cpu_fraction=0.05, batch_bytes=64 * MB)
    start = first_val_config(cfg(1), heavy, cfg(1), Budget(max_workers=32, memory_bytes=512 * MB, cpus=16), SETTINGS)
    assert start is not None and 1 < start.num_workers * start.prefetch_factor <= 8
