"""Where a benchmark ran: the machine, the software versions and the exact package code (for the results' meta)."""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine_info() -> dict[str, Any]:
    """CPUs, RAM, versions, the git commit and a digest of the package's modules (uncommitted changes included)."""
    import lightning
    import psutil
    import torch

    from lightning_dltune.control.resources import usable_cpus

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "usable_cpus": usable_cpus(),
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "git_commit": _commit(),
        "package_sha256": package_digest(),
    }


def package_digest() -> str:
    """A digest of every module of the package, its subpackages' included, by path (uncommitted changes included)."""
    digest = hashlib.sha256()
    package = os.path.join(REPO_ROOT, "lightning_dltune")
    for folder, subfolders, names in os.walk(package):
        subfolders.sort()
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    digest.update(os.path.relpath(path, package).encode() + f.read())
    return digest.hexdigest()[:16]


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
