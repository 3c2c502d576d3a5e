"""Proof on a real GPU: is ``gpu_util`` the real number, does the estimate agree, does the tuner beat static configs?

One command, one process tree, under 8 minutes on one GPU with 16 CPU cores:

    PYTHONPATH=. python benchmarks/gpu.py --out /tmp/gpu-bench
    python benchmarks/gpu.py --device cpu --quick --out /tmp/gpu-bench   # the harness on CPU (~1 min)

1. The NVML check of ``scripts/check_gpu.py`` (device identity by UUID, raw samples, accuracy).
2. Real fits: ResNet-18 from torchvision (random weights) on the package's JPEG pipeline
   (``examples/image_pipeline.py``: decode 224 px JPEGs generated locally, random resized crop to
   160 px, flip, normalise), bf16 autocast on ``cuda:0``. A static grid (workers 0, 4, 8, 12, 16 x
   prefetch 2, plus the rule of thumb), each for the same fixed number of batches, and the tuned
   fit from 0 workers, run before and after the grid (interleaved). Every fit carries a
   ``DataLoaderTuner`` (``tune=False`` for the static ones) reading NVML, so every window records
   samples/s, NVML utilization, the estimate ``1 - starvation``, fetch wait and step time.
3. A summary: tuned / oracle fit time, default / tuned, |NVML - estimate| per window, and whether
   the verdicts agree with what NVML shows.

Writes ``gpu.json`` and ``gpu.md`` to ``--out`` after every fit, so an interrupted run keeps what it
measured. Without torchvision the model falls back to the example's small CNN, and the JSON says so.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
for _path in (REPO_ROOT, HERE, os.path.join(REPO_ROOT, "scripts")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from machine import machine_info  # noqa: E402
from oracle import pick_oracle  # noqa: E402
from strategies import BAND, rule_of_thumb_workers  # noqa: E402

GRID_WORKERS = (0, 4, 8, 12, 16)
PREFETCH = 2
DATA_SIDE_VERDICTS = ("data-bound (I/O)", "data-bound (CPU saturated)", "memory-capped")
VERDICT_TOLERANCE = 0.05  # NVML this far below the band still agrees with "the data side keeps up"
SETTINGS = {  # per mode: what one fit runs
    "full": {"batch_size": 192, "batches": 100, "epochs": 3, "grid": GRID_WORKERS},
    "quick": {"batch_size": 16, "batches": 6, "epochs": 2, "grid": (0, 2)},
}


# ============================================================================================ model
def build_model(device: str, quick: bool) -> tuple[Any, str, bool]:
    """``(model, description, is_resnet)``: ResNet-18 (random weights) where torchvision is installed
    (and not in a quick CPU run); the example's small CNN otherwise."""
    import lightning.pytorch as pl
    import torch
    from torch.nn import functional as F

    try:
        if device == "cpu" and quick:
            raise ImportError("a quick CPU run uses the small CNN")
        from torchvision.models import resnet18
    except ImportError as err:
        from examples.image_pipeline import SmallCNN

        width = 8 if quick else 32
        name = f"SmallCNN(width={width}) from examples/image_pipeline.py ({err})"
        return SmallCNN(num_classes=10, width=width), name, False

    class ResNetClassifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = resnet18(weights=None, num_classes=10).to(memory_format=torch.channels_last)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.net(images.contiguous(memory_format=torch.channels_last))

        def _loss(self, batch: Any) -> torch.Tensor:
            images, labels = batch
            return F.cross_entropy(self(images), labels)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self._loss(batch)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self._loss(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return ResNetClassifier(), "torchvision resnet18(weights=None, num_classes=10), channels_last", True


def warm_up(device: str, quick: bool, batch_size: int, crop: int) -> None:
    """Kernel selection and lazy CUDA set-up before the first timed fit, so no config pays for them."""
    import torch
    from torch.nn import functional as F

    if device != "cuda":
        return
    torch.backends.cudnn.benchmark = True
    model, _, _ = build_model(device, quick)
    model = model.cuda()
    optimizer = model.configure_optimizers()
    x = torch.randn(batch_size, 3, crop, crop, device="cuda")
    y = torch.randint(0, 10, (batch_size,), device="cuda")
    for _ in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


# ============================================================================================ one fit
def run_fit(label: str, num_workers: int, tune: bool, args: argparse.Namespace, log_root: str) -> dict[str, Any]:
    """One fit at a start config; every window the tuner closed, with NVML's reading next to the estimate."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger
    from workloads import Workload, WorkloadDataModule

    from lightning_dltune import DataLoaderTuner

    mode = SETTINGS["quick" if args.quick else "full"]
    workload = Workload(
        name="gpu-jpeg",
        summary="JPEG decode + random resized crop",
        cost="",
        kind="jpeg",
        batch_size=mode["batch_size"],
        train_batches=mode["batches"],
        val_batches=2,
        step_ms=0.0,
    )
    pl.seed_everything(0, verbose=False)
    model, _, _ = build_model(args.device, args.quick)
    data = WorkloadDataModule(
        workload, num_workers=num_workers, prefetch_factor=PREFETCH, pin_memory=args.device == "cuda"
    )
    tuner = DataLoaderTuner(tune=tune, band=BAND, nvml_poll_interval_s=1.0, verbose=False, recommendation_file=False)
    root = tempfile.mkdtemp(prefix=f"{label}-", dir=log_root)
    trainer = pl.Trainer(
        max_epochs=mode["epochs"],
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if args.device == "cuda" else "32-true",
        logger=CSVLogger(root, name="log"),
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[tuner],  # Lightning adds its ModelCheckpoint: saving is part of the fit, and left out of gpu_util
    )
    started = time.perf_counter()
    trainer.fit(model, datamodule=data)
    fit_s = time.perf_counter() - started
    samples = mode["epochs"] * mode["batches"] * mode["batch_size"]
    windows = [_window_row(r, m) for r, m in zip(tuner.history, _logged_nvml_modes(root, len(tuner.history)))]
    if args.device == "cuda":
        torch.cuda.synchronize()
    return {
        "label": label,
        "tuned": tune,
        "start_workers": num_workers,
        "prefetch_factor": PREFETCH,
        "fit_s": fit_s,
        "samples_per_s": samples / fit_s,
        "windows": windows,
        "rebuilds": tuner.rebuilds,
        "final_config": None if not tuner.history else tuner.history[-1].config.as_dict(),
    }


def _logged_nvml_modes(root: str, count: int) -> list[Optional[str]]:
    """``samples``/``rates`` per window, read back from the logged ``dltune/util_from_samples``."""
    modes: list[Optional[str]] = []
    for path in glob.glob(os.path.join(root, "log", "*", "metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row.get("dltune/starvation_ratio"):
                    flag = row.get("dltune/util_from_samples")
                    modes.append(None if not flag else ("samples" if float(flag) else "rates"))
    return (modes + [None] * count)[:count]


def _window_row(record: Any, nvml_mode: Optional[str]) -> dict[str, Any]:
    s = record.stats
    nvml = s.gpu_util if s.util_source == "nvml" else None
    estimate = 1.0 - s.starvation_ratio
    return {
        "epoch": record.epoch,
        "end_batch": record.end_batch,
        "batches": s.batches,
        "num_workers": record.config.num_workers,
        "prefetch_factor": record.config.prefetch_factor,
        "samples_per_s": s.samples_per_s,
        "nvml_util": nvml,
        "nvml_mode": nvml_mode,
        "estimate": estimate,
        "abs_nvml_minus_estimate": None if nvml is None else abs(nvml - estimate),
        "starvation_ratio": s.starvation_ratio,
        "fetch_wait_ms": 1e3 * s.fetch_wait_mean_s,
        "step_ms": 1e3 * s.step_mean_s,
        "verdict": record.verdict,
        "reason": record.reason,
        "next_num_workers": record.next_config.num_workers,
        "next_prefetch_factor": record.next_config.prefetch_factor,
    }


# ============================================================================================ summary
def verdict_agrees(verdict: str, nvml: float) -> bool:
    """A data-side verdict claims the GPU waits (NVML below the band); any other, that it does not."""
    if verdict in DATA_SIDE_VERDICTS:
        return nvml < BAND[0]
    return nvml >= BAND[0] - VERDICT_TOLERANCE


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    static = [r for r in runs if not r["tuned"] and "error" not in r]
    tuned = [r for r in runs if r["tuned"] and "error" not in r]
    grid = [
        {
            "num_workers": r["start_workers"],
            "prefetch_factor": r["prefetch_factor"],
            "projected_fit_s": r["fit_s"],
            "within_budget": True,
            "label": r["label"],
        }
        for r in static
    ]
    oracle = pick_oracle(grid) if grid else None
    default = next((r for r in static if r["start_workers"] == 0), None)
    tuned_s = statistics.median(r["fit_s"] for r in tuned) if tuned else None
    out: dict[str, Any] = {
        "oracle": oracle
        and {"label": oracle["label"], "num_workers": oracle["num_workers"], "fit_s": oracle["projected_fit_s"]},
        "tuned_fit_s": tuned_s,
        "tuned_fit_s_each": [r["fit_s"] for r in tuned],
        "tuned_over_oracle_time": tuned_s / oracle["projected_fit_s"] if oracle and tuned_s else None,
        "default_over_tuned_time": default["fit_s"] / tuned_s if default and tuned_s else None,
    }
    diffs = [(r["label"], w) for r in runs for w in r.get("windows", []) if w["nvml_util"] is not None]
    if diffs:
        gaps = [w["abs_nvml_minus_estimate"] for _, w in diffs]
        out["nvml_vs_estimate"] = {
            "windows": len(gaps),
            "mean_abs": statistics.mean(gaps),
            "median_abs": statistics.median(gaps),
            "max_abs": max(gaps),
            "modes": sorted({str(w["nvml_mode"]) for _, w in diffs}),
        }
        checked = [(label, w, verdict_agrees(w["verdict"], w["nvml_util"])) for label, w in diffs]
        out["verdicts"] = {
            "agree": sum(ok for _, _, ok in checked),
            "windows": len(checked),
            "tuned_agree": sum(ok for label, _, ok in checked if label.startswith("tuned")),
            "tuned_windows": sum(label.startswith("tuned") for label, _, _ in checked),
            "disagreements": [
                {
                    "run": label,
                    "epoch": w["epoch"],
                    "end_batch": w["end_batch"],
                    "verdict": w["verdict"],
                    "nvml_util": w["nvml_util"],
                    "estimate": w["estimate"],
                }
                for label, w, ok in checked
                if not ok
            ],
        }
    else:
        out["nvml_vs_estimate"] = {"windows": 0, "note": "no window measured by NVML (no CUDA device or NVML)"}
        out["verdicts"] = {"windows": 0, "note": "nothing to compare without NVML"}
    return out


# ============================================================================================ reports
def _f(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def write_outputs(results: dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    with open(os.path.join(out, "gpu.md"), "w") as f:
        f.write(render_markdown(results))


def render_markdown(results: dict[str, Any]) -> str:
    """``gpu.md``: the run's setting, the NVML check, every fit, the tuned fits' windows, the summary."""
    meta = results["meta"]
    machine = meta.get("machine", {})
    lines = [
        f"# GPU benchmark ({meta['mode']}, device {meta['device']})",
        "",
        f"{meta.get('gpu_name') or 'no GPU'}; {machine.get('usable_cpus')} usable CPUs"
        f" ({machine.get('cpu_model', '')});"
        f" torch {machine.get('torch')}, lightning {machine.get('lightning')}; commit {machine.get('git_commit')};"
        f" {meta.get('wall_s', 0):.0f} s in all.",
        "",
        f"Model: {meta['model']}. Data: the JPEG example pipeline, batch {meta['batch_size']},"
        f" {meta['batches_per_epoch']} batches x {meta['epochs']} epochs per fit, precision {meta['precision']}.",
        "",
    ]
    lines += _check_lines(results.get("nvml_check", {}))
    lines += _fit_lines(results["runs"])
    lines += _tuned_window_lines(results["runs"])
    lines += _summary_lines(results.get("summary", {}))
    return "\n".join(lines) + "\n"


def _check_lines(check: dict[str, Any]) -> list[str]:
    """The NVML check's table, or why it did not run."""
    lines = ["## NVML check", ""]
    if check.get("checks"):
        lines += [
            f"{'all passed' if check.get('passed') else 'FAILED'}:",
            "",
            "| check | result | value | expected |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {c['name']} | {'pass' if c['ok'] else '**FAIL**'} | `{c['value']}` | {c['expected']} |"
            for c in check["checks"]
        ]
    else:
        lines.append(f"not run: {check.get('skipped') or check.get('error')}")
    return lines


def _fit_lines(runs: list[dict[str, Any]]) -> list[str]:
    """One row per fit: start, fit time, samples/s, the last window's config, NVML / estimate per window."""
    lines = [
        "",
        "## Fits",
        "",
        "| run | start | fit s | samples/s | last window's config | windows: NVML / estimate |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['start_workers']} | failed: {r['error'][:80]} | | | |")
            continue
        pairs = ", ".join(f"{_f(w['nvml_util'])}/{_f(w['estimate'])}" for w in r["windows"])
        final = r["final_config"] or {}
        lines.append(
            f"| {r['label']} | {r['start_workers']}x{r['prefetch_factor']} | {r['fit_s']:.1f} |"
            f" {r['samples_per_s']:.0f} | {final.get('num_workers')}x{final.get('prefetch_factor')} | {pairs} |"
        )
    return lines


def _tuned_window_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Every window of the tuned fits: where it closed, its config, samples/s, NVML, estimate, clocks, verdict."""
    lines = [
        "",
        "## Windows of the tuned fits",
        "",
        "| run | epoch | config | samples/s | NVML | estimate | fetch wait ms | step ms | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if r.get("tuned") and "error" not in r:
            for w in r["windows"]:
                part = f" (first {w['end_batch']})" if w["end_batch"] else ""
                lines.append(
                    f"| {r['label']} | {w['epoch']}{part} | {w['num_workers']}x{w['prefetch_factor']} |"
                    f" {w['samples_per_s']:.0f} | {_f(w['nvml_util'])} {w['nvml_mode'] or ''} |"
                    f" {_f(w['estimate'])} | {w['fetch_wait_ms']:.1f} | {w['step_ms']:.1f} | {w['verdict']} |"
                )
    return lines


def _summary_lines(summary: dict[str, Any]) -> list[str]:
    """The oracle, tuned / oracle and default / tuned time, |NVML - estimate|, and the verdicts against NVML."""
    nv, verdicts, oracle = summary.get("nvml_vs_estimate", {}), summary.get("verdicts", {}), summary.get("oracle")
    lines = [
        "",
        "## Summary",
        "",
        f"- oracle (leanest static config within 2 % of the fastest): {oracle and oracle['label']}"
        f" ({_f(oracle and oracle['fit_s'], '{:.1f}')} s)",
        f"- tuned fit: {_f(summary.get('tuned_fit_s'), '{:.1f}')} s (median of {summary.get('tuned_fit_s_each')})",
        f"- tuned / oracle time: {_f(summary.get('tuned_over_oracle_time'))};"
        f" default (0 workers) / tuned time: {_f(summary.get('default_over_tuned_time'))}",
    ]
    if nv.get("windows"):
        lines.append(
            f"- |NVML - estimate| over {nv['windows']} windows: mean {nv['mean_abs']:.3f}, median"
            f" {nv['median_abs']:.3f}, max {nv['max_abs']:.3f} (NVML read as {', '.join(nv['modes'])})"
        )
        lines.append(
            f"- verdicts agreeing with NVML: {verdicts['agree']}/{verdicts['windows']} windows"
            f" ({verdicts['tuned_agree']}/{verdicts['tuned_windows']} in the tuned fits)"
        )
        lines += [
            f"  - disagrees: {d['run']} epoch {d['epoch']}: {d['verdict']} at NVML {d['nvml_util']:.2f}"
            f" (estimate {d['estimate']:.2f})"
            for d in verdicts["disagreements"]
        ]
    else:
        lines.append(f"- NVML vs estimate: {nv.get('note')}")
    return lines


# ============================================================================================ main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="where gpu.json and gpu.md go")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny model, few batches, grid 0/2 workers")
    parser.add_argument("--skip-check", action="store_true", help="skip the NVML check (step 1)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="skip the remaining fits (the second tuned one last) once this much time is spent",
    )
    parser.add_argument("--seed", type=int, default=0, help="order of the static grid")
    return parser.parse_args(argv)


def plan(args: argparse.Namespace) -> list[tuple[str, int, bool]]:
    """(label, start workers, tuned): the tuned fit, the grid in a seeded shuffle, the tuned fit again."""
    grid = list(SETTINGS["quick" if args.quick else "full"]["grid"])
    rule = rule_of_thumb_workers()
    static = [(f"static {w}x{PREFETCH}", w, False) for w in grid]
    if rule not in grid:
        static.append((f"rule of thumb {rule}x{PREFETCH}", rule, False))
    random.Random(args.seed).shuffle(static)
    tuned = [("tuned from 0 (first)", 0, True)]
    return tuned + static + ([] if args.quick else [("tuned from 0 (last)", 0, True)])


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    torch = _quiet_torch_for(args.device)
    mode = SETTINGS["quick" if args.quick else "full"]
    _, model_name, is_resnet = build_model(args.device, args.quick)
    results: dict[str, Any] = {"meta": _meta(args, mode, model_name, is_resnet, torch), "runs": []}
    print(f"[gpu bench] {results['meta']['mode']} on {args.device}: {model_name}", flush=True)
    results["nvml_check"] = _nvml_check(args, torch)
    write_outputs(results, args.out)

    from workloads import _jpeg_folder

    _jpeg_folder()  # generate the images once, before any fit is timed
    warm_up(args.device, args.quick, mode["batch_size"], 160)
    _run_fits(results, plan(args), args, started)
    print(f"[gpu bench] step 3: summary in {os.path.join(args.out, 'gpu.md')}", flush=True)
    print(render_markdown(results).split("## Summary", 1)[-1].strip(), flush=True)
    return results


def _quiet_torch_for(device: str) -> Any:
    """torch, with Lightning's info lines and warnings off; exits where ``cuda`` is asked and torch sees none."""
    import logging
    import warnings

    import torch

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)  # the progress lines here say what runs
    warnings.filterwarnings("ignore")

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu --quick for the CPU run)")
    if device == "cpu":
        torch.set_num_threads(1)  # as the tuning benchmark: no OpenMP threads spinning against the workers
    return torch


