"""Check on a real GPU that NVML utilization is this device's, arrives as samples, and reads true.

    python scripts/check_gpu.py [--device 0] [--json out.json]

Three groups of checks, one line each (``PASS``/``FAIL``, the value and what was expected):

1. identity: NVML's UUID of the handle the sampler found is ``GPU-`` + torch's device UUID, the PCI
   bus ids agree, the sampler matched by UUID (not the PCI fallback), and samples mode is live; the
   same again in a child process started with ``CUDA_VISIBLE_DEVICES=GPU-<uuid>``;
2. raw samples: ``nvmlDeviceGetSamples`` gives unsigned-int values in 0-100, asking again from the
   newest timestamp returns nothing older, and samples keep arriving through a 3 s idle sleep with a
   live CUDA context;
3. accuracy of :class:`~lightning_dltune.nvml.sampler.UtilizationSampler`: a busy window reads >= 0.9, an
   idle one <= 0.1, a ~50 % duty cycle 0.35-0.65 (each with >= 5 samples), and busy 3 s / idle 3 s /
   busy 3 s reads >= 0.9 with the idle part paused and <= 0.75 without.

Exit status: 0 when every check passes, 1 when one fails, 2 without a CUDA device.
``benchmarks/gpu.py`` runs :func:`run_checks` as its first step. About 40 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run from a checkout: python scripts/check_gpu.py
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from lightning_dltune.nvml.sampler import MODE_SAMPLES, UtilizationSampler, cuda_device_identity  # noqa: E402

WINDOW_S = 3.0
POLL_S = 0.25
MIN_SAMPLES = 5


class Checks:
    """Named pass/fail results with the measured value and what was expected."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.items: list[dict[str, Any]] = []

    def add(self, name: str, ok: bool, value: Any, expected: str) -> bool:
        item = {"name": self.prefix + name, "ok": bool(ok), "value": value, "expected": expected}
        self.items.append(item)
        print(f"  {'PASS' if ok else 'FAIL'}  {item['name']}: {value!r} (expected {expected})", flush=True)
        return bool(ok)

    @property
    def passed(self) -> bool:
        return all(i["ok"] for i in self.items)


# ------------------------------------------------------------------------------------ the load
class Load:
    """Busy and idle phases on one device, polling samplers the way the callback does per batch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        self.a = torch.randn(4096, 4096, device=device, dtype=dtype)
        self.b = torch.randn(4096, 4096, device=device, dtype=dtype) / 64.0

    def busy(self, seconds: float, *samplers: UtilizationSampler) -> None:
        end = time.perf_counter() + seconds
        while True:
            for _ in range(4):
                self.a = torch.tanh(self.a @ self.b)
            torch.cuda.synchronize(self.device)  # bound the queue: the loop's clock is the GPU's
            now = time.perf_counter()
            for sampler in samplers:
                sampler.maybe_poll(now)
            if now >= end:
                return

    def idle(self, seconds: float, *samplers: UtilizationSampler) -> None:
        end = time.perf_counter() + seconds
        while (now := time.perf_counter()) < end:
            time.sleep(min(0.05, end - now))
            for sampler in samplers:
                sampler.maybe_poll(time.perf_counter())

    def duty(self, seconds: float, on_s: float, *samplers: UtilizationSampler) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.busy(on_s, *samplers)
            self.idle(on_s, *samplers)


def _window(sampler: UtilizationSampler, run: Callable[[], None]) -> tuple[Optional[float], int, Optional[str]]:
    sampler.start_window()
    run()
    mean = sampler.window_mean()
    return mean, sampler.sample_count, sampler.window_mode


# ------------------------------------------------------------------------------------ identity
def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pci_key(bus_id: Optional[str]) -> Optional[tuple[int, ...]]:
    """``"00000000:3B:00.0"`` or ``"0000:3b:00.0"`` as numbers, so both spellings compare equal."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except (AttributeError, ValueError):
        return None


