"""UtilizationSampler against a fake pynvml: device mapping, windows, fallbacks, and never raising."""

from __future__ import annotations

import copy
import os
import pickle
import sys
import time
import types

import pytest
import torch

from lightning_dltune import gpu
from lightning_dltune.gpu import UtilizationSampler

# -- a fake pynvml with the names and shapes of nvidia-ml-py --------------------------------------

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15

S = 1_000_000  # microseconds per second
T0 = 1_700_000_000 * S  # fake wall clock start, µs


class NVMLError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code in ``.value``."""

    _strings = {3: "Not Supported", 6: "Not Found", 9: "Driver Not Loaded", 12: "NVML Shared Library Not Found"}

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._strings.get(self.value, f"NVML error {self.value}")


class FakeValue:
    def __init__(self, ui: int) -> None:
        self.uiVal = ui


class FakeSample:
    def __init__(self, ts: int, value: int) -> None:
        self.timeStamp = ts
        self.sampleValue = FakeValue(value)


class FakeGPU:
    def __init__(self, uuid: str, bus_id: str, mig_mode: int = 0, mig_slice: bool = False) -> None:
        self.uuid = uuid
        self.bus_id = bus_id
        self.mig_mode = mig_mode
        self.mig_slice = mig_slice
        self.samples: list[FakeSample] = []
        self.rate = 0


class FakeNVML:
    """Emulates the pynvml calls the sampler uses; every call is counted in ``calls``."""

    NVML_GPU_UTILIZATION_SAMPLES = 1
    NVML_VALUE_TYPE_UNSIGNED_INT = 1
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_ERROR_NOT_SUPPORTED = NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGPU], samples_supported: bool = True, rates_supported: bool = True) -> None:
        self.gpus = gpus
        self.samples_supported = samples_supported
        self.rates_supported = rates_supported
        self.init_error: int | None = None
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

    def nvmlDeviceIsMigDeviceHandle(self, handle: FakeGPU) -> int:
        self.calls.append("nvmlDeviceIsMigDeviceHandle")
        return int(handle.mig_slice)

    # utilization
    def nvmlDeviceGetSamples(self, handle: FakeGPU, sample_type: int, last_seen: int):
        self.calls.append("nvmlDeviceGetSamples")
        assert sample_type == self.NVML_GPU_UTILIZATION_SAMPLES
        if not self.samples_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        fresh = [s for s in handle.samples if last_seen < s.timeStamp <= self.now_us]
        if not fresh:
            raise NVMLError(NVML_ERROR_NOT_FOUND)  # what NVML answers when no newer sample exists
        return self.NVML_VALUE_TYPE_UNSIGNED_INT, fresh

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGPU):
        self.calls.append("nvmlDeviceGetUtilizationRates")
        if not self.rates_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(gpu=handle.rate, memory=0)

    # test helpers
    def emit(self, handle: FakeGPU, seconds: float, value: int, every_s: float = 0.2, others=()) -> None:
        """Advance the clock by ``seconds``; the device samples ``value`` % every ``every_s``.

        ``others``: ``(handle, value)`` pairs of other devices sampling over the same period.
        """
        steps = int(round(seconds / every_s))
        for _ in range(steps):
            self.now_us += int(every_s * S)
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
    assert sampler.mode == "samples"
    assert sampler._handle is b
    assert "nvmlDeviceGetHandleByUUID" in nvml.calls
    assert sampler_for(machine, index=1)._handle is a

    nvml.emit(b, 2.0, value=90, others=[(a, 10)])  # GPU 0 runs someone else's light job
    assert sampler.window_mean() == pytest.approx(0.9)


def test_maps_device_by_pci_bus_id_when_torch_gives_no_uuid(machine, monkeypatch):
    monkeypatch.setattr(gpu, "cuda_device_identity", lambda index: (None, "00000000:86:00.0"))
    sampler = sampler_for(machine)
    assert sampler.available
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
    sampler = sampler_for(machine, poll_interval_s=5.0)
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
    nvml.samples_supported = False
    sampler = sampler_for(machine, poll_interval_s=1.0)
    assert sampler.available and sampler.mode == "rates"
    now = time.perf_counter()
    b.rate = 90
    sampler.maybe_poll(now + 2)
    b.rate = 70
    sampler.pause()  # the reading up to the pause is training
    b.rate = 0
    sampler.maybe_poll(now + 4)  # paused: not read
    sampler.resume()
    b.rate = 80
    assert sampler.window_mean() == pytest.approx(0.8)  # (90 + 70 + 80) / 3
    assert sampler.sample_count == 3


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
    machine.nvml.samples_supported = False
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


def test_fake_matches_real_pynvml_names():
    pynvml = pytest.importorskip("pynvml")
    for name in (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetHandleByPciBusId",
        "nvmlDeviceGetSamples",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceIsMigDeviceHandle",
        "NVMLError",
    ):
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
