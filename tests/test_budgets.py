"""budgets: the worker cap after a failed switch and the start clamp (pure parts; DDP reduction runs in test_ddp)."""

from lightning_dltune.control.budgets import cap_after_failure, clamp_start
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.records import Budget, PolicySettings

MB = 2**20


def test_a_failed_switch_caps_workers_halfway_back_up_and_never_raises_the_cap():
    cap = cap_after_failure(None, failed=LoaderConfig(num_workers=6), restored=LoaderConfig(num_workers=2))
    assert cap == 4
    assert cap_after_failure(cap, failed=LoaderConfig(num_workers=8), restored=LoaderConfig(num_workers=2)) == 4
    assert cap_after_failure(cap, failed=LoaderConfig(num_workers=3), restored=LoaderConfig(num_workers=1)) == 2


def test_a_failure_that_did_not_add_workers_leaves_the_cap_alone():
    assert (
        cap_after_failure(
            None, failed=LoaderConfig(num_workers=2, prefetch_factor=8), restored=LoaderConfig(num_workers=2)
        )
        is None
    )


def test_the_start_clamp_shares_dev_shm_between_train_and_val_and_keeps_a_batch_per_loop():
    # 8 MB /dev/shm, half of it for batches; 1 MB batches; persistent train and val workers
    budget = Budget(max_workers=8, memory_bytes=None, shm_bytes=4 * MB, cpus=8)
    start = LoaderConfig(num_workers=4, prefetch_factor=4)
    clamped = clamp_start(start, budget, batch_bytes=MB, loaders=2, settings=PolicySettings())
    assert 2 * (clamped.num_workers * clamped.prefetch_factor + 1) * MB <= 4 * MB
    assert clamped.num_workers >= 1


def test_the_start_clamp_gives_prefetch_first_then_workers():
    budget = Budget(max_workers=8, memory_bytes=9 * MB, shm_bytes=None, cpus=8)
    clamped = clamp_start(LoaderConfig(num_workers=4, prefetch_factor=4), budget, MB, 1, PolicySettings())
    assert clamped == LoaderConfig(num_workers=4, prefetch_factor=2)  # 8 batches + the loop's own within 9 MB


def test_the_start_clamp_without_a_batch_size_only_applies_the_worker_and_prefetch_caps():
    budget = Budget(max_workers=3, memory_bytes=1.0, shm_bytes=1.0, cpus=4)
    clamped = clamp_start(LoaderConfig(num_workers=6, prefetch_factor=16), budget, None, 2, PolicySettings())
    assert clamped == LoaderConfig(num_workers=3, prefetch_factor=8)


def test_a_run_of_fewer_batches_than_the_worker_budget_lowers_it_and_the_other_sides_share_keeps_that():
    from lightning_dltune.control.budgets import less_the_other_side

    budget = Budget(7, memory_bytes=1e9, shm_bytes=1e9, cpus=8)
    assert budget.for_runs_of(None) is budget and budget.for_runs_of(7) is budget and budget.for_runs_of(40) is budget
    short = budget.for_runs_of(2)
    assert (short.max_workers, short.run_batches, short.cpus) == (2, 2, 8)
    assert budget.for_runs_of(0).max_workers == 0
    shared = less_the_other_side(short, LoaderConfig(num_workers=3, prefetch_factor=2), batch_bytes=1000)
    assert (shared.max_workers, shared.run_batches) == (2, 2) and shared.memory_bytes < 1e9
