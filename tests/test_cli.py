"""The dltune CLI, the shipped configs, the recommendation round trip and the TensorBoard panels, for real.

Each test runs the real command in a subprocess with tiny limits (the accelerator step is emulated
with a sleep, as in the demo on a CPU-only machine); the commands refused before anything starts share one
(``run_many``: the script's own entry point, output caught at the file descriptors).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from dltune_command import REPO, run_many, run_module, run_script

pytestmark = pytest.mark.slow  # subprocesses, DDP or real fits

TINY = [
    "--trainer.max_epochs",
    "2",
    "--trainer.limit_train_batches",
    "6",
    "--trainer.limit_val_batches",
    "2",
    "--data.init_args.num_images",
    "160",
    "--data.init_args.batch_size",
    "8",
    "--model.init_args.emulate_step_ms",
    "5",
]


def logs_args(tmp: Path) -> list[str]:
    return ["--trainer.logger.init_args.save_dir", str(tmp / "logs")]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    proc = run_module("fit", "--config", "configs/demo.yaml", *TINY, *logs_args(tmp), tmp=tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    version = tmp / "logs" / "demo" / "version_0"
    return tmp, version, proc.stdout + proc.stderr


def test_demo_prints_a_line_per_epoch_a_table_and_the_recommendation(demo):
    _, version, output = demo
    lines = [line for line in output.splitlines() if line.startswith("[dltune] epoch")]
    assert len(lines) == 2
    assert all("workers" in line and "GPU busy" in line and "(estimate)" in line and len(line) <= 120 for line in lines)
    assert "lightning-dltune: loader tuning" in output and "recommended: workers=" in output
    assert "emulated" in output  # the accelerator step is emulated on CPU and says so
    assert (version / "dltune_recommendation.yaml").is_file()


def test_recommendation_round_trips_through_the_cli(demo):
    tmp, version, _ = demo
    rec = version / "dltune_recommendation.yaml"
    recommended = yaml.safe_load(rec.read_text())["data"]
    proc = run_module("fit", "--config", "configs/demo.yaml", "--config", str(rec), "--print_config", tmp=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = yaml.safe_load(proc.stdout)
    for key, value in recommended.items():
        assert merged["data"]["init_args"][key] == value, key
    assert merged["data"]["class_path"] == "examples.image_pipeline.JpegDataModule"
    # and it trains with it
    proc = run_module(
        "fit",
        "--config",
        "configs/demo.yaml",
        "--config",
        str(rec),
        *TINY,
        "--trainer.max_epochs",
        "1",
        *logs_args(tmp),
        tmp=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"workers={recommended['num_workers']} prefetch={recommended['prefetch_factor']}" in proc.stderr + proc.stdout
    )


def test_monitor_only_config_never_rebuilds(tmp_path):
    proc = run_module(
        "fit",
        "--config",
        "configs/monitor_only.yaml",
        *TINY,
        "--trainer.max_epochs",
        "2",
        *logs_args(tmp_path),
        tmp=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if line.startswith("[dltune] epoch")]
    configs = [line.split("|")[1].strip() for line in lines]
    assert len(lines) == 2 and all(c.startswith("workers 0") and c.count(", prefetch 2") == 1 for c in configs)
    assert all("->" not in c or c.endswith("(would try)") for c in configs)  # a change is only what it would try


def test_ddp_cpu_config_runs_two_processes(tmp_path):
    proc = run_module("fit", "--config", "configs/ddp_cpu.yaml", *TINY, *logs_args(tmp_path), tmp=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "MEMBER: 2/2" in output
    assert len([line for line in output.splitlines() if line.startswith("[dltune] epoch")]) == 2  # rank zero only


# Commands refused before anything starts, in one Python process (run_many: each is the script's `main()`
# with its own argv, stdout and stderr; starting Lightning once instead of per command saves ~7 s each
# here). "{case}" is each command's own folder; FILES are written there first.
LOGS = ["--trainer.logger.init_args.save_dir", "{case}/logs"]
DEMO = ["fit", "--config", "configs/demo.yaml"]
REFUSED = {
    "num_worker": [*DEMO, "--data.init_args.num_worker", "2", *LOGS],
    "band-range": [*DEMO, "--trainer.callbacks.init_args.band", "[0.9, 1.5]", *LOGS],
    "band-length": [*DEMO, "--trainer.callbacks.init_args.band", "[0.9]", *LOGS],
    "util_source": [*DEMO, "--trainer.callbacks.init_args.util_source", "smi", *LOGS],
    "num_workers": [*DEMO, "--data.init_args.num_workers", "-2", *LOGS],
    "yaml-key": [*DEMO, "--config", "{case}/bad.yaml", *LOGS],
    "yaml-value": [*DEMO, "--config", "{case}/bad.yaml", *LOGS],
    "help": ["--help"],
    "sweep-help": ["sweep", "--help"],
    "sweep-aliases": [
        "sweep",
        "--config",
        "configs/demo.yaml",
        "--step-ms",
        "5",
        "--seconds-per-point",
        "0.5",
        "--min-gain",
        "1.5",
        "--out",
        "{case}/out",
    ],
    "abbreviated-fit": [*DEMO, "--trainer.max_epoch", "1", *LOGS],
    "abbreviated-sweep": ["sweep", "--config", "configs/demo.yaml", "--seconds_per", "1", *LOGS],
    "short-int": [*DEMO, "--trainer.max_epochs", "x", *LOGS],
}
FILES = {
    "yaml-key": "data:\n  init_args:\n    prefetch_factr: 4\n",
    "yaml-value": "data:\n  init_args:\n    num_workers: -2\n",
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Each REFUSED command's result and its folder, by name."""
    tmp = tmp_path_factory.mktemp("refused")
    cases = {name: tmp / name for name in REFUSED}
    for name, case in cases.items():
        case.mkdir()
        if name in FILES:
            (case / "bad.yaml").write_text(FILES[name])
    runs = [[word.replace("{case}", str(cases[name])) for word in words] for name, words in REFUSED.items()]
    return {name: (proc, cases[name]) for name, proc in zip(REFUSED, run_many(runs, tmp=tmp))}


