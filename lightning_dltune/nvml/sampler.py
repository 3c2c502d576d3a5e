"""GPU utilization from NVML for the device this rank trains on, averaged over the training part of a window.

NVML is optional: with no library, no driver, a MIG slice, a device NVML cannot measure, or no
CUDA device at all, :class:`UtilizationSampler` says ``available == False`` with a reason, and the
tuner estimates utilization as ``1 - starvation ratio`` (``util_source = "estimate"``).

NVML is called only in the training process that built the sampler, never in DataLoader worker
processes: the sampler records ``os.getpid()`` when it is built and goes quiet in any other
process (a forked worker inherits a copy of it, and NVML handles are not valid across fork).
"""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_dltune.core import validation
from lightning_dltune.core.stats import UtilSource
from lightning_dltune.nvml.device import (
    GPU_IS_LOST,
    NOT_FOUND,
    cuda_device_identity,
    describe_nvml_error,
    nvml_code,
    nvml_error_code,
    open_device,
    parse_device,
    read_utilization_samples,
)
from lightning_dltune.nvml.utilization import UtilizationWindow

if TYPE_CHECKING:
    import torch

__all__ = ["MODE_RATES", "MODE_SAMPLES", "UtilizationSampler", "cuda_device_identity"]

MODE_SAMPLES = "samples"
"""Read from the driver's sample buffer (``nvmlDeviceGetSamples``), in batches, each sample weighted by its time."""
MODE_RATES = "rates"
"""``nvmlDeviceGetUtilizationRates`` polled every ``poll_interval_s``, each weighted by the time since the last."""
_MODE_PROBING = "probing"  # samples not confirmed yet: read both, keep whichever serves

# Samples mode is confirmed by a sample arriving; after this many empty reads spanning this long,
# the driver does not serve samples for this device and polled rates take over.
_CONFIRM_READS = 3
_CONFIRM_US = 2e6

# A failed read is retried after poll_interval_s x 2**failures (at most _MAX_BACKOFF_S); this many
# failures in a row, or a lost GPU, stop NVML for the fit.
_MAX_FAILURES = 5
_MAX_BACKOFF_S = 60.0


def _now_us() -> float:
    """Wall clock in microseconds, the clock of NVML sample timestamps (a seam for tests)."""
    return time.time() * 1e6


