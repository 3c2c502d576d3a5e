"""Validation measured and tuned on its own: a real fit where the validation loader starves and training does not.

A validation step has no backward pass: with training's workers it starves where training does not.
Each validation run is the validation side's window; the accelerator step is a sleep in the training
process (the host idles while a GPU computes).
"""

from __future__ import annotations

import logging
import time

import lightning.pytorch as pl
import pytest
from fit_workloads import SleepStepModule, SleepyDataModule, SleepyDataset
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import CombinedLoader
from tb_events import scalars

from lightning_dltune import DataLoaderTuner
from lightning_dltune.core.windows import VAL_FEWEST_BATCHES
from lightning_dltune.report.words import reason_text

TRAIN, VAL, BATCH = 160, 40, 4
VAL_COST_S = 0.03  # slow held-out storage: 30 ms a batch against a 1 ms validation step
FAST_VAL = 24  # a second validation set, on fast storage


class _DyingValData(SleepyDataModule):
    """Its validation workers are killed (as by the OOM killer) whenever more than one runs."""

    def setup(self, stage):
        super().setup(stage)
        self.val_dataset = SleepyDataset(VAL, batch_cost_s=VAL_COST_S, fail_in_worker_above=1)


class _TwoValLoaders(SleepyDataModule):
    """Two validation loaders: held-out data on slow storage (loader 0) and a small set on fast storage (1).

    ``mode``: ``None`` returns a list (Lightning runs them one after another); else a ``CombinedLoader`` of it.
    """

    mode = None

    def setup(self, stage):
        super().setup(stage)
        self.fast_val_dataset = SleepyDataset(FAST_VAL)

    def val_dataloader(self):
        self._shut_down_live(lambda trainer: trainer.val_dataloaders)
        loaders = [self.build_loader(d, train=False) for d in (self.val_dataset, self.fast_val_dataset)]
        return loaders if self.mode is None else CombinedLoader(loaders, self.mode)


class _TwoValLoadersCombined(_TwoValLoaders):
    mode = "max_size"  # a step takes a batch of each loader; the one that ran out gives None


class _IdsPerLoader(SleepStepModule):
    """Records each validation run's sample ids per validation loader: ``val_indices[run][dataloader_idx]``."""

    def on_validation_epoch_start(self):
        if not self.trainer.sanity_checking:
            self.val_indices.append({})

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        parts = dict(enumerate(batch)) if isinstance(batch, list) else {dataloader_idx: batch}  # combined: a list
        for idx, part in parts.items():
            if part is not None and not self.trainer.sanity_checking:
                self.val_indices[-1].setdefault(idx, []).extend(part["index"].tolist())
        time.sleep(self.val_step_s)


TRAIN_STEP_S = 0.04  # training's batches cost nothing to make: fed at 0 workers, beside a CPU hog too


def _fit(trainer_kwargs, data_cls=SleepyDataModule, model_cls=SleepStepModule, **trainer_args):
    # (a batch made in the loop costs 2-5 ms beside a CPU hog: a 20 ms step read 85-90 % busy there, at the band's
    # edge, and training sometimes got a worker, which sized validation's start)
    tuner = DataLoaderTuner(window_batches=10, window_seconds=0.2, max_workers=4)
    model = model_cls(step_s=TRAIN_STEP_S, val_step_s=0.001, record_indices=True)
    data = data_cls(train_length=TRAIN, val_length=VAL, batch_size=BATCH, val_batch_cost_s=VAL_COST_S)
    trainer = pl.Trainer(callbacks=[tuner], **{**trainer_kwargs, **trainer_args})
    trainer.fit(model, datamodule=data)
    return tuner, model, data


def _every_val_sample_once_per_run(model):
    assert model.val_indices and [sorted(ids) for ids in model.val_indices] == [list(range(VAL))] * len(
        model.val_indices
    )


