"""A 2-process CPU DDP fit (gloo) stopped by a mid-epoch checkpoint, or resumed from it; run by tests/test_ddp.py.

Usage: python tests/helpers/ddp_resume_fit.py OUT_DIR first|resume NUM_WORKERS
Each rank writes OUT_DIR/<phase>-rank<N>.json with the training indices it saw, per epoch.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/helpers: fit_workloads

import lightning.pytorch as pl  # noqa: E402
from fit_workloads import SleepStepModule, SleepyDataModule  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

CHECKPOINT_EPOCH, CHECKPOINT_BATCH = 1, 2


class CheckpointAndStop(Callback):
    def __init__(self, path):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == CHECKPOINT_EPOCH and batch_idx == CHECKPOINT_BATCH:
            trainer.save_checkpoint(self.path)  # every rank calls it, rank zero writes
            trainer.should_stop = True


def main(out_dir, phase, workers):
    ckpt = os.path.join(out_dir, "mid.ckpt")
    model = SleepStepModule(record_indices=True)
    if phase == "resume":
        model.train_indices.append([])  # Lightning skips on_train_epoch_start when it resumes mid-epoch
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        callbacks=[CheckpointAndStop(ckpt)] if phase == "first" else [],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
    )
    dm = SleepyDataModule(train_length=64, val_length=8, batch_size=4, num_workers=workers)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt if phase == "resume" else None)
    with open(os.path.join(out_dir, f"{phase}-rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"train": model.train_indices, "sampler": type(trainer.train_dataloader.sampler).__name__}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