class UtilizationSampler:
    """Mean NVML ``utilization.gpu`` of this rank's device over the training part of a window.

    What it measures: ``nvidia-smi``'s ``GPU-Util`` (the share of the driver's sample period in which
    a kernel ran), averaged over the training part of the window: after :meth:`start_window`, not
    between :meth:`pause` and :meth:`resume` (validation, checkpointing). Each reading counts for the
    time it covers, and a stretch in which the driver stopped sampling an idle GPU counts as idle.

    How it reads NVML (:attr:`mode`): the driver's sample buffer (``nvmlDeviceGetSamples``), read
    every ``poll_interval_s`` once a first sample confirmed it (``"samples"``), else
    ``nvmlDeviceGetUtilizationRates`` polled as often (``"rates"``); :attr:`window_mode` says which
    served the last :meth:`window_mean`. :meth:`maybe_poll` is meant for every batch: in the common
    case one float comparison, no thread.

    The device is matched by UUID, then PCI bus id (:attr:`matched_by`), never by index. Absent NVML
    is a normal case: ``available == False``, ``source == "estimate"`` and an ``unavailable_reason``,
    never an exception. A failed read is retried with a growing delay; NVML is given up only after
    repeated failures in a row (or a lost GPU). Build, poll and close it in the training process:
    it stays silent in any other (DataLoader workers), and a pickled copy is an unavailable one.

    Args:
        device: the torch device this rank trains on (``cuda:N``). ``None``, ``cpu`` or ``mps``:
            not available. A string such as ``"cuda:0"`` is accepted.
        nvml: the ``pynvml`` module (from ``nvidia-ml-py``); ``None`` imports it lazily. Tests pass
            a fake with the same names.
        poll_interval_s: seconds between two reads of NVML from :meth:`maybe_poll`.

    Raises:
        ValueError: if ``poll_interval_s`` is not a finite number > 0, or ``device`` is not a
            ``torch.device``, a device string or ``None``.

    Example::

        sampler = UtilizationSampler(torch.device("cuda", 0))
        sampler.start_window()
        for batch in loader:
            sampler.maybe_poll(time.perf_counter())
            train_step(batch)
        sampler.pause()  # validation, checkpointing
        validate()
        sampler.resume()
        util = sampler.window_mean()  # e.g. 0.91 (sampler.window_mode: "samples"), or None
        sampler.close()
    """

    def __init__(
        self, device: Union[torch.device, str, None], nvml: Optional[object] = None, poll_interval_s: float = 5.0
    ) -> None:
        self.poll_interval_s = validation.number(
            "poll_interval_s", poll_interval_s, 0.0, math.inf, low_open=True, high_open=True
        )
        self._device_type, self._device_index = parse_device(device)
        self._pid = os.getpid()
        self._nvml: Any = None
        self._handle: Any = None
        self._initialised = False
        self._available = False
        self._reason: Optional[str] = None
        self._mode: Optional[str] = None
        self._mode_note: Optional[str] = None
        self._matched_by: Optional[str] = None
        self._util_samples = 1
        self._failures = 0
        self._cursor_us = 0  # NVML cursor: newest sample timestamp already read
        self._poll_started_us = 0.0
        self._empty_reads = 0
        self._next_poll = math.inf  # the whole per-batch cost: ``now < self._next_poll``
        self._window = UtilizationWindow()
        self._window_mode: Optional[str] = None
        try:
            self._connect(nvml)
        except Exception as err:  # never raise for NVML: an unexpected failure is one more reason
            self._disable(f"NVML setup failed: {type(err).__name__}: {err}")
        if self._available:
            self.start_window()
        elif self._initialised:
            self.close()  # nothing to measure: do not hold an NVML session

    # -- public state ---------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """``True`` when NVML serves utilization for this rank's device."""
        return self._available

    @property
    def source(self) -> str:
        """``"nvml"`` when measured, ``"estimate"`` when the tuner must estimate utilization."""
        return UtilSource.NVML if self._available else UtilSource.ESTIMATE

    @property
    def unavailable_reason(self) -> Optional[str]:
        """Why NVML does not serve (``None`` while available)."""
        return None if self._available else self._reason

    @property
    def mode(self) -> Optional[str]:
        """How NVML is read now: ``"samples"`` (confirmed by a sample), ``"rates"``, ``"probing"``
        (samples not confirmed yet; rates are polled meanwhile) or ``None`` when unavailable."""
        return self._mode if self._available else None

    @property
    def mode_note(self) -> Optional[str]:
        """Why rates are polled instead of samples (``None`` in samples mode)."""
        return self._mode_note if self._mode != MODE_SAMPLES else None

    @property
    def window_mode(self) -> Optional[str]:
        """``"samples"`` or ``"rates"``: what served the last :meth:`window_mean` (``None``: nothing did)."""
        return self._window_mode

    @property
    def matched_by(self) -> Optional[str]:
        """How the NVML handle was found: ``"uuid"`` or ``"pci_bus_id"`` (``None``: not found)."""
        return self._matched_by

    @property
    def handle(self) -> Any:
        """The NVML device handle in use (``None`` when unavailable), for diagnostics (``scripts/check_gpu.py``)."""
        return self._handle if self._available else None

    @property
    def paused(self) -> bool:
        """``True`` between :meth:`pause` and :meth:`resume`."""
        return self._window.paused

    @property
    def sample_count(self) -> int:
        """Readings counted in the current window so far (of the mode that serves it)."""
        acc = self._window.serving(self._mode == MODE_SAMPLES)
        return acc.count if acc is not None else 0

    # -- window control -------------------------------------------------------------------------
    def start_window(self) -> None:
        """Begin a measurement window (anywhere in an epoch): forget every older reading."""
        if not self._live():
            return
        if self._mode != MODE_RATES:
            self._window.skip_samples(self._read_samples())  # older samples are not this window's
        self._window.start(_now_us())
        self._window_mode = None
        self._next_poll = time.perf_counter() + self.poll_interval_s

    def pause(self) -> None:
        """Training pauses (validation, a checkpoint): time after this is not counted."""
        if self.paused or not self._live():
            return
        self._collect()  # what was measured up to here was training
        self._window.pause(_now_us())
        self._next_poll = math.inf

    def resume(self) -> None:
        """Training resumes."""
        if not self.paused or not self._live():
            return
        if self._mode != MODE_RATES:
            self._collect()  # samples of the pause: read now so that none is counted as training
        self._window.resume(_now_us())
        self._next_poll = time.perf_counter() + self.poll_interval_s

    def maybe_poll(self, now: float) -> None:
        """Read NVML if ``poll_interval_s`` passed since the last read; ``now`` is ``time.perf_counter()``."""
        if now < self._next_poll:
            return
        self._next_poll = now + self.poll_interval_s
        if self._live():
            self._collect()
            if self._failures and self._available:  # back off: retry after a growing delay
                self._next_poll = now + min(_MAX_BACKOFF_S, self.poll_interval_s * 2**self._failures)

    def window_mean(self) -> Optional[float]:
        """Mean utilization in ``[0, 1]`` over the training part of the window; ``None`` without data.

        Reads NVML a last time (unless paused). ``None`` when NVML is unavailable or no reading fell
        inside training. :attr:`window_mode` says whether samples or polled rates served it.
        """
        if not self._live():
            return None
        if not self.paused:
            self._collect()
        window = self._window
        acc = window.serving(self._mode == MODE_SAMPLES)
        if acc is None and self._available and not self.paused:
            # a window shorter than the driver's sample period: one instantaneous reading
            self._read_rate(whole_window=True)
            acc = window.serving(self._mode == MODE_SAMPLES)
        if not self._available or acc is None:
            self._window_mode = None
            return None
        self._window_mode = MODE_SAMPLES if acc is window.samples else MODE_RATES
        return window.mean_of_samples(_now_us()) if acc is window.samples else acc.mean()

    def close(self) -> None:
        """Release NVML (``nvmlShutdown``) if this sampler initialised it. Idempotent."""
        initialised, self._initialised = self._initialised, False
        self._next_poll = math.inf
        if initialised and os.getpid() == self._pid:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        if self._available:
            self._disable("closed")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self) -> dict:
        # A pickled or deep-copied sampler (ddp_spawn, deepcopy of a callback) holds no NVML session:
        # modules and device handles do not travel between processes. Build one where it is used.
        state = self.__dict__.copy()
        state.update(
            _nvml=None,
            _handle=None,
            _initialised=False,
            _available=False,
            _next_poll=math.inf,
            _reason="copied from another process or object: build the sampler where it is used",
        )
        return state

    # -- setup ----------------------------------------------------------------------------------
    def _connect(self, nvml: Optional[object]) -> None:
        if self._device_type != "cuda":
            self._reason = f"not a CUDA device ({self._device_type or 'no device'})"
            return
        self._nvml, self._handle, self._matched_by, reason, self._initialised = open_device(
            nvml,
            self._device_index,
            lambda index: cuda_device_identity(index),  # looked up here: tests patch it
        )
        if reason is not None:
            if self._initialised:
                self._disable(reason)
            else:
                self._reason = reason
            return
        self._poll()

    def _poll(self) -> None:
        """Samples if the first read returns any; probing if the buffer is empty; rates if samples fail."""
        nvml = self._nvml
        self._util_samples = int(getattr(nvml, "NVML_GPU_UTILIZATION_SAMPLES", 1))
        self._poll_started_us = _now_us()
        try:
            _, samples = nvml.nvmlDeviceGetSamples(self._handle, self._util_samples, 0)
        except Exception as err:
            if nvml_error_code(err) != nvml_code(nvml, "NVML_ERROR_NOT_FOUND", NOT_FOUND):
                try:
                    nvml.nvmlDeviceGetUtilizationRates(self._handle)
                except Exception as err2:
                    self._disable(
                        f"NVML serves no utilization for this device (samples: {describe_nvml_error(err)}; "
                        f"rates: {describe_nvml_error(err2)})"
                    )
                    return
                self._mode, self._mode_note = MODE_RATES, f"nvmlDeviceGetSamples failed: {describe_nvml_error(err)}"
                self._available = True
                return
            samples = []
        if not samples:
            try:  # the buffer is empty for now: rates must serve until a sample confirms samples mode
                nvml.nvmlDeviceGetUtilizationRates(self._handle)
            except Exception as err:
                why = f"samples: none yet; rates: {describe_nvml_error(err)}"
                self._disable(f"NVML serves no utilization for this device ({why})")
                return
        stamps = sorted(int(s.timeStamp) for s in samples)
        self._cursor_us = stamps[-1] if stamps else 0
        self._window.skip_samples([(ts, 0.0) for ts in stamps])  # learn the driver's period and clock
        self._mode = MODE_SAMPLES if stamps else _MODE_PROBING
        self._available = True
        self._reason = None

    # -- reading --------------------------------------------------------------------------------
    def _live(self) -> bool:
        """Available, and in the process that built the sampler (never in a DataLoader worker)."""
        if not self._available:
            return False
        if os.getpid() != self._pid:
            self._available = False
            self._reason = "not the process that built the sampler (DataLoader worker?)"
            self._initialised = False  # the training process owns the NVML session
            self._next_poll = math.inf
            return False
        return True

    def _collect(self) -> None:
        if self._mode != MODE_RATES:
            self._window.add_samples(self._read_samples())
        if self._mode != MODE_SAMPLES and self._available and not self.paused:
            self._read_rate()

    def _read_samples(self) -> list:
        """New samples as ``(timestamp_us, value in [0, 1])`` in time order; advances the cursor."""
        try:
            out = read_utilization_samples(self._nvml, self._handle, self._util_samples, self._cursor_us)
        except Exception as err:
            self._failed("reading samples", err)
            return []
        self._failures = 0
        if not out:
            self._note_empty_read()
            return out
        if self._mode == _MODE_PROBING:
            self._mode, self._mode_note = MODE_SAMPLES, None
        self._cursor_us = out[-1][0]
        self._window.check_clock(out[-1][0], _now_us())
        return out

    def _note_empty_read(self) -> None:
        if self._mode != _MODE_PROBING:
            return
        self._empty_reads += 1
        waited_us = _now_us() - self._poll_started_us
        if self._empty_reads >= _CONFIRM_READS and waited_us >= _CONFIRM_US:
            self._mode = MODE_RATES
            self._mode_note = (
                f"nvmlDeviceGetSamples returned no sample in {self._empty_reads} reads over"
                f" {waited_us / 1e6:.1f} s; polling nvmlDeviceGetUtilizationRates"
            )

    def _read_rate(self, whole_window: bool = False) -> None:
        try:
            value = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu) / 100.0
        except Exception as err:
            self._failed("reading utilization rates", err)
            return
        self._failures = 0
        self._window.add_rate(value, _now_us(), whole_window)

    def _failed(self, what: str, err: BaseException) -> None:
        """One failed read: :meth:`maybe_poll` retries later; NVML is given up after repeated failures."""
        self._failures += 1
        self._window.previous_us = None  # the driver's buffer may have moved on: the gap is unknown, not idle
        if nvml_error_code(err) == nvml_code(self._nvml, "NVML_ERROR_GPU_IS_LOST", GPU_IS_LOST):
            self._disable(f"NVML error while {what}: {describe_nvml_error(err)}")
        elif self._failures >= _MAX_FAILURES:
            self._disable(f"NVML failed {self._failures} times in a row while {what}; last: {describe_nvml_error(err)}")

    def _disable(self, reason: str) -> None:
        self._available = False
        self._reason = reason
        self._next_poll = math.inf

    def __repr__(self) -> str:
        state = f"mode={self._mode!r}" if self._available else f"reason={self._reason!r}"
        return f"{type(self).__name__}(source={self.source!r}, {state})"