def check_identity(index: int, checks: Checks, load: Optional[Load] = None) -> dict[str, Any]:
    import pynvml

    uuid, pci = cuda_device_identity(index)
    torch_uuid = uuid if uuid and uuid.startswith("GPU-") else f"GPU-{uuid}"
    sampler = UtilizationSampler(torch.device("cuda", index), poll_interval_s=POLL_S)
    info: dict[str, Any] = {
        "torch_uuid": uuid,
        "torch_pci": pci,
        "matched_by": sampler.matched_by,
        "mode_at_start": sampler.mode,
        "unavailable_reason": sampler.unavailable_reason,
    }
    if not checks.add("sampler available", sampler.available, sampler.unavailable_reason or "nvml", "available"):
        return info
    handle = sampler.handle
    nvml_uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    nvml_pci = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    info.update(nvml_uuid=nvml_uuid, nvml_pci=nvml_pci)
    checks.add("NVML UUID of the handle == GPU- + torch UUID", nvml_uuid == torch_uuid, nvml_uuid, torch_uuid)
    checks.add(
        "PCI bus ids match",
        _pci_key(pci) is not None and _pci_key(nvml_pci) == _pci_key(pci),
        [nvml_pci, pci],
        "the same bus id",
    )
    checks.add("matched by UUID, not the PCI fallback", sampler.matched_by == "uuid", sampler.matched_by, "'uuid'")
    (load or Load(torch.device("cuda", index))).busy(1.5, sampler)
    checks.add("samples mode is live", sampler.mode == MODE_SAMPLES, sampler.mode, f"{MODE_SAMPLES!r}")
    info["mode"] = sampler.mode
    sampler.close()
    return info


def check_identity_in_child(uuid: str, checks: Checks) -> None:
    """The same identity checks where ``CUDA_VISIBLE_DEVICES`` names the device by UUID."""
    visible = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--identity-only"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        child = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        checks.add(f"child with CUDA_VISIBLE_DEVICES={visible} ran", False, proc.stderr[-500:], "a JSON report")
        return
    for item in child["checks"]:
        checks.add(
            f"[CUDA_VISIBLE_DEVICES={visible[:12]}...] {item['name']}", item["ok"], item["value"], item["expected"]
        )


# ------------------------------------------------------------------------------------ raw samples
def check_raw_samples(handle: Any, load: Load, checks: Checks) -> dict[str, Any]:
    import pynvml

    kind = pynvml.NVML_GPU_UTILIZATION_SAMPLES
    load.busy(1.0)
    try:
        value_type, samples = pynvml.nvmlDeviceGetSamples(handle, kind, 0)
    except pynvml.NVMLError as err:  # Not Found: an empty buffer after a busy second fails the checks below
        value_type, samples = f"error: {err}", []
    values = [s.sampleValue.uiVal for s in samples]
    stamps = sorted(int(s.timeStamp) for s in samples)
    steps = [b - a for a, b in zip(stamps, stamps[1:]) if b > a]
    period_ms = statistics.median(steps) / 1e3 if steps else None
    checks.add(
        "sample value type is unsigned int",
        value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
        value_type,
        f"{pynvml.NVML_VALUE_TYPE_UNSIGNED_INT}",
    )
    checks.add(
        "sample values in 0-100",
        bool(values) and all(0 <= v <= 100 for v in values),
        {"min": min(values, default=None), "max": max(values, default=None), "count": len(values)},
        "0 <= v <= 100, some samples",
    )
    newest = stamps[-1] if stamps else 0
    again = _samples_after(handle, newest)
    checks.add(
        "asking again from the newest timestamp returns nothing older",
        all(int(s.timeStamp) > newest for s in again),
        len(again),
        "no sample at or before the cursor",
    )
    time.sleep(WINDOW_S)  # idle with a live context
    idle = _samples_after(handle, newest)
    expected = int(0.5 * WINDOW_S * 1e3 / period_ms) if period_ms else 1
    checks.add(
        f"samples keep arriving through a {WINDOW_S:.0f} s idle sleep",
        len(idle) >= expected,
        len(idle),
        f">= {expected} (half of {WINDOW_S:.0f} s / {period_ms} ms)",
    )
    return {"period_ms": period_ms, "buffer_samples": len(samples), "samples_during_idle": len(idle)}


def _samples_after(handle: Any, cursor: int) -> list:
    import pynvml

    try:
        return list(pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, cursor)[1])
    except pynvml.NVMLError as err:
        if err.value == pynvml.NVML_ERROR_NOT_FOUND:
            return []
        raise


