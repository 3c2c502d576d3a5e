"""The Trainer features people use, one real tiny fit each: what a user would check still holds.

Every row runs a real ``lightning.Trainer`` on CPU with the tuner and a :class:`TunableDataModule` over
an I/O-like dataset (a fixed sleep per batch, an emulated accelerator step: a sleep in the training
process), so that the tuner adds workers early in the first epoch and switches loaders mid-epoch
inside the feature under test. Each row checks what a user would: every training sample at most
once per epoch (exactly the expected count), every validation sample exactly once per validation
run, the ``dltune/`` metrics logged, no stray files in the working directory.

``ROWS`` names each row's feature and what it checks; ``scripts/works_with.py`` renders docs/works-with.md's
"Works with" table from it and a run of this file.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from fit_workloads import SleepStepModule, SleepyDataModule, SleepyDataset
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset

from lightning_dltune import DataLoaderTuner

pytestmark = pytest.mark.slow  # real fits, one per row

BATCH = 4
TRAIN = 96  # 24 training batches an epoch
VAL = 10  # 3 validation batches, the last one partial
BATCH_COST_S = 0.012  # storage latency per batch: starved at 0 workers
STEP_S = 0.002

ROWS: dict[str, str] = {}


def row(feature: str, checks: str):
    """Registers a test as a row of the compatibility matrix."""

    def register(fn):
        ROWS[fn.__name__] = f"{feature}|{checks}"
        return fn

    return register


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty current directory: a row must leave nothing in it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def make_tuner(**kwargs: Any) -> DataLoaderTuner:
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("max_workers", 2)
    kwargs.setdefault("first_decision_after", 4)
    return DataLoaderTuner(**kwargs)


def make_data(**kwargs: Any) -> SleepyDataModule:
    kwargs.setdefault("train_length", TRAIN)
    kwargs.setdefault("val_length", VAL)
    kwargs.setdefault("batch_size", BATCH)
    kwargs.setdefault("batch_cost_s", BATCH_COST_S)
    return SleepyDataModule(**kwargs)


def fit(
    tmp_path: Path,
    model: pl.LightningModule,
    data: Any = None,
    tuner: DataLoaderTuner | None = None,
    **trainer_kwargs: Any,
) -> tuple[pl.Trainer, DataLoaderTuner]:
    tuner = tuner or make_tuner()
    settings: dict[str, Any] = dict(
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        logger=CSVLogger(str(tmp_path / "logs"), name="run"),
    )
    settings.update(trainer_kwargs)
    callbacks = [tuner] + list(settings.pop("callbacks", []))
    ckpt_path = settings.pop("ckpt_path", None)
    trainer = pl.Trainer(callbacks=callbacks, **settings)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer, tuner


def logged_metrics(trainer: pl.Trainer) -> set[str]:
    names: set[str] = set()
    path = Path(trainer.logger.log_dir) / "metrics.csv"
    if path.exists():
        names.update(path.read_text().splitlines()[0].split(","))
    return names


def check_train_once(model: SleepStepModule, per_epoch: int, epochs: int) -> None:
    assert len(model.train_indices) == epochs, model.train_indices
    for seen in model.train_indices:
        assert len(seen) == len(set(seen)) == per_epoch


def check_val_once(model: SleepStepModule, runs: int, length: int = VAL) -> None:
    assert len(model.val_indices) == runs
    for seen in model.val_indices:
        assert sorted(seen) == list(range(length))


def check_tuned(trainer: pl.Trainer, tuner: DataLoaderTuner) -> None:
    # the start was seen starved, below the band (the data costs 12 ms a batch, the step 2 ms plus Lightning's
    # own): by the 4-batch first window, or, where that one held a slow first step (too few steps to leave
    # warm-up out; bf16's first step on a busy machine), by the epoch's next window; a first window diluted
    # by that step (20-30 % starved) is still below the band, and is acted on
    start = [r for r in tuner.history if r.num_workers == tuner.history[0].num_workers == 0]
    shown = [(r.end_batch, r.num_workers, round(r.starvation_ratio, 2), r.reason) for r in tuner.history]
    assert any(r.starvation_ratio > 1 - tuner.band[0] for r in start), shown
    assert max(r.num_workers for r in tuner.history) > 0, shown  # and the tuner added workers
    assert {"dltune/starvation_ratio", "dltune/gpu_util", "dltune/num_workers"} <= logged_metrics(trainer)


# ------------------------------------------------------------------------------------------------ optimisation


@row("`accumulate_grad_batches=3`", "samples once, metrics, tuning")
def test_accumulate_grad_batches(tmp_path, workdir):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    trainer, tuner = fit(tmp_path, model, make_data(), accumulate_grad_batches=3)
    check_train_once(model, TRAIN, 2)
    check_val_once(model, 2)
    check_tuned(trainer, tuner)
    assert trainer.global_step == 2 * TRAIN // BATCH // 3
    assert not os.listdir(workdir)


@row("gradient clipping + `precision='bf16-mixed'`", "samples once, metrics, tuning")
def test_gradient_clipping_and_bf16(tmp_path, workdir):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    # three epochs: CI once ended two epochs with every window at 0 workers, a start window starved; with 2
    # epochs of 24 batches there are three windows, and a slow bf16 first step on a busy machine can make the
    # first two hold (its window in the band, the next one's step time moved from it). A third gives the step
    # up a window to run in (the cause was not reproduced: the failure now prints each window's reason)
    trainer, tuner = fit(tmp_path, model, make_data(), gradient_clip_val=0.5, precision="bf16-mixed", max_epochs=3)
    check_train_once(model, TRAIN, 3)
    check_tuned(trainer, tuner)


class ManualModule(SleepStepModule):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()


@row("manual optimization", "samples once, metrics, tuning")
def test_manual_optimization(tmp_path, workdir):
    model = ManualModule(step_s=STEP_S, record_indices=True)
    trainer, tuner = fit(tmp_path, model, make_data())
    check_train_once(model, TRAIN, 2)
    check_tuned(trainer, tuner)


# ------------------------------------------------------------------------------------------------ loop limits


@pytest.mark.parametrize("interval, runs_per_epoch", [(0.5, 2), (8, 3)], ids=["float", "int"])
def test_val_check_interval(tmp_path, workdir, interval, runs_per_epoch):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    trainer, tuner = fit(tmp_path, model, make_data(), val_check_interval=interval)
    check_train_once(model, TRAIN, 2)
    check_val_once(model, 2 * runs_per_epoch)
    check_tuned(trainer, tuner)


ROWS["test_val_check_interval"] = "`val_check_interval` (float and int)|samples once, validation once per run, tuning"


@row("`check_val_every_n_epoch=2`", "samples once, validation once, tuning")
def test_check_val_every_n_epoch(tmp_path, workdir):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    trainer, tuner = fit(tmp_path, model, make_data(), check_val_every_n_epoch=2, max_epochs=4)
    check_train_once(model, TRAIN, 4)
    check_val_once(model, 2)
    assert len({r.epoch for r in tuner.history}) == 4


@pytest.mark.parametrize("limit, batches", [(0.5, 12), (10, 10)], ids=["float", "int"])
def test_limit_train_batches(tmp_path, workdir, limit, batches):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    trainer, tuner = fit(tmp_path, model, make_data(), limit_train_batches=limit)
    check_train_once(model, batches * BATCH, 2)
    assert sum(r.stats.all_batches for r in tuner.history) == 2 * batches
    check_tuned(trainer, tuner)


ROWS["test_limit_train_batches"] = "`limit_train_batches` (float and int)|samples once, batches counted"


@row("`max_steps` ending mid-epoch", "samples once, steps counted")
def test_max_steps_across_epochs(tmp_path, workdir):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    trainer, tuner = fit(tmp_path, model, make_data(), max_steps=30, max_epochs=-1)
    assert trainer.global_step == 30
    assert [len(s) for s in model.train_indices] == [TRAIN, 6 * BATCH]
    assert all(len(s) == len(set(s)) for s in model.train_indices)
    assert sum(r.stats.all_batches for r in tuner.history) == 30


@row("`overfit_batches=2`", "the same batches every epoch")
def test_overfit_batches(tmp_path, workdir):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    fit(tmp_path, model, make_data(), overfit_batches=2, max_epochs=3)
    assert len({tuple(sorted(s)) for s in model.train_indices}) == 1
    assert len(model.train_indices[0]) == 2 * BATCH


@row("sanity validation (`num_sanity_val_steps=2`)", "not measured as training")
def test_sanity_validation(tmp_path, workdir):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    trainer, tuner = fit(tmp_path, model, make_data(), num_sanity_val_steps=2)
    check_train_once(model, TRAIN, 2)
    check_val_once(model, 2)
    assert sum(r.stats.all_batches for r in tuner.history) == 2 * TRAIN // BATCH


@row("`fast_dev_run=True`", "no files, no verdict without evidence")
def test_fast_dev_run(tmp_path, workdir):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    trainer, tuner = fit(tmp_path, model, make_data(), fast_dev_run=True, default_root_dir=None, logger=True)
    assert not os.listdir(workdir)
    assert tuner.recommendation_path is None
    assert all(r.stats.fetches > 0 for r in tuner.history)  # a verdict only from measured fetches


@row("`logger=False`", "no files in the current directory")
def test_no_logger_writes_nothing(tmp_path, workdir):
    model = SleepStepModule(step_s=STEP_S)
    fit(tmp_path, model, make_data(), logger=False, default_root_dir=None)
    assert not os.listdir(workdir)


# ------------------------------------------------------------------------------------------------ loaders


@pytest.mark.parametrize("reload", [1, 2])
def test_reload_dataloaders_every_n_epochs(tmp_path, workdir, reload):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    trainer, tuner = fit(tmp_path, model, make_data(), reload_dataloaders_every_n_epochs=reload, max_epochs=3)
    check_train_once(model, TRAIN, 3)
    check_val_once(model, 3)
    check_tuned(trainer, tuner)
    # a reloaded loader runs the tuned config, not the start one
    assert tuner.history[-1].num_workers == tuner.history[-2].next_config.num_workers


ROWS["test_reload_dataloaders_every_n_epochs"] = (
    "`reload_dataloaders_every_n_epochs` (1 and 2)|samples once, tuned config kept"
)


class TwoLoaderData(SleepyDataModule):
    def __init__(self, plain: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plain = plain

    def train_dataloader(self):
        if self.plain:  # loaders the tuner did not build: timed around Lightning's combined fetch
            make = lambda: DataLoader(
                SleepyDataset(TRAIN, batch_cost_s=BATCH_COST_S),
                batch_size=BATCH,  # noqa: E731
                drop_last=True,
            )
            return {"a": make(), "b": make()}
        first = super().train_dataloader()
        second = self.build_loader(SleepyDataset(TRAIN, batch_cost_s=BATCH_COST_S), train=True)
        return {"a": first, "b": second}


class TwoLoaderModule(SleepStepModule):
    def training_step(self, batch, batch_idx):
        x = torch.cat([batch["a"]["x"], batch["b"]["x"]])
        if self.step_s:
            time.sleep(self.step_s)  # one emulated accelerator step for both loaders' batches
        return self.layer(x).pow(2).mean()


@pytest.mark.parametrize("plain", [False, True], ids=["tunable", "plain"])
def test_two_train_loaders(tmp_path, workdir, plain):
    model = TwoLoaderModule(step_s=0.01)
    data = TwoLoaderData(plain, train_length=TRAIN, val_length=VAL, batch_size=BATCH, batch_cost_s=BATCH_COST_S)
    trainer, tuner = fit(tmp_path, model, data, tuner=make_tuner(tune=False), max_epochs=1)
    stats = tuner.history[0].stats
    truth = 2 * BATCH_COST_S / (2 * BATCH_COST_S + 0.01)  # 0 workers: both loaders' batches are made in the fetch
    assert stats.starvation_ratio == pytest.approx(truth, abs=0.12)
    assert stats.all_batches * 2 * BATCH == 2 * TRAIN and stats.samples == 2 * BATCH * stats.batches


ROWS["test_two_train_loaders"] = (
    "two train loaders (a dict: `CombinedLoader`), ours and plain|starvation and samples/s against truth"
)


class IterData(SleepyDataModule):
    """A stream written for ``num_workers=0``: every worker would replay all of it."""

    def __init__(self, sharded: bool, **kwargs: Any) -> None:
        super().__init__(iterable_shards_by_worker=sharded, **kwargs)
        self.sharded = sharded

    def setup(self, stage):
        super().setup(stage)
        self.train_dataset = SleepyStream(TRAIN, sharded=self.sharded)


class SleepyStream(IterableDataset):
    def __init__(self, length: int, sharded: bool) -> None:
        self.length, self.sharded = length, sharded

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if (self.sharded and info is not None) else (0, 1)
        for i in range(start, self.length, step):
            time.sleep(BATCH_COST_S / BATCH)
            yield {"x": torch.full((8,), float(i)), "index": i}


@pytest.mark.parametrize("sharded", [False, True], ids=["not-sharded", "sharded"])
def test_iterable_datasets(tmp_path, workdir, sharded):
    model = SleepStepModule(step_s=STEP_S, record_indices=True)
    _, tuner = fit(
        tmp_path,
        model,
        IterData(sharded, train_length=TRAIN, val_length=VAL, batch_size=BATCH, batch_cost_s=0),
        max_epochs=3,
    )
    workers = {r.num_workers for r in tuner.history}
    assert workers == {0} if not sharded else max(workers) > 0  # a stream that does not shard keeps its start
    for seen in model.train_indices:
        assert len(seen) == len(set(seen))
        # with workers, torch batches inside each worker: up to one partial batch per worker is dropped
        assert len(seen) >= TRAIN - max(workers) * (BATCH - 1)


ROWS["test_iterable_datasets"] = (
    "`IterableDataset`, sharded by worker and not|samples at most once; workers held "
    "unless `iterable_shards_by_worker=True`"
)


Pair = namedtuple("Pair", ["x", "index"])


@dataclass
class Sample:
    x: torch.Tensor
    index: int


class ShapedDataset(SleepyDataset):
    def __init__(self, shape: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shape = shape

    def __getitem__(self, index: int) -> Any:
        x = self._sample(index)
        return {"dict": {"x": x, "index": index}, "namedtuple": Pair(x, index), "dataclass": Sample(x, index)}[
            self.shape
        ]


class ShapedData(SleepyDataModule):
    def __init__(self, shape: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shape = shape

    def setup(self, stage):
        super().setup(stage)
        self.train_dataset = ShapedDataset(self.shape, length=TRAIN, batch_cost_s=BATCH_COST_S)


def collate_samples(samples):
    from torch.utils.data import default_collate

    if isinstance(samples[0], Sample):
        return Sample(torch.stack([s.x for s in samples]), torch.tensor([s.index for s in samples]))
    return default_collate(samples)


class ShapedModule(SleepStepModule):
    @staticmethod
    def _x_and_index(batch):
        if isinstance(batch, Sample) or (isinstance(batch, tuple) and hasattr(batch, "_fields")):
            return batch.x, batch.index
        return SleepStepModule._x_and_index(batch)


@pytest.mark.parametrize("shape", ["dict", "namedtuple", "dataclass"])
def test_batch_shapes(tmp_path, workdir, shape):
    model = ShapedModule(step_s=STEP_S, record_indices=True)
    data = ShapedData(
        shape,
        train_length=TRAIN,
        val_length=VAL,
        batch_size=BATCH,
        batch_cost_s=BATCH_COST_S,
        loader_kwargs={"collate_fn": collate_samples},
    )
    trainer, tuner = fit(tmp_path, model, data)
    check_train_once(model, TRAIN, 2)
    check_tuned(trainer, tuner)
    first = tuner.history[0].stats
    assert first.all_batches == 4 and first.samples == BATCH * first.batches  # the batch size read from the batch


ROWS["test_batch_shapes"] = "dict, namedtuple and dataclass batches|samples once, batch size read"


class IterStepModule(SleepStepModule):
    def training_step(self, dataloader_iter):
        batch = next(dataloader_iter)
        if isinstance(batch, tuple) and len(batch) == 3 and isinstance(batch[1], int):
            batch = batch[0]  # Lightning 2.x yields (batch, batch_idx, dataloader_idx)
        return super().training_step(batch, 0)


class EpochClock(pl.Callback):
    """Wall time of each epoch's training batches from the first batch's start: the truth for samples/s."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == trainer.num_training_batches - 1:
            self.seconds.append(time.perf_counter() - self._t0)


