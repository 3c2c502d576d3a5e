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
from typing import TYPE_CHECKING, Any, Optional, Tuple, Union

if TYPE_CHECKING:
    import torch

__all__ = ["UtilizationSampler", "cuda_device_identity"]

_SOURCE_NVML = "nvml"
_SOURCE_ESTIMATE = "estimate"

# How the sampler reads NVML once it is available.
_MODE_SAMPLES = "samples"  # nvmlDeviceGetSamples: the driver's own sample buffer, read in batches
_MODE_RATES = "rates"  # nvmlDeviceGetUtilizationRates: one reading per poll

# NVML return codes (same values in every NVML release); the module's own names win when present.
_NOT_SUPPORTED = 3
_NOT_FOUND = 6
_FUNCTION_NOT_FOUND = 13
_MIG_ENABLE = 1

# nvmlValueType_t -> nvmlValue_t field; utilization samples are "unsigned int" (uiVal).
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

# NVML sample timestamps are "CPU timestamp in microseconds" (wall clock). If the newest sample is
# further than this from time.time(), the clocks are not comparable and samples are attributed by
# when they were collected instead (collection also happens at every pause/resume boundary).
_CLOCK_SKEW_LIMIT_US = 60e6


def _now_us() -> float:
    """Wall clock in microseconds, the clock of NVML sample timestamps (a seam for tests)."""
    return time.time() * 1e6


def cuda_device_identity(index: int) -> Tuple[Optional[str], Optional[str]]:
    """``(uuid, pci_bus_id)`` of CUDA device ``index`` as this process sees it.

    ``index`` is torch's ordinal, i.e. after ``CUDA_VISIBLE_DEVICES`` reordering; that is why NVML
    (which numbers all devices of the machine) is addressed by UUID or PCI bus id, never by index.
    The UUID is returned with NVML's prefix (``"GPU-..."``) when torch already gives one, bare
    otherwise. Initialises CUDA in this process (the training process does that anyway).

    Raises:
        RuntimeError: where torch has no CUDA device ``index`` (CPU or ROCm build, bad index).
    """
    import torch

    if getattr(torch.version, "hip", None):
        raise RuntimeError("ROCm build of torch: NVML does not serve AMD devices")
    if not torch.cuda.is_available():
        raise RuntimeError("torch reports no CUDA device")
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    uuid_str = str(uuid).strip() if uuid is not None else None
    bus = getattr(props, "pci_bus_id", None)
    dev = getattr(props, "pci_device_id", None)
    domain = getattr(props, "pci_domain_id", 0) or 0
    pci = f"{int(domain):08X}:{int(bus):02X}:{int(dev):02X}.0" if bus is not None and dev is not None else None
    return (uuid_str or None), pci


