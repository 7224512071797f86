"""Property-based tests of the pool on the sim backend (hypothesis state machine).

Random multi-stream alloc/free/submit/finish/release sequences; after every step: live blocks never
overlap, capacity is never exceeded, the safety rule holds (TraceChecker replays the trace), the
accounting is exact (pool, streams, accounts), the priority order holds (a fitting block of a
better class is never passed over), an OOM changes nothing; at the end everything coalesces back
into whole segments that are released.
"""

from __future__ import annotations

from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine
from hypothesis.stateful import invariant
from hypothesis.stateful import precondition
from hypothesis.stateful import rule
import pytest

from waterwave_hpo.memory import AllocationSource
from waterwave_hpo.memory import OOMReason
from waterwave_hpo.memory import PoolOutOfMemoryError
from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory import round_size
from waterwave_hpo.memory.testing import TraceChecker

KiB = 1 << 10
MiB = 1 << 20
CAPACITY = 16 * MiB
STREAMS = (0, 1, 2, 3)
QUOTA_BYTES = 6 * MiB

sizes = st.one_of(
    st.integers(0, 4 * KiB),
    st.integers(4 * KiB, 512 * KiB),
    st.integers(512 * KiB, 3 * MiB),
    st.sampled_from([10 * MiB, 12 * MiB]),
)
streams = st.sampled_from(STREAMS)

