"""The stream-aware memory pool: one pool for all co-hosted trials on a GPU.

Source: Waterwave (IEEE TC 72(10), 2023), the first mechanism, "stream-aware allocation": memory
one trial frees is usable by another as soon as it is *scheduled* safe, not when the GPU drained.
The hot path is C++ (``allocator_ext/``); this module is its ctypes facade.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import threading
from typing import TYPE_CHECKING
from typing import Any

from waterwave_hpo import _checks
from waterwave_hpo import _experimental
from waterwave_hpo.memory._errors import OOMReason
from waterwave_hpo.memory._errors import PoolBackendError
from waterwave_hpo.memory._errors import PoolOutOfMemoryError
from waterwave_hpo.memory._lib import SEGMENT_ALLOC_FN
from waterwave_hpo.memory._lib import SEGMENT_FREE_FN
from waterwave_hpo.memory._lib import BlockInfoStruct
from waterwave_hpo.memory._lib import Counters
from waterwave_hpo.memory._lib import DriverCountersStruct
from waterwave_hpo.memory._lib import last_error
from waterwave_hpo.memory._lib import load_library
from waterwave_hpo.memory._sim import SimDevice
from waterwave_hpo.memory._stats import AllocationSource
from waterwave_hpo.memory._stats import BlockInfo
from waterwave_hpo.memory._stats import DriverStats
from waterwave_hpo.memory._stats import LockStats
from waterwave_hpo.memory._stats import PoolStats
from waterwave_hpo.memory._stats import UsageStats
from waterwave_hpo.memory._streams import StreamLike
from waterwave_hpo.memory._streams import stream_handle

if TYPE_CHECKING:
    from collections.abc import Callable

_WW_OK = 0
_WW_INVALID = 4
_WW_BACKEND_ERROR = 5

#: Capacity of a ``sim`` pool created with ``capacity_bytes=None``: a simulated 1 GiB device.
SIM_DEFAULT_CAPACITY_BYTES = 1 << 30
_UNLIMITED = 2**64 - 1


class Backend(enum.Enum):
    """Where a pool's segments come from (its upstream, as in RMM)."""

    #: The CUDA driver (``libcuda.so.1``, loaded at run time): ``cuMemAlloc``/``cuMemFree``.
    CUDA = "cuda"
    #: CuPy's allocator (``cupy.cuda.alloc``), so the pool shares CuPy's accounting of the device.
    CUPY = "cupy"
    #: A simulated device: host memory, virtual streams and events the caller completes.
    SIM = "sim"


_BACKEND_CODES = {Backend.SIM: 0, Backend.CUDA: 1, Backend.CUPY: 2}
_SIM_EXTERNAL_CODE = 3


def round_size(nbytes: int) -> int:
    """The size class (block size, bytes) the pool uses for a request of ``nbytes``.

    Multiples of 512 bytes up to 1 MiB; above, multiples of 1/16 of the next power of two.
    """
    if nbytes < 0:
        raise _checks.value_error("nbytes", nbytes, "must be >= 0", "pass a size in bytes")
    return int(load_library().ww_round_size(nbytes))


