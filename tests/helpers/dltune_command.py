"""How the tests run the ``dltune`` command: the installed script or ``python -m lightning_dltune``.

Every run gets its own image cache under the test's ``tmp`` (the demo generates JPEGs there) and
unbuffered output, so what a killed or timed-out run printed is still read back.

Example::

    proc = run_script("fit", "--config", "configs/demo.yaml", tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
"""

from __future__ import annotations

import json
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


# One Python process runs many short commands (a bad option, ``--help``): each is the console script's own
# entry point, ``main()`` with ``sys.argv`` as the script sets it, its stdout and stderr caught at the file
# descriptors, so Lightning's logging handlers are caught too. Starting Lightning takes seconds; a command
# that stops at its parser takes a fraction of one. The launchers themselves are tested by run_script and
# run_module.
_MANY = r"""
import json, os, sys
sys.path.append(sys.path.pop(0))  # as the installed script: the current directory is not searched first
from lightning_dltune.cli.command import main

runs, out, SCRIPT = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
results = []
for k, (args, cwd) in enumerate(runs):
    os.chdir(cwd)
    saved = os.dup(1), os.dup(2)
    files = [os.path.join(out, f"{k}.{name}") for name in ("out", "err")]
    for fd, path in zip((1, 2), files):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [SCRIPT, *args]
    try:
        code = main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    results.append(code)
with open(os.path.join(out, "codes.json"), "w") as f:
    json.dump(results, f)
"""


def run_many(
    runs: list[list[str]], tmp: Path, cwd: Path = REPO, timeout: float = 300
) -> list[subprocess.CompletedProcess]:
    """Run ``dltune`` once per word list in ``runs``, one after another in one Python process (see ``_MANY``).

    Only for commands that stop before a fit starts: a fit's loader workers, loggers and threads would share
    the process with the commands after it. Each result is what that one command printed and its exit status.
    """
    out = tmp / "run_many"
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _MANY, json.dumps([[r, str(cwd)] for r in runs]), str(out), str(DLTUNE_SCRIPT)],
        cwd=cwd,
        env=command_env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and (out / "codes.json").is_file(), proc.stderr[-3000:]
    codes = json.loads((out / "codes.json").read_text())
    return [
        subprocess.CompletedProcess(
            [str(DLTUNE_SCRIPT), *args], code, (out / f"{k}.out").read_text(), (out / f"{k}.err").read_text()
        )
        for k, (args, code) in enumerate(zip(runs, codes))
    ]
