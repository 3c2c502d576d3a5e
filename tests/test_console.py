"""console: lines go through an enabled progress bar and reach the terminal under TQDM; notices are said once."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from lightning_dltune.report.console import Notices, say

HELPERS = Path(__file__).parent / "helpers"
REPO = Path(__file__).parents[1]


class Bar:
    def __init__(self, enabled):
        self.is_enabled = enabled
        self.printed = []

    def print(self, text):
        self.printed.append(text)


class Trainer:
    def __init__(self, bar, zero=True):
        self.progress_bar_callback = bar
        self.is_global_zero = zero


def test_a_line_goes_through_an_enabled_bar_on_rank_zero_only():
    bar = Bar(True)
    say(Trainer(bar), "[dltune] hello")
    say(Trainer(bar, zero=False), "[dltune] not from rank 1")
    assert bar.printed == ["[dltune] hello"]


def test_without_an_enabled_bar_the_line_goes_to_lightnings_logger(caplog):
    bar = Bar(False)
    with caplog.at_level("INFO"):
        say(Trainer(bar), "[dltune] logged")
    assert bar.printed == [] and "[dltune] logged" in caplog.text


def test_a_notice_is_said_once_per_fit_and_again_after_a_reset():
    bar = Bar(True)
    notices = Notices()
    for _ in range(3):
        notices.once(Trainer(bar), "key", "said once")
    notices.reset()
    notices.once(Trainer(bar), "key", "said once")
    assert bar.printed == ["said once", "said once"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notices.once(None, "warn", "a warning on every rank", warn=True, all_ranks=True)
        notices.once(None, "warn", "a warning on every rank", warn=True, all_ranks=True)
    assert [str(w.message) for w in caught] == ["a warning on every rank"]


def _run_project(tmp_path, *args, model="plain", seen=None):
    """The user's own project (loaders in its LightningModule, TQDM bar) with the tuner added from the command line."""
    env = dict(os.environ, PYTHONPATH=str(REPO), DLTUNE_TEST_MODEL=model, DLTUNE_TEST_SEEN=str(seen or ""))
    return subprocess.run(
        [sys.executable, str(HELPERS / "module_loaders_project.py"), "fit", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


FIT = [
    "--trainer.max_epochs=2",
    "--trainer.callbacks+=lightning_dltune.DataLoaderTuner",
    "--trainer.callbacks.window_batches=4",
]


@pytest.mark.slow
def test_a_project_tuned_from_the_command_line_under_a_tqdm_bar_says_it_all_in_the_terminal(tmp_path):
    # TQDMProgressBar.print drops text before its first bar (setup) and after its last one closed (on_fit_end)
    seen = tmp_path / "seen.json"
    proc = _run_project(tmp_path, f"--trainer.default_root_dir={tmp_path}", *FIT, seen=seen)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Epoch 1: 100%" in proc.stdout  # the TQDM bar ran
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[dltune] epoch ")]
    assert lines and "workers 0 -> " in lines[0], lines  # the model's own loader, tuned in place
    assert not [line for line in proc.stdout.splitlines() if line.startswith("DataLoaderTuner: ")]
    assert [sorted(ids) for ids in json.loads(seen.read_text())] == [list(range(64))] * 2  # every sample once
    assert "lightning-dltune: loader tuning" in proc.stdout
    assert "recommended: workers=" in proc.stdout
    # the model's knob is `workers`: no fragment `--config` would refuse, the DataLoader arguments in words
    assert not list(tmp_path.rglob("dltune_recommendation.yaml"))
    words = [line for line in proc.stdout.splitlines() if line.startswith("[dltune] to use the recommendation")]
    assert len(words) == 1 and "set num_workers=" in words[0] and "prefetch_factor=" in words[0], words
    assert "LightningModule (Model) takes no num_workers argument" in words[0]


@pytest.mark.slow
def test_a_recommendation_for_a_models_own_loader_arguments_is_accepted_back_by_its_cli(tmp_path):
    proc = _run_project(tmp_path, f"--trainer.default_root_dir={tmp_path}", *FIT, model="named")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = next(tmp_path.rglob("dltune_recommendation.yaml"))
    fragment = yaml.safe_load(rec.read_text())
    assert set(fragment) == {"model"} and set(fragment["model"]) == {"num_workers", "prefetch_factor"}
    assert f"--config {rec}" in rec.read_text()  # its own comment names where it is
    said = [line for line in proc.stdout.splitlines() if line.startswith("[dltune] recommendation written to")]
    assert len(said) == 1 and "pin_memory=" in said[0] and "persistent_workers=" in said[0], said
    again = _run_project(tmp_path, "--config", str(rec), "--print_config", model="named")
    assert again.returncode == 0, again.stderr[-3000:]
    assert yaml.safe_load(again.stdout)["model"]["num_workers"] == fragment["model"]["num_workers"]