@pytest.mark.parametrize(
    ("name", "named"),
    [
        ("num_worker", "num_worker"),
        ("band-range", "band"),
        ("band-length", "band"),
        ("util_source", "util_source"),
        ("num_workers", "num_workers"),
    ],
)
def test_bad_configuration_exits_non_zero_naming_the_key(refused, name, named):
    proc, case = refused[name]
    assert proc.returncode != 0
    assert named in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (case / "logs").exists()  # nothing started


def test_bad_yaml_file_names_the_key(refused):
    proc, _ = refused["yaml-key"]
    assert proc.returncode != 0 and "prefetch_factr" in proc.stderr


USER_SCRIPT = """
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
from lightning.pytorch.cli import LightningCLI
from fit_workloads import SleepStepModule, SleepyDataModule
LightningCLI(SleepStepModule, SleepyDataModule)
"""

USER_CONFIG = {
    "trainer": {
        "max_epochs": 2,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "num_sanity_val_steps": 0,
        "callbacks": [
            {
                "class_path": "lightning_dltune.DataLoaderTuner",
                "init_args": {
                    "tune": True,
                    "band": [0.8, 0.9],
                    "util_source": "estimate",
                    "stall_threshold_ms": 2.0,
                    "log_every_n_steps": 5,
                    "max_workers": 3,
                    "memory_fraction": 0.4,
                    "shm_fraction": 0.4,
                    "max_rebuilds": 4,
                    "min_gain": 0.1,
                    "max_prefetch_factor": 4,
                    "nvml_poll_interval_s": 2.0,
                    "verbose": True,
                    "recommendation_file": False,
                },
            }
        ],
    },
    "model": {"step_s": 0.005},
    "data": {
        "train_length": 64,
        "val_length": 8,
        "batch_cost_s": 0.01,
        "batch_size": 4,
        "num_workers": 0,
        "prefetch_factor": 2,
    },
}