def _meta(
    args: argparse.Namespace, mode: dict[str, Any], model_name: str, is_resnet: bool, torch: Any
) -> dict[str, Any]:
    """The run's meta: mode, device, model, what one fit runs, the GPU, the machine."""
    return {
        "mode": "quick" if args.quick else "full",
        "device": args.device,
        "model": model_name,
        "resnet18": is_resnet,
        "batch_size": mode["batch_size"],
        "batches_per_epoch": mode["batches"],
        "epochs": mode["epochs"],
        "band": BAND,
        "precision": "bf16-mixed" if args.device == "cuda" else "32-true",
        "gpu_name": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "machine": machine_info(),
        "rule_of_thumb_workers": rule_of_thumb_workers(),
    }


def _nvml_check(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    """Step 1: the NVML check of ``scripts/check_gpu.py``, or why it is skipped; an error is recorded, not raised."""
    if args.device != "cuda":
        return {"skipped": "no CUDA device (--device cpu)"}
    if args.skip_check:
        return {"skipped": "--skip-check"}
    print("[gpu bench] step 1: NVML check", flush=True)
    import check_gpu

    try:
        check = check_gpu.run_checks(0)
    except Exception as err:  # the fits still tell a lot: record and go on
        check = {"error": f"{type(err).__name__}: {err}", "passed": False}
    torch.cuda.empty_cache()
    return check


def _run_fits(
    results: dict[str, Any], fits: list[tuple[str, int, bool]], args: argparse.Namespace, started: float
) -> None:
    """Step 2: every planned fit, skipped once the time budget is spent; the outputs rewritten after each."""
    with tempfile.TemporaryDirectory(prefix="dltune-gpu-bench-") as log_root:
        for i, (label, workers, tune) in enumerate(fits, start=1):
            spent = time.perf_counter() - started
            if spent > args.budget_s:
                print(f"[gpu bench] budget of {args.budget_s:.0f} s spent: skipping {label}", flush=True)
                results["runs"].append(
                    {
                        "label": label,
                        "start_workers": workers,
                        "tuned": tune,
                        "prefetch_factor": PREFETCH,
                        "error": "skipped: time budget spent",
                    }
                )
                continue
            print(f"[gpu bench] step 2: fit {i}/{len(fits)} {label} ({spent:.0f} s so far)", flush=True)
            results["runs"].append(_fit_or_error(label, workers, tune, args, log_root))
            results["summary"] = summarize(results["runs"])
            results["meta"]["wall_s"] = time.perf_counter() - started
            write_outputs(results, args.out)


def _fit_or_error(label: str, workers: int, tune: bool, args: argparse.Namespace, log_root: str) -> dict[str, Any]:
    """One fit under its label, or the error that stopped it; a line saying which."""
    try:
        run = run_fit(label.split(" (")[0].replace(" ", "-"), workers, tune, args, log_root)
        run["label"] = label
    except Exception as err:
        run = {
            "label": label,
            "start_workers": workers,
            "tuned": tune,
            "prefetch_factor": PREFETCH,
            "error": f"{type(err).__name__}: {err}",
        }
    if "error" not in run:
        pairs = " ".join(f"{_f(w['nvml_util'])}/{_f(w['estimate'])}" for w in run["windows"])
        print(
            f"    {run['fit_s']:.1f} s, {run['samples_per_s']:.0f} samples/s, NVML/estimate per window: {pairs}",
            flush=True,
        )
    else:
        print(f"    ! {run['error']}", flush=True)
    return run


if __name__ == "__main__":
    main()