class PlainData(pl.LightningDataModule):
    """Loaders the tuner did not build: their fetches are timed around Lightning's batch iterator."""

    def train_dataloader(self):
        return DataLoader(SleepyDataset(TRAIN, batch_cost_s=BATCH_COST_S), batch_size=BATCH, drop_last=True)

    def val_dataloader(self):
        return DataLoader(SleepyDataset(VAL), batch_size=BATCH)


@pytest.mark.parametrize("plain", [False, True], ids=["tunable", "plain"])
def test_dataloader_iter(tmp_path, workdir, plain):
    model = IterStepModule(step_s=STEP_S, record_indices=True)
    clock = EpochClock()
    trainer, tuner = fit(
        tmp_path,
        model,
        PlainData() if plain else make_data(),
        tuner=make_tuner(tune=False),
        max_epochs=1,
        callbacks=[clock],
    )
    check_train_once(model, TRAIN, 1)
    records = tuner.history
    samples = sum(r.stats.samples for r in records)
    busy = sum(r.stats.busy_s for r in records)
    fetch = sum(r.stats.fetch_wait_total_s for r in records)
    assert sum(r.stats.all_batches for r in records) * BATCH == TRAIN  # every batch, warm-up steps included
    assert plain or (records[0].stats.batch_bytes or 0) > 0  # ours estimate a batch's bytes from one sample
    # the step fetches its own batch: that wait is fetch wait, not step time (counted once, not twice)
    assert samples / busy == pytest.approx(TRAIN / clock.seconds[0], rel=0.25)
    assert fetch >= TRAIN // BATCH * BATCH_COST_S * 0.9 and busy - fetch < fetch  # a 12 ms fetch, a 2 ms step


