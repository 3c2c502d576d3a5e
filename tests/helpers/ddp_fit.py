"""A 2-process CPU DDP fit (gloo) where rank 1's data is slow; run as a script by tests/test_ddp.py.

Usage: python tests/helpers/ddp_fit.py OUT_DIR
Each rank writes OUT_DIR/rank<N>.json with its history and final loader config.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/helpers: fit_workloads

import lightning.pytorch as pl  # noqa: E402
from fit_workloads import SleepStepModule, SleepyDataModule, SleepyDataset  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lightning_dltune import DataLoaderTuner  # noqa: E402

SLOW_BATCH_COST_S = 0.06
STEP_S = 0.02


class OneSlowRankData(SleepyDataModule):
    """Rank 1 reads from slow storage (60 ms a batch); rank 0's data is free."""

    def setup(self, stage):
        super().setup(stage)
        if self.trainer.global_rank == 1:
            self.train_dataset = SleepyDataset(self.train_length, batch_cost_s=SLOW_BATCH_COST_S)


def main(out_dir):
    tuner = DataLoaderTuner(verbose=True, max_workers=4)
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=3,
        callbacks=[tuner],
        logger=TensorBoardLogger(os.path.join(out_dir, "tb"), name="ddp"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
    )
    dm = OneSlowRankData(train_length=160, val_length=16, batch_size=4, num_workers=0)
    trainer.fit(SleepStepModule(step_s=STEP_S), datamodule=dm)
    report = {
        "rank": trainer.global_rank,
        "final_config": dm.loader_config.as_dict(),
        "live_workers": [dl.num_workers for dl in dm.live_loaders()],
        "train_sampler": type(trainer.train_dataloader.sampler).__name__,
        "history": [
            {
                "epoch": r.epoch,
                "num_workers": r.num_workers,
                "starvation_ratio": r.starvation_ratio,
                "verdict": r.verdict,
                "next_workers": r.next_config.num_workers,
            }
            for r in tuner.history
        ],
    }
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
