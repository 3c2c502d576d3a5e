"""What else runs on the training process's cores, read from the host (real processes, real /proc).

The suite must pass beside a CPU hog that is not ours (``python -c "while True: pass" &``): every check
compares two intervals of this test, never an absolute level.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from neighbour import busy_loop, start_neighbour, stop_neighbour

from lightning_dltune.measure.host_cpu import HostCpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's per-CPU times")


def _others_over(host: HostCpu, seconds: float) -> float:
    start = host.read()
    time.sleep(seconds)
    share = host.between(start, host.read())
    assert share is not None
    return share.others


def test_a_neighbour_shows_and_the_processes_we_started_do_not():
    host = HostCpu()
    quiet = _others_over(host, 1.0)

    pid = start_neighbour()
    try:
        time.sleep(0.2)
        beside = _others_over(host, 1.0)
    finally:
        stop_neighbour(pid)
    assert beside > quiet + 0.6  # a busy loop takes about a core

    ours = subprocess.Popen([sys.executable, "-c", busy_loop(30)])  # a worker of ours (a descendant) takes a core too
    try:
        time.sleep(0.2)
        with_child = _others_over(host, 1.0)
    finally:
        ours.kill()
        ours.wait()
    assert with_child < quiet + 0.4

    start = host.read()  # a worker that made batches and exited between two readings is still ours
    subprocess.run([sys.executable, "-c", busy_loop(0.8)])
    share = host.between(start, host.read())
    assert share is not None and share.others < quiet + 0.4


def test_too_short_an_interval_or_a_missing_reading_says_nothing():
    host = HostCpu()
    reading = host.read()
    assert reading is not None
    assert host.between(reading, host.read()) is None  # under the host's 10 ms ticks' resolution
    assert host.between(None, reading) is None
    time.sleep(0.15)
    share = host.between(reading, host.read())
    assert share is not None and share.others >= 0.0 and 0.0 <= share.busy <= 1.0
