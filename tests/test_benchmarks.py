"""The tuning benchmark harness: its quickest mode runs every strategy on a tiny workload and writes its reports."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses, DDP or real fits

REPO_ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("default", "rule", "oracle", "tuned_default", "tuned_bad", "own_default", "own_bad")


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "tuning.py"),
            "--smoke",
            "--out",
            str(out),
            "--log-dir",
            str(out / "logs"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_smoke_run_writes_json_with_a_checkable_ratio_per_start(smoke_results):
    results = json.loads((smoke_results / "tuning.json").read_text())
    assert results["meta"]["mode"] == "smoke"
    workload = results["workloads"]["step-bound"]
    for start in ("from_default", "from_bad"):
        ratio = workload["tuned"][start]["tuned_over_oracle_time"]
        assert isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0
    for key in STRATEGIES:
        s = workload["strategies"][key]
        assert "error" not in s, s
        assert len(s["samples_per_s"]) == results["meta"]["epochs"] == 2
        assert all(x > 0 for x in s["samples_per_s"])
        assert s["fit_s"] > 0 and s["peak_memory_mb"] > 0
    assert workload["grid"] and workload["oracle_config"]["num_workers"] in (0, 2)
    assert {t["workload"] for t in results["targets"]} == {"step-bound"}


def test_smoke_run_tunes_the_modules_own_loaders_against_the_oracle_and_the_mixin(smoke_results):
    results = json.loads((smoke_results / "tuning.json").read_text())
    workload = results["workloads"]["step-bound"]
    for own, mixin, start in (("own_default", "tuned_default", "from_default"), ("own_bad", "tuned_bad", "from_bad")):
        (run,) = workload["runs"][own]
        assert run["spec"]["own_loaders"] and run["spec"]["tune"]
        assert not workload["runs"][mixin][0]["spec"]["own_loaders"]
        assert workload["strategies"][own]["start_config"] == workload["strategies"][mixin]["start_config"]
        ratios = workload["own_loaders"][start]
        for key in ("own_over_oracle_time", "own_over_mixin_time"):
            assert isinstance(ratios[key], float) and math.isfinite(ratios[key]) and ratios[key] > 0
    own_checks = [t for t in results["targets"] if t["target"].startswith("own loaders")]
    assert len(own_checks) == 4 and {t["start"] for t in own_checks} == {"from_default", "from_bad"}
    assert "own loaders, tuned, bad start" in (smoke_results / "tuning.md").read_text()


def test_smoke_run_writes_markdown_table_and_png(smoke_results):
    md = (smoke_results / "tuning.md").read_text()
    assert "emulated" in md and "| strategy |" in md and "tuned, bad start" in md
    from PIL import Image

    with Image.open(smoke_results / "tuning.png") as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 300


def test_the_results_name_the_package_code_down_to_its_subpackages(tmp_path, monkeypatch):
    from benchmark_modules import load_benchmark_module

    machine = load_benchmark_module("machine")
    policy = tmp_path / "lightning_dltune" / "core" / "policy.py"
    policy.parent.mkdir(parents=True)
    policy.write_text("RULES = 1\n")
    monkeypatch.setattr(machine, "REPO_ROOT", str(tmp_path))
    before = machine.package_digest()
    policy.write_text("RULES = 2\n")
    assert machine.package_digest() != before
