"""The demo as a new user runs it, checked: the first look, the verdicts and the recommendation.

    python benchmarks/demo_check.py                      # 3 runs on a quiet machine, ~2 min on 2 cores
    python benchmarks/demo_check.py --runs 2 --hog       # 2 runs beside a process spinning on a core
    python benchmarks/demo_check.py --out benchmarks/results/demo_check.json

Each run is ``dltune fit --config configs/demo.yaml`` (the JPEG pipeline started at ``num_workers=0``,
its accelerator step emulated by a 30 ms sleep) in its own process, read from its console as a user
reads it. Three things are checked per run:

- **the first look finds the starvation**: the fit's first window (``epoch 0 to batch 10``) runs 0
  workers, is judged data-bound, and moves to more workers;
- **no verdict contradicts its own utilization**: no "data-bound" line above the band's top, no
  "compute-bound" line below its bottom;
- **the recommendation is never slower than a config measured under the same conditions**: in the
  fit's last two epochs (same machine, same moment: the conditions the recommendation was judged under),
  the recommended config's median window is within ``min_gain`` (5 %) of the best median window of any
  config. Like is compared with like: the recommended config's windows of those epochs, not the median it
  quotes (that is over all its windows since conditions last shifted, and a config that ran the whole fit
  would be compared with its own later windows). Where it did not run in those epochs, its quoted rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAND = (0.85, 0.95)
MIN_GAIN = 0.05
_LINE = re.compile(r"^\[dltune\] epoch (\d+)(?: to batch (\d+))? \| workers (\d+)(?: -> (\d+))?.*\| GPU busy (\d+)%")
_ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+~?(\d+)%\s+~?(\d+)%\s+(\d+)%\s+([\d,.]+)\s+([\d,]+)\s+(.+)$")
_RECOMMENDED = re.compile(r"^recommended: workers=(\d+) prefetch=(\d+).*\(([\d,]+) samples/s")


def _dltune() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "dltune")
    return here if os.path.exists(here) else "dltune"


def run_demo(log_dir: str, epochs: int) -> str:
    """One demo fit; its console (stdout and stderr together)."""
    command = [
        _dltune(),
        "fit",
        "--config",
        os.path.join(ROOT, "configs", "demo.yaml"),
        f"--trainer.max_epochs={epochs}",
        f"--trainer.logger.init_args.save_dir={log_dir}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the demo exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def judge(console: str, epochs: int) -> dict[str, Any]:
    """The three checks of one run's console."""
    lines = [m for m in map(_LINE.match, console.splitlines()) if m]
    verdicts = [line for line in console.splitlines() if line.startswith("[dltune] epoch ")]
    rows = [m for m in map(_ROW.match, console.splitlines()) if m]
    recommended = next((m for m in map(_RECOMMENDED.match, console.splitlines()) if m), None)
    first = lines[0] if lines else None
    first_ok = bool(
        first
        and first.group(2) is not None
        and first.group(3) == "0"
        and first.group(4) is not None
        and int(first.group(4)) > 0
        and "data-bound" in verdicts[0]
    )
    contradictions = []
    for text, line in zip(verdicts, lines):
        busy = int(line.group(5)) / 100
        if ("data-bound" in text and busy > BAND[1]) or ("compute-bound" in text and busy < BAND[0]):
            contradictions.append(text)
    late: dict[tuple[int, int], list[float]] = {}  # each config's windows of the last two epochs
    for r in rows:
        if int(r.group(1)) >= epochs - 2:
            late.setdefault((int(r.group(3)), int(r.group(4))), []).append(float(r.group(9).replace(",", "")))
    best_late = max((statistics.median(rates) for rates in late.values()), default=None)
    rate = float(recommended.group(3).replace(",", "")) if recommended else None
    key = (int(recommended.group(1)), int(recommended.group(2))) if recommended else None
    rate_late = statistics.median(late[key]) if key in late else rate
    recommendation_ok = rate_late is not None and best_late is not None and rate_late >= (1 - MIN_GAIN) * best_late
    return {
        "first_line": verdicts[0] if verdicts else None,
        "first_look_finds_starvation": first_ok,
        "contradicting_verdicts": contradictions,
        "recommended": recommended.group(0) if recommended else None,
        "recommended_samples_per_s": rate,
        "recommended_median_last_two_epochs_samples_per_s": rate_late,
        "best_config_median_last_two_epochs_samples_per_s": best_late,
        "recommendation_not_slower": recommendation_ok,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6, help="the demo's own 6 by default")
    parser.add_argument("--hog", action="store_true", help="run beside `python -c 'while True: pass'`")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--log-dir", default="/tmp/dltune-demo-check")
    args = parser.parse_args(argv)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.hog else None
    results = []
    try:
        for k in range(args.runs):
            started = time.perf_counter()
            log_dir = os.path.join(args.log_dir, f"run{k}")
            console = run_demo(log_dir, args.epochs)
            with open(os.path.join(log_dir, "console.txt"), "w") as f:
                f.write(console)
            result = {"run": k, "hog": args.hog, "wall_s": round(time.perf_counter() - started, 1)}
            result.update(judge(console, args.epochs))
            results.append(result)
            print(json.dumps(result), flush=True)
    finally:
        if hog is not None:
            hog.kill()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    ok = all(
        r["first_look_finds_starvation"] and not r["contradicting_verdicts"] and r["recommendation_not_slower"]
        for r in results
    )
    print(
        f"{sum(1 for r in results if r['first_look_finds_starvation'])}/{len(results)} first looks found the"
        f" starvation; {sum(len(r['contradicting_verdicts']) for r in results)} contradicting verdicts;"
        f" {sum(1 for r in results if r['recommendation_not_slower'])}/{len(results)} recommendations not slower"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
