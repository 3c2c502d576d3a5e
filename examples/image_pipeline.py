"""A real image pipeline to tune: JPEG decode and augmentation in the workers, a small CNN in the loop.

Everything is local and self-contained (Pillow and torch, no torchvision, no downloads):

- :func:`make_jpeg_dataset` writes a synthetic, learnable folder of JPEGs once and caches it;
- :class:`JpegFolderDataset` decodes, random-resized-crops, flips and normalises them (real CPU work
  per sample, plus an optional per-sample sleep that emulates network storage);
- :class:`JpegDataModule` is a :class:`~lightning_dltune.TunableDataModule` over it;
- :class:`SmallCNN` is a cheap classifier whose step can be stretched with a sleep to emulate an
  accelerator on a CPU-only machine.

Example::

    import lightning as L
    from lightning_dltune import DataLoaderTuner
    from examples.image_pipeline import JpegDataModule, SmallCNN

    trainer = L.Trainer(max_epochs=4, callbacks=[DataLoaderTuner()])
    trainer.fit(SmallCNN(emulate_step_ms=25), datamodule=JpegDataModule(num_workers=0))
"""

from __future__ import annotations

import colorsys
import csv
import json
import math
import os
import shutil
import tempfile
import time
import uuid
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from PIL import Image, ImageDraw
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_dltune import TunableDataModule

# Bump when the generator changes, so cached folders from an older generator are not reused.
GENERATOR_VERSION = 1
MANIFEST = "labels.csv"
MARKER = "dataset.json"  # written last: its presence means the folder is complete

_SHAPES = ("disc", "square", "triangle", "ring", "cross")
# Two hue families (fractions of the colour wheel): warm and cool, so a class is shape x colour.
_HUE_CENTRES = (0.04, 0.58)


