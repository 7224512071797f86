"""The pool under CuPy (``memory/_cupy.py``) without CUDA: a fake ``cupy`` and a ``sim`` pool.

``make_cupy_allocator`` refuses ``sim`` pools (CuPy would dereference simulated pointers), so the
allocator is checked against a stand-in that reports the ``cuda`` backend and forwards to a
``sim`` pool: the accounting, the stream, the free when CuPy drops the memory and the OOM type
are the pool's; only the pointers are simulated.
"""

from __future__ import annotations

import gc
import types
from typing import Any
import weakref

from fakes import fake_cupy
import pytest

from waterwave_hpo.memory import Backend
from waterwave_hpo.memory import PoolOutOfMemoryError
from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory._cupy import CupySegmentSource
from waterwave_hpo.memory._cupy import make_cupy_allocator

MIB = 1 << 20


class _CupyOutOfMemoryError(Exception):
    """``cupy.cuda.memory.OutOfMemoryError(size, total, limit)``."""

    def __init__(self, size: int, total: int, limit: int) -> None:
        super().__init__(f"Out of memory allocating {size} bytes (allocated so far: {total})")
        self.size = size


class _UnownedMemory:
    def __init__(self, ptr: int, size: int, owner: Any, device_id: int = -1) -> None:
        self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id


class _MemoryPointer:
    def __init__(self, mem: _UnownedMemory, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + offset


def _cupy(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    cupy = fake_cupy.install(monkeypatch)
    memory = types.ModuleType("cupy.cuda.memory")
    memory.OutOfMemoryError = _CupyOutOfMemoryError  # type: ignore[attr-defined]
    cupy.cuda.memory = memory  # type: ignore[attr-defined]
    cupy.cuda.UnownedMemory = _UnownedMemory  # type: ignore[attr-defined]
    cupy.cuda.MemoryPointer = _MemoryPointer  # type: ignore[attr-defined]
    return cupy


class _CudaLike:
    """A ``sim`` pool that says it is a ``cuda`` pool (see the module docstring)."""

    backend = Backend.CUDA

    def __init__(self, pool: StreamAwarePool) -> None:
        self._pool = pool
        self.device = 0
        self.allocate = pool.allocate
        self.free = pool.free
        self.stats = pool.stats


def test_cupy_arrays_take_pool_memory_on_the_current_stream_and_give_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cupy = _cupy(monkeypatch)
    sim = StreamAwarePool(capacity_bytes=64 * MIB, backend="sim")
    allocate = make_cupy_allocator(_CudaLike(sim))  # type: ignore[arg-type]
    with cupy.cuda.ExternalStream(0xBEEF):
        p = allocate(3 * MIB)
    assert sim.stream_stats(0xBEEF).allocated_bytes >= 3 * MIB  # on the trial's stream
    assert p.mem.device_id == 0
    del p
    gc.collect()
    assert sim.stats().allocated_bytes == 0  # freed when CuPy dropped the memory


def test_pool_exhaustion_is_cupys_own_out_of_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = _cupy(monkeypatch)
    sim = StreamAwarePool(capacity_bytes=4 * MIB, backend="sim")
    allocate = make_cupy_allocator(_CudaLike(sim))  # type: ignore[arg-type]
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as caught:
        allocate(64 * MIB)
    assert isinstance(caught.value.__cause__, PoolOutOfMemoryError)


def test_a_sim_pool_is_refused_for_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    _cupy(monkeypatch)
    with pytest.raises(RuntimeError, match="needs a 'cuda' or 'cupy' pool, not 'sim'"):
        make_cupy_allocator(StreamAwarePool(backend="sim"))


def test_the_cupy_upstream_takes_segments_from_cupys_pool_and_reports_exhaustion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cupy = _cupy(monkeypatch)
    handed: list[weakref.ref[Any]] = []

    class _Segment:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

    class _DefaultPool:
        def malloc(self, nbytes: int) -> Any:
            if nbytes > 8 * MIB:
                raise cupy.cuda.memory.OutOfMemoryError(nbytes, 0, 8 * MIB)
            segment = _Segment(0x7000_0000 + len(handed) * 16 * MIB)
            handed.append(weakref.ref(segment))
            return segment

    cupy.get_default_memory_pool = lambda: _DefaultPool()  # type: ignore[attr-defined]
    source = CupySegmentSource(0)
    ptr = source.allocate(2 * MIB, stream=5)
    assert ptr == 0x7000_0000 and handed[0]() is not None  # kept alive while the pool has it
    assert source.allocate(16 * MIB, stream=5) == 0  # exhaustion is 0, never an exception
    source.free(ptr, 2 * MIB)
    gc.collect()
    assert handed[0]() is None  # given back to CuPy's pool


def test_without_cupy_the_cupy_backend_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(RuntimeError, match=r"pip install 'waterwave-hpo\[cuda\]'"):
        CupySegmentSource(0)