@pytest.mark.slow
def test_a_starved_validation_loader_gets_workers_of_its_own_and_training_keeps_its_config(
    trainer_kwargs, tmp_path, caplog
):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    with caplog.at_level(logging.INFO):
        tuner, model, data = _fit(trainer_kwargs, max_epochs=2, val_check_interval=0.5, logger=logger)
    runs = tuner.val_history
    assert len(runs) == 4  # twice an epoch, the sanity check left out
    # the first run follows training's 0 workers, or, where a batch made in training's loop costs a few ms (beside
    # a CPU hog), starts at a worker sized from training's window for a step a third as long: starved either way
    assert runs[0].num_workers <= 1 and runs[0].starvation_ratio > 0.5
    assert runs[0].next_config.num_workers > runs[0].num_workers
    assert runs[-1].num_workers > 0 and runs[-1].samples_per_s > 2 * runs[0].samples_per_s
    assert {r.num_workers for r in tuner.history} == {0}  # training was never starved: it keeps its config
    assert data.loader_config.num_workers == 0 and data.val_config.num_workers > 0
    _every_val_sample_once_per_run(model)
    assert [sorted(ids) for ids in model.train_indices] == [list(range(TRAIN))] * 2
    logged = scalars(str(tmp_path))
    val_steps = [step for step, _ in logged["dltune/val/starvation_ratio"]]
    assert len(val_steps) == 4 and val_steps == sorted(val_steps)
    assert "dltune/val/num_workers" in logged and "dltune/val/gpu_util" not in logged
    assert "lightning-dltune: validation loaders" in caplog.text
    assert "[dltune] validation at step" in caplog.text and "[dltune] validation loaders: recommended" in caplog.text
    fragment = next(tmp_path.rglob("dltune_recommendation.yaml")).read_text()
    assert "val_num_workers:" in fragment and "num_workers: 0" in fragment


@pytest.mark.slow
def test_a_validation_switch_whose_workers_die_rolls_back_with_every_sample_once_per_run(trainer_kwargs):
    with pytest.warns(UserWarning, match="loader config failed") as record:
        tuner, model, data = _fit(trainer_kwargs, _DyingValData, max_epochs=2, val_check_interval=0.5)
    assert len([w for w in record if "loader config failed" in str(w.message)]) == 1
    assert data.val_config.num_workers <= 1 and data.loader_config.num_workers == 0
    assert len(tuner.val_history) == 4
    _every_val_sample_once_per_run(model)


