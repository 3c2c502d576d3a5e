"""Changing conditions inside a benchmark fit, and the per-batch clocks that judge the part after a change.

The callbacks run in the child process of one fit (see ``tuning.py --run-one``):

- :class:`EpochFlag` writes the current epoch to a file at every epoch start: persistent loader workers
  hold their own copy of the dataset, so the epoch reaches them through the file, not an attribute.
- :class:`CpuHog` runs one busy-looping process (a noisy neighbour) during one epoch.
- :class:`BatchClock` keeps the start and end of every training batch and the start of every epoch, so
  that a phase's wall time and the point where the fit reached the band come from the fit's own clocks.

:func:`clock_summary` turns those clocks into the numbers the harness reports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from workloads import HOG_MARK

BAND_SPAN = 20
"""Batches over which utilization must reach the band's low edge for the fit to count as in band there."""

UTIL_BLOCK = 25
"""Batches per point of the per-batch utilization series kept in the results."""


class EpochFlag(Callback):
    """Writes ``trainer.current_epoch`` to ``path`` at every epoch start (atomically: a worker never reads half)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._write(0)

    def _write(self, epoch: int) -> None:
        partial = self.path + ".partial"
        with open(partial, "w") as f:
            f.write(str(epoch))
        os.replace(partial, self.path)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._write(trainer.current_epoch)


class CpuHog(Callback):
    """One process that busy-loops on a CPU from the start of epoch ``epoch`` to the start of the next one.

    A neighbour, as another job on the node is: not the training process's descendant (a launcher starts
    it and exits, so it is reparented), which the tuner would count as the job's own CPU. It ends itself
    after ``limit_s`` whatever happens to the fit, and is ended with the fit.
    """

    def __init__(self, epoch: int, limit_s: float = 900.0) -> None:
        self.epoch = epoch
        self.limit_s = limit_s
        self.pid: Optional[int] = None
        self.started_at: Optional[float] = None
        self.ended_at: Optional[float] = None

    def _start(self) -> None:
        code = f"import time\nend = time.monotonic() + {self.limit_s}\nwhile time.monotonic() < end:\n    pass\n"
        launcher = (
            "import subprocess, sys\n"
            f"hog = subprocess.Popen([sys.executable, '-c', {code!r}, {HOG_MARK!r}], stdout=subprocess.DEVNULL,"
            " stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)\n"
            "print(hog.pid)\n"
        )
        out = subprocess.run([sys.executable, "-c", launcher], check=True, capture_output=True, text=True)
        self.pid = int(out.stdout.strip())
        self.started_at = time.perf_counter()

    def _stop(self) -> None:
        if self.pid is not None and self.ended_at is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.ended_at = time.perf_counter()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch and self.pid is None:
            self._start()
        elif trainer.current_epoch > self.epoch:
            self._stop()

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._stop()


class BatchClock(Callback):
    """``perf_counter`` at every epoch start and at the start and end of every training batch."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, float, float]] = []  # (epoch, start, end)
        self.epoch_starts: dict[int, float] = {}
        self._start = 0.0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epoch_starts[trainer.current_epoch] = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches.append((trainer.current_epoch, self._start, time.perf_counter()))


def _waits_and_steps(clock: BatchClock) -> tuple[list[float], list[float]]:
    """Per batch: the fetch wait (since the previous batch ended, or since the epoch started) and the step."""
    waits, steps = [], []
    previous: Optional[tuple[int, float, float]] = None
    for epoch, start, end in clock.batches:
        since = previous[2] if previous is not None and previous[0] == epoch else clock.epoch_starts.get(epoch, start)
        waits.append(max(0.0, start - since))
        steps.append(end - start)
        previous = (epoch, start, end)
    return waits, steps


def band_reached(
    waits: list[float], steps: list[float], low: float, first: int = 0, span: int = BAND_SPAN
) -> Optional[int]:
    """The batch by which the fit first ran ``span`` batches in a row at utilization >= ``low``, from ``first`` on.

    Utilization over batches ``[b, b + span)`` is Σ step / Σ (wait + step); the answer is ``b + span``
    (batches from the start of the fit), ``None`` where that never happened.
    """
    for b in range(first, len(steps) - span + 1):
        busy = sum(steps[b : b + span])
        if busy / (busy + sum(waits[b : b + span])) >= low:
            return b + span
    return None


def clock_summary(clock: BatchClock, fit_end: float, phase_start: int, low: float) -> dict[str, Any]:
    """What the harness reports from the clocks.

    Args:
        clock: the fit's :class:`BatchClock`.
        fit_end: ``perf_counter`` when ``trainer.fit`` returned.
        phase_start: the fit's first batch of the judged phase (0: the whole fit).
        low: the band's low edge.

    Returns:
        ``phase_s``: wall time from the end of the batch before the phase to the end of the fit (the whole fit
        from its first epoch's start where the phase starts at 0); ``band_reached_batch``: see
        :func:`band_reached`, from the first batch; ``band_reached_after_change``: the same from the phase's
        first batch, counted from it; ``util_blocks``: utilization per ``UTIL_BLOCK`` batches.
    """
    waits, steps = _waits_and_steps(clock)
    if not steps:
        return {"phase_s": None, "band_reached_batch": None, "band_reached_after_change": None, "util_blocks": []}
    if 0 < phase_start <= len(clock.batches):
        phase_from = clock.batches[phase_start - 1][2]
    else:
        phase_from = min(clock.epoch_starts.values(), default=clock.batches[0][1])
    after = band_reached(waits, steps, low, first=phase_start) if 0 < phase_start < len(steps) else None
    blocks = []
    for b in range(0, len(steps), UTIL_BLOCK):
        busy = sum(steps[b : b + UTIL_BLOCK])
        blocks.append(busy / (busy + sum(waits[b : b + UTIL_BLOCK])))
    return {
        "phase_s": fit_end - phase_from,
        "band_reached_batch": band_reached(waits, steps, low),
        "band_reached_after_change": None if after is None else after - phase_start,
        "util_blocks": blocks,
        "batches_clocked": len(steps),
    }
