"""The job's window across DDP ranks: pack each rank's stats, gather them through the strategy, reduce.

The rows are gathered with one sum all-reduce of a block in which each rank fills its own slot
(:func:`gather_rows`), not with ``strategy.all_gather``: on gloo, gathering one window's 24 fields from
2 CPU processes took 15-16 ms on the 2-core test machine (median of 2000), the barrier and all-reduce
0.8 ms. A window's looks run it up to 24 times a window; each rank's slot is added to zeros, exactly.

Packing and reduction follow the fields' declarations in :mod:`lightning_dltune.core.stats`; this module
only moves the rows. torchmetrics' state sync is not used: it syncs through ``torch.distributed``
itself, while a callback goes through ``trainer.strategy``, and the job's window keeps one rank's
whole row (the most starved) rather than reducing each state on its own.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, TypeVar

import torch

from lightning_dltune.core.stats import WindowStats, from_row, reduce_ranks, to_row

S = TypeVar("S", bound=WindowStats)


def pack(stats: WindowStats, device: Any = "cpu") -> torch.Tensor:
    """One rank's stats as a flat float64 tensor (declaration order, ``nan`` for unknown)."""
    return torch.tensor(to_row(stats), dtype=torch.float64, device=device)


def unpack(cls: type[S], gathered: torch.Tensor | Sequence[Sequence[float]]) -> list[S]:
    """Every rank's stats from the gathered rows (``world_size x fields``, or one flat row per rank)."""
    fields = len(to_row(cls()))
    if isinstance(gathered, torch.Tensor):
        gathered = gathered.detach().reshape(-1, fields).cpu().tolist()
    return [from_row(cls, row) for row in gathered]


def gather_rows(strategy: Any, rows: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's ``rows``, stacked in rank order (``world_size x rows.shape``).

    One sum ``strategy.reduce`` of a zero block whose slot ``strategy.global_rank`` holds ``rows``: each
    value is added to zeros only, so it arrives exactly (``nan`` and ``inf`` included). Every rank must call
    it at the same point (a collective) with rows of the same shape.
    """
    block = rows.new_zeros((world_size, *rows.shape))
    block[strategy.global_rank] = rows
    return strategy.reduce(block, reduce_op="sum")


def reduce_across_ranks(strategy: Any, stats: S, world_size: int, device: Any = "cpu") -> S:
    """The job's stats: every rank's gathered (:func:`gather_rows`) and reduced by the declarations.

    Every rank must call it at the same point (a collective); with one process it returns ``stats``.
    """
    if world_size <= 1:
        return stats
    gathered = gather_rows(strategy, pack(stats, device), world_size)
    return reduce_ranks(unpack(type(stats), gathered))


def most_run_batches(strategy: Any, lengths: Sequence[float], world_size: int, device: Any = "cpu") -> Optional[int]:
    """The most batches one run of a rank's loaders takes (``lengths``: each loader's, as Lightning counts
    them), the largest on any rank; ``None`` where a loader's length is unknown (``inf``) or none is given.

    Every rank must call it at the same point (a collective); with one process no communication.
    """
    most = max((float(n) for n in lengths), default=math.inf)
    if world_size > 1:
        most = float(strategy.reduce(torch.tensor(most, dtype=torch.float64, device=device), reduce_op="max"))
    return int(most) if math.isfinite(most) else None
