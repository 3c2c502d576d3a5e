"""Lightning projects shaped like the ones in the wild, none written for the tuner: loaders built in the
LightningModule, in a plain LightningDataModule, passed to ``fit``, a DataLoader subclass with its own
constructor argument, a custom batch sampler.

Every dataset is :class:`~fit_workloads.SleepyDataset`: each batch sleeps (storage latency) and carries
its sample indices, so a test checks that every sample was trained once per epoch. The accelerator step
is a sleep in the training process (the host idles while a GPU computes).
"""

from __future__ import annotations

from typing import Any, Iterator

import lightning.pytorch as pl
import torch
from fit_workloads import SleepStepModule, SleepyDataset
from torch.utils.data import DataLoader, Sampler

TRAIN_LENGTH, VAL_LENGTH, BATCH = 240, 16, 4
BATCH_COST_S, STEP_S = 0.03, 0.005  # I/O-bound: 30 ms of storage latency per batch against a 5 ms step


def train_set(**kwargs: Any) -> SleepyDataset:
    return SleepyDataset(TRAIN_LENGTH, batch_cost_s=BATCH_COST_S, **kwargs)


def val_set() -> SleepyDataset:
    return SleepyDataset(VAL_LENGTH)


class TaggedLoader(DataLoader):
    """A DataLoader subclass with a constructor argument of its own (as projects add for their own needs)."""

    def __init__(self, dataset: Any, tag: str, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.tag = tag


class ChunkBatchSampler(Sampler):
    """A custom batch sampler: shuffled chunks of consecutive indices (as length-bucketing samplers do)."""

    def __init__(self, length: int, batch_size: int, seed: int = 0) -> None:
        self.length, self.batch_size, self.epoch, self.seed = length, batch_size, 0, seed

    def __len__(self) -> int:
        return self.length // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        self.epoch += 1
        for chunk in order.tolist():
            yield list(range(chunk * self.batch_size, (chunk + 1) * self.batch_size))


class ModuleLoaders(SleepStepModule):
    """Loaders in the LightningModule's own hooks, built from its own arguments."""

    def __init__(self, workers: int = 0, shape: str = "module", **kwargs: Any) -> None:
        super().__init__(step_s=STEP_S, record_indices=True, **kwargs)
        self.workers, self.shape = workers, shape

    def train_dataloader(self) -> DataLoader:
        if self.shape == "subclass":
            return TaggedLoader(train_set(), "train", batch_size=BATCH, shuffle=True, num_workers=self.workers)
        if self.shape == "batch_sampler":
            sampler = ChunkBatchSampler(TRAIN_LENGTH, BATCH)
            return DataLoader(train_set(), batch_sampler=sampler, num_workers=self.workers)
        return DataLoader(train_set(), batch_size=BATCH, shuffle=True, num_workers=self.workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(val_set(), batch_size=BATCH, num_workers=self.workers)


class NoLoaders(SleepStepModule):
    """A LightningModule whose loaders come from elsewhere (a datamodule, fit's arguments)."""

    def __init__(self) -> None:
        super().__init__(step_s=STEP_S, record_indices=True)


class PlainData(pl.LightningDataModule):
    """A plain LightningDataModule, no mixin."""

    def __init__(self, batch_size: int = BATCH, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage: str) -> None:
        self.train, self.val = train_set(), val_set()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, self.batch_size, num_workers=self.num_workers)


def fit_shape(shape: str, trainer: pl.Trainer) -> tuple[SleepStepModule, dict[str, Any]]:
    """Fit the project of ``shape``; returns its module and what the user held (the loaders they passed)."""
    held: dict[str, Any] = {}
    if shape == "datamodule":
        model: SleepStepModule = NoLoaders()
        trainer.fit(model, datamodule=PlainData())
    elif shape == "fit_args":
        model = NoLoaders()
        held["train"] = DataLoader(train_set(), batch_size=BATCH, shuffle=True)
        held["val"] = DataLoader(val_set(), batch_size=BATCH)
        trainer.fit(model, train_dataloaders=held["train"], val_dataloaders=held["val"])
    else:
        model = ModuleLoaders(shape=shape)
        trainer.fit(model)
    return model, held
