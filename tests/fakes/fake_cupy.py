"""A fake ``cupy`` module: just enough of ``cupy.cuda`` to see which stream and allocator a
thread's CuPy work would use (current stream and allocator are thread-local, as in CuPy).

Install it with :func:`install`, which puts it in ``sys.modules`` for the test.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import sys
import threading
import types
from typing import Any

import pytest

_local = threading.local()


class ExternalStream:
    """``cupy.cuda.ExternalStream(ptr, device_id=-1)``; ``with`` makes it current."""

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        self.ptr = int(ptr)
        self.device_id = device_id
        self._saved: list[Any] = []

    def __enter__(self) -> ExternalStream:
        self._saved.append(getattr(_local, "stream", None))
        _local.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.stream = self._saved.pop()


class _NullStream:
    ptr = 0  # CuPy's default (legacy) stream


class Device:
    """``cupy.cuda.Device(id)``; ``with`` makes it current."""

    def __init__(self, device: int = 0) -> None:
        self.id = device

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def get_current_stream() -> Any:
    return getattr(_local, "stream", None) or _NullStream()


@contextlib.contextmanager
def using_allocator(allocator: Callable[[int], Any] | None = None) -> Iterator[None]:
    saved = getattr(_local, "allocator", None)
    _local.allocator = allocator
    try:
        yield
    finally:
        _local.allocator = saved


class OutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError(size, total, limit=0)``: a ``MemoryError``, as CuPy's."""

    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        super().__init__(
            f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes)."
        )


class FakeArray:
    """What ``cupy.empty`` returns here: the stream it was made on."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.stream_ptr = get_current_stream().ptr
        self.allocator = getattr(_local, "allocator", None)


class MemoryPool:
    """``cupy.cuda.MemoryPool``'s limit: ``set_limit(size=None, fraction=None)``, get_limit()."""

    def __init__(self) -> None:
        self.limit = 0

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        self.limit = int(size or 0)

    def get_limit(self) -> int:
        return self.limit


def install(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Put the fake ``cupy`` (and ``cupy.cuda``) in ``sys.modules`` for one test."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    memory = types.ModuleType("cupy.cuda.memory")
    memory.OutOfMemoryError = OutOfMemoryError  # type: ignore[attr-defined]
    cuda.memory = memory  # type: ignore[attr-defined]
    cuda.ExternalStream = ExternalStream  # type: ignore[attr-defined]
    cuda.Device = Device  # type: ignore[attr-defined]
    cuda.get_current_stream = get_current_stream  # type: ignore[attr-defined]
    cuda.using_allocator = using_allocator  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    cupy.empty = lambda nbytes: FakeArray(nbytes)  # type: ignore[attr-defined]
    pool = MemoryPool()  # one per device in CuPy; one is enough for these tests
    cupy.get_default_memory_pool = lambda: pool  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.memory", memory)
    return cupy
