"""The CUDA driver (``libcuda.so.1``) through ``ctypes``, for what must not initialise torch's CUDA.

``torch.cuda.get_device_properties`` and every other ``torch.cuda`` query past the device count
run ``torch.cuda._lazy_init``, which also initialises PyTorch's caching allocator: from then on
:func:`waterwave_hpo.memory.use_pool` is refused in this process and a threads study run later
in it gets PyTorch's allocator (the late path, ``docs/guide/memory.md``). The driver API
answers the same questions without a context (``cuInit`` creates none) and leaves torch
untouched.
"""

from __future__ import annotations

import ctypes

import torch

_driver: ctypes.CDLL | None = None


class DriverError(RuntimeError):
    """A driver call returned a ``CUresult`` other than ``CUDA_SUCCESS``."""


def load_driver() -> ctypes.CDLL:
    """``libcuda.so.1``, ``cuInit``'ed once per process.

    Raises:
        OSError: If the library cannot be loaded (no NVIDIA driver on this machine).
        DriverError: If ``cuInit`` fails (e.g. ``CUDA_ERROR_NO_DEVICE``, 100).
    """
    global _driver
    if _driver is None:
        driver = ctypes.CDLL("libcuda.so.1")
        check(driver.cuInit(0), "cuInit")
        _driver = driver
    return _driver


def check(result: int, call: str) -> None:
    """Raise :class:`DriverError` naming ``call`` unless ``result`` is 0 (``CUDA_SUCCESS``)."""
    if result != 0:
        raise DriverError(f"{call} failed with CUresult {result}")


def device_total_bytes(device: torch.device) -> int:
    """The device memory of ``device`` in bytes, without initialising torch's CUDA.

    Asks the driver (``cuDeviceTotalMem``, no context); where the driver cannot be reached
    through ``ctypes``, falls back to ``torch.cuda.get_device_properties`` (which initialises
    torch's CUDA in this process). An index-less ``device`` means device 0 unless torch's CUDA is
    initialised already (then its current device).
    """
    index = device.index
    if index is None:
        initialised = torch.cuda.is_initialized()
        index = torch.cuda.current_device() if initialised else 0
    try:
        driver = load_driver()
        handle = ctypes.c_int()
        check(driver.cuDeviceGet(ctypes.byref(handle), index), "cuDeviceGet")
        total = ctypes.c_size_t()
        check(driver.cuDeviceTotalMem_v2(ctypes.byref(total), handle), "cuDeviceTotalMem_v2")
        return int(total.value)
    except (OSError, AttributeError, DriverError):
        return int(torch.cuda.get_device_properties(index).total_memory)
