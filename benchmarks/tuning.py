"""Does the tuner pay? Every workload under every loader strategy, in one run, on this machine.

For each workload of :mod:`workloads` (I/O-bound, CPU-bound, step-bound, memory-heavy, bursty, and three
whose conditions change during the fit: drift-epoch, slow-at-epoch, noisy-neighbour) the harness runs, in
the same session so that ratios hold on a noisy machine:

- ``default``: ``num_workers=0``, what a new user gets;
- ``rule``: a common rule of thumb, Lightning's ``suggested_max_num_workers(1)`` workers, prefetch 2;
- ``oracle``: the best static config of a grid over workers x prefetch, measured in this run (every
  grid point runs a few epochs; the winner then runs the full fit);
- ``tuned_default``: :class:`~lightning_dltune.DataLoaderTuner` from the default start;
- ``tuned_bad``: the tuner from a bad start, 16 workers x prefetch 8;
- ``own_default`` and ``own_bad``: the same two tuned fits with the loaders a project builds itself,
  plain ``DataLoader`` calls in the LightningModule's hooks and no datamodule (:mod:`own_loaders`),
  judged against the oracle and against the mixin's tuned fit of the same start.

A workload that slows down during the fit (:mod:`phases`) is judged on the part after the change: its
grid runs the slow cost throughout, so the oracle is the best static config *of that phase*, and the
ratio compares the phase's wall time in the tuned and oracle fits (from the fits' own batch clocks).

Every fit runs in its own process (``--run-one``); the parent samples the memory of the whole
process tree (training process and loader workers) while it runs. Static strategies carry a
``DataLoaderTuner(tune=False)`` so that every strategy is measured by the same clocks.

    python benchmarks/tuning.py                  # full: 8 workloads, 8 epochs (~35 min on 2 cores)
    python benchmarks/tuning.py --quick          # 2 workloads, 3 epochs, tiny grid (~2 min)
    python benchmarks/tuning.py --smoke          # step-bound, 2 short epochs: does the harness work (~30 s)
    python benchmarks/tuning.py --workloads io-bound bursty --out /tmp/bench

Writes ``tuning.json``, ``tuning.md`` and ``tuning.png`` to ``--out`` (default ``benchmarks/results``).
"""