class Account:
    """The memory account of one trial, charged for what its bound streams allocate.

    Get one with :meth:`StreamAwarePool.open_account`. Every allocation on a bound stream counts
    towards the account's stats and quota. Thread-safe.
    """

    def __init__(self, pool: StreamAwarePool, account_id: int, name: str) -> None:
        self._pool = pool
        self._id = account_id
        self._name = name
        self._closed = False

    @property
    def id(self) -> int:
        """The account's id in its pool (the ``account_id`` of trace records and snapshots)."""
        return self._id

    @property
    def name(self) -> str:
        """The name given at :meth:`StreamAwarePool.open_account` (e.g. the trial number)."""
        return self._name

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Account {self._name!r} is closed; open a new one.")

    def bind(self, stream: StreamLike) -> None:
        """Charges every later allocation on ``stream`` to this account.

        Args:
            stream: A stream handle (see :func:`stream_handle`); one stream belongs to at most one
                account at a time.

        Raises:
            ValueError: ``stream`` is already bound to another account.
            RuntimeError: The account is closed.
        """
        self._check_open()
        handle = stream_handle(stream)
        rc = self._pool._lib.ww_account_bind(self._pool._handle(), self._id, handle)
        if rc != _WW_OK:
            raise ValueError(
                f"Cannot bind stream {handle} to account {self._name!r}: {last_error()}."
            )

    def unbind(self, stream: StreamLike) -> None:
        """Stops charging ``stream``'s allocations to this account.

        Raises:
            ValueError: ``stream`` is not bound to this account.
        """
        self._check_open()
        handle = stream_handle(stream)
        rc = self._pool._lib.ww_account_unbind(self._pool._handle(), self._id, handle)
        if rc != _WW_OK:
            raise ValueError(f"Cannot unbind stream {handle}: {last_error()}.")

    def set_quota(self, quota_bytes: int | None) -> None:
        """Limits the account's allocated bytes; an allocation beyond it fails as out of memory.

        Args:
            quota_bytes: The limit in bytes (> 0), or None for no limit.

        Raises:
            TypeError: ``quota_bytes`` is neither an int nor None.
            ValueError: ``quota_bytes`` is not positive.
        """
        self._check_open()
        self._pool.set_quota(self, quota_bytes)

    def stats(self) -> UsageStats:
        """The account's counters (allocated bytes, peak bytes, counts by source, quota).

        Raises:
            RuntimeError: The account is closed.
        """
        self._check_open()
        c = Counters()
        rc = self._pool._lib.ww_account_stats(self._pool._handle(), self._id, ctypes.byref(c))
        if rc != _WW_OK:
            raise RuntimeError(last_error())
        return UsageStats._from_counters(c)

    @property
    def peak_allocated_bytes(self) -> int:
        """The account's peak allocated bytes (the trial's peak memory)."""
        return self.stats().peak_allocated_bytes

    def close(self) -> None:
        """Unbinds all the account's streams and forgets it. Idempotent.

        Blocks it still holds stay valid; freeing them later charges no account.
        """
        if self._closed:
            return
        self._closed = True
        if self._pool._ptr is not None:
            self._pool._lib.ww_account_close(self._pool._handle(), self._id)
        self._pool._account_closed()

    def __enter__(self) -> Account:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Account(name={self._name!r}, id={self._id}, closed={self._closed})"


