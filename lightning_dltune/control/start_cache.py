"""The next fit starts tuned: the last recommendation for the same machine and data, kept in a small cache.

One JSON file per data set-up (dataset class and length, bytes of a batch, batch size) in
:func:`cache_dir` (``$XDG_CACHE_HOME/lightning-dltune``, else ``~/.cache/lightning-dltune``; delete
it to clear). Each file holds the machine it was measured on (usable CPUs, total memory, world size)
and the config the fit recommended; a fit on another machine does not take it (and says why).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import psutil

from lightning_dltune.control.resources import usable_cpus
from lightning_dltune.core.config import LoaderConfig

CACHE_ENV = "XDG_CACHE_HOME"


def cache_dir(root: Optional[str] = None) -> str:
    """Where the recommendations are kept (``root`` if given)."""
    if root:
        return root
    base = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lightning-dltune")


@dataclass(frozen=True)
class Fingerprint:
    """What a recommendation holds for: the data (``dataset``, its length, a batch's bytes and size) and the
    machine (usable CPUs, memory, ranks)."""

    dataset: str
    length: Optional[int]
    batch_bytes: Optional[int]
    batch_size: Optional[int]
    cpus: float
    memory_gib: float
    world_size: int

    def data_key(self) -> str:
        data = (self.dataset, self.length, self.batch_bytes, self.batch_size)
        return hashlib.sha256(repr(data).encode()).hexdigest()[:16]

    def machine(self) -> dict[str, Any]:
        return {"cpus": self.cpus, "memory_gib": self.memory_gib, "world_size": self.world_size}


def fingerprint(dataset: Any, batch_size: Optional[int], batch_bytes: Optional[int], world_size: int) -> Fingerprint:
    """The fingerprint of this fit on this machine."""
    try:
        length: Optional[int] = len(dataset)
    except TypeError:  # a stream
        length = None
    kind = f"{type(dataset).__module__}.{type(dataset).__qualname__}"
    memory = round(psutil.virtual_memory().total / 2**30, 1)
    return Fingerprint(kind, length, batch_bytes, batch_size, round(usable_cpus(), 2), memory, world_size)


class StartCache:
    """The cache of start configs in ``root`` (default :func:`cache_dir`)."""

    def __init__(self, root: Optional[str] = None) -> None:
        self.root = cache_dir(root)

    def path(self, key: Fingerprint) -> str:
        return os.path.join(self.root, f"{key.data_key()}.json")

    def lookup(self, key: Fingerprint) -> tuple[Optional[LoaderConfig], Optional[str]]:
        """The saved config for ``key`` and what to say about it (``(None, None)``: nothing saved for this data)."""
        path = self.path(key)
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            config = LoaderConfig(**saved["config"])
        except (OSError, ValueError, KeyError, TypeError):
            return None, None
        if saved.get("machine") != key.machine():
            return None, (
                f"[dltune] the saved start for this data ({path}) was measured on another machine"
                f" ({_machine_words(saved.get('machine'))}, here {_machine_words(key.machine())}): starting"
                " from the loaders' own config"
            )
        return (
            config,
            f"[dltune] starting from the last recommendation for this machine and data: {config.short()} ({path})",
        )

    def save(self, key: Fingerprint, config: LoaderConfig, samples_per_s: float) -> str:
        """Keep ``config`` as the start for ``key``; returns the file's path."""
        os.makedirs(self.root, exist_ok=True)
        path = self.path(key)
        entry = {
            "data": {k: v for k, v in asdict(key).items() if k not in key.machine()},
            "machine": key.machine(),
            "config": config.as_dict(),
            "samples_per_s": samples_per_s,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(entry, f, indent=1)
        os.replace(tmp, path)  # a reader never sees half a file
        return path


def _machine_words(machine: Any) -> str:
    if not isinstance(machine, dict):
        return "unknown"
    return f"{machine.get('cpus')} CPUs, {machine.get('memory_gib')} GiB, {machine.get('world_size')} process(es)"
