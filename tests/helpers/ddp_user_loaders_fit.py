"""A 2-process CPU DDP fit (gloo) of a project whose loaders live in its LightningModule; run by tests/test_ddp.py.

Usage: python tests/helpers/ddp_user_loaders_fit.py OUT_DIR
Each rank writes OUT_DIR/user_rank<N>.json: the sample ids it trained per epoch, its history, and what
its training loader was during the fit (class, sampler, workers). The accelerator step is a sleep.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/helpers

import lightning.pytorch as pl  # noqa: E402
from user_projects import ModuleLoaders  # noqa: E402

from lightning_dltune import DataLoaderTuner  # noqa: E402


class LookAtTheLoader(pl.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        loader = trainer.train_dataloader
        self.seen.append([type(loader).__name__, type(loader.sampler).__name__, loader.num_workers])


def main(out_dir):
    tuner = DataLoaderTuner(window_batches=10, window_seconds=0.3, max_workers=3)
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
    model = ModuleLoaders()
    trainer.fit(model)
    report = {
        "train_indices": model.train_indices,
        "val_indices": model.val_indices,
        "history": [[r.epoch, r.num_workers, r.next_config.num_workers, r.verdict] for r in tuner.history],
        "first_loader": look.seen[0],
        "last_loader": look.seen[-1],
        "after_fit": type(trainer.train_dataloader).__name__,
    }
    with open(os.path.join(out_dir, f"user_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
