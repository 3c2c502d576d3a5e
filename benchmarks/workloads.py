"""The benchmark's workloads: an emulated accelerator step and a dataset whose cost is stated.

The accelerator step is a sleep in the training process (while a GPU computes, the host is idle, and
a sleep is exactly that). Each workload's data side costs something known per sample or per batch:

- ``io-bound``: 2.5 ms of storage latency per sample (a sleep, no CPU): 80 ms a batch against a
  20 ms step, so one loader needs about 4 workers waiting in parallel; more cores are not needed.
- ``cpu-bound``: the example JPEG pipeline (decode, random resized crop, flip, normalise), about
  37-48 ms of CPU a batch on one core of this machine against a 20 ms step: the two cores saturate
  before the step is fed.
- ``step-bound``: in-memory tensors, well under 1 ms a batch against a 20 ms step: workers cannot help.
- ``memory-heavy``: 768 KB samples (12 MB a batch) with 3.75 ms of latency per sample (60 ms a
  batch, ~78 ms with filling and collating 12 MB; about 4 workers needed) and a stated memory budget of 256 MB for
  prefetched batches, so a
  deep prefetch (8 workers x 4 = 32 batches = 384 MB) would break it.
- ``bursty``: 8 ms a batch, but every 10th batch takes 10x (80 ms): on average one worker keeps up
  with the 20 ms step, yet the slow batch starves the loop unless enough batches are prefetched.

Three workloads whose conditions change during the fit (continuous control):

- ``drift-epoch``: ONE long epoch of 900 batches; 1.25 ms of latency per sample (40 ms a batch, ~2-3
  workers), 3x from batch 450 on (120 ms a batch, ~6-7 workers). Unshuffled, so the slowdown sits at
  sample indices ``>= 450 x batch size`` whatever the worker count. Judged on batches 450-899.
- ``slow-at-epoch``: 1 ms of latency per sample (32 ms a batch), 3x from epoch 3 on. The workers learn
  the epoch from a file the training process writes at each epoch start (persistent workers do not see
  attributes set in the training process). Judged on epochs 3 to the end.
- ``noisy-neighbour``: the CPU-bound JPEG pipeline while a CPU hog (one busy-looping process) runs
  during epoch 3 only. Judged on the whole fit.

:func:`build` turns a :class:`Workload` into the model and the :class:`~lightning_dltune.TunableDataModule`
a benchmark fit runs.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `examples` and the package live next to benchmarks/, uninstalled
    sys.path.insert(0, REPO_ROOT)

from lightning_dltune import TunableDataModule  # noqa: E402

STEP_MS = 20.0
"""The emulated accelerator step of every workload, in milliseconds."""

JPEG_IMAGES = 512
JPEG_IMAGE_SIZE = 224
JPEG_CROP_SIZE = 160


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: what the data costs, what the step costs, and the oracle's grid.

    Args:
        name: short name used on the command line and in the results.
        summary: one line for tables.
        cost: the stated cost of the data side and of the step, in words.
        kind: ``"latency"`` (per-sample sleep), ``"jpeg"`` (real decode/augment), ``"bursty"``
            (per-batch sleep, every ``burst_every``-th batch ``burst_every`` times longer).
        batch_size: samples per batch (train and val).
        train_batches: training batches per epoch.
        val_batches: validation batches per epoch (cheap: the validation set costs no latency).
        step_ms: the emulated accelerator step.
        sample_shape: shape of one sample tensor (``latency`` and ``bursty``).
        sample_latency_ms: storage latency per sample (``latency``).
        batch_cost_ms: storage latency per batch (``bursty``).
        burst_every: every this-many-th batch is ``burst_every`` x slower (``bursty``).
        memory_budget_mb: bytes prefetched batches may hold, stated to the tuner through its
            ``memory_fraction``; ``None``: the tuner's default (half of available RAM).
        grid_workers, grid_prefetch: the static configs the oracle is picked from.
        epochs: epochs of this workload's fits, where they differ from the run's (a one-epoch workload).
        slow_factor: how much slower samples get once the workload slows down.
        slow_from_fraction: samples slow down from this fraction of each epoch's batches on (by index).
        slow_from_epoch: samples slow down from this epoch on.
        hog_epoch: a CPU hog runs during this epoch (started at its start, ended at the next epoch's).
        full_grid_epochs: grid points run every epoch (the hog's epoch must be in them).
    """

    name: str
    summary: str
    cost: str
    kind: str
    batch_size: int
    train_batches: int
    val_batches: int = 2
    step_ms: float = STEP_MS
    sample_shape: tuple[int, ...] = (64,)
    sample_latency_ms: float = 0.0
    batch_cost_ms: float = 0.0
    burst_every: int = 0
    memory_budget_mb: Optional[float] = None
    grid_workers: tuple[int, ...] = (0, 1, 2, 4, 8)
    grid_prefetch: tuple[int, ...] = (1, 2, 4)
    extra: dict[str, Any] = field(default_factory=dict)
    epochs: Optional[int] = None
    slow_factor: float = 1.0
    slow_from_fraction: Optional[float] = None
    slow_from_epoch: Optional[int] = None
    hog_epoch: Optional[int] = None
    full_grid_epochs: bool = False

    def scaled(self, train_batches: int) -> Workload:
        """The same workload with ``train_batches`` batches per epoch (quick mode)."""
        return replace(self, train_batches=train_batches)

    @property
    def phased(self) -> bool:
        """Whether the workload slows down during the fit (judged on the part after the change)."""
        return self.slow_from_fraction is not None or self.slow_from_epoch is not None

    @property
    def slow_from_batch(self) -> Optional[int]:
        """The first slow batch of an epoch (``slow_from_fraction``), ``None`` where the epoch does not change."""
        if self.slow_from_fraction is None:
            return None
        return round(self.slow_from_fraction * self.train_batches)

    def phase_start(self) -> int:
        """The fit's first slow training batch, counted over the whole fit (0 for an unchanging workload)."""
        if self.slow_from_epoch is not None:
            return self.slow_from_epoch * self.train_batches
        return self.slow_from_batch or 0

    def slowed_throughout(self) -> Workload:
        """The judged phase alone: the slow cost from the first batch on (what the phase's oracle is picked on).

        A one-epoch drift keeps only its slow batches; an epoch-boundary slowdown is slow from epoch 0.
        """
        if self.slow_from_fraction is not None:
            return replace(self, train_batches=self.train_batches - (self.slow_from_batch or 0), slow_from_fraction=0.0)
        if self.slow_from_epoch is not None:
            return replace(self, slow_from_epoch=0)
        return self

    @property
    def sample_bytes(self) -> int:
        if self.kind == "jpeg":
            return 3 * JPEG_CROP_SIZE * JPEG_CROP_SIZE * 4
        n = 1
        for d in self.sample_shape:
            n *= d
        return 4 * n

    @property
    def batch_mb(self) -> float:
        return self.batch_size * self.sample_bytes / 2**20


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="io-bound",
            summary="per-sample storage latency: many workers help",
            cost="2.5 ms latency per sample (sleep, no CPU) x 32 = 80 ms per batch; step 20 ms",
            kind="latency",
            batch_size=32,
            train_batches=48,
            sample_latency_ms=2.5,
            grid_workers=(0, 1, 2, 4, 6, 8),
        ),
        Workload(
            name="cpu-bound",
            summary="real JPEG decode + augment: the cores saturate",
            cost=(
                f"decode {JPEG_IMAGE_SIZE}px JPEG, random resized crop to {JPEG_CROP_SIZE}px, flip, normalise:"
                " ~1.2 ms CPU per sample x 32 = ~40 ms CPU per batch on one core; step 20 ms"
            ),
            kind="jpeg",
            batch_size=32,
            train_batches=40,
        ),
        Workload(
            name="step-bound",
            summary="cheap in-memory data: workers do not help",
            cost="64 floats per sample from memory, < 1 ms per batch; step 20 ms",
            kind="latency",
            batch_size=32,
            train_batches=50,
        ),
        Workload(
            name="memory-heavy",
            summary="12 MB batches under a 256 MB prefetch budget: deep prefetch breaks it",
            cost="768 KB per sample (3x256x256 float32) with 3.75 ms latency x 16 = 60 ms, 12 MB per batch; step 20 ms",
            kind="latency",
            batch_size=16,
            train_batches=40,
            sample_shape=(3, 256, 256),
            sample_latency_ms=3.75,
            memory_budget_mb=256.0,
            grid_prefetch=(1, 2, 4, 8),
        ),
        Workload(
            name="bursty",
            summary="every 10th batch is 10x slower: prefetch depth matters",
            cost="8 ms latency per batch, every 10th batch 80 ms (mean 15.2 ms); step 20 ms",
            kind="bursty",
            batch_size=32,
            train_batches=50,
            batch_cost_ms=8.0,
            burst_every=10,
            grid_prefetch=(1, 2, 4, 8),
        ),
        Workload(
            name="drift-epoch",
            summary="one long epoch whose storage gets 3x slower half-way",
            cost=(
                "1.25 ms latency per sample x 32 = 40 ms per batch, x3 (120 ms) from batch 450 of 900; one epoch;"
                " step 20 ms"
            ),
            kind="latency",
            batch_size=32,
            train_batches=900,
            sample_latency_ms=1.25,
            epochs=1,
            slow_factor=3.0,
            slow_from_fraction=0.5,
            grid_workers=(2, 4, 6, 8),
            grid_prefetch=(2, 4),
        ),
        Workload(
            name="slow-at-epoch",
            summary="storage gets 3x slower from epoch 3 on",
            cost="1 ms latency per sample x 32 = 32 ms per batch, x3 (96 ms) from epoch 3; step 20 ms",
            kind="latency",
            batch_size=32,
            train_batches=48,
            sample_latency_ms=1.0,
            slow_factor=3.0,
            slow_from_epoch=3,
            grid_workers=(0, 1, 2, 4, 6, 8),
        ),
        Workload(
            name="noisy-neighbour",
            summary="the JPEG pipeline while a CPU hog runs during epoch 3",
            cost=(
                "decode + augment as cpu-bound (~40 ms CPU per batch); one busy-looping process during epoch 3;"
                " step 20 ms"
            ),
            kind="jpeg",
            batch_size=32,
            train_batches=60,  # ~3-4 s an epoch: the hog's epoch weighs in the fit
            hog_epoch=3,
            full_grid_epochs=True,
            grid_workers=(0, 1, 2, 3, 4),
            grid_prefetch=(2,),
        ),
    )
}

