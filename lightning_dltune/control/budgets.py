"""The job's loader budget: rank resources reduced across ranks, the cap after a failed switch, the start clamp."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional

import torch

from lightning_dltune.control.resources import rank_budget
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.model import prefetch_bytes
from lightning_dltune.core.policy import clamp_to_budget
from lightning_dltune.core.records import Budget, PolicySettings


def job_budget(
    trainer: Any,
    device: Any,
    max_workers: Optional[int],
    memory_fraction: float,
    shm_fraction: float,
    worker_cap: Optional[int] = None,
    held_workers: Optional[int] = None,
) -> Budget:
    """What every rank's loaders may use: the tightest rank's budget, so that all ranks decide alike.

    ``worker_cap`` (after a failed switch) lowers the worker budget; ``held_workers`` (a stream that
    does not shard by worker) pins it. A collective under DDP: every rank must call it.
    """
    local = rank_budget(
        local_ranks=max(1, trainer.num_devices),
        max_workers=max_workers,
        memory_fraction=memory_fraction,
        shm_fraction=shm_fraction,
    )
    workers = local.max_workers if worker_cap is None else min(local.max_workers, worker_cap)
    if held_workers is not None:
        workers = held_workers
    if trainer.world_size <= 1:
        return Budget(workers, local.memory_bytes, local.shm_bytes, local.cpus)
    values = torch.tensor(
        [workers, _or_inf(local.memory_bytes), _or_inf(local.shm_bytes), local.cpus], dtype=torch.float64, device=device
    )
    w, mem, shm, cpus = trainer.strategy.reduce(values, reduce_op="min").tolist()
    return Budget(int(w), None if math.isinf(mem) else mem, None if math.isinf(shm) else shm, cpus)


def fit_batches_left(trainer: Any, end_batch: Optional[int]) -> Optional[int]:
    """The fit's training batches after a window that closed after ``end_batch`` batches of the current epoch
    (``None``: at the epoch's end): the time a rebuild has to pay for itself in.

    ``max_epochs`` and ``max_steps`` bound it (the tighter wins; a step is ``accumulate_grad_batches`` batches at
    most: Lightning also steps at an epoch's end).
    ``None`` where neither does (``-1``: a fit bounded by ``max_time`` or a callback only) or an epoch's length
    is unknown. The same on every rank: it reads only what every rank shares (the epoch's length is already
    taken as such: windows close at the same batch index on every rank).
    """
    per_epoch = trainer.num_training_batches
    if not isinstance(per_epoch, (int, float)) or not math.isfinite(per_epoch) or per_epoch <= 0:
        return None
    bounds = []
    max_epochs = trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0:
        this_epoch = per_epoch - end_batch if end_batch is not None else 0
        bounds.append((max_epochs - trainer.current_epoch - 1) * per_epoch + this_epoch)
    max_steps = trainer.max_steps
    if max_steps is not None and max_steps >= 0:
        bounds.append((max_steps - trainer.global_step) * max(1, trainer.accumulate_grad_batches))
    return max(0, int(min(bounds))) if bounds else None


def cap_after_failure(cap: Optional[int], failed: LoaderConfig, restored: LoaderConfig) -> Optional[int]:
    """The worker cap after ``failed`` rolled back to ``restored``: at most halfway back up to what failed."""
    if failed.num_workers <= restored.num_workers:
        return cap
    halfway = max(restored.num_workers, (restored.num_workers + failed.num_workers) // 2)
    return halfway if cap is None else min(cap, halfway)


def clamp_start(
    config: LoaderConfig,
    budget: Budget,
    batch_bytes: Optional[int],
    loaders: int,
    settings: PolicySettings,
    earn: bool = False,
) -> LoaderConfig:
    """The start config within ``budget`` before any worker starts (prefetch gives way first, then workers).

    ``loaders`` loaders hold their workers' batches at once (persistent train and val workers), and
    each loop holds one more batch of its own: the memory budgets are shared out accordingly.

    ``earn`` (the tuner runs): more workers than the budget allows are no measurement of anything, only a
    number the machine cannot run as asked; such a start begins at one worker a usable CPU (what torch itself
    suggests) and earns more where the loop starves, up to the budget's most, which is there for the I/O that
    windows show. Without it (a fit that only measures) the budget's most. From 16 x 8 on 2 CPUs the
    benchmark's first windows ran 7 workers where 0-2 were the best: 1.17-1.19 times the best config's peak
    memory.
    """
    if earn and config.num_workers > budget.max_workers:
        config = config.replace(num_workers=earned_start(budget))
    if batch_bytes:
        held = batch_bytes * (2 if config.pin_memory else 1)
        share = lambda total: None if total is None else max(0.0, total / loaders - held)  # noqa: E731
        budget = replace(budget, memory_bytes=share(budget.memory_bytes), shm_bytes=share(budget.shm_bytes))
    return clamp_to_budget(config, batch_bytes, budget, settings)[0]


def earned_start(budget: Budget) -> int:
    """Where a start over the worker budget begins when the tuner earns the rest: one worker a usable CPU."""
    return min(budget.max_workers, max(1, math.floor(budget.cpus)))


def clamp_datamodule_start(
    datamodule: Any, budget: Budget, settings: PolicySettings, earn: bool = False
) -> Optional[str]:
    """Bring a :class:`~lightning_dltune.TunableDataModule`'s start config within ``budget`` before any
    loader (train, val, sanity check) starts; returns what to tell the user when it was clamped (``earn``: see
    :func:`clamp_start`)."""
    config = datamodule.loader_config
    # persistent train and val workers hold their batches at once
    loaders = 2 if datamodule.val_dataset is not None and config.persistent_workers else 1
    batch_bytes = datamodule.estimate_batch_bytes() if config.num_workers else None
    clamped = clamp_start(config, budget, batch_bytes, loaders, settings, earn)
    if clamped == config:
        return None
    datamodule.set_loader_config(clamped)
    return clamp_notice(config, datamodule.loader_config, budget, batch_bytes, settings)


def clamp_notice(
    config: LoaderConfig, clamped: LoaderConfig, budget: Budget, batch_bytes: Optional[int], settings: PolicySettings
) -> str:
    """What the console says when a start config was brought within the budget."""
    size = f"{batch_bytes / 2**20:.1f} MB" if batch_bytes else "unknown size"
    said = (
        f"[dltune] start: {config.short()} exceeds the budget (at most {budget.max_workers} workers, prefetch"
        f" {settings.max_prefetch_factor}, memory for prefetched batches of {size}); starting with"
        f" {clamped.short()}"
    )
    if config.num_workers > budget.max_workers and clamped.num_workers < budget.max_workers:
        said += f" (one worker a usable CPU; up to {budget.max_workers} where the loop starves)"
    return said


def less_the_other_side(budget: Budget, other: Optional[LoaderConfig], batch_bytes: Optional[int]) -> Budget:
    """One side's budget (train or val) while the other side's persistent workers sit idle holding their batches.

    Both pools count against memory and ``/dev/shm``; the CPUs are not shared out, since the idle side's
    workers use none while the other side runs.
    """
    if other is None or not batch_bytes or not other.persistent_workers or other.num_workers == 0:
        return budget
    memory, shm = prefetch_bytes(other, batch_bytes)
    less = lambda total, held: None if total is None else max(0.0, total - held)  # noqa: E731
    return replace(budget, memory_bytes=less(budget.memory_bytes, memory), shm_bytes=less(budget.shm_bytes, shm))


def _or_inf(value: Optional[float]) -> float:
    return math.inf if value is None else float(value)
