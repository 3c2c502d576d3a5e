"""UtilizationSampler against a fake pynvml: device mapping, windows, fallbacks, and never raising."""

from __future__ import annotations

import copy
import ctypes
import os
import pickle
import sys
import time
import types

import pytest
import torch

from lightning_dltune.nvml import sampler as gpu
from lightning_dltune.nvml.sampler import UtilizationSampler

pynvml = pytest.importorskip("pynvml")  # nvidia-ml-py, a dependency: its types shape the fake below

# -- a fake pynvml with the names, types and errors of nvidia-ml-py ----------------------------------
# Return values are built from pynvml's own ctypes structures, and errors are pynvml.NVMLError, so
# the sampler meets what the real module hands it: c_uint flags, sample value unions, error codes.

NVML_ERROR_UNINITIALIZED = pynvml.NVML_ERROR_UNINITIALIZED
NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
NVML_ERROR_DRIVER_NOT_LOADED = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
NVML_ERROR_LIBRARY_NOT_FOUND = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
NVML_ERROR_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
NVMLError = pynvml.NVMLError

S = 1_000_000  # microseconds per second
T0 = 1_700_000_000 * S  # fake wall clock start, µs


def FakeSample(ts: int, value: int) -> pynvml.c_nvmlSample_t:
    """A utilization sample as pynvml returns it: a ctypes struct whose value is a union (``uiVal``)."""
    sample = pynvml.c_nvmlSample_t()
    sample.timeStamp = ts
    sample.sampleValue.uiVal = value
    return sample


class FakeGPU:
    def __init__(self, uuid: str, bus_id: str, mig_mode: int = 0, mig_slice: bool = False) -> None:
        self.uuid = uuid
        self.bus_id = bus_id
        self.mig_mode = mig_mode
        self.mig_slice = mig_slice
        self.samples: list = []
        self.rate = 0


class FakeNVML:
    """Emulates the pynvml calls the sampler uses; every call is counted in ``calls``.

    ``samples``: ``"served"`` (the driver keeps a sample buffer), ``"not_found"`` (every read
    answers Not Found, as for an empty buffer), ``"empty"`` (every read succeeds with no sample) or
    ``"not_supported"``. ``errors``: NVML error codes the next reads of samples or rates raise.
    """

    NVML_GPU_UTILIZATION_SAMPLES = pynvml.NVML_GPU_UTILIZATION_SAMPLES
    NVML_VALUE_TYPE_UNSIGNED_INT = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGPU], samples: str = "served", rates_supported: bool = True) -> None:
        self.gpus = gpus
        self.samples = samples
        self.rates_supported = rates_supported
        self.init_error: int | None = None
        self.errors: list[int] = []
        self.inits = 0
        self.shutdowns = 0
        self.calls: list[str] = []
        self.now_us = T0

    # lifecycle
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        self.shutdowns += 1

    # handles: by UUID or PCI bus id (index lookups are deliberately absent)
    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeGPU:
        self.calls.append("nvmlDeviceGetHandleByUUID")
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for g in self.gpus:
            if g.uuid == uuid:
                return g
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str | bytes) -> FakeGPU:
        self.calls.append("nvmlDeviceGetHandleByPciBusId")
        bus_id = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
        for g in self.gpus:
            if g.bus_id.upper() == bus_id.upper():
                return g
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGPU:  # pragma: no cover - must not be used
        raise AssertionError("the sampler must never address NVML devices by index")

    # MIG
    def nvmlDeviceGetMigMode(self, handle: FakeGPU) -> list[int]:
        self.calls.append("nvmlDeviceGetMigMode")
        return [handle.mig_mode, handle.mig_mode]

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeGPU) -> ctypes.c_uint:
        self.calls.append("nvmlDeviceIsMigDeviceHandle")
        return ctypes.c_uint(int(handle.mig_slice))  # pynvml returns the c_uint itself, not its value

    # utilization
    def nvmlDeviceGetSamples(self, handle: FakeGPU, sample_type: int, last_seen: int):
        self.calls.append("nvmlDeviceGetSamples")
        assert sample_type == self.NVML_GPU_UTILIZATION_SAMPLES
        if self.errors:
            raise NVMLError(self.errors.pop(0))
        if self.samples == "not_supported":
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if self.samples == "empty":
            return self.NVML_VALUE_TYPE_UNSIGNED_INT, []
        fresh = [s for s in handle.samples if last_seen < s.timeStamp <= self.now_us]
        if self.samples == "not_found" or not fresh:
            raise NVMLError(NVML_ERROR_NOT_FOUND)  # what NVML answers when no newer sample exists
        return self.NVML_VALUE_TYPE_UNSIGNED_INT, fresh

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGPU) -> pynvml.c_nvmlUtilization_t:
        self.calls.append("nvmlDeviceGetUtilizationRates")
        if self.errors:
            raise NVMLError(self.errors.pop(0))
        if not self.rates_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        rates = pynvml.c_nvmlUtilization_t()
        rates.gpu = handle.rate
        return rates

    # test helpers
    def emit(
        self, handle: FakeGPU, seconds: float, value: int, every_s: float = 0.2, others=(), drop_idle: bool = False
    ) -> None:
        """Advance the clock by ``seconds``; the device samples ``value`` % every ``every_s``.

        ``others``: ``(handle, value)`` pairs of other devices sampling over the same period.
        ``drop_idle``: like some drivers, add no sample while the device is idle (``value == 0``).
        """
        steps = int(round(seconds / every_s))
        for _ in range(steps):
            self.now_us += int(every_s * S)
            handle.rate = value
            if not (drop_idle and value == 0):
                handle.samples.append(FakeSample(self.now_us, value))
            for other, other_value in others:
                other.samples.append(FakeSample(self.now_us, other_value))

    def nvml_calls(self) -> int:
        return len(self.calls)


