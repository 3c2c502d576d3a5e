"""A 2-process CPU DDP fit (gloo) of a project whose loaders live in its LightningModule; run by tests/test_ddp.py.

Usage: python tests/helpers/ddp_user_loaders_fit.py OUT_DIR
Each rank writes OUT_DIR/user_rank<N>.json: the sample ids it trained and validated per epoch, its
training and validation histories, and what its training and validation loaders were during the fit
(class, sampler, workers). The validation data is on slow storage: validation starves where training
does not. The accelerator step is a sleep.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/helpers

import lightning.pytorch as pl  # noqa: E402
from fit_workloads import SleepyDataset  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from user_projects import BATCH, ModuleLoaders  # noqa: E402

from lightning_dltune import DataLoaderTuner  # noqa: E402

VAL_LENGTH = 41  # odd: Lightning's DistributedSampler pads the validation set to an even split
VAL_COST_S = 0.03  # 30 ms a batch against a 1 ms validation step
TRAIN_STEP_S = 0.015


class SlowValidation(ModuleLoaders):
    """The project's validation loader reads held-out data from slow storage.

    Its training step (15 ms against 30 ms of storage latency a batch) needs about two workers, its validation
    step (1 ms) many more: the validation loaders, which start on the training config, get one of their own.
    """

    def __init__(self, **kwargs):
        super().__init__(val_step_s=0.001, **kwargs)
        self.step_s = TRAIN_STEP_S

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            SleepyDataset(VAL_LENGTH, batch_cost_s=VAL_COST_S), batch_size=BATCH, num_workers=self.workers
        )


def _looks(loader):
    return [type(loader).__name__, type(loader.sampler).__name__, loader.num_workers]


class LookAtTheLoader(pl.Callback):
    def __init__(self):
        self.seen = []
        self.val_seen = []  # the validation loader at each run's first batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(_looks(trainer.train_dataloader))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0:
            self.val_seen.append(_looks(trainer.val_dataloaders))


def main(out_dir):
    tuner = DataLoaderTuner(window_batches=10, window_seconds=0.3, max_workers=4)
    look = LookAtTheLoader()
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        callbacks=[tuner, look],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    model = SlowValidation()
    trainer.fit(model)
    report = {
        "train_indices": model.train_indices,
        "val_indices": model.val_indices,
        "history": [[r.epoch, r.num_workers, r.next_config.num_workers, r.verdict] for r in tuner.history],
        "val_history": [
            [r.epoch, r.step, r.num_workers, r.next_config.num_workers, r.starvation_ratio, r.verdict]
            for r in tuner.val_history
        ],
        "val_loaders": look.val_seen,
        "first_loader": look.seen[0],
        "last_loader": look.seen[-1],
        "after_fit": type(trainer.train_dataloader).__name__,
    }
    with open(os.path.join(out_dir, f"user_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
