"""The GPU benchmark and NVML check scripts: their CPU run, their summary arithmetic, their no-GPU exit."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _load_benchmark():
    """``benchmarks/gpu.py`` under its own name (a plain ``import gpu`` could meet another ``gpu``).

    The folders it puts first on ``sys.path`` for its own imports move to the end: a later test, or a
    process it spawns (which starts from this ``sys.path``), must not find a benchmark module first.
    """
    before = list(sys.path)
    spec = importlib.util.spec_from_file_location("gpu_benchmark", REPO_ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    added = [path for path in sys.path if path not in before]
    sys.path[:] = before + added
    return module


gpu_bench = _load_benchmark()


def test_loading_the_benchmark_leaves_the_test_helpers_first_on_sys_path():
    # a ddp_spawn child unpickles the tests' modules by name from this sys.path: it once met benchmarks/ first
    helpers, benchmarks = str(REPO_ROOT / "tests" / "helpers"), str(REPO_ROOT / "benchmarks")
    assert sys.path.index(helpers) < sys.path.index(benchmarks)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-bench")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 3: summary" in proc.stdout
    return out


@pytest.mark.slow
def test_quick_cpu_run_writes_every_fit_and_window(quick_run):
    results = json.loads((quick_run / "gpu.json").read_text())
    meta = results["meta"]
    assert meta["mode"] == "quick" and meta["device"] == "cpu" and not meta["resnet18"]
    assert "SmallCNN" in meta["model"]  # said in the JSON: not the ResNet-18 of a GPU run
    assert results["nvml_check"] == {"skipped": "no CUDA device (--device cpu)"}
    runs = results["runs"]
    labels = [r["label"] for r in runs]
    assert labels[0] == "tuned from 0 (first)"
    assert {"static 0x2", "static 2x2"} <= set(labels)
    for run in runs:
        assert "error" not in run, run
        assert run["fit_s"] > 0 and run["samples_per_s"] > 0
        assert len(run["windows"]) == meta["epochs"]
        for w in run["windows"]:
            assert w["nvml_util"] is None and 0 <= w["estimate"] <= 1  # no NVML on CPU: the estimate only
            assert w["samples_per_s"] > 0 and w["step_ms"] > 0 and w["verdict"]
    summary = results["summary"]
    for key in ("tuned_over_oracle_time", "default_over_tuned_time"):
        assert isinstance(summary[key], float) and math.isfinite(summary[key]) and summary[key] > 0
    assert summary["nvml_vs_estimate"]["windows"] == 0


@pytest.mark.slow
def test_quick_cpu_run_writes_a_readable_markdown_report(quick_run):
    md = (quick_run / "gpu.md").read_text()
    assert md.startswith("# GPU benchmark (quick, device cpu)")
    assert "## Fits" in md and "| tuned from 0 (first) |" in md and "tuned / oracle time:" in md
    assert "no window measured by NVML" in md


def _run(label, workers, fit_s, windows, tuned=False):
    return {
        "label": label,
        "tuned": tuned,
        "start_workers": workers,
        "prefetch_factor": 2,
        "fit_s": fit_s,
        "samples_per_s": 1000 / fit_s,
        "windows": windows,
        "final_config": {"num_workers": workers, "prefetch_factor": 2},
    }


def _window(nvml, estimate, verdict, epoch=0):
    return {
        "epoch": epoch,
        "end_batch": None,
        "batches": 100,
        "num_workers": 0,
        "prefetch_factor": 2,
        "samples_per_s": 500.0,
        "nvml_util": nvml,
        "nvml_mode": "samples",
        "estimate": estimate,
        "abs_nvml_minus_estimate": abs(nvml - estimate),
        "starvation_ratio": 1 - estimate,
        "fetch_wait_ms": 1.0,
        "step_ms": 20.0,
        "verdict": verdict,
    }


def test_summary_compares_tuned_with_the_oracle_and_nvml_with_the_estimate():
    runs = [
        _run("static 0x2", 0, 60.0, [_window(0.10, 0.05, "data-bound (CPU saturated)")]),
        _run("static 8x2", 8, 20.0, [_window(0.80, 0.70, "data-bound (CPU saturated)")]),
        _run("static 16x2", 16, 19.8, [_window(0.95, 0.97, "in band")]),  # within 2 %: 8 is as fast and leaner
        _run(
            "tuned from 0 (first)",
            0,
            22.0,
            [_window(0.10, 0.05, "data-bound (I/O)"), _window(0.60, 0.97, "compute-bound", epoch=1)],
            tuned=True,
        ),
        _run("tuned from 0 (last)", 0, 24.0, [_window(0.93, 0.91, "in band")], tuned=True),
    ]
    summary = gpu_bench.summarize(runs)
    assert summary["oracle"]["label"] == "static 8x2"
    assert summary["tuned_fit_s"] == pytest.approx(23.0)
    assert summary["tuned_over_oracle_time"] == pytest.approx(23.0 / 20.0)
    assert summary["default_over_tuned_time"] == pytest.approx(60.0 / 23.0)
    nv = summary["nvml_vs_estimate"]
    assert nv["windows"] == 6 and nv["max_abs"] == pytest.approx(0.37)
    verdicts = summary["verdicts"]
    # the one miss: "compute-bound" (the data side keeps up) while NVML shows the GPU 40 % idle
    assert (verdicts["agree"], verdicts["windows"]) == (5, 6)
    assert (verdicts["tuned_agree"], verdicts["tuned_windows"]) == (2, 3)
    assert [d["verdict"] for d in verdicts["disagreements"]] == ["compute-bound"]
    md = gpu_bench.render_markdown(
        {
            "meta": {
                "mode": "full",
                "device": "cuda",
                "model": "m",
                "batch_size": 192,
                "batches_per_epoch": 100,
                "epochs": 3,
                "precision": "bf16-mixed",
            },
            "runs": runs,
            "summary": summary,
            "nvml_check": {"skipped": "test"},
        }
    )
    assert "verdicts agreeing with NVML: 5/6 windows (2/3 in the tuned fits)" in md
    assert "disagrees: tuned from 0 (first) epoch 1: compute-bound at NVML 0.60" in md


def test_plan_interleaves_the_tuned_fit_around_a_shuffled_grid_with_the_rule_of_thumb():
    args = gpu_bench.parse_args(["--device", "cpu"])
    fits = gpu_bench.plan(args)
    assert fits[0] == ("tuned from 0 (first)", 0, True) and fits[-1] == ("tuned from 0 (last)", 0, True)
    static = {workers for _, workers, tuned in fits if not tuned}
    assert set(gpu_bench.GRID_WORKERS) <= static
    assert gpu_bench.rule_of_thumb_workers() in static


@pytest.mark.slow
def test_check_gpu_without_cuda_exits_2_with_a_clear_message():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "check_gpu.py")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stdout


class _FakeLoad:
    """check_gpu's busy and idle phases, played on a fake device sampled on the wall clock."""

    def __init__(self, device) -> None:
        self.device = device

    def _hold(self, value: int, seconds: float, samplers) -> None:
        import time

        self.device.set(value)
        end = time.perf_counter() + seconds
        while (now := time.perf_counter()) < end:
            time.sleep(min(0.01, end - now))
            for sampler in samplers:
                sampler.maybe_poll(time.perf_counter())

    def busy(self, seconds, *samplers) -> None:
        self._hold(100, seconds, samplers)
        self.device.set(0)  # the GPU idles once the loop stops feeding it

    def idle(self, seconds, *samplers) -> None:
        self._hold(0, seconds, samplers)

    def duty(self, seconds, on_s, *samplers) -> None:
        import time

        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.busy(on_s, *samplers)
            self.idle(on_s, *samplers)