# Two physical GPUs; CUDA_VISIBLE_DEVICES=1,0 makes torch's cuda:0 the machine's second GPU.
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-1111-1111-1111-111111111111"


@pytest.fixture
def machine(monkeypatch):
    """A fake NVML with two GPUs, visible to torch in reversed order, and a fake wall clock."""
    a = FakeGPU(GPU_A, "00000000:3B:00.0")
    b = FakeGPU(GPU_B, "00000000:86:00.0")
    nvml = FakeNVML([a, b])
    visible = {0: (GPU_B[4:], "00000000:86:00.0"), 1: (GPU_A[4:], "00000000:3B:00.0")}

    def identity(index):
        if index not in visible:
            raise RuntimeError(f"no CUDA device {index}")
        return visible[index]

    monkeypatch.setattr(gpu, "cuda_device_identity", identity)
    monkeypatch.setattr(gpu, "_now_us", lambda: nvml.now_us)
    return types.SimpleNamespace(nvml=nvml, a=a, b=b, visible=visible)


def sampler_for(machine, index=0, **kwargs) -> UtilizationSampler:
    return UtilizationSampler(torch.device("cuda", index), nvml=machine.nvml, **kwargs)


# -- mapping ---------------------------------------------------------------------------------------


def test_maps_device_by_uuid_not_index_when_visible_devices_are_reordered(machine):
    nvml, a, b = machine.nvml, machine.a, machine.b
    sampler = sampler_for(machine, index=0)  # torch's cuda:0 is the machine's second GPU
    assert sampler.available and sampler.source == "nvml" and sampler.unavailable_reason is None
    assert sampler._handle is b and sampler.matched_by == "uuid"
    assert "nvmlDeviceGetHandleByUUID" in nvml.calls
    assert sampler_for(machine, index=1)._handle is a

    nvml.emit(b, 2.0, value=90, others=[(a, 10)])  # GPU 0 runs someone else's light job
    assert sampler.window_mean() == pytest.approx(0.9)
    assert sampler.mode == "samples" and sampler.window_mode == "samples"


def test_maps_device_by_pci_bus_id_when_torch_gives_no_uuid(machine, monkeypatch):
    monkeypatch.setattr(gpu, "cuda_device_identity", lambda index: (None, "00000000:86:00.0"))
    sampler = sampler_for(machine)
    assert sampler.available and sampler.matched_by == "pci_bus_id"
    assert sampler._handle is machine.b
    assert "nvmlDeviceGetHandleByUUID" not in machine.nvml.calls


def test_falls_back_to_pci_bus_id_when_uuid_is_unknown_to_nvml(machine, monkeypatch):
    monkeypatch.setattr(gpu, "cuda_device_identity", lambda index: ("cccccccc-2222", "00000000:3B:00.0"))
    sampler = sampler_for(machine)
    assert sampler.available and sampler._handle is machine.a


