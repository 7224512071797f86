"""Statistics of the stream-aware pool: whole pool, per stream, per account (trial)."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from waterwave_hpo.memory._lib import Counters


class AllocationSource(enum.IntEnum):
    """Where an allocation for stream S was served from, in the pool's priority order.

    Source: Waterwave (IEEE TC 72(10), 2023), prioritized allocation by the synchronization
    attributes of free chunks.
    """

    #: A free block last used by S: stream order makes it safe, no synchronization.
    SAME_STREAM = 1
    #: A free block freed on another stream whose event has completed.
    COMPLETED_EVENT = 2
    #: A free block freed on another stream whose event is pending; S was made to wait on that
    #: event on the GPU (``cuStreamWaitEvent``), the CPU did not block.
    STREAM_WAIT = 3
    #: A new segment from the upstream (device, CuPy, or simulated device).
    NEW_SEGMENT = 4


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A consistent snapshot of a pool's counters. All sizes are bytes.

    Attributes:
        allocated_bytes: Bytes in live blocks (sizes rounded to the pool's size classes).
        requested_bytes: Bytes asked for by live allocations, before rounding.
        reserved_bytes: Bytes of segments the pool holds (live blocks plus cache).
        peak_allocated_bytes: Highest ``allocated_bytes`` since creation or ``reset_peaks()``.
        peak_reserved_bytes: Highest ``reserved_bytes`` since creation or ``reset_peaks()``.
        num_allocs: Successful allocations.
        num_frees: Frees.
        same_stream: Allocations served from a block last used by the same stream.
        completed_event: Allocations served from another stream's block whose event completed.
        stream_wait: Allocations served from another stream's block after a GPU-side wait.
        new_segment: Allocations that took a new segment.
        stream_waits_issued: Stream waits (``cuStreamWaitEvent``) the pool issued.
        ooms: Failed allocations (capacity, quota or device exhausted).
        num_segments: Segments held.
        capacity_bytes: The pool's capacity.
    """

    allocated_bytes: int
    requested_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_allocs: int
    num_frees: int
    same_stream: int
    completed_event: int
    stream_wait: int
    new_segment: int
    stream_waits_issued: int
    ooms: int
    num_segments: int
    capacity_bytes: int

    def count(self, source: AllocationSource) -> int:
        """The number of allocations served from ``source``."""
        return int(getattr(self, source.name.lower()))

    @property
    def cached_bytes(self) -> int:
        """Bytes of segments held but not allocated (``reserved_bytes - allocated_bytes``)."""
        return self.reserved_bytes - self.allocated_bytes

    @classmethod
    def _from_counters(cls, c: Counters) -> PoolStats:
        return cls(
            allocated_bytes=c.allocated_bytes,
            requested_bytes=c.requested_bytes,
            reserved_bytes=c.reserved_bytes,
            peak_allocated_bytes=c.peak_allocated_bytes,
            peak_reserved_bytes=c.peak_reserved_bytes,
            num_allocs=c.num_allocs,
            num_frees=c.num_frees,
            same_stream=c.num_same_stream,
            completed_event=c.num_completed_event,
            stream_wait=c.num_stream_wait,
            new_segment=c.num_new_segment,
            stream_waits_issued=c.num_stream_waits_issued,
            ooms=c.num_ooms,
            num_segments=c.num_segments,
            capacity_bytes=c.capacity_bytes,
        )


@dataclasses.dataclass(frozen=True)
class UsageStats:
    """Counters of one stream or one account (a trial). All sizes are bytes.

    Allocated bytes and allocation counts are charged to the stream (and its account) that
    allocated; a block freed on another stream is still credited back to its allocator.
    ``reserved_bytes`` is the share of segments this stream or account caused to be taken from
    the upstream (segments are shared afterwards; the share is attribution, not ownership).

    Attributes:
        allocated_bytes: Bytes in live blocks (rounded sizes).
        requested_bytes: Bytes asked for by live allocations, before rounding.
        reserved_bytes: Bytes of live segments this stream or account caused.
        peak_allocated_bytes: Highest ``allocated_bytes`` (the trial's peak memory).
        peak_reserved_bytes: Highest ``reserved_bytes``.
        num_allocs: Successful allocations.
        num_frees: Frees of blocks it allocated.
        same_stream: Allocations served from a block last used by the same stream.
        completed_event: Allocations from another stream's block whose event completed.
        stream_wait: Allocations from another stream's block after a GPU-side wait.
        new_segment: Allocations that took a new segment.
        stream_waits_issued: Stream waits issued for it.
        ooms: Its failed allocations (including quota refusals).
        num_segments: Live segments it caused.
        quota_bytes: The account's quota on ``allocated_bytes``; ``None`` when unlimited (and
            always for streams).
    """

    allocated_bytes: int
    requested_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    num_allocs: int
    num_frees: int
    same_stream: int
    completed_event: int
    stream_wait: int
    new_segment: int
    stream_waits_issued: int
    ooms: int
    num_segments: int
    quota_bytes: int | None

    def count(self, source: AllocationSource) -> int:
        """The number of allocations served from ``source``."""
        return int(getattr(self, source.name.lower()))

    @classmethod
    def _from_counters(cls, c: Counters) -> UsageStats:
        return cls(
            allocated_bytes=c.allocated_bytes,
            requested_bytes=c.requested_bytes,
            reserved_bytes=c.reserved_bytes,
            peak_allocated_bytes=c.peak_allocated_bytes,
            peak_reserved_bytes=c.peak_reserved_bytes,
            num_allocs=c.num_allocs,
            num_frees=c.num_frees,
            same_stream=c.num_same_stream,
            completed_event=c.num_completed_event,
            stream_wait=c.num_stream_wait,
            new_segment=c.num_new_segment,
            stream_waits_issued=c.num_stream_waits_issued,
            ooms=c.num_ooms,
            num_segments=c.num_segments,
            quota_bytes=c.quota_bytes or None,
        )


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """One block of a segment in a pool snapshot. Sizes are bytes.

    Attributes:
        ptr: Device address of the block.
        size_bytes: Block size (a size class).
        segment_ptr: Address of the segment holding it.
        segment_size_bytes: Size of that segment.
        allocated: True for a live block, False for a cached free one.
        stream: Live: the allocating stream. Free: the stream that freed it.
        requested_bytes: Live: bytes asked for. Free: 0.
        account_id: Live: the id of the account charged, or None.
        event_pending: Free: True while the freeing stream's event has not completed (or a
            ``record_stream`` stream is still using it).
    """

    ptr: int
    size_bytes: int
    segment_ptr: int
    segment_size_bytes: int
    allocated: bool
    stream: int
    requested_bytes: int
    account_id: int | None
    event_pending: bool


