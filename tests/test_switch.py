"""The loader switch: what torch must offer it, how it tells machinery failures from the user's, and
rollbacks in real fits (a worker killed, /dev/shm full) that keep every sample exactly once."""

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
import weakref

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data import dataloader as torch_dataloader

from lightning_dltune import DataLoaderTuner, LoaderConfig
from lightning_dltune.loaders.loader import build_loader
from lightning_dltune.loaders.switch import CONFIRM_AFTER_BATCHES, LoaderSwitch, SwitchState, loader_config_of
from lightning_dltune.loaders.torch_internals import (
    check_torch_internals,
    is_machinery_failure,
    outstanding_tasks,
    shutdown_iterator,
    take_sampler_rest,
)

HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")


class Indices(Dataset):
    def __init__(self, length=40, kill_in_worker_at=None, raise_at=None):
        self.length = length
        self.kill_in_worker_at = kill_in_worker_at
        self.raise_at = raise_at

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if self.raise_at is not None and i == self.raise_at[0]:
            raise self.raise_at[1]
        if i == self.kill_in_worker_at and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), 9)
        return i


def _caught(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return exc
    raise AssertionError("nothing was raised")


# -- the torch internals ------------------------------------------------------------------------
@pytest.mark.torch_only
def test_the_installed_torch_has_every_internal_the_switch_uses():
    check_torch_internals()


@pytest.mark.torch_only
def test_a_torch_without_an_internal_the_switch_uses_fails_loudly(monkeypatch):
    monkeypatch.delattr(torch_dataloader._MultiProcessingDataLoaderIter, "_shutdown_workers")
    with pytest.raises(RuntimeError, match="_MultiProcessingDataLoaderIter._shutdown_workers"):
        check_torch_internals()


@pytest.mark.torch_only
@pytest.mark.slow  # real worker processes
def test_a_split_iterator_hands_back_exactly_what_its_workers_had_not_delivered():
    # what the switch relies on: the rest of the sampler iteration plus the tasks not yet yielded
    # are the epoch's remaining batches, in order
    loader = DataLoader(Indices(40), batch_size=4, num_workers=2, prefetch_factor=2)
    iterator = iter(loader)
    seen = [next(iterator).tolist() for _ in range(3)]
    tasks = outstanding_tasks(iterator)
    assert tasks == list(range(3, 3 + len(tasks))) and len(tasks) == 4  # 2 workers x prefetch 2 in flight
    rest = take_sampler_rest(iterator)
    drained = [b.tolist() for b in iterator]  # the workers deliver what they hold, then stop
    shutdown_iterator(iterator)
    assert len(drained) == len(tasks)
    flat = [i for b in seen + drained for i in b] + [i for b in rest for i in b]
    assert flat == list(range(40))


# -- what raised it -------------------------------------------------------------------------------
@pytest.mark.torch_only
@pytest.mark.slow  # real worker processes
def test_a_killed_worker_is_a_machinery_failure():
    loader = DataLoader(Indices(40, kill_in_worker_at=9), batch_size=4, num_workers=2)
    exc = _caught(lambda: list(loader))
    assert is_machinery_failure(exc), exc


@pytest.mark.slow  # real worker processes
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "error",
    [
        FileNotFoundError("/data/x.jpg"),
        MemoryError("decoder"),
        RuntimeError("no shm left for my cache"),
        OSError(28, "No space left on device"),
    ],
)
@pytest.mark.torch_only
def test_the_users_own_errors_are_never_machinery_failures(workers, error):
    loader = DataLoader(Indices(40, raise_at=(5, error)), batch_size=4, num_workers=workers)
    exc = _caught(lambda: list(loader))
    assert not is_machinery_failure(exc), exc


@pytest.mark.torch_only
@pytest.mark.slow
def test_a_users_collate_or_worker_init_error_is_not_a_machinery_failure():
    def bad_init(worker_id):
        raise OSError("cannot open the shard index")

    def bad_collate(samples):
        raise RuntimeError("unable to allocate shared memory(shm): my own message")

    for kwargs in ({"worker_init_fn": bad_init}, {"collate_fn": bad_collate}):
        exc = _caught(lambda kwargs=kwargs: list(DataLoader(Indices(8), batch_size=4, num_workers=1, **kwargs)))
        assert not is_machinery_failure(exc), exc