def test_unknown_device_is_unavailable_with_reason(machine, monkeypatch):
    monkeypatch.setattr(gpu, "cuda_device_identity", lambda index: ("cccccccc-2222", "00000000:AF:00.0"))
    sampler = sampler_for(machine)
    assert not sampler.available and sampler.source == "estimate"
    assert "no NVML device matches" in sampler.unavailable_reason
    assert machine.nvml.shutdowns == 1  # nothing to measure: the NVML session is released at once


def test_identity_failure_is_unavailable_not_raised(machine):
    sampler = sampler_for(machine, index=7)
    assert not sampler.available
    assert "cannot identify cuda:7" in sampler.unavailable_reason


# -- windows ---------------------------------------------------------------------------------------


def test_window_mean_counts_only_training_samples(machine):
    nvml, b = machine.nvml, machine.b
    nvml.emit(b, 3.0, value=5)  # idle before the fit: in the driver's buffer, not in the window
    sampler = sampler_for(machine)
    sampler.start_window()
    nvml.emit(b, 2.0, value=100)  # training
    sampler.pause()
    nvml.emit(b, 1.0, value=0)  # validation
    sampler.resume()
    nvml.emit(b, 2.0, value=80)  # training
    assert sampler.window_mean() == pytest.approx(0.9)
    assert sampler.sample_count == 20


def test_samples_of_a_pause_read_late_are_still_excluded_by_timestamp(machine):
    nvml, b = machine.nvml, machine.b
    sampler = sampler_for(machine)
    sampler.start_window()
    nvml.emit(b, 1.0, value=100)
    sampler.pause()
    # the driver publishes the pause's samples only after resume (late): timestamps decide
    pause_start = nvml.now_us
    nvml.now_us += 1 * S
    sampler.resume()
    b.samples += [FakeSample(pause_start + k * 200_000, 0) for k in range(1, 6)]
    nvml.emit(b, 1.0, value=60)
    assert sampler.window_mean() == pytest.approx(0.8)


def test_start_window_forgets_the_previous_window(machine):
    nvml, b = machine.nvml, machine.b
    sampler = sampler_for(machine)
    nvml.emit(b, 2.0, value=20)
    assert sampler.window_mean() == pytest.approx(0.2)
    sampler.start_window()
    nvml.emit(b, 2.0, value=70)
    assert sampler.window_mean() == pytest.approx(0.7)


def test_incomparable_clocks_attribute_samples_by_when_they_are_read(machine, monkeypatch):
    nvml, b = machine.nvml, machine.b
    nvml.now_us = 5 * S  # the driver's clock is not the wall clock
    monkeypatch.setattr(gpu, "_now_us", lambda: 1_700_000_000 * S)
    sampler = sampler_for(machine)
    nvml.emit(b, 1.0, value=40)
    sampler.maybe_poll(time.perf_counter() + 60)
    nvml.emit(b, 1.0, value=100)
    sampler.pause()
    nvml.emit(b, 1.0, value=0)
    sampler.resume()
    nvml.emit(b, 1.0, value=100)
    assert sampler.window_mean() == pytest.approx(0.8)


def test_maybe_poll_does_not_call_nvml_before_the_interval(machine):
    nvml = machine.nvml
    nvml.emit(machine.b, 1.0, value=50)  # samples in the buffer: samples mode, one call per read
    sampler = sampler_for(machine, poll_interval_s=5.0)
    assert sampler.mode == "samples"
    before = nvml.nvml_calls()
    now = time.perf_counter()
    for k in range(1000):
        sampler.maybe_poll(now + k * 1e-3)
    assert nvml.nvml_calls() == before
    sampler.maybe_poll(now + 6.0)
    assert nvml.nvml_calls() == before + 1
    sampler.maybe_poll(now + 6.5)
    assert nvml.nvml_calls() == before + 1


def test_maybe_poll_while_paused_reads_nothing(machine):
    sampler = sampler_for(machine)
    sampler.pause()
    before = machine.nvml.nvml_calls()
    sampler.maybe_poll(time.perf_counter() + 3600)
    assert machine.nvml.nvml_calls() == before