@pytest.mark.slow
def test_check_gpu_passes_every_check_against_a_faithful_fake_device(monkeypatch):
    """The whole NVML check, CUDA and the driver faked as in tests/test_nvml_sampler.py: the script runs through."""
    import types

    import torch
    from test_nvml_sampler import NVML_FUNCTIONS, LiveGPU, LiveNVML

    import lightning_dltune.nvml.sampler as gpu_module

    pynvml = pytest.importorskip("pynvml")
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import check_gpu

    device = LiveGPU()
    device.timeline = [(0, 0)]
    nvml = LiveNVML(device)
    for name in NVML_FUNCTIONS:
        monkeypatch.setattr(pynvml, name, getattr(nvml, name))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda handle: handle.uuid)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetPciInfo", lambda handle: types.SimpleNamespace(busId=b"00000000:3B:00.0"))
    identity = lambda index: (device.uuid[4:], "00000000:3B:00.0")  # noqa: E731  torch's UUID has no prefix
    monkeypatch.setattr(gpu_module, "cuda_device_identity", identity)
    monkeypatch.setattr(check_gpu, "cuda_device_identity", identity)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(check_gpu, "Load", lambda torch_device: _FakeLoad(device))
    monkeypatch.setattr(check_gpu, "WINDOW_S", 1.0)
    monkeypatch.setattr(check_gpu, "POLL_S", 0.1)

    result = check_gpu.run_checks(0, child=False)

    failed = [c for c in result["checks"] if not c["ok"]]
    assert result["passed"], failed
    names = " | ".join(c["name"] for c in result["checks"])
    for expected in (
        "NVML UUID of the handle == GPU- + torch UUID",
        "PCI bus ids match",
        "matched by UUID",
        "samples mode is live",
        "sample values in 0-100",
        "nothing older",
        "idle sleep",
        "busy window",
        "idle window",
        "50 % duty cycle",
        "with the idle part paused",
        "without the pause",
    ):
        assert expected in names
    accuracy = result["accuracy"]
    assert accuracy["busy/idle/busy"]["paused"] >= 0.9 and accuracy["busy/idle/busy"]["unpaused"] <= 0.75
    json.dumps(result, default=str)  # what benchmarks/gpu.py writes


def test_nvml_mode_per_window_is_read_back_from_the_logged_metrics(tmp_path):
    log = tmp_path / "log" / "version_0"
    log.mkdir(parents=True)
    (log / "metrics.csv").write_text(
        "dltune/starvation_ratio,dltune/util_from_samples,epoch,step,train_loss\n"
        ",,0,4,2.3\n"  # the model's own metrics: not a window
        "0.5,1.0,,9,\n"
        "0.1,0.0,,19,\n"
        "0.2,,,29,\n"  # a window measured by the estimate
    )
    assert gpu_bench._logged_nvml_modes(str(tmp_path), 4) == ["samples", "rates", None, None]