EPOCH_FILE_ENV = "DLTUNE_BENCH_EPOCH_FILE"
"""Names the file in which the training process writes the current epoch (read by ``slow-at-epoch``'s workers)."""

HOG_MARK = "dltune-bench-cpu-hog"
"""In the command line of the CPU hog, so that memory sampling leaves the neighbour's process out."""


# ------------------------------------------------------------------------------------------ datasets
class LatencyDataset(Dataset):
    """``length`` samples of ``shape`` float32; each costs ``sample_latency_s`` of waiting (storage).

    The tensor itself is filled in place (about 0.1 ms per MB of CPU), so large samples also cost
    what a real loader pays to materialise them. Samples get ``slow_factor`` x slower from index
    ``slow_from_index`` on, or once the epoch written in ``epoch_file`` reaches ``slow_from_epoch``
    (read per sample: the workers' copy of the dataset cannot see the training process's attributes).
    """

    def __init__(
        self,
        length: int,
        shape: tuple[int, ...],
        sample_latency_s: float = 0.0,
        *,
        slow_factor: float = 1.0,
        slow_from_index: Optional[int] = None,
        slow_from_epoch: Optional[int] = None,
        epoch_file: Optional[str] = None,
    ) -> None:
        self.length = length
        self.shape = tuple(shape)
        self.sample_latency_s = sample_latency_s
        self.slow_factor = slow_factor
        self.slow_from_index = slow_from_index
        self.slow_from_epoch = slow_from_epoch
        self.epoch_file = epoch_file

    def __len__(self) -> int:
        return self.length

    def _slow(self, index: int) -> bool:
        if self.slow_from_index is not None and index >= self.slow_from_index:
            return True
        return self.slow_from_epoch is not None and current_epoch(self.epoch_file) >= self.slow_from_epoch

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        latency = self.sample_latency_s * (self.slow_factor if self._slow(index) else 1.0)
        if latency:
            time.sleep(latency)
        return torch.full(self.shape, float(index % 997) / 997.0), index