ROWS["test_dataloader_iter"] = (
    "`training_step(self, dataloader_iter)`, ours and plain loaders|batch size, fetch wait and samples/s against truth"
)


# ------------------------------------------------------------------------------------------------ fits and resumes


@row("one tuner, two fits", "each fit starts afresh: its own history and `max_rebuilds`")
def test_fit_twice(tmp_path, workdir):
    tuner = make_tuner(max_rebuilds=1)  # "in one fit": the second fit may rebuild again
    fit(tmp_path, SleepStepModule(step_s=STEP_S), make_data(), tuner=tuner, max_epochs=1)
    first_rebuilds = tuner.rebuilds
    fit(tmp_path, SleepStepModule(step_s=STEP_S), make_data(), tuner=tuner, max_epochs=1)
    assert [r.epoch for r in tuner.history] == [0, 0]  # the early window and the rest of the epoch
    assert tuner.history[0].end_batch == 4
    assert first_rebuilds == tuner.rebuilds == 1 and tuner.history[1].num_workers > 0  # fit 2 added workers too
    assert [[r.epoch for r in records] for records in tuner.previous_fits] == [[0, 0]]  # fit 1 kept apart


class AllStagesModule(SleepStepModule):
    def test_step(self, batch, batch_idx):
        return self.validation_step(batch, batch_idx)

    def predict_step(self, batch, batch_idx):
        return self._x_and_index(batch)[0].sum()


