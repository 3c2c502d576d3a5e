"""``dltune sweep`` on the JPEG example, run as the installed command, and its pure parts.

The slow tests run ``.venv/bin/dltune sweep`` in a subprocess on ``configs/demo.yaml`` with a tiny
grid and short points; the accelerator step is emulated by the example model's sleep.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import psutil
import pytest
import yaml
from dltune_command import DLTUNE_SCRIPT, REPO, command_env, run_script

from lightning_dltune.cli.sweep import (
    SweepPoint,
    build_grid,
    datamodule_loaders,
    default_workers,
    leanest_within,
    measure_point,
    predicted_fit_rate,
    predicted_starvation,
    steady_rate,
)
from lightning_dltune.core.config import LoaderConfig
from lightning_dltune.core.policy import Budget

SMALL = ["--data.init_args.num_images", "160", "--data.init_args.batch_size", "8"]


# -- the command, for real --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    out = tmp / "out"
    started = time.perf_counter()
    proc = run_script(
        "sweep",
        "--config",
        "configs/demo.yaml",
        *SMALL,
        "--steps",
        "4",
        "--workers",
        "[0,1,2]",
        "--prefetch",
        "[1,2]",
        "--seconds_per_point",
        "0.5",
        "--out",
        str(out),
        tmp=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp, out, proc.stdout, time.perf_counter() - started


@pytest.mark.slow
def test_sweep_prints_a_table_of_every_point_and_the_recommendation(swept):
    _, _, stdout, _ = swept
    assert "dltune sweep: train loader alone" in stdout
    for header in ("samples/s", "start-up", "worker CPU", "peak memory", "/dev/shm", "starvation"):
        assert header in stdout, header
    rows = [line for line in stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 5  # workers 0 (prefetch does not apply), then 1 and 2 x prefetch 1 and 2
    assert sum(row.rstrip("│ ").endswith("<-") for row in rows) == 1
    assert "recommended: workers=" in stdout
    assert "median of 4 steps" in stdout  # the step was timed on the model, not given by a flag
    assert not [line for line in stdout.splitlines() if line != line.rstrip()]  # no padding to the console width


@pytest.mark.slow
def test_sweep_json_holds_every_point_with_its_measurements(swept):
    _, out, _, _ = swept
    report = json.loads((out / "dltune_sweep.json").read_text())
    assert report["step_source"] == "measured" and report["step_ms"] >= 25.0  # the model sleeps 30 ms a step
    assert len(report["step_samples_ms"]) == 4 and min(report["step_samples_ms"]) >= 25.0
    assert report["batch_size"] == 8 and report["batch_bytes"] > 0
    assert report["budget"]["max_workers"] >= 1
    points = report["points"]
    assert [(p["num_workers"], p["prefetch_factor"]) for p in points] == [(0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]
    for p in points:
        assert p["samples_per_s"] > 0 and p["batches"] >= 4
        assert p["startup_s"] > 0 and p["worker_cpu_cores"] > 0 and p["peak_memory_bytes"] > 0
        assert 0 <= p["predicted_starvation"] <= 1
        assert p["loader_ms_per_batch"] == pytest.approx(1e3 * 8 / p["samples_per_s"], rel=1e-6)
    assert report["recommended"] in points


@pytest.mark.slow
def test_sweep_heatmap_is_a_png(swept):
    _, out, _, _ = swept
    assert (out / "dltune_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_sweep_recommendation_round_trips_through_dltune_fit(swept):
    tmp, out, _, _ = swept
    rec = out / "dltune_recommendation.yaml"
    recommended = yaml.safe_load(rec.read_text())["data"]
    chosen = json.loads((out / "dltune_sweep.json").read_text())["recommended"]
    assert recommended["num_workers"] == chosen["num_workers"]
    assert recommended["prefetch_factor"] == chosen["prefetch_factor"]
    proc = run_script("fit", "--config", "configs/demo.yaml", "--config", str(rec), "--print_config", tmp=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = yaml.safe_load(proc.stdout)["data"]["init_args"]
    assert {k: merged[k] for k in recommended} == recommended


@pytest.mark.slow
def test_sweep_with_a_bad_class_path_exits_2_naming_the_key(tmp_path):
    proc = run_script(
        "sweep",
        "--config",
        "configs/demo.yaml",
        "--data.class_path",
        "examples.nowhere.Data",
        "--out",
        str(tmp_path / "out"),
        tmp=tmp_path,
    )
    assert proc.returncode == 2
    assert "data" in proc.stderr and "examples.nowhere.Data" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_sweep_needs_a_tunable_datamodule_and_says_so_with_exit_2(tmp_path):
    config = tmp_path / "boring.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"class_path": "lightning.pytorch.demos.boring_classes.BoringModel"},
                "data": {"class_path": "lightning.pytorch.demos.boring_classes.BoringDataModule"},
            }
        )
    )
    proc = run_script("sweep", "--config", str(config), "--out", str(tmp_path / "out"), tmp=tmp_path)
    assert proc.returncode == 2 and "TunableDataModule" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_sweep_help_lists_its_options_and_the_fit_config(tmp_path):
    proc = run_script("sweep", "--help", tmp=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: dltune sweep")
    for option in (
        "--step_ms",
        "--steps",
        "--seconds_per_point",
        "--workers",
        "--prefetch",
        "--min_gain",
        "--out",
        "--config",
        "--data",
    ):
        assert option in proc.stdout, option


@pytest.mark.slow
def test_sweep_with_a_bad_option_exits_2_naming_it(tmp_path):
    proc = run_script("sweep", "--config", "configs/demo.yaml", "--seconds_per_point", "0", tmp=tmp_path)
    assert proc.returncode == 2 and "--seconds_per_point" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupting_the_sweep_leaves_no_worker_behind(tmp_path, signum):
    proc = subprocess.Popen(
        [
            str(DLTUNE_SCRIPT),
            "sweep",
            "--config",
            "configs/demo.yaml",
            *SMALL,
            "--step_ms",
            "30",
            "--workers",
            "[2,3]",
            "--prefetch",
            "[2]",
            "--seconds_per_point",
            "60",
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        env=command_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        workers: list = []
        deadline = time.monotonic() + 240
        while len(workers) < 2 and time.monotonic() < deadline:  # the first point's workers are running
            time.sleep(0.2)
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2
        time.sleep(1.0)  # batches flowing
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output and "Traceback" not in output
    # shut down by the sweep itself: torch's own watchdog would take up to 5 s after the parent exits
    alive = [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert not (tmp_path / "out").exists()


# -- the pure parts -------------------------------------------------------------------------------------
def test_default_workers_climb_powers_of_two_and_end_at_the_budget():
    assert default_workers(0) == [0]
    assert default_workers(1) == [0, 1]
    assert default_workers(7) == [0, 1, 2, 4, 7]
    assert default_workers(8) == [0, 1, 2, 4, 8]


def test_grid_has_one_point_at_zero_workers_and_every_prefetch_above():
    points, skipped = build_grid(LoaderConfig(), Budget(max_workers=2), batch_bytes=1e6, prefetch=(1, 4))
    assert [(c.num_workers, c.prefetch_factor) for c in points] == [(0, 2), (1, 1), (1, 4), (2, 1), (2, 4)]
    assert skipped == []


def test_grid_skips_points_over_the_worker_memory_and_shm_budgets_saying_why():
    budget = Budget(max_workers=4, memory_bytes=10e6, shm_bytes=6e6)
    points, skipped = build_grid(LoaderConfig(), budget, batch_bytes=1e6, workers=[0, 2, 4, 8], prefetch=(1, 2, 4))
    # 2 x 4 = 8 batches of 1 MB pass /dev/shm's 6 MB; 4 x 4 = 16 pass the memory budget too
    assert [(c.num_workers, c.prefetch_factor) for c in points] == [(0, 2), (2, 1), (2, 2), (4, 1)]
    why = {(c.num_workers, c.prefetch_factor): reason for c, reason in skipped}
    assert "/dev/shm budget" in why[(2, 4)] and "/dev/shm budget" in why[(4, 2)]
    assert "memory budget" in why[(4, 4)]
    assert all("over the budget of 4" in why[(8, p)] for p in (1, 2, 4))


def test_grid_keeps_the_users_other_loader_settings_and_tries_pinning_when_asked():
    base = LoaderConfig(persistent_workers=False)
    points, _ = build_grid(base, Budget(max_workers=1), batch_bytes=1.0, prefetch=(2,), pin=(False, True))
    assert [(c.num_workers, c.pin_memory) for c in points] == [(0, False), (0, True), (1, False), (1, True)]
    assert not any(c.persistent_workers for c in points)


def test_predicted_starvation_hides_the_loader_behind_the_step_only_with_workers():
    assert predicted_starvation(0.020, 0.030, num_workers=2) == 0.0  # faster than the step: never waits
    assert predicted_starvation(0.060, 0.030, num_workers=2) == pytest.approx(0.5)  # waits 30 of every 60 ms
    assert predicted_starvation(0.020, 0.030, num_workers=0) == pytest.approx(0.4)  # loads in the loop: 20 / 50


def point(workers: int, prefetch: int, fit_samples_per_s: float, pin: bool = False, loader: float = 0.0) -> SweepPoint:
    return SweepPoint(
        LoaderConfig(workers, prefetch, pin),
        loader or fit_samples_per_s,
        10,
        1.0,
        0.1,
        0.5,
        1e8,
        0.0,
        0.0,
        fit_samples_per_s,
    )


def test_predicted_fit_rate_is_bounded_by_the_step():
    assert predicted_fit_rate(0.010, 0.030, num_workers=4, batch_size=32) == pytest.approx(32 / 0.030)
    assert predicted_fit_rate(0.060, 0.030, num_workers=4, batch_size=32) == pytest.approx(32 / 0.060)
    assert predicted_fit_rate(0.010, 0.030, num_workers=0, batch_size=32) == pytest.approx(32 / 0.040)
    assert predicted_fit_rate(0.010, 0.0, num_workers=2, batch_size=32) == pytest.approx(3200)  # no step: the loader


def test_a_loader_faster_than_the_step_buys_nothing_so_the_leanest_that_keeps_up_wins():
    # the loader alone: 2 workers 1100 samples/s, 8 workers 3000; the step caps a fit at 1000
    points = [point(0, 2, 250, loader=330), point(2, 2, 1000, loader=1100), point(8, 2, 1000, loader=3000)]
    assert leanest_within(points, min_gain=0.05).config == LoaderConfig(2, 2)


def test_leanest_within_min_gain_prefers_fewer_workers_then_shallower_prefetch():
    points = [point(0, 2, 300), point(2, 4, 980), point(2, 2, 975), point(4, 1, 1000), point(8, 2, 1020)]
    assert leanest_within(points, min_gain=0.05).config == LoaderConfig(2, 2)  # 975 >= 0.95 x 1020
    assert leanest_within(points[:2] + points[3:], min_gain=0.01).config == LoaderConfig(8, 2)
    assert leanest_within([point(2, 2, 1000, pin=True), point(2, 2, 1000)], 0.05).config.pin_memory is False
    assert leanest_within([], 0.05) is None


def test_steady_rate_leaves_out_the_first_round_of_batches():
    # two workers deliver their first batches together, then one batch every 100 ms
    stamps = [1.0, 1.001, 1.1, 1.2, 1.3, 1.4]
    assert steady_rate(stamps, skip=1) == pytest.approx(10.0, rel=0.02)
    assert steady_rate(stamps, skip=0) == pytest.approx(5 / 0.4)
    assert steady_rate([1.0], skip=0) == 0.0
    assert steady_rate([1.0, 1.5], skip=3) == pytest.approx(2.0)  # too few batches: every one counts


@pytest.mark.slow
def test_a_point_asked_to_stop_ends_at_the_next_batch_with_its_workers_shut_down():
    from fit_workloads import SleepyDataModule

    dm = SleepyDataModule(train_length=4000, batch_size=4, batch_cost_s=0.01, num_workers=2)
    dm.setup("fit")
    before = set(psutil.Process().children(recursive=True))  # e.g. multiprocessing's resource tracker
    calls = []

    def stop_after_ten():
        calls.append(1)
        if len(calls) > 10:
            raise KeyboardInterrupt("signal 2")

    with pytest.raises(KeyboardInterrupt):
        measure_point(
            datamodule_loaders(dm),
            LoaderConfig(num_workers=2),
            seconds=60,
            step_s=0.01,
            batch_size=4,
            stop=stop_after_ten,
        )
    assert len(calls) == 11
    deadline = time.monotonic() + 10  # shut down by the point itself, not left to torch's watchdog
    left = set(psutil.Process().children(recursive=True)) - before
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE}
    assert left == set()
