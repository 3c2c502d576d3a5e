"""One validation path: bad arguments fail at construction, naming the argument, what was given and what is allowed."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_dltune import DataLoaderTuner, LoaderConfig, TunableDataModule
from lightning_dltune.control.resources import rank_budget
from lightning_dltune.core import validation
from lightning_dltune.core.records import PolicySettings


class Data(TunableDataModule, pl.LightningDataModule):
    pass


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        (dict(loader_kwargs="timeout=5"), TypeError, r"`loader_kwargs` must be a mapping .*'timeout=5'"),
        (dict(loader_kwargs=5), TypeError, r"`loader_kwargs` must be a mapping .*got 5"),
        (dict(loader_kwargs={"bogus": 1}), ValueError, r"`loader_kwargs` names \['bogus'\].*allowed: .*'timeout'"),
        (
            dict(loader_kwargs={"timeout": -5}),
            ValueError,
            r"`loader_kwargs\['timeout'\]` must be a number in \[0, inf\], got -5",
        ),
        (dict(loader_kwargs={"num_workers": 2}), ValueError, r"`loader_kwargs` must not set \['num_workers'\]"),
        (dict(persistent_workers="no"), TypeError, r"`persistent_workers` must be True or False or None, got 'no'"),
        (dict(pin_memory=1), TypeError, r"`pin_memory` must be True or False or None"),
        (dict(batch_size=2.5), TypeError, r"`batch_size` must be an integer >= 1, got 2.5"),
        (dict(num_workers=-1), ValueError, r"`num_workers` must be an integer >= 0, got -1"),
        (dict(prefetch_factor=0), ValueError, r"`prefetch_factor` must be an integer >= 1, got 0"),
    ],
)
def test_bad_datamodule_arguments_name_the_argument_and_what_is_allowed(kwargs, error, says):
    with pytest.raises(error, match=says):
        Data(**kwargs)


def test_good_datamodule_arguments_are_kept():
    dm = Data(loader_kwargs={"timeout": 5, "collate_fn": None}, persistent_workers=False)
    assert dm.loader_kwargs == {"timeout": 5, "collate_fn": None}
    assert dm.loader_config.persistent_workers is False


def test_set_loader_config_takes_only_a_loader_config():
    dm = Data()
    with pytest.raises(TypeError, match=r"`config` must be a LoaderConfig.*'4 workers'"):
        dm.set_loader_config("4 workers")
    dm.set_loader_config(LoaderConfig(num_workers=2))
    assert dm.loader_config.num_workers == 2


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(band=0.9), r"`band` must be two numbers \(low, high\) with 0 < low < high <= 1, got 0.9"),
        (dict(band=(0.0, 0.9)), r"`band` must be .* 0 < low < high <= 1"),
        (dict(band=(0.9, 0.8)), r"`band` must be"),
        (dict(band="0.8,0.9"), r"`band` must be"),
        (dict(tune="yes"), r"`tune` must be True or False"),
        (dict(util_source="smi"), r"`util_source` must be one of \('auto', 'nvml', 'estimate'\), got 'smi'"),
        (dict(max_workers=2.0), r"`max_workers` must be an integer >= 0 or None, got 2.0"),
        (dict(min_gain=1.0), r"`min_gain` must be a number in \[0, 1\), got 1.0"),
        (dict(max_rebuilds=True), r"`max_rebuilds` must be an integer >= 0"),
        (dict(verbose=3), r"`verbose` must be True, False or an integer in 0..2, got 3"),
        (dict(verbose="loud"), r"`verbose` must be True, False or an integer in 0..2, got 'loud'"),
    ],
)
def test_bad_tuner_arguments_name_the_argument_and_what_is_allowed(kwargs, says):
    with pytest.raises(ValueError, match=says):  # a wrong type is a TypeError that is also a ValueError
        DataLoaderTuner(**kwargs)


def test_the_band_has_one_rule_everywhere():
    for make in (
        lambda b: DataLoaderTuner(band=b),
        lambda b: PolicySettings(band=b),
        lambda b: validation.band("band", b),
    ):
        with pytest.raises(ValueError, match="0 < low < high <= 1"):
            make((0.0, 0.5))
        with pytest.raises(ValueError, match="0 < low < high <= 1"):
            make((0.5, 1.01))
    assert PolicySettings(band=[0.5, 1]).band == (0.5, 1.0)


def test_loader_config_refuses_strings_for_switches():
    with pytest.raises(TypeError, match="`persistent_workers` must be True or False, got 'no'"):
        LoaderConfig(persistent_workers="no")
    with pytest.raises(TypeError, match="`num_workers` must be an integer >= 0, got '4'"):
        LoaderConfig(num_workers="4")


def test_rank_budget_checks_through_the_same_rules():
    with pytest.raises(ValueError, match=r"`memory_fraction` must be a number in \(0, 1\], got 0"):
        rank_budget(memory_fraction=0)
    with pytest.raises(TypeError, match=r"`local_ranks` must be an integer >= 1 or None, got 1.5"):
        rank_budget(local_ranks=1.5)


@pytest.mark.parametrize(("given", "level"), [(False, 0), (True, 1), (0, 0), (1, 1), (2, 2)])
def test_verbose_takes_a_bool_or_a_level(given, level):
    assert DataLoaderTuner(verbose=given).verbose == level
