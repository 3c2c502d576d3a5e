"""How the tests run the ``dltune`` command: the installed script or ``python -m lightning_dltune``.

Every run gets its own image cache under the test's ``tmp`` (the demo generates JPEGs there) and
unbuffered output, so what a killed or timed-out run printed is still read back.

Example::

    proc = run_script("fit", "--config", "configs/demo.yaml", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DLTUNE_SCRIPT = Path(sys.executable).with_name("dltune")  # the console script the package installs


def command_env(tmp: Path) -> dict[str, str]:
    """This environment with the image cache under ``tmp`` and unbuffered output."""
    return {**os.environ, "DLTUNE_CACHE": str(tmp / "cache"), "PYTHONUNBUFFERED": "1"}


def run_script(*args: str, tmp: Path, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the installed ``dltune`` script with ``args`` to its end, output captured."""
    return subprocess.run(
        [str(DLTUNE_SCRIPT), *args], cwd=cwd, env=command_env(tmp), capture_output=True, text=True, timeout=timeout
    )


def run_module(*args: str, tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m lightning_dltune`` with ``args`` to its end, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_dltune", *args],
        cwd=REPO,
        env=command_env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
