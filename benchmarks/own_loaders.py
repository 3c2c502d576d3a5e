"""A workload's loaders as a project builds them itself: plain ``DataLoader`` calls in the LightningModule.

The ``own_default`` and ``own_bad`` strategies fit :class:`OwnLoadersModule` with no datamodule, so the
tuner takes over the project's own loaders in place (``lightning_dltune.loaders.adopt``) instead of
building them through :class:`~lightning_dltune.TunableDataModule`. Everything else is what
:class:`workloads.WorkloadDataModule` builds, so that the two tuned fits of a start differ only in who
built the loaders: the same datasets and batch size, no shuffling, ``drop_last=True`` for training and
``False`` for validation (the mixin's rule), torch's default collate, no pinned memory (the mixin's
choice on CPU) and persistent workers (the mixin's default; DataLoader refuses them without workers,
and the tuner makes workers it adds to a 0-worker loader persistent).
"""

from __future__ import annotations

from torch.utils.data import DataLoader, Dataset
from workloads import EmulatedStepModule, Workload, make_dataset, prepare


class OwnLoadersModule(EmulatedStepModule):
    """The workload's model, with its train and val loaders built in its own hooks at one config."""

    def __init__(self, workload: Workload, num_workers: int, prefetch_factor: int) -> None:
        super().__init__(workload.step_ms / 1e3)
        self.workload = workload
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor

    def prepare_data(self) -> None:
        prepare(self.workload)

    def setup(self, stage: str) -> None:
        self.train_dataset = make_dataset(self.workload, train=True)
        self.val_dataset = make_dataset(self.workload, train=False)

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        workers = self.num_workers
        return DataLoader(
            dataset,
            batch_size=self.workload.batch_size,
            shuffle=False,
            drop_last=train,
            num_workers=workers,
            prefetch_factor=self.prefetch_factor if workers else None,
            persistent_workers=workers > 0,
            pin_memory=False,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, train=False)


def build_own(workload: Workload, num_workers: int, prefetch_factor: int) -> OwnLoadersModule:
    """The model of a benchmark fit whose own loaders start at ``num_workers`` x ``prefetch_factor``."""
    return OwnLoadersModule(workload, num_workers, prefetch_factor)