# -- the switch's life ----------------------------------------------------------------------------
@pytest.mark.torch_only
@pytest.mark.slow  # real worker processes
def test_a_switch_is_confirmed_after_its_batches_and_then_detaches():
    loader = build_loader(Indices(40), LoaderConfig(num_workers=0), batch_size=4)
    switch = LoaderSwitch(loader, LoaderConfig(num_workers=1), LoaderConfig(num_workers=0), confirm_after=3)
    assert switch.state is SwitchState.STARTED and loader.switch is switch and loader.num_workers == 1
    it = iter(loader)
    next(it), next(it)
    assert switch.state is SwitchState.STARTED
    next(it)
    assert switch.state is SwitchState.CONFIRMED and loader.switch is None
    assert [i for b in it for i in b.tolist()] == list(range(12, 40))


@pytest.mark.torch_only
@pytest.mark.slow
def test_a_worker_killed_after_the_first_batches_rolls_back_with_every_sample_once():
    rolled = []
    loader = build_loader(Indices(40, kill_in_worker_at=21), LoaderConfig(num_workers=0), batch_size=4)
    LoaderSwitch(
        loader,
        LoaderConfig(num_workers=2),
        LoaderConfig(num_workers=0),
        on_rollback=lambda s, e: rolled.append(s.target.num_workers),
    )
    seen = [i for b in loader for i in b.tolist()]
    assert seen == list(range(40))  # the batches the dead worker held came again, in order
    # torch reports the death as it finds it (a RuntimeError, or a reset connection mid-transfer)
    assert rolled == [2] and loader.num_workers == 0


@pytest.mark.torch_only
@pytest.mark.slow  # real worker processes
def test_a_pending_switch_drains_the_old_workers_then_runs_the_rest_with_the_new_ones():
    loader = build_loader(Indices(40), LoaderConfig(num_workers=1), batch_size=4)
    it = iter(loader)
    seen = [i for _ in range(2) for i in next(it).tolist()]
    switch = LoaderSwitch(loader, LoaderConfig(num_workers=2), LoaderConfig(num_workers=1), pending=True)
    seen += [i for b in it for i in b.tolist()]
    assert seen == list(range(40)) and loader.num_workers == 2 and switch.state is SwitchState.STARTED


@pytest.mark.torch_only
@pytest.mark.slow  # real worker processes
def test_a_dropped_loader_stops_its_persistent_workers_at_once_without_the_garbage_collector():
    # a loader in a reference cycle with its persistent iterator (its switch, its sampler's wrapper) is freed
    # by the cyclic garbage collector, which closes the worker queues before torch's iterator can tell its
    # workers to stop: the training process then waits torch's 5 s timeout a worker, whenever it collects
    def switched_epoch():
        loader = build_loader(Indices(40), LoaderConfig(num_workers=1), batch_size=4)
        it = iter(loader)
        next(it)
        LoaderSwitch(loader, LoaderConfig(num_workers=2), LoaderConfig(num_workers=1), pending=True)
        assert len(list(it)) == 9
        workers = [w.pid for w in loader._iterator._workers]
        return weakref.ref(loader), workers

    enabled = gc.isenabled()
    gc.disable()
    try:
        started = time.monotonic()
        dropped, pids = switched_epoch()
        assert dropped() is None and len(pids) == 2  # freed as the last reference went, not by a collection
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # the worker is gone (reaped by torch's join)
        assert time.monotonic() - started < 5
    finally:
        if enabled:
            gc.enable()


class Stamped(Dataset):
    """Each sample says which process made it and when it started (the host clock is shared)."""

    def __init__(self, length, seconds, kill_in_new_worker_at=None):
        self.length, self.seconds, self.kill_at = length, seconds, kill_in_new_worker_at

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        if i == self.kill_at and info is not None and info.num_workers > 1:
            os.kill(os.getpid(), 9)
        started = time.monotonic()
        time.sleep(self.seconds)
        return torch.tensor([i, os.getpid(), started], dtype=torch.float64)