class StreamAwarePool:
    """One memory pool for all co-hosted trials on a device, aware of CUDA streams.

    Free blocks remember the stream that freed them and an event recorded there. An allocation
    for stream S takes, in this order: (1) a free block last used by S; (2) a free block of
    another stream whose event has completed; (3) a free block of another stream whose event is
    pending, after making S wait on it on the GPU (never a CPU wait); (4) a new segment, within
    ``capacity_bytes``; (5) after coalescing and releasing wholly free cached segments, a retry;
    then it fails. Blocks are rounded to size classes (:func:`round_size`), split from segments and
    coalesced on free. Source: Waterwave (IEEE TC 72(10), 2023), prioritized allocation.

    Every method is thread-safe and releases the GIL while in C++.

    Experimental: the ``cuda`` and ``cupy`` backends have never run on a GPU (they are tested
    against fakes on the CPU); the first use of each in a process emits
    :class:`waterwave_hpo.ExperimentalWarning`.

    Args:
        capacity_bytes: Most bytes of segments the pool may hold. None: no limit beyond the
            device's for ``cuda``/``cupy``; a simulated 1 GiB device for ``sim``.
        backend: ``"cuda"`` (the CUDA driver), ``"cupy"`` (segments from CuPy's allocator) or
            ``"sim"`` (a simulated device; see :attr:`sim`), or a :class:`Backend`.
        device: CUDA device ordinal (``cuda``/``cupy``); ignored by ``sim``.

    Raises:
        TypeError: ``capacity_bytes`` or ``device`` is not an int.
        ValueError: ``capacity_bytes``, ``backend`` or ``device`` is out of range.
        RuntimeError: The backend cannot start (no CUDA driver, no such device, CuPy missing).
        ImportError: The C++ library is not built (reinstall with ``pip install .``).
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        backend: str | Backend = "cuda",
        device: int = 0,
        _segment_source: tuple[Callable[[int, int], int], Callable[[int, int], None]] | None = None,
    ) -> None:
        self._ptr: int | None = None
        self._pinned = False  # set by use_pool: PyTorch holds it until the process ends
        self._accounts_lock = threading.Lock()
        self._open_accounts = 0  # under _accounts_lock
        self._release_deferred = False  # under _accounts_lock
        _checks.check_optional_int(
            "capacity_bytes",
            capacity_bytes,
            minimum=1,
            fix="pass a positive number of bytes, or None for the device's memory",
        )
        try:
            self._backend = Backend(backend)
        except ValueError:
            allowed = ", ".join(repr(b.value) for b in Backend)
            raise _checks.value_error(
                "backend", backend, f"is not one of {allowed}", "pass 'cuda' on a GPU"
            ) from None
        _checks.check_int("device", device, minimum=0, fix="pass a CUDA device ordinal in [0, 64)")
        if device >= 64:
            raise _checks.value_error(
                "device", device, "must be < 64", "pass a CUDA device ordinal in [0, 64)"
            )
        self._device = device
        if self._backend is Backend.CUDA:
            _experimental.warn_experimental(_experimental.ExperimentalPath.POOL_CUDA)
        elif self._backend is Backend.CUPY:
            _experimental.warn_experimental(_experimental.ExperimentalPath.POOL_CUPY)
        self._lib = load_library()
        self._lock = threading.Lock()
        self._cupy_upstream: Any = None
        if capacity_bytes is None:
            capacity = SIM_DEFAULT_CAPACITY_BYTES if self._backend is Backend.SIM else _UNLIMITED
        else:
            capacity = capacity_bytes
        self._capacity = capacity
        alloc_cb = SEGMENT_ALLOC_FN()
        free_cb = SEGMENT_FREE_FN()
        code = _BACKEND_CODES[self._backend]
        if self._backend is Backend.CUPY:
            from waterwave_hpo.memory._cupy import CupySegmentSource

            self._cupy_upstream = CupySegmentSource(device)
            _segment_source = (self._cupy_upstream.allocate, self._cupy_upstream.free)
        if _segment_source is not None:
            seg_alloc, seg_free = _segment_source

            lib = self._lib

            def _alloc(_ctx: int | None, nbytes: int, stream: int) -> int:
                # 0 is "out of memory"; any other failure is a backend error, never an OOM;
                # the upstream returns 0 itself when it is exhausted.
                try:
                    return int(seg_alloc(nbytes, stream))
                except MemoryError:
                    return 0
                except Exception as exc:
                    lib.ww_set_upstream_error(
                        f"segment source: {type(exc).__name__}: {exc}".encode("utf-8", "replace")
                    )
                    return 0

            def _free(_ctx: int | None, ptr: int, nbytes: int) -> None:
                try:
                    seg_free(ptr, nbytes)
                except Exception:
                    pass

            alloc_cb = SEGMENT_ALLOC_FN(_alloc)
            free_cb = SEGMENT_FREE_FN(_free)
            if self._backend is Backend.SIM:
                code = _SIM_EXTERNAL_CODE
        # The callbacks must outlive the C++ pool.
        self._callbacks = (alloc_cb, free_cb)
        ptr = self._lib.ww_pool_create(code, device, capacity, alloc_cb, free_cb, None)
        if not ptr:
            raise RuntimeError(
                f"Cannot create a {self._backend.value!r} pool on device {device}: {last_error()}"
            )
        self._ptr = int(ptr)
        self._sim = SimDevice(self) if self._backend is Backend.SIM else None

    # -- internals -----------------------------------------------------------------------------

    def _handle(self) -> int:
        ptr = self._ptr
        if ptr is None:
            raise RuntimeError("This StreamAwarePool is closed.")
        return ptr

    # -- properties ----------------------------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """Where the pool's segments come from."""
        return self._backend

    @property
    def device(self) -> int:
        """The CUDA device ordinal (0 for ``sim``)."""
        return self._device

    @property
    def capacity_bytes(self) -> int | None:
        """Most bytes of segments the pool may hold; None when only the device limits it."""
        return None if self._capacity == _UNLIMITED else self._capacity

    def set_capacity(self, capacity_bytes: int | None) -> None:
        """Sets the most bytes of segments the pool may hold from now on.

        What ``capacity_bytes=`` set at construction, changed in place, so that a pool already
        installed as PyTorch's allocator (:func:`~waterwave_hpo.memory.use_pool`) can be bounded
        afresh, e.g. per benchmark row, where ``torch.cuda.set_per_process_memory_fraction``
        bounds PyTorch's own allocator: both count the bytes of the segments taken from the
        device (reserved bytes, cached ones included). Nothing held is taken away: segments
        beyond a lowered capacity stay until freed, and meanwhile no new segment is taken
        (:meth:`release_cached` gives back the wholly free ones first). Thread-safe.

        A ``sim`` pool's simulated device keeps the address space it was made with (16 times
        its first capacity, at least 1 GiB): beyond it, a new segment fails as the device
        refusing it (``OOMReason.UPSTREAM``).

        Args:
            capacity_bytes: The new capacity in bytes (> 0). None: as at construction, no limit
                beyond the device's for ``cuda``/``cupy``, :data:`SIM_DEFAULT_CAPACITY_BYTES`
                for ``sim``.

        Raises:
            TypeError: ``capacity_bytes`` is neither an int nor None.
            ValueError: ``capacity_bytes`` is not positive.
            RuntimeError: The pool is closed.
        """
        _checks.check_optional_int(
            "capacity_bytes",
            capacity_bytes,
            minimum=1,
            fix="pass a positive number of bytes, or None for the device's memory",
        )
        if capacity_bytes is None:
            sim = self._backend is Backend.SIM
            capacity = SIM_DEFAULT_CAPACITY_BYTES if sim else _UNLIMITED
        else:
            capacity = capacity_bytes
        self._lib.ww_pool_set_capacity(self._handle(), capacity)
        self._capacity = capacity

    @property
    def sim(self) -> SimDevice:
        """The simulated device of a ``sim`` pool: ``submit``, ``finish``, ``trace``.

        Raises:
            AttributeError: The pool's backend is not ``sim``.
        """
        if self._sim is None:
            raise AttributeError(
                f"pool.sim exists only for backend='sim'; this pool's backend is "
                f"{self._backend.value!r}."
            )
        return self._sim

    # -- allocation ----------------------------------------------------------------------------

    def allocate(self, nbytes: int, stream: StreamLike = None) -> int:
        """Allocates ``nbytes`` bytes for use on ``stream``.

        The block may come from another stream's free memory; if so, the pool has already made
        ``stream`` wait (on the GPU) for that memory's last use, so it is safe for work enqueued
        on ``stream`` from now on.

        Args:
            nbytes: Bytes wanted (>= 0; rounded up to a size class, at least 512).
            stream: The stream the memory is used on (None: the default stream).

        Returns:
            The device pointer (for ``sim``, a host address), 512-byte aligned.

        Raises:
            TypeError: ``nbytes`` is not an int.
            ValueError: ``nbytes`` is negative.
            PoolOutOfMemoryError: Capacity, quota or device exhausted; the pool is unchanged.
            PoolBackendError: The backend failed otherwise (a CUDA error other than
                ``CUDA_ERROR_OUT_OF_MEMORY``, e.g. an illegal address); not an out of memory.
        """
        return self.allocate_with_source(nbytes, stream)[0]

    def allocate_with_source(
        self, nbytes: int, stream: StreamLike = None
    ) -> tuple[int, AllocationSource]:
        """Like :meth:`allocate`, also saying where the block came from (priority step).

        Returns:
            ``(pointer, source)``.

        Raises:
            TypeError: ``nbytes`` is not an int.
            ValueError: ``nbytes`` is negative.
            PoolOutOfMemoryError: Capacity, quota or device exhausted; the pool is unchanged.
            PoolBackendError: The backend failed otherwise (not an out of memory).
        """
        _checks.check_int("nbytes", nbytes, minimum=0, fix="pass a size in bytes")
        handle = stream_handle(stream)
        out = ctypes.c_uint64(0)
        src = ctypes.c_int(0)
        rc = self._lib.ww_pool_allocate(
            self._handle(), nbytes, handle, ctypes.byref(out), ctypes.byref(src)
        )
        if rc in (1, 2, 3):
            raise PoolOutOfMemoryError(
                last_error(), nbytes=nbytes, stream=handle, reason=OOMReason(rc)
            )
        if rc != _WW_OK:
            raise PoolBackendError(
                f"The {self._backend.value!r} pool on device {self._device} cannot serve "
                f"{nbytes} bytes: {last_error()}",
                nbytes=nbytes,
                stream=handle,
            )
        return int(out.value), AllocationSource(src.value)

    def free(self, ptr: int, stream: StreamLike = None) -> None:
        """Returns a block to the pool, in ``stream``'s order.

        The pool records an event on ``stream``; until it completes, another stream gets the
        block only after waiting on it on the GPU.

        Args:
            ptr: A pointer returned by :meth:`allocate` and not freed since.
            stream: The stream whose queued work is the block's last use. None: the stream it was
                allocated on.

        Raises:
            ValueError: ``ptr`` is not a live allocation of this pool (double free, foreign
                pointer).
        """
        handle = 0 if stream is None else stream_handle(stream)
        rc = self._lib.ww_pool_free(self._handle(), ptr, handle, 0 if stream is None else 1)
        if rc != _WW_OK:
            raise ValueError(f"The ptr argument {ptr:#x} cannot be freed: {last_error()}.")

    def record_stream(self, ptr: int, stream: StreamLike) -> None:
        """Marks a live block as also used on ``stream`` (``Tensor.record_stream`` semantics).

        When the block is freed, it is reused only after the work queued on ``stream`` at that
        time has completed, in addition to the freeing stream's rule. PyTorch's pluggable
        allocator drops ``Tensor.record_stream``; call this instead with
        ``tensor.untyped_storage().data_ptr()`` (the block's start, not a view's offset pointer).

        Raises:
            ValueError: ``ptr`` is not a live allocation of this pool.
        """
        rc = self._lib.ww_pool_record_stream(self._handle(), ptr, stream_handle(stream))
        if rc != _WW_OK:
            raise ValueError(f"The ptr argument {ptr:#x}: {last_error()}.")

    def release_cached(self) -> int:
        """Gives wholly free segments whose last uses completed back to the upstream.

        Returns:
            Bytes released.
        """
        return int(self._lib.ww_pool_release_cached(self._handle()))

    def release_cached_when_idle(self) -> int | None:
        """:meth:`release_cached` now if no account is open, else when the last one closes.

        Giving a segment back to the CUDA driver (``cuMemFree``) synchronises the whole device:
        with trials running, every neighbour's stream would be waited for. So while an account
        (a running trial) is open, the release is deferred to the close of the last open one.
        Meanwhile the cached blocks serve every stream of the pool anyway. What
        ``torch.cuda.empty_cache()`` does under the pool.

        Returns:
            Bytes released now, or None when the release was deferred.
        """
        with self._accounts_lock:
            if self._open_accounts > 0:
                self._release_deferred = True
                return None
        return self.release_cached()

    def _account_closed(self) -> None:
        with self._accounts_lock:
            self._open_accounts -= 1
            run = self._open_accounts == 0 and self._release_deferred
            if run:
                self._release_deferred = False
        if run and self._ptr is not None:
            self.release_cached()

    # -- accounts ------------------------------------------------------------------------------

    def open_account(self, name: str = "", *, streams: tuple[StreamLike, ...] = ()) -> Account:
        """Opens an account (one per trial) and binds ``streams`` to it.

        Args:
            name: A label (e.g. the trial number), for messages and repr.
            streams: Streams to bind now (more with :meth:`Account.bind`).

        Returns:
            The account; close it when the trial ends.

        Raises:
            ValueError: One of ``streams`` is already bound to another account.
        """
        account_id = int(self._lib.ww_account_open(self._handle()))
        account = Account(self, account_id, name)
        with self._accounts_lock:
            self._open_accounts += 1
        try:
            for s in streams:
                account.bind(s)
        except Exception:
            account.close()
            raise
        return account

    def set_quota(self, account: Account, quota_bytes: int | None) -> None:
        """Limits ``account``'s allocated bytes; beyond it, its allocations fail as out of memory.

        Args:
            account: An open account of this pool.
            quota_bytes: The limit in bytes (> 0), or None to remove it.

        Raises:
            TypeError: ``quota_bytes`` is neither an int nor None.
            ValueError: ``quota_bytes`` is not positive, or ``account`` belongs to
                another pool.
        """
        if account._pool is not self:
            raise ValueError(f"The account argument {account!r} belongs to another pool.")
        _checks.check_optional_int(
            "quota_bytes", quota_bytes, minimum=1, fix="pass a positive int, or None for no quota"
        )
        rc = self._lib.ww_account_set_quota(self._handle(), account.id, quota_bytes or 0)
        if rc != _WW_OK:
            raise ValueError(f"Cannot set the quota of {account!r}: {last_error()}.")

    # -- statistics ----------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        """A consistent snapshot of the pool's counters (bytes, peaks, counts by source)."""
        c = Counters()
        self._lib.ww_pool_stats(self._handle(), ctypes.byref(c))
        return PoolStats._from_counters(c)

    def stream_stats(self, stream: StreamLike) -> UsageStats:
        """The counters of one stream (zeros for a stream the pool never saw)."""
        c = Counters()
        self._lib.ww_pool_stream_stats(self._handle(), stream_handle(stream), ctypes.byref(c))
        return UsageStats._from_counters(c)

    def reset_peaks(self) -> None:
        """Sets every peak (pool, streams, accounts) to its current value."""
        self._lib.ww_pool_reset_peaks(self._handle())

    def lock_stats(self) -> LockStats:
        """Contention of the pool's mutex, and the events recorded under it (:class:`LockStats`)."""
        out = (ctypes.c_uint64 * 6)()
        self._lib.ww_pool_lock_stats(self._handle(), out)
        events = (ctypes.c_uint64 * 2)()
        self._lib.ww_pool_event_stats(self._handle(), events)
        return LockStats(*(int(x) for x in out), *(int(x) for x in events))

    def driver_stats(self) -> DriverStats:
        """What the pool asked of the driver, and its mutex, so far (:class:`DriverStats`)."""
        out = DriverCountersStruct()
        self._lib.ww_pool_driver_stats(self._handle(), ctypes.byref(out))
        fields = dataclasses.fields(DriverStats)
        return DriverStats(**{f.name: int(getattr(out, f.name)) for f in fields})

    def reset_driver_stats(self) -> None:
        """Sets every count of :meth:`driver_stats` to zero."""
        self._lib.ww_pool_reset_driver_stats(self._handle())

    def set_profiling(self, enabled: bool) -> None:
        """Whether to time how long the pool's mutex is held (``DriverStats.lock_hold_ns``).

        Off by default: it reads the clock twice per acquisition.
        """
        self._lib.ww_pool_set_profiling(self._handle(), 1 if enabled else 0)

    def snapshot(self) -> list[BlockInfo]:
        """Every block of every segment, in address order (what PyTorch's snapshot gives back)."""
        handle = self._handle()
        while True:
            n = int(self._lib.ww_pool_snapshot(handle, None, 0))
            buf = (BlockInfoStruct * max(n, 1))()
            m = int(self._lib.ww_pool_snapshot(handle, buf, n))
            if m <= n:
                return [
                    BlockInfo(
                        ptr=b.ptr,
                        size_bytes=b.size,
                        segment_ptr=b.segment_ptr,
                        segment_size_bytes=b.segment_size,
                        allocated=bool(b.allocated),
                        stream=b.stream,
                        requested_bytes=b.requested,
                        account_id=None if b.account < 0 else b.account,
                        event_pending=bool(b.event_pending),
                    )
                    for b in buf[:m]
                ]

    # -- integrations --------------------------------------------------------------------------

    def cupy_allocator(self) -> Callable[[int], Any]:
        """An allocator for ``cupy.cuda.set_allocator`` / ``cupy.cuda.using_allocator``.

        CuPy arrays then take memory from this pool on CuPy's current stream, so a trial's CuPy
        arrays and PyTorch tensors share one pool and one account.

        Raises:
            RuntimeError: CuPy is not installed, or the pool's backend is ``sim``.
        """
        from waterwave_hpo.memory._cupy import make_cupy_allocator

        return make_cupy_allocator(self)

    def close(self) -> None:
        """Destroys the pool. Segments with live blocks are leaked, not freed. Idempotent.

        A pool installed with :func:`use_pool` is never destroyed (PyTorch may free tensors into
        it until the process ends); ``close`` does nothing for it.
        """
        if self._pinned:
            return
        with self._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is not None:
            self._lib.ww_pool_destroy(ptr)

    def __del__(self) -> None:
        # A pool installed as PyTorch's allocator is kept alive by _torch's registry.
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"StreamAwarePool(backend={self._backend.value!r}, device={self._device}, "
            f"capacity_bytes={self.capacity_bytes})"
        )
