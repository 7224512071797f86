"""CuPy integration: the ``cupy`` upstream, the allocator and the current stream.

CuPy integration: the ``cupy`` segment upstream, ``pool.cupy_allocator()`` and a trial's
stream as CuPy's current stream (:func:`cupy_on_stream`).

Segments come from CuPy's default memory pool, so a CuPy-backed deployment keeps one accounting
of the device; segment requests are rare (a Python call there costs little). The pool calls them
without holding its own lock, so an autograd thread that needs the GIL for them cannot deadlock
against a Python thread that holds the GIL and waits for the pool.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING
from typing import Any

from waterwave_hpo.memory._errors import PoolOutOfMemoryError

if TYPE_CHECKING:
    from collections.abc import Callable
    from collections.abc import Iterator

    from waterwave_hpo.memory._pool import StreamAwarePool


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            "CuPy is not installed; the 'cupy' backend and pool.cupy_allocator() need it: "
            "pip install 'waterwave-hpo[cuda]' (cupy-cuda12x)."
        ) from exc
    return cupy


class CupySegmentSource:
    """Takes segments from CuPy's default memory pool and keeps them alive until released.

    Args:
        device: CUDA device ordinal.

    Raises:
        RuntimeError: CuPy is not installed.
    """

    def __init__(self, device: int) -> None:
        self._cupy = _import_cupy()
        self._device = device
        self._lock = threading.Lock()
        self._live: dict[int, Any] = {}

    def allocate(self, nbytes: int, stream: int) -> int:
        """A segment of ``nbytes`` bytes from CuPy's default pool, or 0 when it is exhausted.

        ``stream`` is not passed on: the segment outlives any one stream's use.
        """
        del stream
        cupy = self._cupy
        try:
            with cupy.cuda.Device(self._device):
                mem = cupy.get_default_memory_pool().malloc(nbytes)
        except cupy.cuda.memory.OutOfMemoryError:
            return 0
        ptr = int(mem.ptr)
        with self._lock:
            self._live[ptr] = mem
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        """Gives a segment back to CuPy's pool."""
        del nbytes
        with self._lock:
            self._live.pop(ptr, None)


class _PoolBlock:
    """Owner of one pool block lent to CuPy; gives it back when CuPy drops the memory."""

    __slots__ = ("_pool", "ptr")

    def __init__(self, pool: StreamAwarePool, ptr: int) -> None:
        self._pool = pool
        self.ptr = ptr

    def __del__(self) -> None:
        try:
            self._pool.free(self.ptr)
        except Exception:
            pass  # the pool was closed first; nothing to give back


def make_cupy_allocator(pool: StreamAwarePool) -> Callable[[int], Any]:
    """An allocator function for ``cupy.cuda.set_allocator`` drawing from ``pool``.

    Each allocation is made on CuPy's current stream and freed (in that stream's order) when
    CuPy drops the memory. Exhaustion raises ``cupy.cuda.memory.OutOfMemoryError``.

    Raises:
        RuntimeError: CuPy is not installed, or ``pool`` is a ``sim`` pool.
    """
    from waterwave_hpo.memory._pool import Backend

    if pool.backend is Backend.SIM:
        raise RuntimeError("pool.cupy_allocator() needs a 'cuda' or 'cupy' pool, not 'sim'.")
    cupy = _import_cupy()
    device = pool.device

    def allocate(nbytes: int) -> Any:
        stream = cupy.cuda.get_current_stream().ptr
        try:
            ptr = pool.allocate(nbytes, int(stream))
        except PoolOutOfMemoryError as exc:
            stats = pool.stats()
            raise cupy.cuda.memory.OutOfMemoryError(
                nbytes, stats.reserved_bytes, stats.capacity_bytes
            ) from exc
        owner = _PoolBlock(pool, ptr)
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device_id=device)
        return cupy.cuda.MemoryPointer(mem, 0)

    return allocate


@contextlib.contextmanager
def cupy_on_stream(stream_ptr: int, device: int, pool: StreamAwarePool | None) -> Iterator[None]:
    """Make ``stream_ptr`` CuPy's current stream in this thread for the block.

    Make ``stream_ptr`` CuPy's current stream in this thread for the block, and, with a pool,
    route CuPy's allocations in this thread to it.

    A trial's CuPy arrays then run in its stream's order and are charged to its pool account,
    instead of going to CuPy's default stream (unordered with the trial's PyTorch work). CuPy's
    current stream and ``using_allocator`` are thread-local, as a trial's thread is. Nothing
    happens when CuPy is not installed.

    Args:
        stream_ptr: The trial's raw ``cudaStream_t`` (``torch.cuda.Stream.cuda_stream``).
        device: Its CUDA device ordinal.
        pool: The device's installed pool, or ``None`` (CuPy keeps its own allocator).
    """
    try:
        import cupy
    except ImportError:
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(cupy.cuda.Device(device))
            stack.enter_context(cupy.cuda.ExternalStream(stream_ptr, device))
            if pool is not None:
                stack.enter_context(cupy.cuda.using_allocator(make_cupy_allocator(pool)))
        except Exception as error:  # a CuPy that cannot reach this CUDA: the trial goes on
            stack.close()
            _warn_cupy_unusable(error)
        yield


_cupy_warned = False


def _warn_cupy_unusable(error: BaseException) -> None:
    global _cupy_warned
    if not _cupy_warned:
        _cupy_warned = True
        import logging

        logging.getLogger("waterwave_hpo").warning(
            "CuPy is installed but its current stream could not be set to the trial's (%s: %s); "
            "CuPy work in trials runs on CuPy's own stream, unordered with PyTorch's. Install "
            "the CuPy build for your torch's CUDA (waterwave-hpo[cuda12] or [cuda13]).",
            type(error).__name__,
            error,
        )
