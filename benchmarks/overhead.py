"""What DataLoaderTuner costs per batch: bare fits against fits with the callback, interleaved.

Data and step are trivially fast (a tiny linear model on in-memory tensors), so any per-batch cost
of the callback shows. Each round runs every variant once, in turn, so a noisy machine hits them
alike; the epoch time is read from the loop itself (epoch start to epoch end, epochs after the
first), and the median over rounds is reported.

    python benchmarks/overhead.py              # ~1 minute on 2 cores
    python benchmarks/overhead.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_dltune import DataLoaderTuner, TunableDataModule  # noqa: E402


class EpochClock(Callback):
    def __init__(self):
        self.epoch_s = []

    def on_train_epoch_start(self, trainer, pl_module):
        self._t0 = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        self.epoch_s.append(time.perf_counter() - self._t0)


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _dataset(n):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, generator=g))


class PlainData(pl.LightningDataModule):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def train_dataloader(self):
        return DataLoader(_dataset(self.n), batch_size=4, shuffle=True, drop_last=True)


class TunableData(TunableDataModule, pl.LightningDataModule):
    def __init__(self, n, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def setup(self, stage):
        self.train_dataset = _dataset(self.n)


VARIANTS = {
    "bare (plain DataLoader)": (PlainData, False),
    "empty Callback (plain DataLoader)": (PlainData, "empty"),
    "DataLoaderTuner (plain DataLoader)": (PlainData, True),
    "bare (TunableDataModule)": (TunableData, False),
    "DataLoaderTuner (TunableDataModule)": (TunableData, True),
}


def per_batch_s(data_cls, with_tuner, batches, epochs=3):
    clock = EpochClock()
    callbacks = [clock]
    if with_tuner == "empty":
        callbacks.append(Callback())  # what Lightning's dispatch of any one more callback costs
    elif with_tuner:
        callbacks.append(DataLoaderTuner(tune=False, verbose=False, recommendation_file=False))
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
    )
    data = data_cls(batches * 4, batch_size=4) if data_cls is TunableData else data_cls(batches * 4)
    trainer.fit(Tiny(), datamodule=data)
    return min(clock.epoch_s[1:]) / batches  # epoch 0 warms up


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=2000, help="batches per epoch")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="500 batches, 3 rounds")
    parser.add_argument("--json", default=None, help="write results to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.rounds = 500, 3
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    times = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, (data_cls, with_tuner) in VARIANTS.items():
            times[name].append(per_batch_s(data_cls, with_tuner, args.batches))
    median = {name: statistics.median(v) for name, v in times.items()}
    rows = []
    for loader in ("plain DataLoader", "TunableDataModule"):
        bare, tuned = median[f"bare ({loader})"], median[f"DataLoaderTuner ({loader})"]
        rows.append(
            {
                "loader": loader,
                "bare_us": bare * 1e6,
                "with_tuner_us": tuned * 1e6,
                "overhead_us": (tuned - bare) * 1e6,
                "overhead_share": (tuned - bare) / bare,
            }
        )
    # the instrumented loader against a plain one, both without the callback: the cost of owning the loader
    loader_cost = median["bare (TunableDataModule)"] - median["bare (plain DataLoader)"]
    dispatch = median["empty Callback (plain DataLoader)"] - median["bare (plain DataLoader)"]
    print(f"per-batch time, median of {args.rounds} interleaved rounds of {args.batches} batches:")
    print("| loader | bare µs/batch | with DataLoaderTuner µs/batch | overhead µs/batch | overhead |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['loader']} | {r['bare_us']:.1f} | {r['with_tuner_us']:.1f} | {r['overhead_us']:+.2f}"
            f" | {r['overhead_share']:+.2%} |"
        )
    own = median["DataLoaderTuner (plain DataLoader)"] - median["empty Callback (plain DataLoader)"]
    print(
        f"Lightning's dispatch of one more (empty) Callback: {dispatch * 1e6:+.2f} µs/batch; "
        f"DataLoaderTuner's own hooks beyond it: {own * 1e6:+.2f} µs/batch"
    )
    print(f"instrumented loader without the callback vs plain DataLoader: {loader_cost * 1e6:+.2f} µs/batch")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "batches": args.batches,
                    "rounds": args.rounds,
                    "rows": rows,
                    "loader_cost_us": loader_cost * 1e6,
                    "empty_callback_us": dispatch * 1e6,
                    "raw_s": times,
                },
                f,
                indent=2,
            )
    return rows


if __name__ == "__main__":
    main()