def test_users_own_lightning_cli_takes_the_callback_and_a_tunable_datamodule(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT.format(repo=str(REPO), tests=str(REPO / "tests" / "helpers")))
    (tmp_path / "conf").mkdir()
    config = tmp_path / "conf" / "user.yaml"
    config.write_text(yaml.safe_dump(USER_CONFIG))
    proc = subprocess.run(
        [sys.executable, str(script), "fit", "--config", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if line.startswith("[dltune] epoch")]
    assert len([line for line in lines if line.startswith("[dltune] epoch 1 ")]) == 1
    # the YAML's arguments took effect: never past max_workers=3, no recommendation file written
    import re

    counts = re.findall(r"workers=(\d+)", output) + re.findall(r"workers (?:\d+ -> )?(\d+)", "\n".join(lines))
    assert counts and max(int(w) for w in counts) <= 3
    assert any(re.search(r"\| workers 0 -> [1-3],", line) for line in lines)  # starved at 0 workers: it tuned
    assert not list(tmp_path.rglob("dltune_recommendation.yaml"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read().decode())


def test_tensorboard_server_shows_the_dltune_panels(demo):
    tmp, _, _ = demo
    port = _free_port()
    tensorboard = Path(sys.executable).with_name("tensorboard")
    cmd = [str(tensorboard)] if tensorboard.exists() else [sys.executable, "-m", "tensorboard.main"]
    server = subprocess.Popen(
        cmd + ["--logdir", str(tmp / "logs"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        layout = None
        while time.monotonic() < deadline:
            try:
                layout = _get_json(f"{base}/data/plugin/custom_scalars/layout")
                tags = _get_json(f"{base}/data/plugin/scalars/tags")
                if layout and tags:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert layout, "tensorboard served no custom-scalars layout"
        assert [c["title"] for c in layout["category"]][:2] == ["dltune: headline", "dltune: detail"]
        assert layout["category"][0]["chart"][-1]["title"].startswith("GPU busy (estimate")  # shown first
        run = "demo/version_0"  # the demo's own run (other tests add runs beside it)
        run_tags = tags[run]
        for name in ("dltune/starvation_ratio", "dltune/gpu_util", "dltune/fetch_wait_ms", "dltune/num_workers"):
            assert name in run_tags
        series = _get_json(f"{base}/data/plugin/scalars/scalars?tag=dltune/num_workers&run={run}")
        assert len(series) == 2  # one point per epoch
    finally:
        server.terminate()
        server.wait(timeout=20)


# -- the installed `dltune` script: exit status and imports --------------------------------------------
def test_installed_dltune_script_exits_0_after_a_successful_fit(tmp_path):
    proc = run_script(
        "fit", "--config", "configs/demo.yaml", *TINY, "--trainer.max_epochs", "1", *logs_args(tmp_path), tmp=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "DLTuneCLI object" not in output
    assert "[dltune] epoch 0" in output  # it did train
    # Lightning's install tips and torch's pytree deprecations are hidden; Lightning's own warnings are not
    assert "Tip:" not in output and "_pytree" not in output and "LeafSpec" not in output
    assert "log_every_n_steps" in output  # fewer batches than the logging interval: still said


@pytest.mark.parametrize("launcher", ["script", "module"])
def test_bad_configuration_exits_with_status_2(tmp_path, launcher):
    args = ("fit", "--config", "configs/demo.yaml", "--data.init_args.num_workers", "-2")
    proc = run_script(*args, tmp=tmp_path) if launcher == "script" else run_module(*args, tmp=tmp_path)
    assert proc.returncode == 2 and "num_workers" in proc.stderr


@pytest.mark.parametrize("launcher", ["script", "module"])
def test_help_exits_0_and_points_to_the_sweep(tmp_path, launcher):
    proc = run_script("--help", tmp=tmp_path) if launcher == "script" else run_module("--help", tmp=tmp_path)
    assert proc.returncode == 0 and "dltune sweep --help" in proc.stdout


STRAY_MODULE = "open('stray_module_imported', 'w').close()\n"
USER_MODEL = """
import psutil  # installed, not yet imported when dltune starts
import pynvml
from lightning.pytorch.demos.boring_classes import BoringModel

for module in (psutil, pynvml):
    print(module.__name__, "from", module.__file__)


class UserModel(BoringModel):
    pass
"""


def test_stray_modules_in_the_current_directory_do_not_shadow_installed_ones(tmp_path):
    for name in ("pynvml", "psutil"):  # e.g. a debugging copy of NVML's bindings left in the project
        (tmp_path / f"{name}.py").write_text(STRAY_MODULE)
    (tmp_path / "user_model.py").write_text(USER_MODEL)  # class paths still resolve from here
    config = tmp_path / "user.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"class_path": "user_model.UserModel"},
                "data": {"class_path": "lightning.pytorch.demos.boring_classes.BoringDataModule"},
            }
        )
    )
    proc = run_script("fit", "--config", str(config), "--print_config", tmp=tmp_path, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = dict(line.split(" from ", 1) for line in proc.stdout.splitlines() if " from " in line)
    assert set(found) == {"psutil", "pynvml"}
    assert all("site-packages" in path for path in found.values()), found
    assert not (tmp_path / "stray_module_imported").exists()


# -- feeling like LightningCLI: the sweep in --help, underscore options, short errors, no abbreviations --
def test_help_lists_the_sweep_among_the_subcommands(refused):
    proc, _ = refused["help"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "{fit,validate,test,predict,sweep,report}" in proc.stdout
    assert any(line.split()[:2] == ["sweep", "The"] for line in proc.stdout.splitlines())  # with its description


def test_sweep_help_names_its_options_with_underscores_and_the_hyphen_aliases(refused):
    proc, _ = refused["sweep-help"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    usage = proc.stdout.split("\n\n", 1)[0]
    for option in ("--step_ms", "--seconds_per_point", "--min_gain"):
        assert f"[{option} " in usage, option
        assert f"{option} {option[2:].upper()}, --{option[2:].replace('_', '-')} " in proc.stdout, option


def test_sweep_takes_the_hyphen_aliases_and_names_the_underscore_option_in_errors(refused):
    proc, case = refused["sweep-aliases"]
    # every alias parsed (else: unrecognized), and the bad --min-gain stopped it before anything ran
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "`--min_gain` must be a number in [0, 1), got 1.5." in proc.stderr and "unrecognized" not in proc.stderr
    assert not (case / "out").exists()


@pytest.mark.parametrize(
    ("name", "said"),
    [
        (
            "abbreviated-fit",
            "dltune: error: unrecognized option --trainer.max_epoch; did you mean --trainer.max_epochs?",
        ),
        ("abbreviated-sweep", "dltune: error: unrecognized option --seconds_per; did you mean --seconds_per_point?"),
    ],
)
def test_an_abbreviated_option_is_refused_naming_the_option_meant(refused, name, said):
    proc, case = refused[name]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert said in proc.stderr and "usage:" not in proc.stderr
    assert not (case / "logs").exists()  # nothing started


def _short_error(proc: subprocess.CompletedProcess) -> list[str]:
    """The error's lines, after checking it is short and free of jsonargparse's dumps."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 5, proc.stderr
    for noise in ("Namespace(", "Union subtypes", "usage:", "Traceback"):
        assert noise not in proc.stderr, noise
    assert lines[-1].startswith("Run 'dltune ") and lines[-1].endswith(" --help' for the options.")
    return lines


def test_a_bad_value_in_yaml_is_one_short_paragraph_naming_key_and_value(refused):
    proc, case = refused["yaml-value"]
    lines = _short_error(proc)
    error = next(line for line in lines if line.startswith("dltune: error: "))
    assert "data (examples.image_pipeline.JpegDataModule)" in error
    assert "`num_workers` must be an integer >= 0, got -2" in error
    assert lines[-1] == "Run 'dltune fit --help' for the options."
    assert not (case / "logs").exists()


@pytest.mark.parametrize(
    ("name", "said"),
    [
        (
            "band-length",
            "trainer.callbacks.init_args.band (lightning_dltune.DataLoaderTuner): Expected a tuple with 2 elements",
        ),
        (
            "num_worker",
            "data (examples.image_pipeline.JpegDataModule): Option 'num_worker' is not accepted;"
            " did you mean 'num_workers'?",
        ),
        ("short-int", "trainer.max_epochs: expected int or null, got x"),
    ],
)
def test_a_bad_value_on_the_command_line_is_one_short_paragraph(refused, name, said):
    proc, _ = refused[name]
    lines = _short_error(proc)
    assert f"dltune: error: {said}" in lines[-2]


# -- the pure parts: condensing jsonargparse's reports, the noise filters --------------------------------
UNION_REPORT = """Parser key "data":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.datamodule.LightningDataModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'examples.image_pipeline.JpegDataModule':
        Parser key "prefetch_factor":
          Expected a <class 'int'>. Got value: two
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='prefetch_factor', val='two')"""

BUILD_REPORT = """Does not validate against any of the Union subtypes
Subtypes: [<class 'lightning.pytorch.core.datamodule.LightningDataModule'>, <class 'NoneType'>]
Errors:
  - `num_workers` must be an integer >= 0, got -2.
  - Expected a <class 'NoneType'>
Given value type: <class 'jsonargparse._namespace.Namespace'>
Given value: Namespace(class_path='examples.image_pipeline.JpegDataModule', init_args=Namespace(num_workers=-2))"""


def test_condense_keeps_the_key_path_the_class_and_the_innermost_error():
    from lightning_dltune.cli.errors import condense

    assert condense(UNION_REPORT) == (
        "data.init_args.prefetch_factor (examples.image_pipeline.JpegDataModule): expected int. Got value: two"
    )
    assert condense(BUILD_REPORT) == (
        "examples.image_pipeline.JpegDataModule: `num_workers` must be an integer >= 0, got -2."
    )
    assert condense("plain message") == "plain message"


def test_known_noise_is_hidden_only_inside_the_command_and_only_that_noise():
    import logging
    import warnings

    from lightning_dltune.cli.noise import quiet_known_noise

    tip = "💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels](...)"
    leaf = "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)` instead."
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_known_noise():
                warnings.warn(leaf, FutureWarning, stacklevel=1)
                warnings.warn("the user's own deprecation", FutureWarning, stacklevel=1)
                logger.info(tip)
                logger.info("GPU available: False")
            warnings.warn(leaf, FutureWarning, stacklevel=1)  # a library user still sees it
            logger.info(tip)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [str(w.message) for w in caught] == ["the user's own deprecation", leaf]
    assert seen == ["GPU available: False", tip]