# ------------------------------------------------------------------------------------ accuracy
def check_accuracy(device: torch.device, load: Load, checks: Checks) -> dict[str, Any]:
    sampler = UtilizationSampler(device, poll_interval_s=POLL_S)
    whole = UtilizationSampler(device, poll_interval_s=POLL_S)  # never paused
    load.busy(0.5, sampler, whole)  # confirms samples mode
    out: dict[str, Any] = {}
    for name, run, lo, hi in (
        ("busy", lambda: load.busy(WINDOW_S, sampler), 0.9, 1.0),
        ("idle", lambda: load.idle(WINDOW_S, sampler), 0.0, 0.1),
        ("50 % duty cycle", lambda: load.duty(WINDOW_S, 0.1, sampler), 0.35, 0.65),
    ):
        mean, count, mode = _window(sampler, run)
        out[name] = {"mean": mean, "samples": count, "mode": mode}
        checks.add(
            f"{name} window reads {lo:g}-{hi:g} with >= {MIN_SAMPLES} samples",
            mean is not None and lo <= mean <= hi and count >= MIN_SAMPLES,
            {"mean": None if mean is None else round(mean, 3), "samples": count, "mode": mode},
            f"{lo:g} <= mean <= {hi:g}, samples >= {MIN_SAMPLES}",
        )

    sampler.start_window()
    whole.start_window()
    load.busy(WINDOW_S, sampler, whole)
    sampler.pause()
    load.idle(WINDOW_S, whole)  # "validation": the GPU idles
    sampler.resume()
    load.busy(WINDOW_S, sampler, whole)
    paused, unpaused = sampler.window_mean(), whole.window_mean()
    out["busy/idle/busy"] = {"paused": paused, "unpaused": unpaused}
    checks.add(
        "busy/idle/busy with the idle part paused reads >= 0.9", paused is not None and paused >= 0.9, paused, ">= 0.9"
    )
    checks.add(
        "busy/idle/busy without the pause reads <= 0.75", unpaused is not None and unpaused <= 0.75, unpaused, "<= 0.75"
    )
    out["direct_rate_after_busy"] = _direct_rate(sampler.handle)
    sampler.close()
    whole.close()
    return out


def _direct_rate(handle: Any) -> Optional[int]:
    """A second opinion: ``utilization.gpu`` as ``nvidia-smi`` shows it."""
    try:
        import pynvml

        return int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:
        return None


# ------------------------------------------------------------------------------------ entry points
def run_checks(index: int = 0, child: bool = True) -> dict[str, Any]:
    """Every check on CUDA device ``index``; returns ``{"passed", "checks", "device", ...}``."""
    if not torch.cuda.is_available():
        return {"passed": False, "error": "torch sees no CUDA device", "checks": []}
    import pynvml

    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    checks = Checks()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    print(f"NVML check on {result['device']} (cuda:{index})", flush=True)
    load = Load(device)
    load.busy(0.3)  # warm-up: kernels, clocks
    result["identity"] = check_identity(index, checks, load)
    if result["identity"].get("torch_uuid") and child:
        check_identity_in_child(result["identity"]["torch_uuid"], checks)
    if checks.passed or result["identity"].get("nvml_uuid"):
        pynvml.nvmlInit()
        try:
            uuid = result["identity"]["nvml_uuid"]
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            result["raw_samples"] = check_raw_samples(handle, load, checks)
        finally:
            pynvml.nvmlShutdown()
        result["accuracy"] = check_accuracy(device, load, checks)
    result["checks"] = checks.items
    result["passed"] = checks.passed
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=int, default=0, help="CUDA device index as torch sees it")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--identity-only", action="store_true", help=argparse.SUPPRESS)  # the child's mode
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("FAIL: torch sees no CUDA device")
        return 2
    if args.identity_only:
        checks = Checks()
        with _stdout_to_stderr():
            check_identity(args.device, checks)
        print(json.dumps({"checks": checks.items}))
        return 0
    result = run_checks(args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    failed = [c["name"] for c in result["checks"] if not c["ok"]]
    print("OK: every NVML check passed" if result["passed"] else f"FAIL: {len(failed)} check(s) failed: {failed}")
    return 0 if result["passed"] else 1


class _stdout_to_stderr:
    """The child's check lines go to stderr, so that its stdout holds only the JSON report."""

    def __enter__(self) -> None:
        self._stdout = sys.stdout
        sys.stdout = sys.stderr

    def __exit__(self, *exc: Any) -> None:
        sys.stdout = self._stdout


if __name__ == "__main__":
    sys.exit(main())