# This file is the command line; the harness lives next to it: workload_runs (the order of one
# workload's runs), fit_launcher and fit_runner (one fit in its own process), own_loaders (a project's
# own loaders), tree_memory, oracle, analysis, targets, tuning_report and tuning_plot.

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
for _path in (REPO_ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from analysis import analyse  # noqa: E402
from fit_runner import run_one  # noqa: E402
from machine import machine_info  # noqa: E402
from strategies import BAD_START, BAND, rule_of_thumb_workers  # noqa: E402
from targets import evaluate_targets  # noqa: E402
from tuning_report import num_text, write_outputs  # noqa: E402
from workload_runs import run_workload  # noqa: E402


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="io-bound and step-bound, 3 epochs, half-length epochs, grid 0/2/4 workers x prefetch 2",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the quickest check that the harness works: step-bound only, 2 epochs of 8 batches, "
        "grid 0/2 workers x prefetch 2 (~30 s; numbers mean little)",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for tuning.json/.md/.png")
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), help="which workloads (default: all)")
    parser.add_argument("--epochs", type=int, help="epochs per strategy (default 8; quick 3)")
    parser.add_argument("--grid-epochs", type=int, help="epochs per oracle grid point (default 3; quick 2)")
    parser.add_argument("--grid-workers", type=int, nargs="+", help="override every workload's grid of workers")
    parser.add_argument("--grid-prefetch", type=int, nargs="+", help="override every workload's grid of prefetch")
    parser.add_argument("--train-batches", type=int, help="training batches per epoch for every workload")
    parser.add_argument("--repeats", type=int, default=1, help="runs per strategy (the median run is reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run order and of the fits")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a fit is killed")
    parser.add_argument("--log-dir", help="where child logs go (default: a fresh temporary folder)")
    parser.add_argument(
        "--render",
        metavar="JSON",
        help="only re-render tuning.md/.png (and the target checks) from an existing tuning.json",
    )
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.quick = True
        args.workloads = args.workloads or ["step-bound"]
        args.epochs = args.epochs or 2
        args.grid_workers = args.grid_workers or [0, 2]
        args.train_batches = args.train_batches or 8
    if args.quick:
        args.workloads = args.workloads or ["io-bound", "step-bound"]
        args.epochs = args.epochs or 3
        args.grid_epochs = args.grid_epochs or 2
        args.grid_workers = args.grid_workers or [0, 2, 4]
        args.grid_prefetch = args.grid_prefetch or [2]
    args.workloads = args.workloads or list(WORKLOADS)
    args.epochs = args.epochs or 8
    args.grid_epochs = min(args.grid_epochs or 3, args.epochs)
    if args.epochs < 2 or args.grid_epochs < 1 or args.repeats < 1:
        parser.error("--epochs must be >= 2, --grid-epochs and --repeats >= 1")
    return args


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.run_one:
        result = run_one(json.loads(args.run_one))
        with open(args.result, "w") as f:
            json.dump(result, f)
        return result
    if args.render:
        return _render(args.render, args.out)

    from workloads import WORKLOADS

    started = time.perf_counter()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="dltune-bench-logs-")
    os.makedirs(log_dir, exist_ok=True)
    rng = random.Random(args.seed)
    machine = machine_info()
    rule_workers = rule_of_thumb_workers()
    print(
        f"lightning-dltune tuning benchmark ({'quick' if args.quick else 'full'}): {args.workloads}, "
        f"{args.epochs} epochs (a one-epoch workload: 1); child logs in {log_dir}",
        flush=True,
    )
    meta = _run_meta(args, argv, machine, rule_workers)
    results: dict[str, Any] = {"meta": meta, "workloads": {}, "targets": []}
    for index, name in enumerate(args.workloads):
        workload = WORKLOADS[name]
        batches = args.train_batches or (max(8, workload.train_batches // 2) if args.quick else workload.train_batches)
        workload = workload.scaled(batches)
        print(f"[{index + 1}/{len(args.workloads)}] {name}: {workload.cost}", flush=True)
        w = run_workload(workload, index, args, rule_workers, log_dir, rng)
        results["workloads"][name] = analyse(w, w["epochs"])
        _finish_meta(results, started)
        write_outputs(results, args.out)  # after every workload: a crash keeps what ran
    _finish_meta(results, started)
    write_outputs(results, args.out)
    print(f"done in {meta['wall_s'] / 60:.1f} min: {args.out}/tuning.{{json,md,png}}", flush=True)
    _print_targets(results["targets"])
    return results


def _render(path: str, out: str) -> dict[str, Any]:
    """``--render``: the target checks evaluated again and the outputs rewritten from an existing JSON."""
    with open(path) as f:
        results = json.load(f)
    results["targets"] = evaluate_targets(results["workloads"])
    write_outputs(results, out)
    print(f"rendered {out}/tuning.{{json,md,png}} from {path}")
    return results


def _run_meta(
    args: argparse.Namespace, argv: Optional[list[str]], machine: dict[str, Any], rule_workers: int
) -> dict[str, Any]:
    """The run's meta as it starts: mode, command line, machine, protocol, seed, start time."""
    command = "python benchmarks/tuning.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    return {
        "mode": "smoke"
        if args.smoke
        else "quick"
        if args.quick
        else ("full" if not any((args.train_batches, args.grid_workers, args.grid_prefetch)) else "custom"),
        "command": command.strip(),
        "machine": machine,
        "epochs": args.epochs,
        "grid_epochs": args.grid_epochs,
        "repeats": args.repeats,
        "rule_of_thumb_workers": rule_workers,
        "bad_start": {"num_workers": BAD_START[0], "prefetch_factor": BAD_START[1]},
        "band": list(BAND),
        "seed": args.seed,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _print_targets(targets: list[dict[str, Any]]) -> None:
    """The target checks, one line each, at the end of a run."""
    for t in targets:
        value = num_text(t["value"])
        print(f"  {'met   ' if t['met'] else 'MISSED'} {t['target']:<44} {t['workload']:<13} {t['start']:<13} {value}")


def _finish_meta(results: dict[str, Any], started: float) -> None:
    meta = results["meta"]
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["wall_s"] = time.perf_counter() - started
    loads, samples, cost = [], 0, 0.0
    for w in results["workloads"].values():
        loads += [g["load_avg_1m"] for g in w["grid"] if g.get("load_avg_1m") is not None and g["source"] == "grid"]
        for runs in w["runs"].values():
            for r in runs:
                loads.append(r.get("load_avg_1m", 0.0))
                mem = r.get("memory", {})
                samples += mem.get("samples", 0) or 0
                cost += r.get("process_wall_s", 0.0)
    meta["load_avg_min"] = min(loads) if loads else 0.0
    meta["load_avg_max"] = max(loads) if loads else 0.0
    meta["sampler_interval_ms"] = 1e3 * cost / samples if samples else 0.0
    results["targets"] = evaluate_targets(results["workloads"])


if __name__ == "__main__":
    main()