def test_maybe_poll_keeps_samples_beyond_the_driver_buffer(machine):
    nvml, b = machine.nvml, machine.b
    sampler = sampler_for(machine, poll_interval_s=1.0)
    now = time.perf_counter()
    for k in range(1, 4):
        nvml.emit(b, 1.0, value=50)
        sampler.maybe_poll(now + 2.0 * k)
        b.samples.clear()  # the driver's ring buffer moved on
    assert sampler.window_mean() == pytest.approx(0.5)
    assert sampler.sample_count == 15


def test_short_window_without_samples_reads_the_current_rate(machine):
    machine.b.rate = 77
    sampler = sampler_for(machine)
    assert sampler.window_mean() == pytest.approx(0.77)


# -- fallbacks and unavailable cases ---------------------------------------------------------------


def test_falls_back_to_utilization_rates_where_samples_are_not_supported(machine):
    nvml, b = machine.nvml, machine.b
    nvml.samples = "not_supported"
    sampler = sampler_for(machine, poll_interval_s=1.0)
    assert sampler.available and sampler.mode == "rates" and "Not Supported" in sampler.mode_note
    now = time.perf_counter()
    nvml.now_us += 2 * S
    b.rate = 90
    sampler.maybe_poll(now + 2)  # 90 % over the first 2 s
    nvml.now_us += 1 * S
    b.rate = 70
    sampler.pause()  # the reading up to the pause is training: 70 % over 1 s
    nvml.now_us += 5 * S
    b.rate = 0
    sampler.maybe_poll(now + 4)  # paused: not read
    sampler.resume()
    nvml.now_us += 1 * S
    b.rate = 80
    assert sampler.window_mean() == pytest.approx((2 * 0.9 + 0.7 + 0.8) / 4)  # the pause weighs nothing
    assert sampler.sample_count == 3 and sampler.window_mode == "rates"


@pytest.mark.parametrize("answer", ["not_found", "empty"])
def test_samples_that_never_arrive_fall_back_to_rates_over_the_training_part(machine, answer):
    """An empty sample buffer is not a confirmation: after a few empty reads the polled rates serve, labelled so."""
    nvml, b = machine.nvml, machine.b
    nvml.samples = answer
    sampler = sampler_for(machine, poll_interval_s=1.0)
    assert sampler.available and sampler.mode == "probing"
    now = time.perf_counter()
    for k, rate in enumerate((60, 80, 100, 100), start=1):
        nvml.now_us += 1 * S
        b.rate = rate
        sampler.maybe_poll(now + 2 * k)
    assert sampler.mode == "rates"
    assert "no sample in 3 reads" in sampler.mode_note or "no sample in 4 reads" in sampler.mode_note
    assert sampler.window_mean() == pytest.approx((0.6 + 0.8 + 1.0 + 1.0) / 4)
    assert sampler.window_mode == "rates" and sampler.source == "nvml"


def test_samples_mode_is_confirmed_by_the_first_sample(machine):
    nvml, b = machine.nvml, machine.b
    sampler = sampler_for(machine, poll_interval_s=1.0)
    assert sampler.mode == "probing"  # the buffer was empty at start
    nvml.emit(b, 1.0, value=40)
    sampler.maybe_poll(time.perf_counter() + 2)
    assert sampler.mode == "samples" and sampler.mode_note is None
    nvml.emit(b, 3.0, value=40)
    before = nvml.calls.count("nvmlDeviceGetUtilizationRates")
    assert sampler.window_mean() == pytest.approx(0.4)
    assert sampler.window_mode == "samples"
    assert nvml.calls.count("nvmlDeviceGetUtilizationRates") == before  # confirmed: no more rate polls


def test_samples_are_weighted_by_the_time_they_cover(machine):
    nvml, b = machine.nvml, machine.b
    nvml.emit(b, 1.0, value=50)  # the driver's period (0.2 s) is learnt from the buffer
    sampler = sampler_for(machine)
    nvml.emit(b, 1.0, value=100, every_s=0.1)  # 10 samples over 1 s
    nvml.emit(b, 2.0, value=0, every_s=0.4)  # 5 samples over 2 s (slower, not a gap)
    assert sampler.window_mean() == pytest.approx(1 / 3)  # by count it would read 10 / 15
    assert sampler.sample_count == 15


def test_idle_gap_without_samples_counts_as_idle(machine):
    """Some drivers stop sampling an idle GPU: the gap is idle time, not missing data."""
    nvml, b = machine.nvml, machine.b
    nvml.emit(b, 1.0, value=50)
    sampler = sampler_for(machine)
    nvml.emit(b, 2.0, value=100)
    nvml.emit(b, 2.0, value=0, drop_idle=True)
    nvml.emit(b, 2.0, value=100)
    assert sampler.window_mean() == pytest.approx(4 / 6)  # the samples alone would read 1.0
    assert sampler.sample_count == 20