@row("`ckpt_path='last'`, then validate, test and predict", "resumed with the tuned config; other stages untouched")
def test_resume_then_validate_test_predict(tmp_path, workdir):
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    model = SleepStepModule(step_s=STEP_S)
    trainer, tuner = fit(tmp_path, model, make_data(), callbacks=[ckpt], enable_checkpointing=True)
    tuned = tuner.history[-1].next_config
    data = make_data()
    tuner2 = make_tuner()
    trainer2, _ = fit(
        tmp_path,
        SleepStepModule(step_s=STEP_S),
        data,
        tuner=tuner2,
        max_epochs=3,
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)],
        enable_checkpointing=True,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert trainer2.current_epoch == 3
    assert tuner2.history[-1].epoch == 2 and tuner2.history[-1].num_workers == tuned.num_workers
    trainer2.validate(datamodule=data)
    trainer2.test(AllStagesModule(), dataloaders=DataLoader(SleepyDataset(8), batch_size=4))
    out = trainer2.predict(AllStagesModule(), dataloaders=DataLoader(SleepyDataset(8), batch_size=4))
    assert len(out) == 2


@row("`EarlyStopping` + `ModelCheckpoint`", "stops, saves, tuner state in the checkpoint")
def test_early_stopping_and_checkpoint(tmp_path, workdir):
    class ValLoss(SleepStepModule):
        def validation_step(self, batch, batch_idx):
            super().validation_step(batch, batch_idx)
            self.log("val_loss", 1.0)  # never improves: stops after `patience` epochs

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val_loss")
    trainer, tuner = fit(
        tmp_path,
        ValLoss(step_s=STEP_S),
        make_data(),
        max_epochs=10,
        enable_checkpointing=True,
        callbacks=[EarlyStopping("val_loss", patience=1), ckpt],
    )
    assert trainer.current_epoch < 10
    saved = torch.load(ckpt.best_model_path, weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("DataLoaderTuner"))
    assert state["history"]


