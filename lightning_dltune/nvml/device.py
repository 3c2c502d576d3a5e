"""Which NVML device this process trains on, and NVML's errors in words.

The CUDA device is identified as torch sees it (after ``CUDA_VISIBLE_DEVICES`` reordering) and
matched to its NVML handle by UUID, then PCI bus id, never by index: NVML numbers all devices of the
machine. Nothing here imports torch or pynvml at module level.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = [
    "GPU_IS_LOST",
    "NOT_FOUND",
    "cuda_device_identity",
    "describe_nvml_error",
    "find_handle",
    "is_mig",
    "nvml_code",
    "nvml_error_code",
    "parse_device",
    "read_utilization_samples",
]

# NVML return codes (the same in every NVML release); the module's own names win when present.
NOT_FOUND = 6
GPU_IS_LOST = 15
_MIG_ENABLE = 1

# nvmlValueType_t -> nvmlValue_t field; utilization samples are "unsigned int" (uiVal).
_VALUE_FIELDS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def cuda_device_identity(index: int) -> tuple[Optional[str], Optional[str]]:
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


def parse_device(device: Any) -> tuple[Optional[str], Optional[int]]:
    """``(type, index)`` of a ``torch.device``, a device string or ``None``.

    Raises:
        ValueError: for anything else.
    """
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


def read_utilization_samples(nvml: Any, handle: Any, sample_type: int, cursor_us: int) -> list[tuple[int, float]]:
    """Utilization samples newer than ``cursor_us`` as ``(timestamp_us, value in [0, 1])``, oldest first.

    NVML answers Not Found where no sample is newer than the cursor: that is an empty list here.

    Raises:
        Exception: any other NVML error, as the module raised it.
    """
    try:
        value_type, samples = nvml.nvmlDeviceGetSamples(handle, sample_type, cursor_us)
    except Exception as err:
        if nvml_error_code(err) != nvml_code(nvml, "NVML_ERROR_NOT_FOUND", NOT_FOUND):
            raise
        return []
    field = _VALUE_FIELDS.get(int(value_type) if value_type is not None else 1, "uiVal")
    return sorted(
        (ts, float(getattr(s.sampleValue, field)) / 100.0) for s in samples if (ts := int(s.timeStamp)) > cursor_us
    )


def find_handle(nvml: Any, uuid: Optional[str], pci: Optional[str]) -> tuple[Any, Optional[str], bool, str]:
    """Handle of the device by UUID, else PCI bus id: ``(handle, matched_by, is_mig_slice, why_not)``.

    ``matched_by`` is ``"uuid"`` or ``"pci_bus_id"``; ``handle`` is ``None`` (with ``why_not``) when
    neither finds the device. A bare UUID is tried with NVML's ``GPU-`` and ``MIG-`` prefixes.
    """
    errors = []
    if uuid:
        bare = uuid[4:] if uuid[:4] in ("GPU-", "MIG-") else uuid
        candidates = [uuid] if uuid != bare else ["GPU-" + bare, "MIG-" + bare]
        for name in candidates:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(name), "uuid", name.startswith("MIG-"), ""
            except Exception as err:
                errors.append(f"UUID {name}: {describe_nvml_error(err)}")
    if pci:
        try:
            return nvml.nvmlDeviceGetHandleByPciBusId(pci), "pci_bus_id", False, ""
        except Exception as err:
            errors.append(f"PCI bus id {pci}: {describe_nvml_error(err)}")
    if not errors:
        return None, None, False, "torch gives neither UUID nor PCI bus id for the device"
    return None, None, False, "no NVML device matches (" + "; ".join(errors) + ")"


def is_mig(nvml: Any, handle: Any) -> bool:
    """``True`` for a MIG slice or a GPU in MIG mode (NVML reports no utilization for them)."""
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


def nvml_error_code(err: BaseException) -> Optional[int]:
    """The NVML return code an error carries (``pynvml.NVMLError.value``), else ``None``."""
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


def nvml_code(nvml: Any, name: str, default: int) -> int:
    """The module's constant ``name`` (e.g. ``NVML_ERROR_NOT_FOUND``), else ``default``."""
    value = getattr(nvml, name, default)
    return value if isinstance(value, int) else default


def describe_nvml_error(err: BaseException) -> str:
    """An NVML error as ``"Not Supported (NVML error 3)"``; other errors as ``"Type: message"``."""
    code = nvml_error_code(err)
    try:
        text = str(err)
    except Exception:
        text = ""
    if code is not None:
        return f"{text or type(err).__name__} (NVML error {code})"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def open_device(
    nvml: Any, device_index: Optional[int], identify: Callable[[int], tuple[Optional[str], Optional[str]]]
) -> tuple[Any, Any, Optional[str], Optional[str], bool]:
    """Start NVML and find the handle of CUDA device ``device_index`` (``None``: torch's current device).

    ``nvml``: the ``pynvml`` module, ``None`` to import it; ``identify``: ``(uuid, pci_bus_id)`` of a
    CUDA device index (:func:`cuda_device_identity`).

    Returns:
        ``(nvml, handle, matched_by, reason, initialised)``: ``reason`` says why NVML cannot serve the
        device (``None`` when it can); ``initialised`` whether ``nvmlInit`` succeeded (the caller
        then owns an NVML session to shut down).
    """
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]
        except Exception as err:
            return None, None, None, f"NVML library not installed (pip install nvidia-ml-py): {err}", False
    try:
        nvml.nvmlInit()
    except Exception as err:
        return nvml, None, None, f"NVML init failed (no NVIDIA driver?): {describe_nvml_error(err)}", False
    index = device_index
    try:
        if index is None:
            import torch

            index = torch.cuda.current_device()
        uuid, pci = identify(index)
    except Exception as err:
        return nvml, None, None, f"cannot identify cuda:{index if index is not None else '?'}: {err}", True
    handle, matched_by, mig_slice, why = find_handle(nvml, uuid, pci)
    if handle is None:
        return nvml, None, matched_by, why, True
    if mig_slice or is_mig(nvml, handle):
        return nvml, handle, matched_by, "MIG enabled: NVML reports no utilization for MIG devices", True
    return nvml, handle, matched_by, None, True
