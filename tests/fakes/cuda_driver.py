"""A fake CUDA driver for ``ctypes`` callers: ``libcuda.so.1``'s entry points as Python callables.

Code that loads the driver with ``ctypes.CDLL("libcuda.so.1")`` and passes ``ctypes.byref(x)``
out-parameters (``host/_streams.py``) runs against :class:`FakeDriver`: each entry point
writes its out-parameter through the ``byref`` object and returns a ``CUresult`` (0 = success).
It records the calls, hands out distinct stream handles, and fails any call named in
``fail`` with the result given there.
"""

from __future__ import annotations

import itertools
from typing import Any


class FakeDriver:
    """``cuInit``, ``cuDeviceTotalMem``, the primary context, ``cuStreamCreate`` (module doc)."""

    def __init__(self, fail: dict[str, int] | None = None, total_bytes: int = 141 << 30) -> None:
        self.total_bytes = total_bytes  # every device's memory (cuDeviceTotalMem)
        self.fail = dict(fail or {})
        self.calls: list[str] = []
        self.context = 0  # the calling thread's current context (one thread is enough here)
        self.retained: list[int] = []
        self.stream_flags: list[int] = []
        self._handles = itertools.count(0x5000)

    def _call(self, name: str) -> int:
        self.calls.append(name)
        return self.fail.get(name, 0)

    def cuInit(self, flags: int) -> int:
        return self._call("cuInit")

    def cuCtxGetCurrent(self, out: Any) -> int:
        out._obj.value = self.context or None
        return self._call("cuCtxGetCurrent")

    def cuDeviceGet(self, out: Any, ordinal: int) -> int:
        out._obj.value = ordinal
        return self._call("cuDeviceGet")

    def cuDeviceTotalMem_v2(self, out: Any, device: Any) -> int:
        out._obj.value = self.total_bytes  # needs no context, as the real one
        return self._call("cuDeviceTotalMem_v2")

    def cuDevicePrimaryCtxRetain(self, out: Any, device: Any) -> int:
        out._obj.value = 0xC000 + int(getattr(device, "value", device))
        self.retained.append(out._obj.value)
        return self._call("cuDevicePrimaryCtxRetain")

    def cuCtxSetCurrent(self, context: Any) -> int:
        self.context = int(getattr(context, "value", context) or 0)
        return self._call("cuCtxSetCurrent")

    def cuStreamCreate(self, out: Any, flags: int) -> int:
        result = self._call("cuStreamCreate")
        if result == 0:
            out._obj.value = next(self._handles)
            self.stream_flags.append(flags)
        return result


class FakeExternalStream:
    """``torch.cuda.ExternalStream(ptr, device=...)``: a stream made outside torch."""

    def __init__(self, stream_ptr: int, device: Any = None) -> None:
        self.cuda_stream = int(stream_ptr)
        self.device = device
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


class FakeTorchStreamPool:
    """``torch.cuda.Stream(device, priority)``: 32 pooled streams per priority, round-robin."""

    def __init__(self) -> None:
        self._next = {0: itertools.cycle(range(32)), -1: itertools.cycle(range(32))}

    def __call__(self, device: Any = None, priority: int = 0) -> FakeExternalStream:
        slot = next(self._next[priority])
        return FakeExternalStream(0x100 * (2 if priority < 0 else 1) + slot, device)
