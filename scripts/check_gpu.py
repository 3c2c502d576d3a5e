"""Check that NVML utilization works for cuda:0 on this machine: ``python scripts/check_gpu.py``.

Runs matmuls for ~3 s with a ~1 s idle pause in the middle (excluded from the window, as
validation is in a fit), then prints what :class:`lightning_dltune.gpu.UtilizationSampler` measured
next to a direct ``nvmlDeviceGetUtilizationRates`` reading (what ``nvidia-smi`` shows).

Exit status: 0 when NVML serves and the training window reads busy (>= 50 %); 1 when NVML does
not serve (the tuner would estimate); 2 without a CUDA device; 3 when the window reads idle.
"""

from __future__ import annotations

import os
import sys
import time

try:
    import lightning_dltune  # noqa: F401
except ImportError:  # run from a checkout: python scripts/check_gpu.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from lightning_dltune.gpu import UtilizationSampler, cuda_device_identity

BUSY_S = 1.5  # each of the two training phases
PAUSE_S = 1.0
MIN_BUSY = 0.5


def busy(seconds: float, a: torch.Tensor, b: torch.Tensor, *samplers: UtilizationSampler) -> None:
    """Keep the GPU busy for ``seconds``, polling the samplers the way the callback does per batch."""
    end = time.perf_counter() + seconds
    while True:
        for _ in range(8):
            a = torch.tanh(a @ b)
        torch.cuda.synchronize()  # bound the queue: the loop's clock is the GPU's
        now = time.perf_counter()
        for sampler in samplers:
            sampler.maybe_poll(now)
        if now >= end:
            return


def direct_rate(index: int) -> str:
    """A second opinion: utilization.gpu read straight from pynvml, the device found by UUID."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid, pci = cuda_device_identity(index)
            name = uuid if uuid and uuid[:4] in ("GPU-", "MIG-") else f"GPU-{uuid}"
            handle = pynvml.nvmlDeviceGetHandleByUUID(name) if uuid else pynvml.nvmlDeviceGetHandleByPciBusId(pci)
            rate = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            return f"{rate} % (NVML device {pynvml.nvmlDeviceGetIndex(handle)}, {name}, pci {pci})"
        finally:
            pynvml.nvmlShutdown()
    except Exception as err:  # a diagnostic only
        return f"unavailable ({type(err).__name__}: {err})"


def _pct(value: "float | None") -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def main() -> int:
    if not torch.cuda.is_available():
        print("FAIL: torch sees no CUDA device")
        return 2
    device = torch.device("cuda", 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    print(f"device: {torch.cuda.get_device_name(device)}  CUDA_VISIBLE_DEVICES={visible!r}")
    sampler = UtilizationSampler(device, poll_interval_s=0.5)
    print(f"source: {sampler.source}  mode: {sampler.mode}  reason: {sampler.unavailable_reason}")
    if not sampler.available:
        print("FAIL: NVML does not serve utilization for cuda:0; the tuner will estimate it")
        return 1

    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    b = torch.randn(8192, 8192, device=device, dtype=dtype) / 90.0
    whole = UtilizationSampler(device, poll_interval_s=0.5)  # never paused: counts the idle pause too
    busy(0.3, a, b, sampler, whole)  # warm-up (kernels, clocks), not measured

    sampler.start_window()
    whole.start_window()
    started = time.perf_counter()
    busy(BUSY_S, a, b, sampler, whole)
    sampler.pause()
    time.sleep(PAUSE_S)  # "validation": the GPU idles, and it must not count
    sampler.resume()
    busy(BUSY_S / 2, a, b, sampler, whole)
    cross = direct_rate(0)  # read while busy
    busy(BUSY_S / 2, a, b, sampler, whole)
    mean = sampler.window_mean()
    mean_whole = whole.window_mean()
    elapsed = time.perf_counter() - started
    print(f"window: {elapsed:.1f} s with a {PAUSE_S:.1f} s pause; samples counted: {sampler.sample_count}")
    print(f"window mean (training only): {_pct(mean)}")
    print(f"window mean including the pause: {_pct(mean_whole)} (expected about {PAUSE_S / elapsed:.0%} lower)")
    print(f"nvidia-smi-like reading while busy: {cross}")
    sampler.close()
    whole.close()

    if mean is None:
        print("FAIL: NVML served no sample inside the training window")
        return 1
    if mean < MIN_BUSY:
        print(f"FAIL: the training window reads {_pct(mean)}, expected >= {_pct(MIN_BUSY)} (pause counted?)")
        return 3
    print("OK: NVML serves utilization for cuda:0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
