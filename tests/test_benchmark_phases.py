"""The benchmark's changing conditions: where a slowdown starts, what the phase oracle runs, how the band is clocked."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def _benchmark_modules():
    """``benchmarks/phases.py`` and ``benchmarks/workloads.py``, without shadowing the tests' own ``workloads``."""
    names = ("workloads", "phases")
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    sys.path.insert(0, BENCHMARKS)
    try:
        return importlib.import_module("phases"), importlib.import_module("workloads")
    finally:
        sys.path.remove(BENCHMARKS)
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


_phases, _workloads = _benchmark_modules()
EpochFlag, band_reached = _phases.EpochFlag, _phases.band_reached
WORKLOADS, LatencyDataset, make_dataset = _workloads.WORKLOADS, _workloads.LatencyDataset, _workloads.make_dataset


def test_drift_slows_samples_from_the_middle_of_the_epoch_whatever_its_length():
    drift = WORKLOADS["drift-epoch"]
    assert (drift.epochs, drift.phase_start(), drift.train_batches) == (1, 450, 900)
    short = drift.scaled(200)
    assert short.phase_start() == 100
    assert make_dataset(short, train=True).slow_from_index == 100 * short.batch_size
    # the phase's oracle runs the slow half alone, slow from its first batch
    alone = short.slowed_throughout()
    assert alone.train_batches == 100 and make_dataset(alone, train=True).slow_from_index == 0


def test_slow_at_epoch_reads_the_epoch_the_training_process_wrote(tmp_path):
    flag = EpochFlag(str(tmp_path / "epoch"))
    dataset = LatencyDataset(4, (2,), 0.0, slow_factor=3.0, slow_from_epoch=3, epoch_file=flag.path)
    assert not dataset._slow(0)
    flag._write(3)
    assert dataset._slow(0)
    assert WORKLOADS["slow-at-epoch"].phase_start() == 3 * WORKLOADS["slow-at-epoch"].train_batches
    assert WORKLOADS["slow-at-epoch"].slowed_throughout().slow_from_epoch == 0


def test_slow_at_epoch_without_its_epoch_file_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("DLTUNE_BENCH_EPOCH_FILE", raising=False)
    with pytest.raises(RuntimeError, match="DLTUNE_BENCH_EPOCH_FILE"):
        make_dataset(WORKLOADS["slow-at-epoch"], train=True)


def test_band_is_reached_after_twenty_fed_batches_in_a_row():
    steps = [0.020] * 100
    waits = [0.060] * 30 + [0.001] * 70  # starved for 30 batches, then fed
    assert band_reached(waits, steps, 0.85) == 30 + 20
    assert band_reached(waits, steps, 0.85, first=60) == 80
    assert band_reached([0.060] * 100, steps, 0.85) is None