def test_idle_tail_without_samples_at_window_end_counts_as_idle(machine):
    nvml, b = machine.nvml, machine.b
    nvml.emit(b, 1.0, value=50)
    sampler = sampler_for(machine)
    nvml.emit(b, 2.0, value=90)
    nvml.emit(b, 2.0, value=0, drop_idle=True)
    assert sampler.window_mean() == pytest.approx(0.45)


def test_one_transient_error_is_retried_later_not_fatal(machine):
    nvml, b = machine.nvml, machine.b
    nvml.emit(b, 1.0, value=50)
    sampler = sampler_for(machine, poll_interval_s=1.0)
    now = time.perf_counter()
    nvml.emit(b, 1.0, value=80)
    nvml.errors = [NVML_ERROR_TIMEOUT]
    sampler.maybe_poll(now + 2)
    assert sampler.available and sampler.source == "nvml"
    calls = nvml.nvml_calls()
    sampler.maybe_poll(now + 3.5)  # backing off: the retry waits longer than one poll interval
    assert nvml.nvml_calls() == calls
    nvml.emit(b, 1.0, value=80)
    sampler.maybe_poll(now + 10)  # the retry reads what the driver kept meanwhile
    assert nvml.nvml_calls() == calls + 1
    assert sampler.window_mean() == pytest.approx(0.8)


def test_repeated_errors_give_nvml_up_with_the_last_error(machine):
    nvml, b = machine.nvml, machine.b
    nvml.emit(b, 1.0, value=50)
    sampler = sampler_for(machine, poll_interval_s=1.0)
    nvml.errors = [NVML_ERROR_TIMEOUT] * 5
    now = time.perf_counter()
    for k in range(4):
        sampler.maybe_poll(now + 1000 * (k + 1))
        assert sampler.available
    sampler.maybe_poll(now + 5000)
    assert not sampler.available and sampler.source == "estimate"
    assert "5 times in a row" in sampler.unavailable_reason and "Timeout" in sampler.unavailable_reason
    assert sampler.window_mean() is None


def test_samples_missed_while_failing_are_not_counted_as_idle(machine):
    """After a failed read the driver's buffer may have moved on: the unseen stretch is unknown, not idle."""
    nvml, b = machine.nvml, machine.b
    nvml.emit(b, 1.0, value=50)
    sampler = sampler_for(machine, poll_interval_s=1.0)
    now = time.perf_counter()
    nvml.emit(b, 1.0, value=90)
    sampler.maybe_poll(now + 2)
    nvml.emit(b, 3.0, value=90)
    b.samples.clear()  # the ring buffer moved on while NVML failed
    nvml.errors = [NVML_ERROR_TIMEOUT]
    sampler.maybe_poll(now + 4)
    nvml.emit(b, 1.0, value=90)
    assert sampler.window_mean() == pytest.approx(0.9)


def test_library_missing_is_an_estimate_with_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    sampler = UtilizationSampler(torch.device("cuda", 0))
    assert not sampler.available and sampler.source == "estimate"
    assert "NVML library not installed" in sampler.unavailable_reason
    assert sampler.window_mean() is None
    sampler.maybe_poll(time.perf_counter() + 100)
    sampler.close()


@pytest.mark.parametrize("code", [NVML_ERROR_DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND])
def test_init_failure_is_an_estimate_with_reason(machine, code):
    machine.nvml.init_error = code
    sampler = sampler_for(machine)
    assert not sampler.available and sampler.source == "estimate"
    assert "NVML init failed" in sampler.unavailable_reason and f"NVML error {code}" in sampler.unavailable_reason
    sampler.close()
    assert machine.nvml.shutdowns == 0  # never initialised, never shut down


def test_mig_enabled_gpu_is_unavailable(machine):
    machine.b.mig_mode = 1
    sampler = sampler_for(machine)
    assert not sampler.available and sampler.source == "estimate"
    assert "MIG" in sampler.unavailable_reason
    assert "nvmlDeviceGetSamples" not in machine.nvml.calls


