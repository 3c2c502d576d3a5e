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
    digest = hashlib.sha256()
    package = os.path.join(REPO_ROOT, "lightning_dltune")
    for name in sorted(os.listdir(package)):
        if name.endswith(".py"):
            with open(os.path.join(package, name), "rb") as f:
                digest.update(name.encode() + f.read())
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "usable_cpus": usable_cpus(),
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "ram_gib": psutil.virtual_memory().total / 2**30,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "git_commit": commit,
        "package_sha256": digest.hexdigest()[:16],
    }
