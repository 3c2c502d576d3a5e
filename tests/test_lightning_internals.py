"""The private Lightning attributes the plain-loader timing uses: present, and a release without them fails loudly."""

import pytest

from lightning_dltune.measure import lightning_internals


def test_this_lightning_has_what_the_tuner_relies_on():
    lightning_internals.check_lightning_internals()


def test_a_lightning_without_the_fit_loops_fetcher_fails_loudly_naming_it(monkeypatch):
    from lightning.pytorch.loops import fit_loop

    class FitLoopWithoutFetcher:
        def __init__(self):
            self.epoch_loop = None

    monkeypatch.setattr(fit_loop, "_FitLoop", FitLoopWithoutFetcher)
    with pytest.raises(RuntimeError, match="_FitLoop._data_fetcher"):
        lightning_internals.check_lightning_internals()


def test_fetches_per_step_is_one_for_a_single_loader_and_for_sequential_combination():
    class Loop:
        def __init__(self, mode):
            self._combined_loader = type("Combined", (), {"_mode": mode})()

    class Trainer:
        def __init__(self, mode):
            self.fit_loop = Loop(mode)

    assert lightning_internals.fetches_per_step(Trainer("max_size_cycle"), 1) == 1
    assert lightning_internals.fetches_per_step(Trainer("max_size_cycle"), 3) == 3
    assert lightning_internals.fetches_per_step(Trainer("sequential"), 3) == 1


def test_validation_fetches_per_step_follow_the_validation_loops_own_combined_loader():
    def trainer(train_mode, val_mode):
        combined = lambda mode: type("Combined", (), {"_mode": mode})()  # noqa: E731
        val_loop = type("Loop", (), {"_combined_loader": None if val_mode is None else combined(val_mode)})()
        epoch_loop = type("EpochLoop", (), {"val_loop": val_loop})()
        fit_loop = type("FitLoop", (), {"_combined_loader": combined(train_mode), "epoch_loop": epoch_loop})()
        return type("Trainer", (), {"fit_loop": fit_loop})()

    # a list of validation loaders runs one after another, whatever the training loaders' mode
    assert lightning_internals.fetches_per_step(trainer("max_size_cycle", "sequential"), 2, validation=True) == 1
    assert lightning_internals.fetches_per_step(trainer("max_size_cycle", None), 2, validation=True) == 1
    # a CombinedLoader from val_dataloader() keeps its mode: a batch of each loader every step
    assert lightning_internals.fetches_per_step(trainer("sequential", "max_size"), 2, validation=True) == 2
    assert lightning_internals.fetches_per_step(trainer("sequential", "max_size"), 2) == 1