# ------------------------------------------------------------------------------------------------ the console


@pytest.mark.parametrize("bar", [TQDMProgressBar, RichProgressBar], ids=["tqdm", "rich"])
def test_progress_bars(tmp_path, workdir, bar, capsys):
    # what reaches the terminal, not what was handed to the bar: TQDM's own print drops text while no bar is
    # active (the table at the end of the fit comes after its last bar closed)
    fit(
        tmp_path,
        SleepStepModule(step_s=STEP_S),
        make_data(),
        tuner=make_tuner(verbose=True),
        enable_progress_bar=True,
        callbacks=[bar()],
        max_epochs=1,
    )
    terminal = capsys.readouterr().out
    assert "[dltune] epoch 0 to batch 4" in terminal
    assert "lightning-dltune: loader tuning" in terminal and "recommended: workers=" in terminal


ROWS["test_progress_bars"] = (
    "TQDM and Rich progress bars|window lines, the final table and the recommendation on the terminal"
)


# ------------------------------------------------------------------------------------------------ processes


@row("`strategy='ddp_spawn'` on 2 CPU processes", "the tuner's history comes back to the main process")
@pytest.mark.slow
def test_ddp_spawn(tmp_path, workdir):
    from torch.multiprocessing import ProcessExitedException

    tuner = make_tuner()
    try:
        fit(
            tmp_path,
            SleepStepModule(step_s=STEP_S),
            make_data(),
            tuner=tuner,
            strategy="ddp_spawn",
            devices=2,
            max_epochs=1,
        )
    except ProcessExitedException as exc:
        # after the fit, a rank other than zero can abort at its exit on a loaded machine, in torch's gloo
        # threads ("terminate called without an active exception"; Lightning leaves the process group up):
        # torch's, not the tuner's. Judge what came back; if rank zero was stopped before handing it, say so
        if exc.signal_name != "SIGABRT" or exc.error_index == 0:
            raise
        if not tuner.history:
            pytest.skip("rank 1 aborted at exit in torch's gloo threads before rank zero handed the state back")
    assert tuner.history and tuner.history[0].end_batch == 4  # the early window, then the rest of epoch 0
    assert tuner.history[-1].epoch == 0 and tuner.recommended_config is not None
    assert tuner.rebuilds == sum(r.changed for r in tuner.history + tuner.val_history)  # train and val changes