# --------------------------------------------------------------------------------- generation
def default_cache_root() -> str:
    """``$DLTUNE_CACHE`` or ``~/.cache/lightning-dltune/jpegs``."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "lightning-dltune", "jpegs")
    return os.environ.get("DLTUNE_CACHE") or default


def _dataset_params(num_images: int, image_size: int, num_classes: int, seed: int) -> dict[str, int]:
    return {
        "num_images": num_images,
        "image_size": image_size,
        "num_classes": num_classes,
        "seed": seed,
        "version": GENERATOR_VERSION,
    }


def _folder_name(params: dict[str, int]) -> str:
    return "synthetic-n{num_images}-s{image_size}-c{num_classes}-seed{seed}-v{version}".format(**params)


def _read_marker(folder: str) -> Optional[dict[str, Any]]:
    try:
        with open(os.path.join(folder, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_complete(folder: str, params: dict[str, int]) -> bool:
    marker = _read_marker(folder)
    return marker is not None and marker.get("params") == params and os.path.isfile(os.path.join(folder, MANIFEST))


def _hsv_to_rgb(h: float, s: float, v: float) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb(h % 1.0, s, v)
    return int(255 * r), int(255 * g), int(255 * b)


def _render(label: int, num_classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """One ``size`` x ``size`` RGB image of class ``label``: a coloured shape on a gradient, with clutter and noise."""
    shape = _SHAPES[label % len(_SHAPES)]
    family = (label // len(_SHAPES)) % len(_HUE_CENTRES)
    # classes beyond 10 shift the hue further, so any num_classes stays separable in principle
    hue = _HUE_CENTRES[family] + 0.13 * (label // (len(_SHAPES) * len(_HUE_CENTRES))) + rng.uniform(-0.06, 0.06)

    # background: a linear gradient between two muted colours at a random angle
    angle = rng.uniform(0, 2 * math.pi)
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) / max(1, size - 1)
    t = np.cos(angle) * xs + np.sin(angle) * ys
    t = (t - t.min()) / max(1e-6, float(t.max() - t.min()))
    c0 = np.array(_hsv_to_rgb(rng.uniform(), rng.uniform(0.1, 0.4), rng.uniform(0.2, 0.6)), np.float32)
    c1 = np.array(_hsv_to_rgb(rng.uniform(), rng.uniform(0.1, 0.4), rng.uniform(0.3, 0.8)), np.float32)
    background = c0 + t[..., None] * (c1 - c0)
    image = Image.fromarray(background.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)

    # clutter: a few thin lines of random colour, unrelated to the class
    for _ in range(int(rng.integers(1, 4))):
        x0, y0, x1, y1 = (int(v) for v in rng.integers(0, size, 4))
        draw.line((x0, y0, x1, y1), fill=_hsv_to_rgb(rng.uniform(), 0.3, 0.7), width=int(rng.integers(1, 3)))

    # the class object
    colour = _hsv_to_rgb(hue, rng.uniform(0.6, 1.0), rng.uniform(0.7, 1.0))
    radius = rng.uniform(0.18, 0.32) * size
    cx, cy = (rng.uniform(radius, size - radius) for _ in range(2))
    rot = rng.uniform(0, 2 * math.pi)

    def polygon(corners: int, r: float) -> list[tuple[float, float]]:
        return [
            (cx + r * math.cos(rot + 2 * math.pi * k / corners), cy + r * math.sin(rot + 2 * math.pi * k / corners))
            for k in range(corners)
        ]

    if shape == "disc":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=colour)
    elif shape == "square":
        draw.polygon(polygon(4, radius * 1.2), fill=colour)
    elif shape == "triangle":
        draw.polygon(polygon(3, radius * 1.3), fill=colour)
    elif shape == "ring":
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        draw.ellipse(box, outline=colour, width=max(2, int(radius / 3)))
    else:  # cross
        arm = radius * 0.35
        for a in (rot, rot + math.pi / 2):
            dx, dy = math.cos(a), math.sin(a)
            px, py = -dy * arm, dx * arm
            draw.polygon(
                [
                    (cx - dx * radius + px, cy - dy * radius + py),
                    (cx + dx * radius + px, cy + dy * radius + py),
                    (cx + dx * radius - px, cy + dy * radius - py),
                    (cx - dx * radius - px, cy - dy * radius - py),
                ],
                fill=colour,
            )

    pixels = np.asarray(image, dtype=np.float32)
    pixels = pixels + rng.normal(0.0, 12.0, pixels.shape).astype(np.float32)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def _generate(folder: str, params: dict[str, int]) -> None:
    """Write all images, the manifest and (last) the marker with the per-channel mean and std."""
    num_images, size, num_classes, seed = (params[k] for k in ("num_images", "image_size", "num_classes", "seed"))
    images_dir = os.path.join(folder, "images")
    os.makedirs(images_dir)
    channel_sum = np.zeros(3, np.float64)
    channel_sq = np.zeros(3, np.float64)
    rows = []
    for i in range(num_images):
        rng = np.random.default_rng([seed, i])
        label = i % num_classes  # balanced classes
        pixels = _render(label, num_classes, size, rng)
        as_float = pixels.reshape(-1, 3).astype(np.float64) / 255.0
        channel_sum += as_float.sum(0)
        channel_sq += (as_float**2).sum(0)
        name = f"{i:06d}.jpg"
        Image.fromarray(pixels, "RGB").save(os.path.join(images_dir, name), quality=int(rng.integers(75, 96)))
        rows.append((f"images/{name}", label))
    with open(os.path.join(folder, MANIFEST), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("path", "label"))
        writer.writerows(rows)
    count = num_images * size * size
    mean = channel_sum / count
    std = np.sqrt(np.maximum(channel_sq / count - mean**2, 1e-12))
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump({"params": params, "mean": mean.tolist(), "std": std.tolist()}, f, indent=2)


def make_jpeg_dataset(
    root: Optional[str] = None, num_images: int = 2000, image_size: int = 96, num_classes: int = 10, seed: int = 0
) -> str:
    """Generate (once) a folder of synthetic JPEGs and return its path.

    The folder ``<root>/synthetic-n<num_images>-s<image_size>-c<num_classes>-seed<seed>-v<version>``
    holds ``images/*.jpg``, a manifest ``labels.csv`` (``path,label``) and a marker ``dataset.json``
    (the parameters, and the per-channel mean and std used for normalisation). A folder whose marker
    matches is reused as is; one whose marker is missing or differs is generated again. Generation
    goes to a private temporary folder that is renamed into place, so processes racing to create the
    same dataset never see a partial folder: the first rename wins, the others discard their copy.

    Each image shows a class-dependent shape (disc, square, triangle, ring, cross) in a
    class-dependent hue family (warm or cool) at a random place, size and angle, on a random
    gradient with clutter lines and Gaussian noise: easy to learn, not trivial.

    Args:
        root: cache root; ``None``: ``$DLTUNE_CACHE`` or ``~/.cache/lightning-dltune/jpegs``.
        num_images: images to write (classes are balanced: image ``i`` has label ``i % num_classes``).
        image_size: side of the square images, in pixels.
        num_classes: number of classes.
        seed: generator seed; the same parameters give the same images.

    Raises:
        ValueError: for ``num_images < 1``, ``image_size < 8``, ``num_classes < 1`` or a non-integer seed.
    """
    _check_int("num_images", num_images, 1)
    _check_int("image_size", image_size, 8)
    _check_int("num_classes", num_classes, 1)
    _check_int("seed", seed, 0)
    root = os.path.abspath(os.path.expanduser(root or default_cache_root()))
    params = _dataset_params(num_images, image_size, num_classes, seed)
    folder = os.path.join(root, _folder_name(params))
    if _is_complete(folder, params):
        return folder

    os.makedirs(root, exist_ok=True)
    if os.path.exists(folder):
        # incomplete or from different parameters: move it aside (atomic), then delete it
        stale = os.path.join(root, f".stale-{uuid.uuid4().hex}")
        try:
            os.rename(folder, stale)
        except OSError:
            pass  # someone else moved or replaced it meanwhile
        else:
            shutil.rmtree(stale, ignore_errors=True)
    staging = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        _generate(staging, params)
        try:
            os.rename(staging, folder)  # fails if the folder exists: another process won the race
        except OSError:
            if not _is_complete(folder, params):
                raise
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return folder


# --------------------------------------------------------------------------------- dataset
class JpegFolderDataset(Dataset):
    """The images of a folder made by :func:`make_jpeg_dataset`, decoded and augmented per sample.

    Training mode: random resized crop (area scale 0.35-1, aspect ratio 3/4-4/3) to ``crop_size``,
    random horizontal flip. Validation mode: a centre crop (87.5 % of the side) resized to
    ``crop_size``, no flip. Both convert to a ``float32`` tensor ``(3, crop_size, crop_size)``
    normalised with the dataset's per-channel mean and std. Randomness comes from torch's global
    generator, which the DataLoader seeds differently in every worker (and
    :func:`lightning.seed_everything` seeds in the main process), as torchvision's transforms do.

    Args:
        folder: a folder returned by :func:`make_jpeg_dataset`.
        indices: the subset of manifest rows to serve; ``None``: all.
        crop_size: side of the output images.
        train: training (random) or validation (deterministic) augmentation.
        storage_latency_ms: a per-sample sleep before the file is read, emulating network storage.

    Returns per item: ``(image, label)`` with ``image`` a ``(3, crop_size, crop_size)`` float tensor
    and ``label`` an ``int``.

    Raises:
        ValueError: for ``crop_size < 1``, a negative ``storage_latency_ms``, or a folder without a manifest.
    """

    SCALE = (0.35, 1.0)
    RATIO = (3 / 4, 4 / 3)
    VAL_CROP = 0.875

    def __init__(
        self,
        folder: str,
        indices: Optional[list[int]] = None,
        crop_size: int = 64,
        train: bool = True,
        storage_latency_ms: float = 0.0,
    ) -> None:
        _check_int("crop_size", crop_size, 1)
        _check_non_negative("storage_latency_ms", storage_latency_ms)
        marker = _read_marker(folder)
        manifest = os.path.join(folder, MANIFEST)
        if marker is None or not os.path.isfile(manifest):
            raise ValueError(f"`folder` {folder!r} has no {MANIFEST} and {MARKER}: create it with make_jpeg_dataset().")
        with open(manifest, newline="") as f:
            rows = [(os.path.join(folder, path), int(label)) for path, label in list(csv.reader(f))[1:]]
        self.samples = rows if indices is None else [rows[i] for i in indices]
        self.crop_size = crop_size
        self.train = train
        self.storage_latency_s = storage_latency_ms / 1000.0
        self.num_classes = int(marker["params"]["num_classes"])
        self.mean = torch.tensor(marker["mean"], dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(marker["std"], dtype=torch.float32).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        if self.storage_latency_s:
            time.sleep(self.storage_latency_s)  # the round trip to remote storage
        with Image.open(path) as file:
            image = file.convert("RGB")
        box = self._random_box(image.size) if self.train else self._center_box(image.size)
        image = image.resize((self.crop_size, self.crop_size), Image.BILINEAR, box=box)
        if self.train and torch.rand(()) < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return self._to_tensor(image), label

    def _random_box(self, size: tuple[int, int]) -> tuple[float, float, float, float]:
        """A box of random area and aspect ratio, as in torchvision's RandomResizedCrop."""
        width, height = size
        area = width * height
        log_lo, log_hi = math.log(self.RATIO[0]), math.log(self.RATIO[1])
        for _ in range(10):
            u = torch.rand(4).tolist()
            target = area * (self.SCALE[0] + u[0] * (self.SCALE[1] - self.SCALE[0]))
            ratio = math.exp(log_lo + u[1] * (log_hi - log_lo))
            w = math.sqrt(target * ratio)
            h = math.sqrt(target / ratio)
            if 0 < w <= width and 0 < h <= height:
                x0 = u[2] * (width - w)
                y0 = u[3] * (height - h)
                return (x0, y0, x0 + w, y0 + h)
        return self._center_box(size, fraction=1.0)

    def _center_box(self, size: tuple[int, int], fraction: float = VAL_CROP) -> tuple[float, float, float, float]:
        width, height = size
        side = fraction * min(width, height)
        x0, y0 = (width - side) / 2, (height - side) / 2
        return (x0, y0, x0 + side, y0 + side)

    def _to_tensor(self, image: Image.Image) -> torch.Tensor:
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8))  # HWC, a writable copy
        return (pixels.permute(2, 0, 1).float().div_(255.0) - self.mean).div_(self.std)


# --------------------------------------------------------------------------------- datamodule
class JpegDataModule(TunableDataModule, L.LightningDataModule):
    """The synthetic JPEG folder as a tunable DataModule: fixed train/val split, augmentation in the workers.

    Args:
        data_dir: cache root for the generated images; ``None``: ``$DLTUNE_CACHE`` or
            ``~/.cache/lightning-dltune/jpegs``.
        num_images: images in the dataset (train + val).
        image_size: side of the stored JPEGs.
        crop_size: side of the images the model sees.
        val_fraction: share of the images held out for validation, in ``[0, 1)``; ``0``: no validation.
        storage_latency_ms: per-sample sleep emulating network storage (an I/O-bound pipeline).
        **kwargs: the :class:`~lightning_dltune.TunableDataModule` arguments (``batch_size``,
            ``num_workers``, ``prefetch_factor``, ``pin_memory``, ``persistent_workers``, ``shuffle``,
            ``loader_kwargs``).

    Raises:
        ValueError: for a bad argument (named in the message), including a training split smaller
            than one batch.

    Example::

        dm = JpegDataModule(num_images=2000, storage_latency_ms=2.0, batch_size=32, num_workers=0)
        L.Trainer(max_epochs=4, callbacks=[DataLoaderTuner()]).fit(SmallCNN(), datamodule=dm)
    """

    NUM_CLASSES = 10
    SEED = 0

    def __init__(
        self,
        data_dir: Optional[str] = None,
        num_images: int = 2000,
        image_size: int = 96,
        crop_size: int = 64,
        val_fraction: float = 0.1,
        storage_latency_ms: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if data_dir is not None and not isinstance(data_dir, (str, os.PathLike)):
            raise ValueError(f"`data_dir` must be a path or None, got {data_dir!r}.")
        _check_int("num_images", num_images, 1)
        _check_int("image_size", image_size, 8)
        _check_int("crop_size", crop_size, 8)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
            raise ValueError(f"`val_fraction` must be a number in [0, 1), got {val_fraction!r}.")
        _check_non_negative("storage_latency_ms", storage_latency_ms)
        num_val = int(round(num_images * val_fraction))
        if num_images - num_val < self.batch_size:
            raise ValueError(
                f"`num_images`={num_images} leaves {num_images - num_val} training images"
                f" (val_fraction={val_fraction}), fewer than one batch (batch_size={self.batch_size});"
                " training drops incomplete batches."
            )
        self.data_dir = None if data_dir is None else os.fspath(data_dir)
        self.num_images = num_images
        self.image_size = image_size
        self.crop_size = crop_size
        self.val_fraction = float(val_fraction)
        self.storage_latency_ms = float(storage_latency_ms)
        self.num_val = num_val

    def _folder(self) -> str:
        return make_jpeg_dataset(self.data_dir, self.num_images, self.image_size, self.NUM_CLASSES, self.SEED)

    def prepare_data(self) -> None:
        self._folder()

    def setup(self, stage: str) -> None:
        folder = self._folder()  # reads the marker only, once prepare_data has run
        order = torch.randperm(self.num_images, generator=torch.Generator().manual_seed(self.SEED)).tolist()
        val_idx, train_idx = sorted(order[: self.num_val]), sorted(order[self.num_val :])
        common = {"crop_size": self.crop_size, "storage_latency_ms": self.storage_latency_ms}
        self.train_dataset = JpegFolderDataset(folder, train_idx, train=True, **common)
        self.val_dataset = JpegFolderDataset(folder, val_idx, train=False, **common) if val_idx else None


# --------------------------------------------------------------------------------- model
class SmallCNN(L.LightningModule):
    """A small conv net: a stride-2 conv stem, three conv-BN-ReLU-maxpool blocks, global average pool, linear.

    Args:
        num_classes: output classes.
        lr: AdamW learning rate.
        emulate_step_ms: make every training step take at least this long by sleeping after the
            backward pass: on a CPU-only machine this stands in for an accelerator's step (while a
            GPU computes, the host is idle, as in a sleep). Leave ``0`` on a real accelerator.
        width: channels of the first block (doubled in each following block).

    Logs ``train_loss`` (progress bar), ``val_loss`` and ``val_acc``.

    Raises:
        ValueError: for ``num_classes < 2``, ``lr <= 0``, a negative ``emulate_step_ms`` or ``width < 1``.
    """

    def __init__(self, num_classes: int = 10, lr: float = 1e-3, emulate_step_ms: float = 0.0, width: int = 16) -> None:
        super().__init__()
        _check_int("num_classes", num_classes, 2)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or math.isinf(lr):
            raise ValueError(f"`lr` must be a number > 0, got {lr!r}.")
        _check_non_negative("emulate_step_ms", emulate_step_ms)
        _check_int("width", width, 1)
        self.save_hyperparameters()
        # a stride-2 stem keeps the step cheap on CPU (about 13 ms for 32 images of 64 px on 2 cores)
        blocks: list[nn.Module] = [*_conv_bn_relu(3, width, stride=2)]
        channels = width
        for out in (width, 2 * width, 4 * width):
            blocks += [*_conv_bn_relu(channels, out), nn.MaxPool2d(2)]
            channels = out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)
        self._emulate_step_s = emulate_step_ms / 1000.0
        self._step_started = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))

    def on_fit_start(self) -> None:
        if self._emulate_step_s:
            rank_zero_info(
                f"SmallCNN: the accelerator step is emulated: every training step lasts at least"
                f" {1e3 * self._emulate_step_s:g} ms (a sleep after backward)."
            )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._step_started = time.perf_counter()
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_after_backward(self) -> None:
        # inside the step as the tuner times it (between its batch-start and batch-end hooks)
        if self._emulate_step_s:
            remaining = self._emulate_step_s - (time.perf_counter() - self._step_started)
            if remaining > 0:
                time.sleep(remaining)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def _conv_bn_relu(channels_in: int, channels_out: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(inplace=True),
    ]


# --------------------------------------------------------------------------------- checks
def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")


def _check_non_negative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
