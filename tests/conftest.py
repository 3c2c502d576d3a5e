import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)


def pytest_collection_modifyitems(config, items):
    """A test that builds a Trainer (it asks for ``trainer_kwargs``) runs a real fit: the slow tier."""
    for item in items:
        if "trainer_kwargs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def trainer_kwargs(tmp_path):
    """Quiet, CPU-only Trainer arguments in ``tmp_path``."""
    return dict(
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
    )