USER_CLI = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from lightning.pytorch.cli import LightningCLI
    from fit_workloads import SleepStepModule, SleepyDataModule

    LightningCLI(SleepStepModule, SleepyDataModule, save_config_kwargs={{"overwrite": True}})
    """
)


@row("a user's own `LightningCLI(Model, DataModule)`", "the recommendation file is accepted back")
@pytest.mark.slow
def test_users_own_cli_accepts_the_recommendation(tmp_path, workdir):
    import subprocess

    import yaml

    script = tmp_path / "train.py"
    script.write_text(USER_CLI.format(tests=str(Path(__file__).parent / "helpers")))
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "max_epochs": 1,
                    "accelerator": "cpu",
                    "default_root_dir": str(tmp_path / "run"),
                    "enable_progress_bar": False,
                    "limit_val_batches": 1,
                    "callbacks": [
                        {
                            "class_path": "lightning_dltune.DataLoaderTuner",
                            "init_args": {"verbose": False, "max_workers": 2, "first_decision_after": 4},
                        }
                    ],
                },
                "model": {"step_s": STEP_S},
                "data": {"train_length": TRAIN, "val_length": VAL, "batch_size": BATCH, "batch_cost_s": BATCH_COST_S},
            }
        )
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    first = subprocess.run(
        [sys.executable, str(script), "fit", "--config", str(config)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    rec = next((tmp_path / "run").rglob("dltune_recommendation.yaml"))
    again = subprocess.run(
        [sys.executable, str(script), "fit", "--config", str(config), "--config", str(rec), "--print_config"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    rec_values = yaml.safe_load(rec.read_text())["data"]
    merged = yaml.safe_load(again.stdout)["data"]
    assert {k: merged[k] for k in rec_values} == rec_values
