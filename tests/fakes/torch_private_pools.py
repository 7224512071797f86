"""PyTorch's private memory pools (``torch.cuda.MemPool``), with the bookkeeping that can abort.

Modelled on ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``:
``createOrIncrefPool``, ``beginAllocateToPool``, ``endAllocateToPool``, ``releasePool``,
``emptyCache(mempool_id)`` -> ``release_cached_blocks`` -> ``synchronize_and_free_events``) and
``aten/src/ATen/cuda/MemPool.cpp`` (``MemPool::MemPool``, ``MemPool::~MemPool``), as read for
torch 2.11-2.15. What the allocator keeps, and what this fake keeps the same way:

* **A use count per private pool.** ``MemPool(...)`` creates the pool with count 1
  (``createOrIncrefPool``); ``_cuda_beginAllocate*ToPool`` on an existing pool asserts the count
  is positive and increments it; ``_cuda_releasePool`` decrements it, asserts it stays >= 0, and
  at 0 marks the pool freeable (asserting it was not freeable already).
* **``captures_underway``**: one entry per pool currently routed (a graph capture, a
  ``use_mem_pool`` block, a stream routed to a pool). ``begin`` refuses a pool already
  routed; ``end`` refuses one that is not.
* **``~MemPool``** (when the last Python reference goes): ``setUseOnOOM(false)``,
  ``releasePool``, then ``emptyCache(id)``, whose first step (``synchronize_and_free_events``)
  asserts ``captures_underway`` is empty: "This function syncs, so capture should not be
  underway". A ``c10::Error`` thrown in a destructor is ``std::terminate``: the process aborts,
  with nothing Python could catch. The fake records each such abort in
  :attr:`FakePrivatePools.terminations` (the test asserts it stays empty) instead of ending the
  test process; a failed assertion outside a destructor raises ``RuntimeError``, as PyTorch's
  binding turns a ``c10::Error`` into one.
* **While any capture is underway** PyTorch's out-of-memory recovery (``release_cached_blocks``)
  and ``empty_cache`` cannot run: :meth:`FakePrivatePools.empty_cache` raises as the allocator's
  assertion would.

Install with :meth:`FakePrivatePools.install` (a ``monkeypatch`` undoes it).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import torch

#: The ``torch._C`` entry points of routing, across torch versions (the stream variant is what
#: graph capture and stream routing use; the thread variant is ``torch.cuda.use_mem_pool``'s).
BEGIN_STREAM = "_cuda_beginAllocateCurrentStreamToPool"
BEGIN_THREAD = "_cuda_beginAllocateCurrentThreadToPool"
END = "_cuda_endAllocateToPool"
RELEASE = "_cuda_releasePool"


class TorchInternalAssert(RuntimeError):
    """A ``TORCH_INTERNAL_ASSERT``/``TORCH_CHECK`` of the caching allocator failed."""


class FakePrivatePools:
    """The caching allocator's private pools of one device; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        #: pool id -> use count (``PrivatePool::use_count``).
        self.use_counts: dict[tuple[int, int], int] = {}
        #: Pools whose count reached 0 (``graph_pools_freeable``).
        self.freeable: set[tuple[int, int]] = set()
        #: ``captures_underway``: pool id -> the stream (handle) or thread routed to it.
        self.captures_underway: dict[tuple[int, int], Any] = {}
        #: Each ``std::terminate`` the real allocator would have raised (a message each).
        self.terminations: list[str] = []
        #: Every call, in order, for tests that check the protocol.
        self.calls: list[tuple[Any, ...]] = []
        fake = self

        class MemPool:
            """``torch.cuda.MemPool``: ``MemPool::MemPool`` and ``MemPool::~MemPool``."""

            def __init__(
                self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False
            ) -> None:
                self.allocator = allocator
                self._id = (0, next(fake._ids))
                fake._create_or_incref(self._id)

            @property
            def id(self) -> tuple[int, int]:
                return self._id

            def use_count(self) -> int:
                return fake.use_counts.get(self._id, 0)

            def __del__(self) -> None:
                fake._destroy(self._id)

        self.MemPool = MemPool

    # -- DeviceCachingAllocator ------------------------------------------------------------------
    def _create_or_incref(self, pool_id: tuple[int, int]) -> None:
        with self._lock:
            self.calls.append(("create", pool_id))
            if pool_id in self.use_counts:
                self._check(self.use_counts[pool_id] > 0, "pool use_count > 0")
                self.use_counts[pool_id] += 1
            else:
                self.use_counts[pool_id] = 1

    def begin(self, device: int, pool_id: tuple[int, int], *_: Any) -> None:
        """``beginAllocateToPool``: route the current stream (or thread) to the pool."""
        with self._lock:
            self.calls.append(("begin", device, pool_id))
            if pool_id in self.use_counts:
                self._check(self.use_counts[pool_id] > 0, "it->second->use_count > 0")
                self.use_counts[pool_id] += 1
            else:
                self.use_counts[pool_id] = 1
            self._check(
                pool_id not in self.captures_underway,
                "beginAllocateToPool: already recording to mempool_id",
            )
            self.captures_underway[pool_id] = torch.cuda.current_stream()

    def end(self, device: int, pool_id: tuple[int, int]) -> None:
        """``endAllocateToPool``: the routing to the pool ends."""
        with self._lock:
            self.calls.append(("end", device, pool_id))
            self._check(
                self.captures_underway.pop(pool_id, None) is not None,
                "endAllocatePool: not currently recording to mempool_id",
            )

    def release(self, device: int, pool_id: tuple[int, int]) -> None:
        """``releasePool``: one user fewer; at 0 the pool's segments may be freed."""
        with self._lock:
            self.calls.append(("release", device, pool_id))
            self._release(pool_id)

    def _release(self, pool_id: tuple[int, int]) -> None:
        self._check(pool_id in self.use_counts, "it != graph_pools.end()")
        self.use_counts[pool_id] -= 1
        self._check(self.use_counts[pool_id] >= 0, "uc >= 0")
        if self.use_counts[pool_id] == 0:
            self._check(pool_id not in self.freeable, "inserted")
            self.freeable.add(pool_id)

    def empty_cache(self, pool_id: tuple[int, int] | None = None) -> None:
        """``emptyCache``: ``release_cached_blocks``, which first synchronizes every event."""
        with self._lock:
            self.calls.append(("empty_cache", pool_id))
            self._check(
                not self.captures_underway,
                "captures_underway.size() == 0 (synchronize_and_free_events)",
            )
            for freed in list(self.freeable):  # no segments are modelled: each is emptied
                self.freeable.discard(freed)
                self.use_counts.pop(freed, None)

    def _destroy(self, pool_id: tuple[int, int]) -> None:
        """``MemPool::~MemPool``: a failed assertion here is ``std::terminate``."""
        try:
            with self._lock:
                self.calls.append(("~MemPool", pool_id))
                self._release(pool_id)
                self.empty_cache(pool_id)
        except TorchInternalAssert as error:
            self.terminations.append(f"~MemPool{pool_id}: std::terminate: {error}")

    @staticmethod
    def _check(condition: bool, what: str) -> None:
        if not condition:
            raise TorchInternalAssert(f"INTERNAL ASSERT FAILED: {what}")

    # -- installation ------------------------------------------------------------------------------
    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakePrivatePools:
        """``torch.cuda.MemPool`` and the ``torch._C`` routing entry points, for one test."""
        monkeypatch.setattr(torch.cuda, "MemPool", self.MemPool, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "MemPool", self.MemPool, raising=False)
        monkeypatch.setattr(torch._C, BEGIN_STREAM, self.begin, raising=False)
        monkeypatch.setattr(torch._C, BEGIN_THREAD, self.begin, raising=False)
        monkeypatch.setattr(torch._C, END, self.end, raising=False)
        monkeypatch.setattr(torch._C, RELEASE, self.release, raising=False)
        monkeypatch.setattr(torch.cuda.memory, END, self.end, raising=False)
        monkeypatch.setattr(torch.cuda.memory, RELEASE, self.release, raising=False)
        monkeypatch.setattr(
            torch.cuda.memory, "_cuda_beginAllocateCurrentThreadToPool", self.begin, raising=False
        )
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.empty_cache(), raising=False)
        return self
