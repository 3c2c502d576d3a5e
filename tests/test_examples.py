"""The example image pipeline: dataset generation, decode and augmentation, the DataModule, and a real fit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `examples` is not installed: it lives next to the package
    sys.path.insert(0, str(REPO_ROOT))

from examples.image_pipeline import MANIFEST, MARKER, JpegDataModule, JpegFolderDataset, SmallCNN, make_jpeg_dataset  # noqa: E402
from lightning_dltune import DataLoaderTuner  # noqa: E402


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> str:
    return make_jpeg_dataset(str(tmp_path_factory.mktemp("jpegs")), num_images=40, image_size=48, num_classes=4)


def _image_mtimes(folder: str) -> dict[str, float]:
    images = os.path.join(folder, "images")
    return {name: os.stat(os.path.join(images, name)).st_mtime_ns for name in os.listdir(images)}


# ------------------------------------------------------------------------------ generation
def test_generation_writes_images_manifest_and_marker(small_folder):
    assert len(os.listdir(os.path.join(small_folder, "images"))) == 40
    lines = Path(small_folder, MANIFEST).read_text().splitlines()
    assert lines[0] == "path,label" and len(lines) == 41
    assert {int(line.split(",")[1]) for line in lines[1:]} == {0, 1, 2, 3}
    assert Path(small_folder, MARKER).is_file()


def test_generation_is_idempotent(tmp_path):
    first = make_jpeg_dataset(str(tmp_path), num_images=20, image_size=32)
    before = _image_mtimes(first)
    again = make_jpeg_dataset(str(tmp_path), num_images=20, image_size=32)
    assert again == first
    assert _image_mtimes(again) == before  # nothing rewritten


def test_generation_with_other_parameters_makes_another_folder(tmp_path):
    a = make_jpeg_dataset(str(tmp_path), num_images=20, image_size=32)
    b = make_jpeg_dataset(str(tmp_path), num_images=24, image_size=32)
    assert a != b
    assert len(os.listdir(os.path.join(b, "images"))) == 24


def test_generation_redoes_a_folder_whose_marker_does_not_match(tmp_path):
    folder = make_jpeg_dataset(str(tmp_path), num_images=20, image_size=32)
    Path(folder, MARKER).write_text('{"params": {"num_images": 3}}')
    os.remove(os.path.join(folder, "images", "000000.jpg"))
    assert make_jpeg_dataset(str(tmp_path), num_images=20, image_size=32) == folder
    assert len(os.listdir(os.path.join(folder, "images"))) == 20
    assert '"num_images": 20' in Path(folder, MARKER).read_text()


def test_generation_racing_creators_agree_and_leave_no_debris(tmp_path):
    start = threading.Barrier(3)
    results, errors = [], []

    def create() -> None:
        start.wait()
        try:
            results.append(make_jpeg_dataset(str(tmp_path), num_images=30, image_size=32))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert len(os.listdir(os.path.join(results[0], "images"))) == 30
    assert os.listdir(tmp_path) == [os.path.basename(results[0])]  # staging folders are gone


def test_default_cache_root_follows_dltune_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DLTUNE_CACHE", str(tmp_path))
    folder = make_jpeg_dataset(num_images=10, image_size=16)
    assert Path(folder).parent == tmp_path


# ------------------------------------------------------------------------------ dataset
def test_dataset_returns_normalised_crops_and_labels(small_folder):
    ds = JpegFolderDataset(small_folder, crop_size=24)
    torch.manual_seed(0)
    images, labels = zip(*(ds[i] for i in range(len(ds))))
    batch = torch.stack(images)
    assert batch.shape == (40, 3, 24, 24) and batch.dtype == torch.float32
    assert all(isinstance(y, int) and 0 <= y < 4 for y in labels)
    assert abs(batch.mean().item()) < 0.5
    assert 0.5 < batch.std().item() < 1.5


def test_training_augmentation_is_random_and_validation_is_not(small_folder):
    train = JpegFolderDataset(small_folder, crop_size=24, train=True)
    torch.manual_seed(1)
    a = train[0][0]
    torch.manual_seed(1)
    assert torch.equal(train[0][0], a)  # reproducible from torch's (per-worker) seed
    assert any(not torch.equal(train[0][0], a) for _ in range(5))
    val = JpegFolderDataset(small_folder, crop_size=24, train=False)
    assert torch.equal(val[3][0], val[3][0])


def test_storage_latency_adds_a_sleep_per_sample(small_folder):
    n, latency_ms = 10, 20.0
    fast = JpegFolderDataset(small_folder, crop_size=24)
    slow = JpegFolderDataset(small_folder, crop_size=24, storage_latency_ms=latency_ms)

    def timed(ds) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            ds[i]
        return time.perf_counter() - t0

    base, delayed = timed(fast), timed(slow)
    expected = n * latency_ms / 1000
    assert 0.9 * expected <= delayed - base <= 3 * expected + 0.5


# ------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_images": 0}, "num_images"),
        ({"num_images": 20}, "num_images"),  # 18 training images: less than one batch of 32
        ({"image_size": 4}, "image_size"),
        ({"crop_size": 0}, "crop_size"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"val_fraction": -0.1}, "val_fraction"),
        ({"storage_latency_ms": -1.0}, "storage_latency_ms"),
        ({"storage_latency_ms": float("nan")}, "storage_latency_ms"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_datamodule_rejects_bad_arguments(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        JpegDataModule(data_dir=str(tmp_path), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_classes": 1}, "num_classes"),
        ({"lr": 0.0}, "lr"),
        ({"emulate_step_ms": -5}, "emulate_step_ms"),
        ({"width": 0}, "width"),
    ],
)
def test_model_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        SmallCNN(**kwargs)


def test_generation_and_dataset_reject_bad_arguments(tmp_path, small_folder):
    with pytest.raises(ValueError, match="`num_images`"):
        make_jpeg_dataset(str(tmp_path), num_images=0)
    with pytest.raises(ValueError, match="`crop_size`"):
        JpegFolderDataset(small_folder, crop_size=0)
    with pytest.raises(ValueError, match="`folder`"):
        JpegFolderDataset(str(tmp_path))


def test_datamodule_splits_train_and_val_without_overlap(tmp_path):
    dm = JpegDataModule(
        data_dir=str(tmp_path), num_images=60, image_size=32, crop_size=16, val_fraction=0.25, batch_size=8
    )
    dm.prepare_data()
    dm.setup("fit")
    train = {path for path, _ in dm.train_dataset.samples}
    val = {path for path, _ in dm.val_dataset.samples}
    assert len(train) == 45 and len(val) == 15 and not train & val


# ------------------------------------------------------------------------------ a real fit
@pytest.mark.slow
def test_fit_with_tuner_records_one_epoch_each_and_emulates_the_step(tmp_path):
    L.seed_everything(0)
    dm = JpegDataModule(
        data_dir=str(tmp_path / "data"), num_images=120, image_size=48, crop_size=32, batch_size=16, num_workers=0
    )
    model = SmallCNN(width=8, emulate_step_ms=30.0)
    tuner = DataLoaderTuner()
    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=2,
        callbacks=[tuner],
        default_root_dir=str(tmp_path),
        logger=L.pytorch.loggers.TensorBoardLogger(str(tmp_path / "logs")),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(model, datamodule=dm)

    assert [r.epoch for r in tuner.history] == [0, 1]
    assert all(r.stats.all_batches == 3 for r in tuner.history)
    # the sleep is inside the step the tuner times
    assert all(r.stats.step_s / r.stats.batches >= 0.029 for r in tuner.history)
    assert {"train_loss", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    assert tuner.recommended_config is not None


# ------------------------------------------------------------------------------ the script
@pytest.mark.slow
def test_plain_example_runs_as_a_script(tmp_path):
    env = {**os.environ, "DLTUNE_CACHE": str(tmp_path / "cache")}
    help_run = subprocess.run(
        [sys.executable, "examples/train_plain.py", "--help"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_run.returncode == 0, help_run.stderr
    assert "--storage-latency-ms" in help_run.stdout

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.train_plain",
            "--epochs",
            "2",
            "--num-images",
            "64",
            "--limit-batches",
            "4",
            "--batch-size",
            "8",
            "--emulate-step-ms",
            "5",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "DataLoaderTuner history" in run.stdout
    assert "Recommended loader config" in run.stdout
    assert list((tmp_path / "cache").iterdir())  # the images went to $DLTUNE_CACHE


@pytest.mark.slow
def test_datamodule_arguments_reach_lightning_cli(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["train"])  # only `args` below, not pytest's command line
    cli = LightningCLI(
        SmallCNN,
        JpegDataModule,
        run=False,
        args=[
            "--data.batch_size=16",
            "--data.num_workers=1",
            "--data.prefetch_factor=3",
            "--data.num_images=64",
            f"--data.data_dir={tmp_path}",
            "--model.width=8",
            "--seed_everything=0",
            "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
    )
    dm = cli.datamodule
    assert (dm.batch_size, dm.num_images, dm.data_dir) == (16, 64, str(tmp_path))
    assert (dm.loader_config.num_workers, dm.loader_config.prefetch_factor) == (1, 3)