def current_epoch(epoch_file: Optional[str]) -> int:
    """The epoch the training process last wrote to ``epoch_file`` (0 before the first write)."""
    if not epoch_file:
        return 0
    try:
        with open(epoch_file) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


class BurstyDataset(Dataset):
    """Batches cost ``batch_cost_s``, except every ``burst_every``-th batch (by position), which costs
    ``burst_every`` x.

    Batch positions come from the first index of the batch (the loader does not shuffle), so the slow
    batches sit at fixed places in every epoch.
    """

    def __init__(
        self, length: int, shape: tuple[int, ...], batch_size: int, batch_cost_s: float, burst_every: int
    ) -> None:
        self.length = length
        self.shape = tuple(shape)
        self.batch_size = batch_size
        self.batch_cost_s = batch_cost_s
        self.burst_every = burst_every

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full(self.shape, float(index % 997) / 997.0), index

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        position = indices[0] // self.batch_size
        cost = self.batch_cost_s
        if self.burst_every and position % self.burst_every == self.burst_every - 1:
            cost *= self.burst_every
        if cost:
            time.sleep(cost)
        return [self[i] for i in indices]


def _jpeg_folder() -> str:
    from examples.image_pipeline import make_jpeg_dataset

    return make_jpeg_dataset(None, num_images=JPEG_IMAGES, image_size=JPEG_IMAGE_SIZE, num_classes=10, seed=0)