def test_mig_slice_handle_is_unavailable(machine):
    slice_ = FakeGPU("MIG-dddddddd-3333-3333-3333-333333333333", "00000000:86:00.0", mig_slice=True)
    machine.nvml.gpus.insert(0, slice_)
    machine.visible[0] = ("dddddddd-3333-3333-3333-333333333333", "00000000:86:00.0")
    sampler = sampler_for(machine)
    assert not sampler.available and "MIG" in sampler.unavailable_reason


def test_not_supported_is_an_estimate_with_reason(machine):
    machine.nvml.samples = "not_supported"
    machine.nvml.rates_supported = False
    sampler = sampler_for(machine)
    assert not sampler.available and sampler.source == "estimate"
    assert "Not Supported" in sampler.unavailable_reason
    assert sampler.window_mean() is None


def test_nvml_error_while_polling_turns_into_estimate(machine):
    sampler = sampler_for(machine)

    def lost(*args):
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)

    machine.nvml.nvmlDeviceGetSamples = lost
    sampler.maybe_poll(time.perf_counter() + 100)
    assert not sampler.available and sampler.source == "estimate"
    assert "NVML error 15" in sampler.unavailable_reason
    assert sampler.window_mean() is None


@pytest.mark.parametrize("device", [None, torch.device("cpu"), torch.device("mps"), "cpu"])
def test_non_cuda_device_is_unavailable_without_touching_nvml(machine, device):
    sampler = UtilizationSampler(device, nvml=machine.nvml)
    assert not sampler.available and sampler.source == "estimate"
    assert "not a CUDA device" in sampler.unavailable_reason
    assert machine.nvml.calls == []


def test_cuda_without_cuda_torch_is_unavailable_not_raised():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    sampler = UtilizationSampler(torch.device("cuda", 0), nvml=FakeNVML([]))
    assert not sampler.available
    assert "cannot identify cuda:0" in sampler.unavailable_reason


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), float("inf"), "5"])
def test_bad_poll_interval_raises(machine, interval):
    with pytest.raises(ValueError, match="poll_interval_s"):
        sampler_for(machine, poll_interval_s=interval)


def test_bad_device_raises():
    with pytest.raises(ValueError, match="device"):
        UtilizationSampler(3)


# -- process ownership -----------------------------------------------------------------------------


def test_close_shuts_nvml_down_once(machine):
    sampler = sampler_for(machine)
    sampler.close()
    sampler.close()
    assert machine.nvml.inits == 1 and machine.nvml.shutdowns == 1
    assert not sampler.available


def test_other_process_never_calls_nvml(machine, monkeypatch):
    sampler = sampler_for(machine)
    before = machine.nvml.nvml_calls()
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as seen from a forked DataLoader worker
    sampler.start_window()
    sampler.maybe_poll(time.perf_counter() + 100)
    sampler.pause()
    sampler.resume()
    assert sampler.window_mean() is None
    sampler.close()
    assert machine.nvml.nvml_calls() == before
    assert machine.nvml.shutdowns == 0


def test_pickled_or_copied_sampler_holds_no_nvml_session(machine):
    sampler = sampler_for(machine)
    for clone in (copy.deepcopy(sampler), pickle.loads(pickle.dumps(sampler))):
        assert not clone.available and clone.source == "estimate"
        assert "copied" in clone.unavailable_reason
        clone.close()
    assert sampler.available and machine.nvml.shutdowns == 0


# the NVML functions the fakes serve (a test that swaps them into the real pynvml swaps these)
NVML_FUNCTIONS = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetHandleByPciBusId",
    "nvmlDeviceGetSamples",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceIsMigDeviceHandle",
)


def test_fake_matches_real_pynvml_names():
    pynvml = pytest.importorskip("pynvml")
    for name in (*NVML_FUNCTIONS, "NVMLError"):
        assert hasattr(pynvml, name), name
    assert pynvml.NVML_GPU_UTILIZATION_SAMPLES == FakeNVML.NVML_GPU_UTILIZATION_SAMPLES
    assert pynvml.NVML_ERROR_NOT_SUPPORTED == NVML_ERROR_NOT_SUPPORTED
    assert pynvml.NVML_ERROR_NOT_FOUND == NVML_ERROR_NOT_FOUND
    assert pynvml.NVML_DEVICE_MIG_ENABLE == FakeNVML.NVML_DEVICE_MIG_ENABLE
    assert pynvml.NVMLError(NVML_ERROR_NOT_SUPPORTED).value == NVML_ERROR_NOT_SUPPORTED
    assert [f for f, _ in pynvml.c_nvmlSample_t._fields_] == ["timeStamp", "sampleValue"]


