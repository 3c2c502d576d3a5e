"""CPU hogs that are not the test process's descendants: neighbours, as another job on the node is.

Each busy-loops for at most ``seconds`` (a test that dies leaves none behind for long); the shell that starts
it exits at once, so it is reparented and the tuner's reading of its own process tree does not count it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

_LOOP = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def busy_loop(seconds: float) -> str:
    """Python code that keeps a core busy for ``seconds`` (run it as a child to make a worker of our own)."""
    return _LOOP.format(seconds=seconds)


def start_neighbour(seconds: float = 60.0) -> int:
    """A detached busy loop; its pid."""
    code = busy_loop(seconds)
    out = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{code}" >/dev/null 2>&1 & echo $!'],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout.strip())


def stop_neighbour(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