@pytest.mark.parametrize(
    ("trainer_args", "data_cls", "runs", "ids"),
    [
        (dict(val_check_interval=10, max_epochs=1), SleepyDataModule, 4, {0: VAL}),  # 40 batches: at 10, 20, 30, 40
        (dict(check_val_every_n_epoch=2, max_epochs=4), SleepyDataModule, 2, {0: VAL}),
        (dict(limit_val_batches=4, max_epochs=2), SleepyDataModule, 2, {0: 4 * BATCH}),  # the first 4 batches
        (dict(limit_val_batches=0.5, max_epochs=2), SleepyDataModule, 2, {0: VAL // 2}),  # 5 of 10 batches
        (dict(num_sanity_val_steps=2, max_epochs=2), SleepyDataModule, 2, {0: VAL}),  # no window for the sanity check
        (dict(num_sanity_val_steps=-1, max_epochs=2), SleepyDataModule, 2, {0: VAL}),  # a whole sanity run, left out
        (dict(max_epochs=2), _TwoValLoaders, 2, {0: VAL, 1: FAST_VAL}),
        (dict(max_epochs=2), _TwoValLoadersCombined, 2, {0: VAL, 1: FAST_VAL}),
    ],
    ids=[
        "val_check_interval-int",
        "check_val_every_n_epoch",
        "limit_val_batches-int",
        "limit_val_batches-float",
        "sanity-steps",
        "sanity-all",
        "two-loaders",
        "two-loaders-combined",
    ],
)
@pytest.mark.slow
def test_each_validation_run_is_one_validation_window(trainer_kwargs, trainer_args, data_cls, runs, ids, caplog):
    with caplog.at_level(logging.INFO):
        tuner, model, data = _fit(trainer_kwargs, data_cls, _IdsPerLoader, **trainer_args)
    assert len(tuner.val_history) == len(model.val_indices) == runs
    # every run saw each loader's samples once (the first batches' ones where limit_val_batches cuts the run)
    expected = {idx: list(range(n)) for idx, n in ids.items()}
    assert [{idx: sorted(seen) for idx, seen in run.items()} for run in model.val_indices] == [expected] * runs
    batches = {idx: -(-n // BATCH) for idx, n in ids.items()}
    combined = data_cls is _TwoValLoadersCombined  # a step takes a batch of each loader
    assert {r.stats.batches for r in tuner.val_history} == {
        max(batches.values()) if combined else sum(batches.values())
    }
    # several loaders: each one's part of each run, its own batches (one loader: nothing more to show)
    parts = [(p.run, p.dataloader_idx, p.stats.batches) for p in tuner.val_loader_history]
    assert parts == ([(run, idx, n) for run in range(runs) for idx, n in batches.items()] if len(ids) > 1 else [])
    # the starved validation side got more workers after its first run, or, where a run is fewer than the 8
    # batches a decision needs, after the runs that together hold them (two of 4 or 5); training kept its config.
    # It starts at training's 0 workers, or (on a busy machine, where training's batch costs a few ms to make
    # in the loop) at a worker or two sized from training's window for the shorter validation step
    first = tuner.val_history[0]
    deciding = 0 if first.stats.batches >= VAL_FEWEST_BATCHES else 1
    assert tuner.val_history[deciding].next_config.num_workers > first.config.num_workers
    if deciding:  # a run too short to judge holds its config, and the console says why
        assert first.next_config == first.config
        assert "needed to judge: holding" in reason_text(first.reason)
        assert f"| {first.stats.batches} of {VAL_FEWEST_BATCHES} batches to judge\n" in caplog.text + "\n"
    assert data.val_config.num_workers > 0
    assert data.loader_config.num_workers == 0


def _table_rows(output):
    """The validation table's rows from the console output, split into cells (title, header and rule left out)."""
    table = output[output.index("lightning-dltune: validation loaders") :].splitlines()[3:]
    return [line.split() for line in table if line.strip()][: 3 * 2]  # two runs, each `all` and two loaders


@pytest.mark.slow
def test_several_validation_loaders_are_each_measured_and_the_slow_one_starves_more(trainer_kwargs, tmp_path, capsys):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    tuner, model, _ = _fit(
        trainer_kwargs, _TwoValLoaders, _IdsPerLoader, max_epochs=2, logger=logger, enable_progress_bar=True
    )
    output = capsys.readouterr().out  # the console lines and the tables go through the progress bar
    expected = {0: list(range(VAL)), 1: list(range(FAST_VAL))}
    assert [{idx: sorted(ids) for idx, ids in run.items()} for run in model.val_indices] == [expected] * 2
    runs, parts = tuner.val_history, tuner.val_loader_history
    assert len(runs) == 2 and [(p.run, p.dataloader_idx) for p in parts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for run, record in enumerate(runs):  # the run (one config for both loaders) is its loaders' parts together
        mine = [p.stats for p in parts if p.run == run]
        assert sum(s.batches for s in mine) == record.stats.batches == 10 + 6
        assert sum(s.samples for s in mine) == record.stats.samples == VAL + FAST_VAL
        assert sum(s.fetch_wait_total_s for s in mine) == pytest.approx(record.stats.fetch_wait_total_s)
    # read back from TensorBoard: each loader's own series, at the run's step; the slow storage starves its loader
    logged = scalars(str(tmp_path))
    assert [x for x, _ in logged["dltune/val/0/starvation_ratio"]] == [
        x for x, _ in logged["dltune/val/starvation_ratio"]
    ]
    series = lambda idx, name: [v for _, v in logged[f"dltune/val/{idx}/{name}"]]  # noqa: E731
    # (the wait says how much more: a starvation ratio saturates near 1, and against a 1 ms validation step a
    # batch made in the loop in 2-3 ms beside a CPU hog reads 50-70 % starved on fast storage too)
    slow, fast = series(0, "starvation_ratio"), series(1, "starvation_ratio")
    assert len(slow) == len(fast) == 2 and slow[0] > 0.7 and slow[0] > fast[0]  # the same config for both
    # both loaders pay the same hand-over (or batch made in the loop): the slow storage's 30 ms a batch is the gap
    assert series(0, "fetch_wait_ms")[0] - series(1, "fetch_wait_ms")[0] > 0.5 * VAL_COST_S * 1e3
    assert series(1, "samples_per_s")[0] > 2 * series(0, "samples_per_s")[0]
    # with workers of its own the slow loader waits less than it did on none (how its wait then compares with
    # the fast loader's depends on how many workers its runs were given: both may be near the hand-over time)
    assert series(0, "fetch_wait_ms")[1] < series(0, "fetch_wait_ms")[0]
    # the console: each run's line names each loader's starvation, the table gives each loader rows of its own
    assert output.count("| loaders 0: ") == 2
    rows = _table_rows(output)
    assert [row[2] if row[2] == "all" else row[0] for row in rows] == ["all", "0", "1"] * 2
    assert [int(row[1]) for row in rows if row[2] != "all"] == [10, 6] * 2
    first_slow, first_fast = (float(row[4].rstrip("%")) for row in rows[1:3])
    assert first_slow > first_fast
    # a checkpoint keeps them (and the spawn hand-over, which goes through the same state)
    restored = DataLoaderTuner()
    restored.load_state_dict(tuner.state_dict())
    assert restored.val_loader_history == parts


@pytest.mark.slow
def test_validation_starts_with_workers_sized_from_training_before_its_first_run(trainer_kwargs, caplog):
    # 40 ms a batch on both sets; 1 worker feeds the 60 ms training step (with room for a batch's hand-over from a
    # worker, up to 10 ms beside a CPU hog), not the 20 ms validation step
    tuner = DataLoaderTuner(window_batches=10, window_seconds=0.2, max_workers=4)
    model = SleepStepModule(step_s=0.06, val_step_s=0.02, record_indices=True)
    data = SleepyDataModule(
        train_length=TRAIN, val_length=VAL, batch_size=BATCH, batch_cost_s=0.04, val_batch_cost_s=0.04, num_workers=1
    )
    trainer = pl.Trainer(callbacks=[tuner], **{**trainer_kwargs, "max_epochs": 2, "val_check_interval": 0.5})
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=data)
    runs = tuner.val_history
    assert len(runs) == 4
    # the first run already has workers of its own: 40 ms / 20 ms x 1.2 headroom = 2.4, so 3 (a step measured 10 %
    # slow on a busy host still gives 3; a batch measured slower, 4: the cap)
    assert runs[0].num_workers in (3, 4) and runs[0].starvation_ratio < 0.4
    assert {r.num_workers for r in tuner.history} == {1} and data.loader_config.num_workers == 1
    assert f"[dltune] validation starts at {runs[0].num_workers} workers x prefetch 2 of its own" in caplog.text
    _every_val_sample_once_per_run(model)
    assert [sorted(ids) for ids in model.train_indices] == [list(range(TRAIN))] * 2


@pytest.mark.slow
def test_a_validation_start_sized_too_generously_is_given_back_by_its_own_runs(trainer_kwargs):
    # a validation step as long as the training step (a heavy metric): the start's third of it was wrong, and the
    # workers it sized (3 for a 40 ms batch against a third of 60 ms; 2 where a busy host slows the step measured)
    # are slack the validation runs give back
    tuner = DataLoaderTuner(window_batches=10, window_seconds=0.2, max_workers=4)
    model = SleepStepModule(step_s=0.06, val_step_s=0.06, record_indices=True)
    data = SleepyDataModule(
        train_length=TRAIN, val_length=VAL, batch_size=BATCH, batch_cost_s=0.04, val_batch_cost_s=0.04, num_workers=1
    )
    trainer = pl.Trainer(callbacks=[tuner], **{**trainer_kwargs, "max_epochs": 3, "val_check_interval": 0.5})
    trainer.fit(model, datamodule=data)
    runs = tuner.val_history
    # the start: slack. The typical batch waits for little more than its hand-over (a few ms beside a CPU hog); the
    # first waits for its workers' start (10 % of a 10-batch run, more on a loaded machine), so the run's whole
    # starvation ratio is not what says it
    start = runs[0].num_workers
    assert start in (2, 3) and runs[0].stats.fetch_wait_p50_s < 0.25 * runs[0].stats.step_p50_s
    assert data.val_config.num_workers < start and runs[-1].num_workers < start  # given back by the validation runs
    assert data.loader_config.num_workers == 1
    _every_val_sample_once_per_run(model)


@pytest.mark.slow
def test_a_validation_run_of_two_batches_gets_no_more_than_two_workers(trainer_kwargs, caplog):
    # training runs 4 workers (60 ms batches against a 20 ms step: 3 at least); the validation set is 2 batches of
    # 40 ms against a 1 ms step: the start sized from training (3-4 workers) and the training config itself would
    # start workers that never get a batch (a loader hands a run's batches to its workers in turn from the first,
    # every run)
    tuner = DataLoaderTuner(window_batches=10, window_seconds=0.2, max_workers=4)
    model = SleepStepModule(step_s=0.02, val_step_s=0.001, record_indices=True)
    data = SleepyDataModule(
        train_length=TRAIN, val_length=8, batch_size=BATCH, batch_cost_s=0.06, val_batch_cost_s=0.04, num_workers=4
    )
    trainer = pl.Trainer(callbacks=[tuner], **{**trainer_kwargs, "max_epochs": 2, "val_check_interval": 0.5})
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=data)
    runs = tuner.val_history
    assert len(runs) == 4
    assert runs[0].num_workers == 2 and all(r.num_workers <= 2 for r in runs)
    assert trainer.val_dataloaders.num_workers <= 2 and data.val_config.num_workers <= 2
    assert "a validation run of 2 batches gives work to no more (training runs" in caplog.text
    assert data.loader_config.num_workers > 2  # training keeps the workers its 60 ms batches need
    assert [sorted(ids) for ids in model.val_indices] == [list(range(8))] * 4
