"""Ctrl-C and SIGTERM as a request to stop, answered at a point of the program's own choosing."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence


class StopRequest:
    """Ctrl-C or SIGTERM during a sweep: stop at the next batch, where the point's loader shuts down in order.

    The signal only sets a flag: an exception raised inside torch's loader machinery (mid-transfer of a
    batch, half-way through starting or stopping workers) can leave a worker, a queue or a transfer
    thread half shut, and the process hanging at exit. :meth:`check` raises :class:`KeyboardInterrupt`
    from the sweep's own code instead. A second signal raises at once.
    """

    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {signum}")
        self.signum = signum

    def check(self) -> None:
        """Raise :class:`KeyboardInterrupt` if a stop was asked for."""
        if self.signum is not None:
            raise KeyboardInterrupt(f"signal {self.signum}")

    @contextmanager
    def installed(self, signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[StopRequest]:
        """This request handles ``signums`` inside the block; the previous handlers come back after it."""
        previous = {signum: signal.signal(signum, self) for signum in signums}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