def test_real_pynvml_without_driver_is_an_estimate(monkeypatch):
    """On this machine (no driver) or a GPU one, the real module never makes the sampler raise."""
    pytest.importorskip("pynvml")
    sampler = UtilizationSampler(torch.device("cuda", 0))
    assert sampler.source in ("nvml", "estimate")
    if not sampler.available:
        assert sampler.unavailable_reason
    sampler.close()


# -- inside a real fit -----------------------------------------------------------------------------


class LiveGPU(FakeGPU):
    """A fake device sampled on the real wall clock every 20 ms; ``set(value)`` changes what it reports."""

    PERIOD_US = 20_000

    def __init__(self) -> None:
        super().__init__(GPU_A, "00000000:3B:00.0")
        self.timeline = [(0, 100)]
        self.sampled_to = int(time.time() * S) // self.PERIOD_US * self.PERIOD_US

    def set(self, value: int) -> None:
        self.timeline.append((int(time.time() * S), value))
        self.rate = value

    def busy_fraction(self, start: int, end: int) -> float:
        busy = 0.0
        for (t, v), (t_next, _) in zip(self.timeline, self.timeline[1:] + [(end, 0)]):
            busy += v / 100 * max(0, min(end, t_next) - max(start, t))
        return busy / (end - start)

    def refresh(self) -> None:
        """Publish the samples due by now: each the busy share of its period, as NVML reports it."""
        now = int(time.time() * S)
        while self.sampled_to + self.PERIOD_US <= now:
            self.sampled_to += self.PERIOD_US
            value = round(100 * self.busy_fraction(self.sampled_to - self.PERIOD_US, self.sampled_to))
            self.samples.append(FakeSample(self.sampled_to, value))


class LiveNVML(FakeNVML):
    def __init__(self, device: LiveGPU) -> None:
        super().__init__([device])
        self.device = device

    def nvmlDeviceGetSamples(self, handle, sample_type, last_seen):
        handle.refresh()
        self.now_us = int(time.time() * S)
        return super().nvmlDeviceGetSamples(handle, sample_type, last_seen)


@pytest.mark.slow
def test_fit_leaves_validation_and_checkpoint_saving_out_of_gpu_util(monkeypatch, tmp_path):
    """The GPU idles while validating and saving checkpoints; the training part it reports stays busy."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dltune import DataLoaderTuner
    from lightning_dltune.measure import probe

    device = LiveGPU()
    nvml = LiveNVML(device)
    monkeypatch.setattr(gpu, "cuda_device_identity", lambda index: (GPU_A, device.bus_id))
    monkeypatch.setattr(
        probe,
        "UtilizationSampler",
        lambda dev, poll_interval_s: UtilizationSampler("cuda:0", nvml=nvml, poll_interval_s=poll_interval_s),
    )

    class SlowCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, *args, **kwargs):
            device.set(0)  # writing the file: the GPU has nothing to do
            time.sleep(0.25)
            super().save_checkpoint(*args, **kwargs)
            device.set(100)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(0.02)
            return self.layer(batch[0]).pow(2).mean()

        def on_validation_start(self):
            device.set(0)

        def validation_step(self, batch, batch_idx):
            time.sleep(0.1)

        def on_validation_end(self):
            device.set(100)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(160, 4))
    tuner = DataLoaderTuner(tune=False, nvml_poll_interval_s=0.1, verbose=False, recommendation_file=False)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path),
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[SlowCheckpointIO()],
        callbacks=[tuner, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)],
    )
    trainer.fit(Model(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=40))

    assert len(list((tmp_path / "ckpt").iterdir())) >= 8  # 4 saves an epoch, each 0.25 s of idle GPU
    for record in tuner.history:
        assert record.stats.util_source == "nvml"
        # 40 x 20 ms of training an epoch against >= 1 s of saves and validation: counted, they would pull it to ~0.45
        assert record.stats.gpu_util >= 0.9, record
    import csv

    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("dltune/util_from_nvml")]
    assert [float(r["dltune/util_from_nvml"]) for r in rows] == [1.0, 1.0]
    assert [float(r["dltune/util_from_samples"]) for r in rows] == [1.0, 1.0]
