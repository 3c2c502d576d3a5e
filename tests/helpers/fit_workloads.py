"""Ground-truth workloads for real CPU fits.

The accelerator's step is emulated with a fixed sleep in the training process: while a GPU computes,
the host is idle, which is what a sleep is. Datasets cost a known sleep per batch (I/O-like) or a
known amount of CPU work, so measured fetch waits and step times can be checked against truth.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from lightning_dltune import TunableDataModule


class SleepyDataset(Dataset):
    """``length`` samples of ``dim`` floats; producing one batch sleeps ``batch_cost_s`` (``__getitems__``).

    Every ``slow_every``-th batch (by first index) costs ``slow_factor`` times more (bursty storage).
    From the moment the file ``slow_once`` exists, every batch costs ``slower`` times more (storage that slows
    down mid-fit: a test's callback creates the file where the fit should meet the change, whatever the
    machine's pace; every worker process sees it).
    """

    def __init__(
        self,
        length: int = 256,
        dim: int = 8,
        batch_cost_s: float = 0.0,
        slow_every: int = 0,
        slow_factor: float = 1.0,
        fail_in_worker_above: Optional[int] = None,
        slower: float = 1.0,
        slow_once: Optional[str] = None,
    ) -> None:
        self.length = length
        self.dim = dim
        self.batch_cost_s = batch_cost_s
        self.slow_every = slow_every
        self.slow_factor = slow_factor
        self.fail_in_worker_above = fail_in_worker_above
        self.slower = slower
        self.slow_once = slow_once

    def __len__(self) -> int:
        return self.length

    def _sample(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(index)
        return torch.randn(self.dim, generator=g)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": self._sample(index), "index": index}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        if self.fail_in_worker_above is not None and info is not None and info.num_workers > self.fail_in_worker_above:
            os.kill(os.getpid(), 9)  # a worker killed by the OS (out of memory), as at too many workers
        cost = self.batch_cost_s
        if self.slow_every and (indices[0] // max(1, len(indices))) % self.slow_every == 0:
            cost *= self.slow_factor
        if self.slow_once is not None and os.path.exists(self.slow_once):
            cost *= self.slower
        if cost:
            time.sleep(cost)
        return [self[i] for i in indices]


class CountingIterable(IterableDataset):
    """An iterable dataset without ``__len__``: ``length`` samples, sharded over workers."""

    def __init__(self, length: int = 64, dim: int = 8) -> None:
        self.length = length
        self.dim = dim

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.length, step):
            yield torch.full((self.dim,), float(i)), i


class SleepStepModule(pl.LightningModule):
    """A tiny model whose training step also sleeps ``step_s``: an emulated accelerator step."""

    def __init__(
        self, step_s: float = 0.0, val_step_s: float = 0.0, dim: int = 8, record_indices: bool = False
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(dim, 1)
        self.step_s = step_s
        self.val_step_s = val_step_s
        self.record_indices = record_indices
        self.train_indices: list[list[int]] = []
        self.val_indices: list[list[int]] = []

    @staticmethod
    def _x_and_index(batch: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if isinstance(batch, dict):
            return batch["x"], batch.get("index")
        if isinstance(batch, (list, tuple)):
            return batch[0], batch[1] if len(batch) > 1 else None
        return batch, None

    def on_train_epoch_start(self) -> None:
        if self.record_indices:
            self.train_indices.append([])

    def on_validation_epoch_start(self) -> None:
        if self.record_indices and not self.trainer.sanity_checking:
            self.val_indices.append([])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, index = self._x_and_index(batch)
        if self.record_indices and index is not None:
            self.train_indices[-1].extend(index.tolist())
        if self.step_s:
            time.sleep(self.step_s)
        return self.layer(x).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, index = self._x_and_index(batch)
        if self.record_indices and index is not None and not self.trainer.sanity_checking:
            self.val_indices[-1].extend(index.tolist())
        if self.val_step_s:
            time.sleep(self.val_step_s)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SleepyDataModule(TunableDataModule, pl.LightningDataModule):
    """A TunableDataModule over :class:`SleepyDataset` train and val sets."""

    def __init__(
        self,
        train_length: int = 256,
        val_length: int = 64,
        batch_cost_s: float = 0.0,
        val_batch_cost_s: float = 0.0,
        dataset_kwargs: Optional[dict] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.train_length = train_length
        self.val_length = val_length
        self.batch_cost_s = batch_cost_s
        self.val_batch_cost_s = val_batch_cost_s
        self.dataset_kwargs = dataset_kwargs or {}

    def setup(self, stage: str) -> None:
        self.train_dataset = SleepyDataset(self.train_length, batch_cost_s=self.batch_cost_s, **self.dataset_kwargs)
        self.val_dataset = SleepyDataset(self.val_length, batch_cost_s=self.val_batch_cost_s)


def steady_truth(batch_cost_s: float, step_s: float, workers: int) -> tuple[float, float]:
    """(fetch wait, step time) per batch in steady state for a pipeline of ``workers`` serial producers."""
    if workers == 0:
        return batch_cost_s, step_s
    period = max(step_s, batch_cost_s / workers)
    return period - step_s, step_s
