"""Ctrl-C and SIGTERM only ask to stop; the program stops where it chooses."""

import signal

import pytest

from lightning_dltune.cli.interrupt import StopRequest


def test_a_stop_signal_only_asks_and_a_second_one_stops_at_once():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest().installed() as stop:
        stop.check()  # nothing asked yet
        signal.raise_signal(signal.SIGTERM)  # handled between bytecodes: no exception inside whatever ran
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            stop.check()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
