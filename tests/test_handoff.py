"""handoff: a spawned process's state reaches the process that built the tuner, once."""

import multiprocessing

import pytest

from lightning_dltune.control.handoff import SpawnHandoff

pytestmark = pytest.mark.slow  # a spawned process


def _send_from_child(handoff: SpawnHandoff) -> None:
    assert handoff.in_spawned_process()
    handoff.send({"state": {"rebuilds": 3}})


def test_a_spawned_process_hands_its_state_back_once():
    handoff = SpawnHandoff()
    assert not handoff.in_spawned_process() and handoff.receive() is None
    child = multiprocessing.get_context("spawn").Process(target=_send_from_child, args=(handoff,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert handoff.receive() == {"state": {"rebuilds": 3}}
    assert handoff.receive() is None  # read once: the file is gone