def _switched_after_two(loader, target, wait_s=0.0, **switch_kwargs):
    """Two batches, then a pending switch to ``target`` (after ``wait_s``); every row, and the old worker's pid."""
    it = iter(loader)
    rows = [next(it)[0] for _ in range(2)]
    time.sleep(wait_s)
    switch = LoaderSwitch(loader, target, loader_config_of(loader), pending=True, **switch_kwargs)
    rows += [batch[0] for batch in it]
    return rows, int(rows[0][1]), switch


@pytest.mark.torch_only
@pytest.mark.slow  # real worker processes
@pytest.mark.parametrize("persistent", [True, False])
def test_a_switch_to_more_workers_takes_over_what_the_old_ones_held(persistent):
    # one worker x prefetch 8 of 40 ms samples: it holds 8 index batches when the switch comes
    loader = build_loader(Stamped(38, 0.04), LoaderConfig(1, 8, persistent_workers=persistent), batch_size=1)
    new = LoaderConfig(num_workers=4, prefetch_factor=2, persistent_workers=persistent)
    rows, old_pid, switch = _switched_after_two(loader, new, take_over=True)
    assert [int(row[0]) for row in rows] == list(range(38))  # every sample once, in order
    by_old = [int(row[0]) for row in rows if int(row[1]) == old_pid]
    # the old worker stopped at the switch: the new workers made what it held (samples 2-9)
    assert by_old == [0, 1]
    assert len({int(row[1]) for row in rows if int(row[1]) != old_pid}) == 4 and loader.num_workers == 4
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)
    assert switch.state is SwitchState.CONFIRMED  # the new workers delivered the 30 batches that confirm them
    assert [int(b[0][0]) for b in loader] == list(range(38))  # the next epoch, whole, with the new workers


@pytest.mark.torch_only
@pytest.mark.slow  # real worker processes
def test_a_new_worker_killed_while_making_what_the_old_ones_held_rolls_back_with_every_sample_once():
    rolled = []
    loader = build_loader(Stamped(30, 0.04, kill_in_new_worker_at=5), LoaderConfig(1, 8), batch_size=1)
    rows, _, switch = _switched_after_two(
        loader, LoaderConfig(4), take_over=True, on_rollback=lambda s, e: rolled.append(s.target.num_workers)
    )
    assert [int(row[0]) for row in rows] == list(range(30))  # what the dead worker held came again, in order
    assert rolled == [4] and switch.state is SwitchState.ROLLED_BACK and loader.num_workers == 1


@pytest.mark.torch_only
@pytest.mark.slow  # real worker processes
def test_a_take_over_waits_for_the_old_workers_where_they_made_what_they_hold():
    loader = build_loader(Stamped(24, 0.01), LoaderConfig(num_workers=1, prefetch_factor=8), batch_size=1)
    rows, old_pid, _ = _switched_after_two(loader, LoaderConfig(num_workers=4), wait_s=1.0, take_over=True)
    assert [int(row[0]) for row in rows] == list(range(24))
    assert [int(row[0]) for row in rows if int(row[1]) == old_pid] == list(range(10))  # it delivered all 8


@pytest.mark.torch_only
@pytest.mark.slow  # real worker processes
def test_without_take_over_the_new_workers_start_once_the_old_ones_delivered_everything():
    loader = build_loader(Stamped(24, 0.04), LoaderConfig(num_workers=1, prefetch_factor=8), batch_size=1)
    rows, old_pid, _ = _switched_after_two(loader, LoaderConfig(num_workers=4))
    assert [int(row[0]) for row in rows] == list(range(24))
    assert [int(row[0]) for row in rows if int(row[1]) == old_pid] == list(range(10))


@pytest.mark.slow
def test_a_worker_killed_after_its_config_was_confirmed_is_torchs_own_error(trainer_kwargs):
    from fit_workloads import SleepStepModule
    from test_datamodule import KilledData

    # the start config (1 worker) delivers its confirming batches; a few batches later its worker is killed
    kill_batch = CONFIRM_AFTER_BATCHES + 6  # past the batches a worker prefetches
    dm = KilledData(
        kill_from=kill_batch * 4,
        above=0,
        train_length=(kill_batch + 10) * 4,
        val_length=8,
        batch_size=4,
        shuffle=False,
        num_workers=1,
    )
    model = SleepStepModule(record_indices=True)
    # tuning, with rollback armed, but no change of config: the start config is confirmed, then its worker dies
    tuner = DataLoaderTuner(max_rebuilds=0, verbose=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[tuner], **trainer_kwargs)
    # torch reports the death as it finds it: a dead worker, or the connection that hands over a batch's storage
    # closed under it, reset mid-transfer or closed before its handshake (EOFError: met beside a CPU hog)
    handover = (ConnectionResetError, EOFError)
    with warnings.catch_warnings(record=True) as caught, pytest.raises((RuntimeError, *handover)) as raised:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    assert isinstance(raised.value, handover) or "DataLoader worker (pid" in str(raised.value)
    assert not [w for w in caught if "went back" in str(w.message)]  # the config had worked: no rollback
    assert len(model.train_indices[0]) >= CONFIRM_AFTER_BATCHES * 4


