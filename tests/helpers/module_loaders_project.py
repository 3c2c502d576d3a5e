"""A Lightning project shaped like the ones in the wild: loaders built in the LightningModule, its own
``LightningCLI(Model)`` with a TQDM bar in the trainer defaults, the tuner added from the command line.

Usage: python tests/helpers/module_loaders_project.py fit --trainer.callbacks+=lightning_dltune.DataLoaderTuner ...
``Model`` names its knob ``workers`` (no config fragment can set a DataLoader's ``num_workers`` through it);
with ``DLTUNE_TEST_MODEL=named`` the CLI drives ``NamedModel``, which takes ``num_workers`` and ``prefetch_factor``.
The accelerator step is emulated by a sleep in the training process (the host idles while a GPU computes).
With ``DLTUNE_TEST_SEEN=path`` the model writes the sample ids it trained, one list per epoch, as JSON.
"""

import json
import os
import time

import torch
from lightning import LightningModule
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset


class SlowSamples(Dataset):
    """Samples that take 2 ms each to load; each is its own index, so a test can count them."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.full((4,), float(index))


class Model(LightningModule):
    def __init__(self, batch_size: int = 4, workers: int = 0, step_ms: float = 5.0) -> None:
        super().__init__()
        self.batch_size, self.step_ms = batch_size, step_ms
        self.loader_kwargs = {"num_workers": workers}
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def on_train_epoch_start(self) -> None:
        self.seen.append([])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen[-1].extend(int(i) for i in batch[:, 0].tolist())
        time.sleep(self.step_ms / 1000.0)
        return self.layer(batch).sum()

    def on_train_end(self) -> None:
        path = os.environ.get("DLTUNE_TEST_SEEN")
        if path:
            with open(path, "w") as f:
                json.dump(self.seen, f)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.layer(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SlowSamples(64), self.batch_size, shuffle=True, **self.loader_kwargs)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(SlowSamples(16), self.batch_size, **self.loader_kwargs)


class NamedModel(Model):
    def __init__(self, batch_size: int = 4, num_workers: int = 0, prefetch_factor: int = 2, step_ms: float = 5.0):
        super().__init__(batch_size, num_workers, step_ms)
        if num_workers:
            self.loader_kwargs["prefetch_factor"] = prefetch_factor


if __name__ == "__main__":
    model = NamedModel if os.environ.get("DLTUNE_TEST_MODEL") == "named" else Model
    LightningCLI(model, trainer_defaults={"callbacks": [TQDMProgressBar(refresh_rate=10)], "accelerator": "cpu"})
