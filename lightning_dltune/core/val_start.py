"""The validation loaders' config before their first run, sized from what the training side measured.

No torch, no Lightning. Before its first run the validation side has no window of its own, and following
the training config starves it: a validation step makes one forward pass of the three passes' worth a
training step makes (a backward pass costs about two forward passes; the optimizer step comes on top),
so the step it has to be fed for is about a third as long. The training side's last window measured
what a batch costs to make; the first validation run is sized for that cost against a third of the
training step, by the same model and headroom as the training side (:mod:`lightning_dltune.core.model`),
within the CPUs it counts and the budget. From its first run on the validation side decides on its own
runs (a prior sized too high is given back as slack; one too low adds workers).

The prior only ever adds workers to the training config: a validation loader is never started leaner than
the training one, except where its runs are shorter than that config's workers (the budget then says so:
:meth:`~lightning_dltune.core.records.Budget.for_runs_of`, and the caller starts it at that many).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.model import PipelineModel
from lightning_dltune.core.policy import clamp_to_budget
from lightning_dltune.core.records import Budget, PolicySettings
from lightning_dltune.core.stats import WindowStats

VAL_STEP_SHARE = 1 / 3  # a validation step against a training step: one forward pass of about three passes' worth


def first_val_config(
    measured: LoaderConfig, stats: WindowStats, follows: LoaderConfig, budget: Budget, settings: PolicySettings
) -> Optional[LoaderConfig]:
    """The validation loaders' first config, from a training window ``stats`` that ran ``measured``.

    Args:
        measured: the config the training window ran.
        stats: the training window (its job-wide stats) that measured a batch's cost.
        follows: the config the validation loaders would otherwise follow (the training side's next).
        budget: the validation side's budget (what the training side's idle workers leave).
        settings: the policy's knobs (``headroom``, ``min_gain``, ``burst_stall_fraction``).

    Returns:
        ``follows`` with more workers where it is expected to starve a step a third as long (below the
        band), more workers are expected to gain ``min_gain`` and the budget allows them, else ``None``: the
        validation loaders follow the training config until their first run.
    """
    if stats.batches <= 0 or stats.step_mean_s <= 0:
        return None
    model = PipelineModel.infer(
        measured.num_workers, stats, budget.cpus, settings.burst_stall_fraction, measured.prefetch_factor
    )
    val = replace(model, step_mean_s=model.step_mean_s * VAL_STEP_SHARE)
    workers = follows.num_workers
    limit = min(budget.max_workers, val.cpu_limit())
    # the training config must be expected to starve the shorter step, as the policy would judge it: below the band
    if workers >= limit or val.throughput(workers) / val.demand >= settings.band[0] - settings.hysteresis:
        return None
    wanted = val.workers_for(settings.headroom * val.demand, workers + 1, limit) or limit
    if val.throughput(wanted) < (1.0 + settings.min_gain) * val.throughput(workers):
        return None  # more workers are not expected to pay
    target, _ = clamp_to_budget(follows.replace(num_workers=wanted), stats.batch_bytes, budget, settings)
    return target if target.num_workers > workers else None