@dataclasses.dataclass(frozen=True)
class LockStats:
    """Contention of the pool's mutex since the pool was made.

    Attributes:
        acquisitions: Times any thread took the mutex.
        contended: Times a thread found it held and had to wait.
        wait_ns: Nanoseconds spent waiting in those contended acquisitions, summed over threads.
        deferred_frees: Frees from PyTorch's entry point that found the mutex held and were queued
            instead of waiting (drained by the next thread that takes it).
        torch_free_waits: Frees from PyTorch's entry point that waited for the mutex (only with
            the benchmark knob ``ww_pool_set_torch_free_blocking``, the pool's first behaviour).
        torch_free_wait_ns: Nanoseconds those frees waited, with the GIL held.
        events_recorded: CUDA events the pool recorded for frees, under its mutex. The frees of
            one stream share one event per epoch (at most 64 frees), recorded only when another
            stream, a segment release or a snapshot needs to know whether they completed, so a
            trial reusing its own blocks records about one per 64 frees, not one per free.
        frees: Blocks freed.
    """

    acquisitions: int
    contended: int
    wait_ns: int
    deferred_frees: int
    torch_free_waits: int
    torch_free_wait_ns: int
    events_recorded: int = 0
    frees: int = 0

    @property
    def contended_fraction(self) -> float:
        """``contended / acquisitions`` (0.0 before any acquisition)."""
        return self.contended / self.acquisitions if self.acquisitions else 0.0


@dataclasses.dataclass(frozen=True)
class DriverStats:
    """What the pool cost since it was made or since :meth:`StreamAwarePool.reset_driver_stats`.

    On the ``cuda`` backend each ``segment_*``, ``event_*``, ``stream_*`` count is one CUDA driver
    call (each also checks, with ``cuCtxGetCurrent``, that the primary context is current). A
    training step in steady state should cost no segment call, no synchronisation, and about
    one event record per 64 frees (the frees of one stream share an event, see ``pool.hpp``).

    Attributes:
        allocs: Allocations asked for (failures included).
        frees: Frees taken under the mutex (queued PyTorch frees included, when drained).
        segment_allocs: ``cuMemAlloc`` (or the segment callback of a ``cupy`` pool).
        segment_frees: ``cuMemFree``, which synchronises the device.
        event_creates: ``cuEventCreate`` (events are cached and reused).
        event_destroys: ``cuEventDestroy``.
        event_records: ``cuEventRecord``.
        event_queries: ``cuEventQuery``.
        stream_waits: ``cuStreamWaitEvent`` (a GPU-side wait; the CPU does not block).
        stream_syncs: ``cuStreamSynchronize`` (a CPU-side wait; only when no event could be had).
        lock_acquisitions: Times the pool's mutex was taken.
        lock_contended: Times it was found held.
        lock_wait_ns: Nanoseconds waited for it, summed over threads.
        lock_hold_ns: Nanoseconds it was held; counted only while profiling is on
            (:meth:`StreamAwarePool.set_profiling`).
        coalesce_scans: Walks over every block of every segment (to merge neighbours whose
            events completed); each costs O(blocks) and may query events.
        cross_stream_searches: Allocations that looked beyond their own stream's free blocks.
    """

    allocs: int
    frees: int
    segment_allocs: int
    segment_frees: int
    event_creates: int
    event_destroys: int
    event_records: int
    event_queries: int
    stream_waits: int
    stream_syncs: int
    lock_acquisitions: int
    lock_contended: int
    lock_wait_ns: int
    lock_hold_ns: int
    coalesce_scans: int
    cross_stream_searches: int

    @property
    def driver_calls(self) -> int:
        """Every call into the upstream (the driver, on the ``cuda`` backend)."""
        return (
            self.segment_allocs
            + self.segment_frees
            + self.event_creates
            + self.event_destroys
            + self.event_records
            + self.event_queries
            + self.stream_waits
            + self.stream_syncs
        )

    def __sub__(self, other: DriverStats) -> DriverStats:
        """The counts between two readings (``after - before``)."""
        return DriverStats(
            **{
                f.name: getattr(self, f.name) - getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )
