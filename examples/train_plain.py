"""Train SmallCNN on the synthetic JPEG pipeline with the DataLoaderTuner, in plain Python (no CLI).

The loaders start at ``num_workers=0``; the tuner measures starvation every epoch and retunes them.
On a machine without an accelerator the model's step is stretched with a sleep (``--emulate-step-ms``)
to stand in for a GPU's step, so the run shows the starvation a GPU would see.

Run from the repository root::

    python examples/train_plain.py --epochs 4
    python -m examples.train_plain --epochs 4 --storage-latency-ms 1.5   # I/O-bound: network storage
    tensorboard --logdir logs/train_plain                                # the "dltune" custom-scalars tab
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence, Union

if __package__ in (None, ""):  # run as a script: make `examples` and `lightning_dltune` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from examples.image_pipeline import JpegDataModule, SmallCNN
from lightning_dltune import DataLoaderTuner
from lightning_dltune.report.words import reason_text

# Without an accelerator the training step is emulated: the model computes on one CPU thread (SmallCNN:
# about 25 ms per batch of 32), then sleeps to this step time. One thread, because a GPU's compute
# does not take the cores the loader workers need; the sleep is the host waiting on the GPU.
CPU_EMULATED_STEP_MS = 40.0
CPU_TRAINING_THREADS = 1


def _batches(text: str) -> Union[int, float]:
    """``--limit-batches``: an integer count of batches or a float fraction of the epoch."""
    try:
        value: Union[int, float] = int(text)
    except ValueError:
        value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4, help="training epochs (one tuning decision per epoch)")
    parser.add_argument("--log-dir", default=os.path.join("logs", "train_plain"), help="TensorBoard log directory")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="cache for the generated JPEGs (default: $DLTUNE_CACHE or ~/.cache/lightning-dltune/jpegs)",
    )
    parser.add_argument("--num-images", type=int, default=2000, help="images in the synthetic dataset")
    parser.add_argument(
        "--storage-latency-ms",
        type=float,
        default=0.0,
        help="per-sample sleep emulating network storage (makes the pipeline I/O-bound)",
    )
    parser.add_argument(
        "--limit-batches",
        type=_batches,
        default=None,
        help="batches per epoch (int) or fraction of the epoch (float), train and val",
    )
    parser.add_argument(
        "--emulate-step-ms",
        type=float,
        default=None,
        help="emulate an accelerator: stretch each training step to this long (ms); default: 0 on CUDA,"
        f" {CPU_EMULATED_STEP_MS:g} on CPU (where the model then computes on one thread)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=0, help="workers the tuner starts from")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> DataLoaderTuner:
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True)
    on_cpu = not torch.cuda.is_available()
    emulate_step_ms = args.emulate_step_ms
    if emulate_step_ms is None:
        emulate_step_ms = CPU_EMULATED_STEP_MS if on_cpu else 0.0
    if on_cpu and emulate_step_ms > 0:
        torch.set_num_threads(CPU_TRAINING_THREADS)

    datamodule = JpegDataModule(
        data_dir=args.data_dir,
        num_images=args.num_images,
        storage_latency_ms=args.storage_latency_ms,
        batch_size=args.batch_size,
        num_workers=args.num_workers,
    )
    model = SmallCNN(emulate_step_ms=emulate_step_ms)
    tuner = DataLoaderTuner()
    limits = (
        {}
        if args.limit_batches is None
        else {"limit_train_batches": args.limit_batches, "limit_val_batches": args.limit_batches}
    )
    trainer = L.Trainer(
        max_epochs=args.epochs,
        callbacks=[tuner],
        logger=TensorBoardLogger(args.log_dir, name="dltune"),
        enable_checkpointing=False,
        log_every_n_steps=10,
        **limits,
    )
    trainer.fit(model, datamodule=datamodule)
    print_summary(tuner)
    return tuner


def print_summary(tuner: DataLoaderTuner) -> None:
    """One line per epoch of ``tuner.history``, then the recommended loader config."""
    print("\nDataLoaderTuner history")
    for record in tuner.history:
        batches = max(1, record.stats.batches)
        fetch_ms, step_ms = 1e3 * record.stats.fetch_wait_s / batches, 1e3 * record.stats.step_s / batches
        print(
            f"  epoch {record.epoch}: {record.config.short()} | util {record.gpu_util:.0%} ({record.util_source})"
            f" | starvation {record.starvation_ratio:.0%} | fetch wait {fetch_ms:.1f} ms vs step {step_ms:.1f} ms"
            f" per batch | {record.samples_per_s:,.0f} samples/s | {record.verdict}: {reason_text(record.reason)}"
        )
    if tuner.recommended_config is not None:
        print(f"Recommended loader config: {tuner.recommended_config.short()}")
    if tuner.recommendation_path is not None:
        print(f"  (as a LightningCLI fragment: {tuner.recommendation_path})")


if __name__ == "__main__":
    main()
