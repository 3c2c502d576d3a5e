"""recommendation: where the recommended config goes, in the words and the file a user can apply."""

from types import SimpleNamespace

import lightning.pytorch as pl
import yaml

from lightning_dltune import LoaderConfig, TunableDataModule
from lightning_dltune.report.recommendation import recommendation_yaml, target_of


class PlainData(pl.LightningDataModule):
    def __init__(self, root: str = ".", num_workers: int = 0, pin_memory: bool = False) -> None:
        super().__init__()


class MyTunable(TunableDataModule, pl.LightningDataModule):
    def __init__(self, root: str = ".", **kwargs) -> None:
        super().__init__(**kwargs)


class ModelWithWorkers(pl.LightningModule):
    def __init__(self, workers: int = 0) -> None:
        super().__init__()


def test_a_plain_datamodule_gets_the_settings_its_constructor_names_and_nothing_else():
    target = target_of(SimpleNamespace(datamodule=PlainData()))
    assert target[:3] == ("data", ("num_workers", "pin_memory"), "the datamodule (PlainData)")
    assert target.val_keys == ()  # it takes no validation loader settings of its own
    text = recommendation_yaml(LoaderConfig(num_workers=3), section=target.section, keys=target.keys)
    assert yaml.safe_load(text) == {"data": {"num_workers": 3, "pin_memory": False}}


def test_a_tunable_datamodule_takes_every_setting_through_its_kwargs():
    assert target_of(SimpleNamespace(datamodule=MyTunable())).keys == (
        "num_workers",
        "prefetch_factor",
        "pin_memory",
        "persistent_workers",
    )


def test_loaders_of_a_model_without_a_num_workers_argument_get_no_fragment():
    target = target_of(SimpleNamespace(datamodule=None, lightning_module=ModelWithWorkers()))
    assert target.section == "model" and target.keys == () and "ModelWithWorkers" in target.owner