# -- /dev/shm full, for real ---------------------------------------------------------------------
def _small_shm_available() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True
    )
    return probe.returncode == 0


needs_small_shm = pytest.mark.skipif(
    not _small_shm_available(), reason="needs `unshare -m` and tmpfs mounts (root in a mount namespace)"
)


def run_with_small_shm(script: str, shm: str = "8m", timeout: float = 300) -> dict:
    """Runs ``script`` in a private mount namespace whose /dev/shm is a ``shm`` tmpfs; returns its JSON."""
    command = f'mount -t tmpfs -o size={shm} tmpfs /dev/shm && exec {sys.executable} -c "$SCRIPT"'
    env = {**os.environ, "SCRIPT": textwrap.dedent(script), "PYTHONPATH": HELPERS}
    with tempfile.TemporaryDirectory() as cwd:  # whatever the fit writes stays out of the checkout
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", command], capture_output=True, text=True, env=env, timeout=timeout, cwd=cwd
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_small_shm
def test_shm_exhaustion_in_a_worker_is_a_machinery_failure():
    result = run_with_small_shm("""
        import json, torch
        from torch.utils.data import DataLoader, Dataset
        from lightning_dltune.loaders.torch_internals import is_machinery_failure
        class Big(Dataset):
            def __len__(self): return 16
            def __getitem__(self, i): return torch.zeros(2**20)  # 4 MB a sample, 8 MB a batch
        try:
            list(DataLoader(Big(), batch_size=2, num_workers=2))
            print(json.dumps({"raised": None}))
        except Exception as exc:
            print(json.dumps({"raised": str(exc)[-300:], "machinery": is_machinery_failure(exc)}))
    """)
    assert "No space left on device" in result["raised"] and result["machinery"] is True


@pytest.mark.slow
@needs_small_shm
def test_a_batch_that_cannot_reach_the_training_process_is_raised_there_not_waited_for():
    # a collate_fn that builds plain tensors: each moves to /dev/shm in the worker queue's thread, where
    # torch alone prints the error, drops the batch and leaves the training process waiting forever
    result = run_with_small_shm(
        """
        import json, torch
        from torch.utils.data import DataLoader, Dataset
        from lightning_dltune.loaders.adopt import TimedWorkerInit
        from lightning_dltune.loaders.loader import ProductionCounters
        from lightning_dltune.loaders.torch_internals import is_machinery_failure
        class Big(Dataset):
            def __len__(self): return 16
            def __getitem__(self, i): return torch.zeros(3 * 2**18)  # 3 MB a sample
        def stack(samples): return torch.stack(samples) + 0  # 6 MB a batch, outside shared memory
        loader = DataLoader(Big(), batch_size=2, num_workers=2, collate_fn=stack,
                            worker_init_fn=TimedWorkerInit(None, ProductionCounters()))  # an adopted loader's
        try:
            print(json.dumps({"raised": None, "batches": len(list(loader))}))
        except Exception as exc:
            print(json.dumps({"raised": str(exc)[-300:], "machinery": is_machinery_failure(exc)}))
    """,
        timeout=120,
    )
    assert "No space left on device" in result["raised"] and result["machinery"] is True