_RANK = {
    AllocationSource.SAME_STREAM: 1,
    AllocationSource.COMPLETED_EVENT: 2,
    AllocationSource.STREAM_WAIT: 3,
    AllocationSource.NEW_SEGMENT: 4,
}


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = StreamAwarePool(CAPACITY, backend="sim")
        self.checker = TraceChecker(CAPACITY)
        # Account 1 owns streams 1 and 2 (a trial with a side stream) under a quota.
        self.account = self.pool.open_account("trial", streams=(1, 2))
        self.account.set_quota(QUOTA_BYTES)
        self.live: dict[int, tuple[int, int, int]] = {}  # ptr -> (size, requested, stream)
        self.recorded: set[int] = set()  # live blocks with a record_stream
        self.recorded_freed: set[int] = set()  # freed after record_stream

    def _best_available(self, size: int, stream: int) -> int:
        """The best priority class a fitting free block in the snapshot offers (4: none)."""
        best = 4
        for b in self.pool.snapshot():
            if not b.allocated and b.event_pending and self._deferred(b.ptr):
                # Waits for its record_stream streams. The allocation may first release it and
                # merge it with neighbours (changing their freeing stream): no ordering claim then.
                return 4
            if b.allocated or b.size_bytes < size:
                continue
            if b.stream == stream:
                best = min(best, 1)
            elif not b.event_pending:
                best = min(best, 2)
            else:
                best = min(best, 3)
        return best

    def _deferred(self, ptr: int) -> bool:
        # Freed after record_stream: possibly still waiting for those streams (conservative).
        return ptr in self.recorded_freed

    @rule(nbytes=sizes, stream=streams)
    def allocate(self, nbytes: int, stream: int) -> None:
        size = round_size(nbytes)
        best = self._best_available(size, stream)
        before = self.pool.stats()
        live_before = {b.ptr for b in self.pool.snapshot() if b.allocated}
        try:
            ptr, source = self.pool.allocate_with_source(nbytes, stream)
        except PoolOutOfMemoryError as exc:
            after = self.pool.stats()
            assert after.allocated_bytes == before.allocated_bytes
            assert after.num_allocs == before.num_allocs
            assert after.ooms == before.ooms + 1
            assert {b.ptr for b in self.pool.snapshot() if b.allocated} == live_before
            if exc.reason is OOMReason.QUOTA:
                acc = self.account.stats()
                assert stream in (1, 2)
                assert acc.allocated_bytes + size > QUOTA_BYTES
            else:
                assert exc.reason is OOMReason.CAPACITY
                assert best == 4, "OOM although a fitting free block was cached"
            return
        # Priority: never a worse class than the best fitting block visible before the call.
        assert _RANK[source] <= best, (source, best)
        assert ptr % 512 == 0
        self.live[ptr] = (size, nbytes, stream)
        self.recorded_freed.discard(ptr)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), on_other_stream=st.booleans(), stream=streams, busy=st.booleans())
    def free(self, data: st.DataObject, on_other_stream: bool, stream: int, busy: bool) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        free_stream = stream if on_other_stream else self.live[ptr][2]
        if busy:  # the freeing stream still has a kernel queued that uses the block
            self.pool.sim.submit(free_stream)
        alloc_stream = self.live[ptr][2]
        del self.live[ptr]
        if on_other_stream and stream != alloc_stream:
            self.recorded_freed.add(ptr)  # waits for the allocating stream too
        if ptr in self.recorded:
            self.recorded.discard(ptr)
            self.recorded_freed.add(ptr)
        self.pool.free(ptr, stream if on_other_stream else None)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=streams)
    def use_on_another_stream(self, data: st.DataObject, stream: int) -> None:
        # A kernel on `stream` uses the block, declared as Tensor.record_stream would declare it.
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.pool.sim.submit(stream)
        self.pool.sim.use(ptr, self.live[ptr][0], stream)
        self.pool.record_stream(ptr, stream)
        self.recorded.add(ptr)

    @rule(stream=streams, n=st.integers(1, 3))
    def submit(self, stream: int, n: int) -> None:
        for _ in range(n):
            self.pool.sim.submit(stream)

    @rule(stream=streams)
    def finish(self, stream: int) -> None:
        self.pool.sim.finish(stream)

    @rule()
    def finish_all(self) -> None:
        self.pool.sim.finish_all()

    @rule()
    def release_cached(self) -> None:
        before = self.pool.stats()
        released = self.pool.release_cached()
        assert self.pool.stats().reserved_bytes == before.reserved_bytes - released

    @invariant()
    def no_stream_hazard(self) -> None:
        assert self.pool.sim.hazards() == []

    @invariant()
    def trace_is_safe_and_accounting_exact(self) -> None:
        self.checker.feed(self.pool.sim.trace(self.checker.records_seen))
        s = self.pool.stats()
        assert s.reserved_bytes <= CAPACITY
        assert s.allocated_bytes == sum(v[0] for v in self.live.values())
        assert s.requested_bytes == sum(v[1] for v in self.live.values())
        assert s.allocated_bytes == self.checker.allocated_bytes
        assert s.reserved_bytes == self.checker.reserved_bytes
        assert s.peak_allocated_bytes == self.checker.peak_allocated_bytes
        assert s.peak_reserved_bytes == self.checker.peak_reserved_bytes
        assert s.num_allocs == sum(self.checker.sources.values())
        for source in AllocationSource:
            assert s.count(source) == self.checker.sources[source]
        assert s.stream_waits_issued == self.checker.stream_waits
        assert s.ooms == self.checker.ooms
        for stream in STREAMS:
            expected = sum(v[0] for v in self.live.values() if v[2] == stream)
            assert self.pool.stream_stats(stream).allocated_bytes == expected
        acc = self.account.stats()
        assert acc.allocated_bytes == sum(v[0] for v in self.live.values() if v[2] in (1, 2))
        assert acc.allocated_bytes <= QUOTA_BYTES
        snap_live = {b.ptr: b.size_bytes for b in self.pool.snapshot() if b.allocated}
        assert snap_live == {p: v[0] for p, v in self.live.items()}

    def teardown(self) -> None:
        try:
            for ptr in list(self.live):
                self.pool.free(ptr)
            self.live.clear()
            self.pool.sim.finish_all()
            # Coalescing re-forms whole segments: the largest one is served from the cache.
            segments = {b.segment_ptr: b.segment_size_bytes for b in self.pool.snapshot()}
            if segments:
                largest = max(segments.values())
                ptr, source = self.pool.allocate_with_source(largest, 99)
                assert source is not AllocationSource.NEW_SEGMENT
                assert segments.get(ptr) == largest
                self.pool.free(ptr)
                self.pool.sim.finish_all()
            # Every segment is wholly free and synchronized: all are given back.
            self.pool.release_cached()
            self.checker.feed(self.pool.sim.trace(self.checker.records_seen))
            s = self.pool.stats()
            assert s.allocated_bytes == 0 and s.requested_bytes == 0
            assert s.reserved_bytes == 0 and s.num_segments == 0
            assert self.pool.snapshot() == []
        finally:
            self.account.close()
            self.pool.close()


PoolMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolProperties = PoolMachine.TestCase


def test_checker_catches_an_unsafe_handoff() -> None:
    """The safety check itself can fail: a forged trace that hands pending memory over."""
    from waterwave_hpo.memory import AllocRecord
    from waterwave_hpo.memory import FreeRecord
    from waterwave_hpo.memory import SegmentRecord
    from waterwave_hpo.memory import SubmitRecord
    from waterwave_hpo.memory.testing import TraceViolation

    checker = TraceChecker(None)
    forged = [
        SegmentRecord(4096, 2 * MiB, released=False, stream=1, account_id=None),
        AllocRecord(4096, 512, 512, 1, AllocationSource.NEW_SEGMENT, None),
        SubmitRecord(1, 1),
        FreeRecord(4096, 512, 1, 1, None),
        AllocRecord(4096, 512, 512, 2, AllocationSource.COMPLETED_EVENT, None),
    ]
    with pytest.raises(TraceViolation, match="SAFETY"):
        checker.feed(forged)
