"""One CUDA stream per trial slot, never shared by two running trials.

``torch.cuda.Stream()`` hands out 32 pooled streams per priority round-robin, so two trial
threads that each ask torch for a stream can get the same one, and a trial that creates its own
side stream can collide with a neighbour's main stream. Slots instead create their streams with
the CUDA driver (``cuStreamCreate`` with ``CU_STREAM_NON_BLOCKING``, the flag torch uses for its
own streams) and wrap them in ``torch.cuda.ExternalStream``. Streams are kept in a process-wide
free list per device and reused by later slots, never destroyed: a tensor freed after its trial
ended may still name its stream in the caching allocator.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from waterwave_hpo.host._driver import DriverError
from waterwave_hpo.host._driver import check
from waterwave_hpo.host._driver import load_driver

_CU_STREAM_NON_BLOCKING = 0x1
_lock = threading.Lock()
_free: dict[int, list[torch.cuda.Stream]] = {}
_in_use: set[int] = set()


def _driver_stream(device: torch.device) -> torch.cuda.Stream:
    driver = load_driver()
    context = ctypes.c_void_p()
    check(driver.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    if not context.value:
        handle = ctypes.c_int()
        check(driver.cuDeviceGet(ctypes.byref(handle), device.index), "cuDeviceGet")
        check(
            driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle),
            "cuDevicePrimaryCtxRetain",
        )
        check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    raw = ctypes.c_void_p()
    check(driver.cuStreamCreate(ctypes.byref(raw), _CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    return torch.cuda.ExternalStream(raw.value, device=device)  # type: ignore[no-untyped-call]


def _pooled_stream(device: torch.device) -> torch.cuda.Stream:
    # Fallback when the driver cannot be reached through ctypes: walk torch's pools (both
    # priorities, 32 streams each) until a stream no running slot holds comes up.
    for attempt in range(128):
        stream = torch.cuda.Stream(  # type: ignore[no-untyped-call]
            device=device, priority=0 if attempt % 2 == 0 else -1
        )
        if stream.cuda_stream not in _in_use:
            return stream
    raise RuntimeError(
        f"Could not find a CUDA stream on {device} that no other trial holds: torch's stream "
        "pools are exhausted and the CUDA driver could not be loaded to create more. Lower "
        "trials_per_device."
    )


def acquire_stream(device: torch.device) -> torch.cuda.Stream:
    """Return a stream on ``device`` that no other slot holds until :func:`release_stream`.

    Must be called from the thread that will use the stream, after ``torch.cuda.set_device``.

    Raises:
        RuntimeError: If no unshared stream can be had (see :func:`_pooled_stream`).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    with _lock:
        free = _free.setdefault(index, [])
        if free:
            stream = free.pop()
        else:
            try:
                stream = _driver_stream(device)
            except (OSError, AttributeError, DriverError):
                stream = _pooled_stream(device)
        _in_use.add(stream.cuda_stream)
        return stream


def release_stream(stream: torch.cuda.Stream) -> None:
    """Wait for ``stream``'s queued work, then return it to the free list of its device."""
    stream.synchronize()
    with _lock:
        _in_use.discard(stream.cuda_stream)
        _free.setdefault(stream.device.index, []).append(stream)


def streams_in_use() -> frozenset[int]:
    """The raw handles (``cudaStream_t`` as int) of the streams slots hold now."""
    with _lock:
        return frozenset(_in_use)
