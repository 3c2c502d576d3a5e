"""What one decision costs the training loop as a fit grows: ``decide`` on histories of 1 to 2000 windows.

A window's close runs the pure policy in the training process on every rank (the loop waits for it),
and the policy replays the fit's windows (:func:`~lightning_dltune.core.history.recall`). The windows
here come from the pipeline simulator the property tests use (``tests/helpers/pipeline_sim.py``: an
I/O-bound pipeline, +-30 % step jitter, 5 % noise), decided window after window as a fit would; each
length's cost is the median of repeated calls on that history, each right after the decision on the
window before (a fit's pattern: the replay finds the pools and shift checks of the windows it already
judged kept) and with nothing kept (a fit's first decision after a resume). The same histories are also
decided with every window replayed (``REPLAYED_WINDOWS`` lifted), the cost before the replay was bounded.

    python benchmarks/decision_cost.py                  # ~1 minute on 2 cores
    python benchmarks/decision_cost.py --out results    # also writes results/decision_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests", "helpers")]

from pipeline_sim import Pipeline, simulate  # noqa: E402

from lightning_dltune.core import history as history_module  # noqa: E402
from lightning_dltune.core import stats as stats_module  # noqa: E402
from lightning_dltune.core.config import LoaderConfig  # noqa: E402
from lightning_dltune.core.policy import decide  # noqa: E402
from lightning_dltune.core.records import Budget, PolicySettings, WindowRecord  # noqa: E402

LENGTHS = (1, 50, 100, 255, 500, 1000, 2000)
PIPELINE = Pipeline(cpu_s=0.01, io_s=0.2, step_s=0.03, batch_bytes=4 << 20, noise=0.05, step_jitter=0.3)
BUDGET = Budget(max_workers=64, memory_bytes=None, shm_bytes=None, cpus=64.0)
SETTINGS = PolicySettings()
WINDOW_BATCHES = 170  # 5 s of 30 ms steps
WINDOWS_PER_EPOCH = 8


def fit_history(windows: int) -> tuple[list[WindowRecord], LoaderConfig]:
    """``windows`` windows decided one after the other from 0 workers, and the config the last one chose."""
    records: list[WindowRecord] = []
    config, in_epoch, step = LoaderConfig(num_workers=0), 0, 0
    for k in range(windows):
        stats = simulate(config, PIPELINE, 64, batches=WINDOW_BATCHES, seed=k)
        decision = decide(config, stats, BUDGET, records, SETTINGS)
        in_epoch, step = in_epoch + WINDOW_BATCHES, step + WINDOW_BATCHES
        epoch_end = (k + 1) % WINDOWS_PER_EPOCH == 0
        records.append(
            WindowRecord(
                k // WINDOWS_PER_EPOCH,
                config,
                stats,
                decision.verdict,
                decision.reason,
                decision.config,
                end_batch=None if epoch_end else in_epoch,
                step=step,
                judged_util=decision.judged_util,
            )
        )
        config, in_epoch = decision.config, 0 if epoch_end else in_epoch
    return records, config


def forget() -> None:
    """Clear what earlier decisions' replays kept (the pools and shift checks of frozen windows)."""
    history_module._detect_shift.cache_clear()
    stats_module._pooled.cache_clear()


def cost_ms(records: list[WindowRecord], config: LoaderConfig, repeats: int, warm: bool) -> float:
    """Median milliseconds of one decision on ``records`` plus a new window of ``config``.

    ``warm``: right after the decision on the window before (what a fit does, window after window); else with
    nothing kept from earlier decisions (a fit's first decision after a resume).
    """
    stats = simulate(config, PIPELINE, 64, batches=WINDOW_BATCHES, seed=len(records))
    times = []
    for _ in range(repeats):
        forget()
        if warm and records:
            last = records[-1]
            decide(last.config, last.stats, BUDGET, records[:-1], SETTINGS)
        t0 = time.perf_counter()
        decide(config, stats, BUDGET, records, SETTINGS)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for decision_cost.json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    records, config = fit_history(max(LENGTHS))
    bounded = history_module.REPLAYED_WINDOWS
    rows = []
    for n in LENGTHS:
        history, last = records[: n - 1], records[n - 1].config
        now = cost_ms(history, last, args.repeats, warm=True)
        cold = cost_ms(history, last, args.repeats, warm=False)
        history_module.REPLAYED_WINDOWS = 1 << 30  # every window replayed: the cost before the bound
        unbounded = cost_ms(history, last, args.repeats if n <= 500 else 1, warm=False)
        history_module.REPLAYED_WINDOWS = bounded
        rows.append(
            {
                "windows": n,
                "decision_ms": round(now, 2),
                "first_decision_ms": round(cold, 2),
                "every_window_replayed_ms": round(unbounded, 2),
            }
        )
        print(
            f"{n:>5} windows: {now:7.2f} ms a decision after the one before ({cold:7.2f} ms with nothing kept,"
            f" {unbounded:7.2f} ms replaying every window)"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        result = {"replayed_windows": bounded, "window_batches": WINDOW_BATCHES, "rows": rows}
        with open(os.path.join(args.out, "decision_cost.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