class UtilizationSampler:
    """Mean NVML ``utilization.gpu`` of this rank's device over the training part of a window.

    What it measures: the percentage of time over the driver's sample period during which one or
    more kernels ran on the device (``nvidia-smi``'s ``GPU-Util``), averaged over the samples whose
    time lies inside training: after :meth:`start_window`, and not between :meth:`pause` and
    :meth:`resume` (validation, checkpointing). Values are returned in ``[0, 1]``.

    Where ``nvmlDeviceGetSamples`` serves, the driver keeps the samples and the sampler reads them
    in batches every ``poll_interval_s`` (no thread); elsewhere it reads
    ``nvmlDeviceGetUtilizationRates`` once per poll. :meth:`maybe_poll` is meant for every batch: in
    the common case it is one float comparison.

    The device is matched to its NVML handle by UUID (then PCI bus id), never by index, so
    ``CUDA_VISIBLE_DEVICES`` reordering cannot point it at a neighbour's GPU. Absent NVML is a
    normal case: the sampler never raises for it, reports ``available == False``,
    ``source == "estimate"`` and an ``unavailable_reason``.

    Build it, poll it and close it in the training process only; it stays silent in any other
    process (DataLoader workers), and a pickled or deep-copied sampler is an unavailable one.

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
        sampler.pause()  # validation
        validate()
        sampler.resume()
        util = sampler.window_mean()  # e.g. 0.91, or None with sampler.unavailable_reason
        sampler.close()
    """

    def __init__(
        self,
        device: Union["torch.device", str, None],
        nvml: Optional[object] = None,
        poll_interval_s: float = 5.0,
    ) -> None:
        if (
            isinstance(poll_interval_s, bool)
            or not isinstance(poll_interval_s, (int, float))
            or not math.isfinite(poll_interval_s)
            or poll_interval_s <= 0
        ):
            raise ValueError(f"`poll_interval_s` must be a finite number > 0, got {poll_interval_s!r}.")
        self.poll_interval_s = float(poll_interval_s)
        self._device_type, self._device_index = self._parse_device(device)
        self._pid = os.getpid()
        self._nvml: Any = None
        self._handle: Any = None
        self._initialised = False
        self._available = False
        self._reason: Optional[str] = None
        self._mode: Optional[str] = None
        self._util_samples = 0
        # window state
        self._paused = False
        self._next_poll = math.inf  # the whole per-batch cost: ``now < self._next_poll``
        self._sum = 0.0
        self._count = 0
        self._last_seen_us = 0  # NVML cursor: newest sample timestamp already read
        self._clock_ok = True
        self._window_start_us = 0.0
        self._pauses: list[list[float]] = []  # [pause_us, resume_us or inf] of this window
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
        return _SOURCE_NVML if self._available else _SOURCE_ESTIMATE

    @property
    def unavailable_reason(self) -> Optional[str]:
        """Why NVML does not serve (``None`` while available)."""
        return None if self._available else self._reason

    @property
    def mode(self) -> Optional[str]:
        """``"samples"`` (driver sample buffer), ``"rates"`` (one reading per poll) or ``None``."""
        return self._mode if self._available else None

    @property
    def sample_count(self) -> int:
        """Samples counted in the current window so far."""
        return self._count

    # -- window control -------------------------------------------------------------------------
    def start_window(self) -> None:
        """Begin a training window (an epoch): forget every older sample."""
        if not self._live():
            return
        if self._mode == _MODE_SAMPLES:
            self._read_samples()  # advance the cursor past older samples; they are dropped below
        self._sum = 0.0
        self._count = 0
        self._paused = False
        self._pauses = []
        self._window_start_us = _now_us()
        self._next_poll = time.perf_counter() + self.poll_interval_s

    def pause(self) -> None:
        """Training pauses (validation begins): samples after this are not counted."""
        if self._paused or not self._live():
            return
        self._collect()  # what was measured up to here was training
        self._paused = True
        self._pauses.append([_now_us(), math.inf])
        self._next_poll = math.inf

    def resume(self) -> None:
        """Training resumes (validation ended)."""
        if not self._paused or not self._live():
            return
        if self._mode == _MODE_SAMPLES:
            self._collect()  # samples of the pause: read now so none is counted as training
        if self._pauses:
            self._pauses[-1][1] = _now_us()
        self._paused = False
        self._next_poll = time.perf_counter() + self.poll_interval_s

    def maybe_poll(self, now: float) -> None:
        """Read NVML if ``poll_interval_s`` passed since the last read; ``now`` is ``time.perf_counter()``."""
        if now < self._next_poll:
            return
        self._next_poll = now + self.poll_interval_s
        if self._live():
            self._collect()

    def window_mean(self) -> Optional[float]:
        """Mean utilization in ``[0, 1]`` over the training part of the window; ``None`` without data.

        Reads NVML a last time (unless paused). ``None`` when NVML is unavailable or no sample fell
        inside training.
        """
        if not self._live():
            return None
        if not self._paused:
            self._collect()
            if self._count == 0 and self._available and self._mode == _MODE_SAMPLES:
                # a window shorter than the driver's sample period: one instantaneous reading
                self._read_rate()
        if not self._available or self._count == 0:
            return None
        return min(1.0, max(0.0, self._sum / self._count))

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
    @staticmethod
    def _parse_device(device: Any) -> Tuple[Optional[str], Optional[int]]:
        if device is None:
            return None, None
        if isinstance(device, str):
            import torch

            try:
                device = torch.device(device)
            except (RuntimeError, ValueError) as err:
                raise ValueError(f"`device` must be a torch.device, a device string or None, got {device!r}.") from err
        dev_type = getattr(device, "type", None)
        if not isinstance(dev_type, str):
            raise ValueError(f"`device` must be a torch.device, a device string or None, got {device!r}.")
        return dev_type, getattr(device, "index", None)

    def _connect(self, nvml: Optional[object]) -> None:
        if self._device_type != "cuda":
            self._reason = f"not a CUDA device ({self._device_type or 'no device'})"
            return
        if nvml is None:
            try:
                import pynvml as nvml  # type: ignore[no-redef]
            except Exception as err:
                self._reason = f"NVML library not installed (pip install nvidia-ml-py): {err}"
                return
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except Exception as err:
            self._reason = f"NVML init failed (no NVIDIA driver?): {_describe(err)}"
            return
        self._initialised = True
        index = self._device_index
        try:
            if index is None:
                import torch

                index = torch.cuda.current_device()
            uuid, pci = cuda_device_identity(index)
        except Exception as err:
            self._disable(f"cannot identify cuda:{index if index is not None else '?'}: {err}")
            return
        handle, is_mig, why = self._find_handle(uuid, pci)
        if handle is None:
            self._disable(why)
            return
        self._handle = handle
        if is_mig or self._is_mig(handle):
            self._disable("MIG enabled: NVML reports no utilization for MIG devices")
            return
        self._probe()

    def _find_handle(self, uuid: Optional[str], pci: Optional[str]) -> Tuple[Any, bool, str]:
        """Handle of the device by UUID, else PCI bus id; returns ``(handle, is_mig_slice, why_not)``."""
        nvml = self._nvml
        errors = []
        if uuid:
            bare = uuid[4:] if uuid[:4] in ("GPU-", "MIG-") else uuid
            candidates = [uuid] if uuid != bare else ["GPU-" + bare, "MIG-" + bare]
            for name in candidates:
                try:
                    return nvml.nvmlDeviceGetHandleByUUID(name), name.startswith("MIG-"), ""
                except Exception as err:
                    errors.append(f"UUID {name}: {_describe(err)}")
        if pci:
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(pci), False, ""
            except Exception as err:
                errors.append(f"PCI bus id {pci}: {_describe(err)}")
        if not errors:
            return None, False, "torch gives neither UUID nor PCI bus id for the device"
        return None, False, "no NVML device matches (" + "; ".join(errors) + ")"

    def _is_mig(self, handle: Any) -> bool:
        nvml = self._nvml
        is_mig_handle = getattr(nvml, "nvmlDeviceIsMigDeviceHandle", None)
        if is_mig_handle is not None:
            try:
                flag = is_mig_handle(handle)  # pynvml returns a c_uint
                if int(getattr(flag, "value", flag) or 0):
                    return True
            except Exception:
                pass  # older drivers/GPUs: no MIG
        get_mig_mode = getattr(nvml, "nvmlDeviceGetMigMode", None)
        if get_mig_mode is not None:
            try:
                current = get_mig_mode(handle)[0]
                return int(current) == int(getattr(nvml, "NVML_DEVICE_MIG_ENABLE", _MIG_ENABLE))
            except Exception:
                pass  # NotSupported: a GPU without MIG
        return False

    def _probe(self) -> None:
        """Choose samples or rates, whichever this device serves."""
        nvml = self._nvml
        self._util_samples = int(getattr(nvml, "NVML_GPU_UTILIZATION_SAMPLES", 1))
        try:
            _, samples = nvml.nvmlDeviceGetSamples(self._handle, self._util_samples, 0)
            self._last_seen_us = max((int(s.timeStamp) for s in samples), default=0)
            self._mode = _MODE_SAMPLES
        except Exception as err:
            if _code(err) == _code_of(nvml, "NVML_ERROR_NOT_FOUND", _NOT_FOUND):
                self._mode = _MODE_SAMPLES  # served, but the buffer is empty for now
            else:
                samples_err = _describe(err)
                try:
                    nvml.nvmlDeviceGetUtilizationRates(self._handle)
                    self._mode = _MODE_RATES
                except Exception as err2:
                    self._disable(
                        f"NVML serves no utilization for this device (samples: {samples_err}; "
                        f"rates: {_describe(err2)})"
                    )
                    return
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
        if self._mode == _MODE_SAMPLES:
            self._add_samples(self._read_samples())
        elif not self._paused:
            self._read_rate()

    def _read_samples(self) -> list:
        try:
            value_type, samples = self._nvml.nvmlDeviceGetSamples(
                self._handle, self._util_samples, self._last_seen_us
            )
        except Exception as err:
            if _code(err) == _code_of(self._nvml, "NVML_ERROR_NOT_FOUND", _NOT_FOUND):
                return []  # no sample newer than the cursor
            self._disable(f"NVML error while reading samples: {_describe(err)}")
            return []
        field = _VALUE_FIELDS.get(int(value_type) if value_type is not None else 1, "uiVal")
        out = []
        for s in samples:
            ts = int(s.timeStamp)
            if ts <= self._last_seen_us:
                continue
            out.append((ts, float(getattr(s.sampleValue, field))))
        if out:
            newest = max(ts for ts, _ in out)
            self._last_seen_us = newest
            if abs(newest - _now_us()) > _CLOCK_SKEW_LIMIT_US:
                self._clock_ok = False
        return out

    def _add_samples(self, samples: list) -> None:
        if not samples:
            return
        if not self._clock_ok:
            # clocks not comparable: samples read while training count, samples read while paused do not
            if not self._paused:
                for _, value in samples:
                    self._sum += value / 100.0
                    self._count += 1
            return
        start = self._window_start_us
        pauses = self._pauses
        for ts, value in samples:
            if ts <= start:
                continue
            if any(p < ts <= r for p, r in pauses):
                continue
            self._sum += value / 100.0
            self._count += 1

    def _read_rate(self) -> None:
        try:
            rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        except Exception as err:
            self._disable(f"NVML error while reading utilization: {_describe(err)}")
            return
        self._sum += float(rates.gpu) / 100.0
        self._count += 1

    def _disable(self, reason: str) -> None:
        self._available = False
        self._reason = reason
        self._next_poll = math.inf

    def __repr__(self) -> str:
        state = f"mode={self._mode!r}" if self._available else f"reason={self._reason!r}"
        return f"{type(self).__name__}(source={self.source!r}, {state})"


def _code(err: BaseException) -> Optional[int]:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def _code_of(nvml: Any, name: str, default: int) -> int:
    value = getattr(nvml, name, default)
    return value if isinstance(value, int) else default


def _describe(err: BaseException) -> str:
    """An NVML error as ``"Not Supported (NVML error 3)"``; other errors as ``"Type: message"``."""
    code = _code(err)
    try:
        text = str(err)
    except Exception:
        text = ""
    if code is not None:
        return f"{text or type(err).__name__} (NVML error {code})"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