def prepare(workload: Workload) -> None:
    """Make what the workload reads (the JPEG folder, generated once and cached); a no-op for the others."""
    if workload.kind == "jpeg":
        _jpeg_folder()


def make_dataset(workload: Workload, train: bool) -> Dataset:
    """The train (costly) or val (cheap, same shapes) dataset of ``workload``."""
    batches = workload.train_batches if train else workload.val_batches
    length = batches * workload.batch_size
    if workload.kind == "jpeg":
        from examples.image_pipeline import JpegFolderDataset

        indices = [i % JPEG_IMAGES for i in range(length)]  # the epoch cycles over the cached images
        return JpegFolderDataset(_jpeg_folder(), indices, crop_size=JPEG_CROP_SIZE, train=train)
    if workload.kind == "bursty":
        if not train:
            return LatencyDataset(length, workload.sample_shape)
        return BurstyDataset(
            length, workload.sample_shape, workload.batch_size, workload.batch_cost_ms / 1e3, workload.burst_every
        )
    if workload.kind == "latency":
        if not train:
            return LatencyDataset(length, workload.sample_shape)
        slow_from = workload.slow_from_batch
        epoch_file = os.environ.get(EPOCH_FILE_ENV) if workload.slow_from_epoch is not None else None
        if workload.slow_from_epoch is not None and workload.slow_from_epoch > 0 and not epoch_file:
            raise RuntimeError(f"{workload.name} needs ${EPOCH_FILE_ENV}: the file its workers read the epoch from")
        return LatencyDataset(
            length,
            workload.sample_shape,
            workload.sample_latency_ms / 1e3,
            slow_factor=workload.slow_factor,
            slow_from_index=None if slow_from is None else slow_from * workload.batch_size,
            slow_from_epoch=workload.slow_from_epoch,
            epoch_file=epoch_file,
        )
    raise ValueError(f"unknown workload kind {workload.kind!r}")


class WorkloadDataModule(TunableDataModule, pl.LightningDataModule):
    """A :class:`~lightning_dltune.TunableDataModule` over a workload's datasets (no shuffling: fixed bursts)."""

    def __init__(self, workload: Workload, **kwargs: Any) -> None:
        super().__init__(batch_size=workload.batch_size, shuffle=False, **kwargs)
        self.workload = workload

    def prepare_data(self) -> None:
        prepare(self.workload)

    def setup(self, stage: str) -> None:
        self.train_dataset = make_dataset(self.workload, train=True)
        self.val_dataset = make_dataset(self.workload, train=False)


class EmulatedStepModule(pl.LightningModule):
    """A tiny model whose training step lasts at least ``step_s``: the accelerator's step, as a sleep.

    The forward pass reads 8 numbers of each sample, so the host does no real compute, as when a GPU
    computes and the host waits.
    """

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s
        self.layer = nn.Linear(8, 1)

    def _loss(self, batch: Any) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        features = x.reshape(x.shape[0], -1)[:, :8].float()
        return self.layer(features).pow(2).mean()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        started = time.perf_counter()
        loss = self._loss(batch)
        remaining = self.step_s - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def build(workload: Workload, num_workers: int, prefetch_factor: int) -> tuple[EmulatedStepModule, WorkloadDataModule]:
    """The model and datamodule of a benchmark fit that starts at ``num_workers`` x ``prefetch_factor``."""
    model = EmulatedStepModule(workload.step_ms / 1e3)
    data = WorkloadDataModule(workload, num_workers=num_workers, prefetch_factor=prefetch_factor)
    return model, data
