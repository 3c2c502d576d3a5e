"""Bringing the tuner's state back from a spawned rank zero to the process that built the tuner.

Under ``strategy="ddp_spawn"`` (and the other spawn or fork launchers) the fit runs in child
processes, each with its own copy of the callback; Lightning brings back the model's weights and
``callback_metrics``, not a callback's attributes. Rank zero of the children writes the tuner's state
to a file named when the tuner was built; the building process reads it (once) when it next looks
at the history, so ``trainer.callbacks[i].history`` reads the same after any strategy.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from typing import Any, Optional


class SpawnHandoff:
    """A one-shot file from a spawned rank zero to the process that created this object."""

    def __init__(self) -> None:
        self._owner = os.getpid()
        self._path = os.path.join(tempfile.gettempdir(), f"dltune-handoff-{self._owner}-{uuid.uuid4().hex}.json")

    def in_spawned_process(self) -> bool:
        """Whether this copy lives in another process than the one that created it."""
        return os.getpid() != self._owner

    def send(self, state: dict[str, Any]) -> None:
        """From a spawned process: leave ``state`` (JSON values) for the creating process."""
        partial = f"{self._path}.{os.getpid()}.partial"
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(state, f)
        os.replace(partial, self._path)

    def receive(self) -> Optional[dict[str, Any]]:
        """In the creating process: the state a spawned rank zero left, once; ``None`` when there is none."""
        if os.getpid() != self._owner or not os.path.exists(self._path):
            return None
        with open(self._path, encoding="utf-8") as f:
            state = json.load(f)
        os.remove(self._path)
        return state
