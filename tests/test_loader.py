"""TunedDataLoader in real fits: exact queue depth for streams too, a timeout that follows the workers,
and exact mid-epoch resume whatever the worker count of the resumed fit."""

import warnings

import lightning.pytorch as pl
import pytest
from fit_workloads import SleepStepModule, SleepyDataModule
from lightning.pytorch.callbacks import Callback
from test_datamodule import AlternateConfigs, ShardedIterable, StreamData

from lightning_dltune import DataLoaderTuner, LoaderConfig


@pytest.mark.slow
def test_a_well_fed_iterable_loader_reports_its_queue_depth_and_few_stalls(trainer_kwargs):
    # cheap samples, 2 workers x prefetch 2, a 20 ms step: batches are nearly always ready
    dm = StreamData(
        stream=ShardedIterable,
        train_length=160,
        val_length=8,
        batch_size=4,
        num_workers=2,
        iterable_shards_by_worker=True,
    )
    tuner = DataLoaderTuner(tune=False, verbose=False)
    pl.Trainer(max_epochs=1, callbacks=[tuner], **trainer_kwargs).fit(SleepStepModule(step_s=0.02), datamodule=dm)
    stats = tuner.history[0].stats
    assert stats.queue_depth is not None and stats.queue_depth > 1  # exact, not guessed from wait times
    assert stats.stalls <= stats.fetches // 4, (stats.stalls, stats.fetches)


@pytest.mark.slow
def test_a_loader_timeout_applies_to_workers_and_a_start_without_workers_still_runs(trainer_kwargs):
    class RecordTimeout(AlternateConfigs):
        timeouts = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                self.timeouts.append((trainer.train_dataloader.num_workers, trainer.train_dataloader.timeout))

    forcer = RecordTimeout([LoaderConfig(num_workers=0), LoaderConfig(num_workers=1)])
    model = SleepStepModule(record_indices=True)
    dm = SleepyDataModule(train_length=16, val_length=4, batch_size=4, num_workers=0, loader_kwargs={"timeout": 30})
    pl.Trainer(max_epochs=3, callbacks=[forcer], **trainer_kwargs).fit(model, datamodule=dm)
    assert RecordTimeout.timeouts == [(0, 0), (1, 30), (0, 0)]  # torch refuses a timeout without workers
    assert [sorted(s) for s in model.train_indices] == [list(range(16))] * 3


# -- exact mid-epoch resume, with any worker count ------------------------------------------------
class CheckpointAndStop(Callback):
    """Saves a checkpoint after batch ``batch_idx`` of epoch ``epoch`` (as ModelCheckpoint would) and stops."""

    def __init__(self, path, epoch, batch_idx):
        self.path, self.epoch, self.batch_idx = path, epoch, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


@pytest.mark.parametrize("resume_workers", [0, 2])
@pytest.mark.slow
def test_a_fit_resumed_mid_epoch_with_another_worker_count_sees_every_remaining_sample_once(
    trainer_kwargs, tmp_path, resume_workers
):
    ckpt = str(tmp_path / "mid.ckpt")
    first = SleepStepModule(record_indices=True)
    dm = SleepyDataModule(train_length=80, val_length=8, batch_size=4, num_workers=4)
    stop = CheckpointAndStop(ckpt, epoch=1, batch_idx=6)
    pl.Trainer(max_epochs=3, callbacks=[stop], **trainer_kwargs).fit(first, datamodule=dm)
    assert len(first.train_indices[1]) == 7 * 4

    resumed = SleepStepModule(record_indices=True)
    resumed.train_indices.append([])  # Lightning skips on_train_epoch_start when it resumes mid-epoch
    dm = SleepyDataModule(train_length=80, val_length=8, batch_size=4, num_workers=resume_workers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(max_epochs=3, **trainer_kwargs).fit(resumed, datamodule=dm, ckpt_path=ckpt)
    assert not [w for w in caught if "not resumable" in str(w.message)]
    epoch_1 = first.train_indices[1] + resumed.train_indices[0]
    assert sorted(epoch_1) == list(range(80))  # the rest of the epoch, no sample twice, none missed
    assert first.train_indices[1] == first.train_indices[1][:28] and len(resumed.train_indices[0]) == 52
    assert sorted(resumed.train_indices[1]) == list(range(80))  # the next epoch is a whole one


def test_a_workers_fd_server_reset_at_shutdown_prints_no_traceback(monkeypatch):
    import sys
    import threading
    from multiprocessing import resource_sharer

    from lightning_dltune.loaders import loader as loader_module

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda exc_type, exc, tb: seen.append(exc_type))
    loader_module.quiet_fd_server_resets()

    class ResetThenClosed:  # the training process went away mid-transfer, then the server is told to stop
        calls = 0

        def accept(self):
            self.calls += 1
            if self.calls == 1:
                raise ConnectionResetError(104, "Connection reset by peer")
            return self

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def recv(self):
            return None

    # the standard library's own server loop (torch's file_descriptor sharing): it reports through sys.excepthook
    sharer = resource_sharer._ResourceSharer.__new__(resource_sharer._ResourceSharer)
    sharer._listener = ResetThenClosed()
    server = threading.Thread(target=sharer._serve)
    server.start()
    server.join(timeout=10)
    assert not server.is_alive() and sharer._listener.calls == 2 and seen == []

    try:  # any other error still reaches the hook
        raise ConnectionResetError(104, "reset elsewhere")
    except ConnectionResetError:
        sys.excepthook(*sys.exc_info())
    assert seen == [ConnectionResetError]


def test_the_production_histogram_gives_the_p95_and_the_slowest_batch():
    from lightning_dltune.loaders.loader import ProductionCounters, histogram_quantile, histogram_top

    counters = ProductionCounters()
    assert histogram_top(counters.histogram()) is None
    for _ in range(98):
        counters.add(0.010, 0.001)
    counters.add(0.200, 0.001)  # a heavy tail: two batches in a hundred, 20x slower
    counters.add(0.200, 0.001)
    counts = counters.histogram()
    mean = counters.totals()[1] / counters.totals()[0]
    assert histogram_quantile(counts, 0.95, mean) == pytest.approx(mean)  # the tail leaves the p95 alone
    assert 0.200 <= histogram_top(counts) <= 0.200 * 2**0.25  # the top of its bin: at most 19 % over