_SHM_FIT = """
    import json, warnings
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning_dltune import DataLoaderTuner, LoaderConfig
    from fit_workloads import SleepStepModule, SleepyDataModule, SleepyDataset

    def stack(samples):  # plain tensors: they move to /dev/shm in the worker queue's thread, not in collate
        return {{"x": torch.stack([s["x"] for s in samples]), "index": torch.tensor([s["index"] for s in samples])}}

    class Big(SleepyDataset):  # {mb} MB a sample
        def __getitem__(self, i):
            return {{"x": torch.zeros(int({mb} * 2**18)), "index": i}}

    class BigData(SleepyDataModule):
        def setup(self, stage):
            self.train_dataset, self.val_dataset = Big(24), Big(6)

    class Model(SleepStepModule):
        def __init__(self):
            super().__init__(record_indices=True)
            self.layer = torch.nn.Linear(int({mb} * 2**18), 1)

    class Force(Callback):  # the mixin's own rebuild path, forced to {force} from epoch 1
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1 and {force!r}:
                trainer.datamodule.set_loader_config(LoaderConfig(**{force!r}))
                trainer.datamodule.rebuild_loaders()

    dm = BigData(batch_size=2, shuffle=False, {start})
    model = Model()
    callbacks = [Force()] + ([DataLoaderTuner(first_decision_after=0, max_rebuilds=0)] if {tuner} else [])
    trainer = pl.Trainer(max_epochs=2, callbacks=callbacks, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    print(json.dumps({{
        "train": [sorted(s) for s in model.train_indices], "val": [sorted(s) for s in model.val_indices],
        "went_back": [str(w.message) for w in caught if "went back" in str(w.message)],
        "workers": [dl.num_workers for dl in dm.live_loaders()],
        "configs": [(r.config.num_workers, r.config.prefetch_factor) for r in callbacks[-1].history] if {tuner} else [],
    }}))
"""


@pytest.mark.slow
@needs_small_shm
@pytest.mark.parametrize("collate", ["default_collate", "stack"])
def test_a_rebuild_that_fills_dev_shm_goes_back_with_every_sample_once(collate):
    # 3 MB samples, 6 MB batches: 2 workers x prefetch 2 need 24 MB of an 8 MB /dev/shm. default_collate fails
    # making a batch in shared memory; "stack" makes it outside, and the worker's queue fails to send it
    start = "num_workers=0" + (", loader_kwargs={'collate_fn': stack}" if collate == "stack" else "")
    script = _SHM_FIT.format(mb=3, force={"num_workers": 2, "prefetch_factor": 2}, start=start, tuner=False)
    result = run_with_small_shm(script, shm="8m", timeout=150)
    assert len(result["went_back"]) == 1 and "No space left on device" in result["went_back"][0]
    assert result["train"] == [list(range(24))] * 2 and result["val"] == [list(range(6))] * 2
    assert result["workers"] == [0, 0]


@pytest.mark.slow
@needs_small_shm
def test_a_start_config_over_the_dev_shm_budget_is_clamped_before_any_worker_starts():
    # 0.5 MB samples, 1 MB batches: a 4 x 4 start would put 2 x 17 MB through an 8 MB /dev/shm
    script = _SHM_FIT.format(mb=0.5, force={}, start="num_workers=4, prefetch_factor=4", tuner=True)
    result = run_with_small_shm(script, shm="8m")
    assert result["went_back"] == []  # clamped up front: nothing had to fail first
    workers, prefetch = result["configs"][0]
    # train and val workers' batches, plus the one each loop holds, within half the free /dev/shm
    assert workers >= 1 and 2 * (workers * prefetch + 1) * 1 <= 4
    assert result["train"] == [list(range(24))] * 2 and result["val"] == [list(range(6))] * 2


class HangsInWorkers(Indices):
    def __getitem__(self, i):
        if i == 13 and torch.utils.data.get_worker_info() is not None:
            import time

            time.sleep(60)  # a worker stuck on a dead mount
        return i


@pytest.mark.torch_only
@pytest.mark.slow
def test_a_worker_that_hangs_during_a_switch_times_out_and_rolls_back_when_the_loader_has_a_timeout():
    rolled = []
    loader = build_loader(HangsInWorkers(40), LoaderConfig(num_workers=0), batch_size=4, timeout=2)
    LoaderSwitch(
        loader, LoaderConfig(num_workers=2), LoaderConfig(num_workers=0), on_rollback=lambda s, e: rolled.append(str(e))
    )
    assert [i for b in loader for i in b.tolist()] == list(range(40))
    assert len(rolled) == 1 and "timed out" in rolled[0]
