"""StreamAwarePool on the sim backend: the priority order, safety, accounting, accounts, errors."""

from __future__ import annotations

import pytest

from waterwave_hpo.memory import AllocationSource
from waterwave_hpo.memory import AllocRecord
from waterwave_hpo.memory import Backend
from waterwave_hpo.memory import OOMReason
from waterwave_hpo.memory import PoolOutOfMemoryError
from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory import StreamWaitRecord
from waterwave_hpo.memory import round_size
from waterwave_hpo.memory.testing import TraceChecker

MiB = 1 << 20
KiB = 1 << 10
A, B, C = 1, 2, 3  # sim stream handles
SEG = 10 * MiB  # requests >= 10 MiB get a segment of exactly their size


def make_pool(capacity_bytes: int = 64 * MiB) -> StreamAwarePool:
    return StreamAwarePool(capacity_bytes, backend="sim")


def check(pool: StreamAwarePool) -> TraceChecker:
    checker = TraceChecker(pool.capacity_bytes)
    checker.feed(pool.sim.trace())
    return checker


def test_same_stream_block_is_reused_without_synchronization() -> None:
    pool = make_pool()
    p, src = pool.allocate_with_source(100 * KiB, A)
    assert src is AllocationSource.NEW_SEGMENT
    pool.sim.submit(A)
    pool.free(p, A)
    q, src = pool.allocate_with_source(100 * KiB, A)
    assert (q, src) == (p, AllocationSource.SAME_STREAM)
    assert pool.stats().stream_waits_issued == 0
    check(pool)


def test_other_stream_gets_completed_block_without_wait() -> None:
    pool = make_pool()
    p = pool.allocate(SEG, A)
    pool.sim.submit(A)
    pool.free(p, A)
    pool.sim.finish(A)
    q, src = pool.allocate_with_source(SEG, B)
    assert (q, src) == (p, AllocationSource.COMPLETED_EVENT)
    assert pool.stats().stream_waits_issued == 0
    check(pool)


def test_other_stream_pending_block_after_gpu_wait() -> None:
    pool = make_pool()
    p = pool.allocate(SEG, A)
    pool.sim.submit(A)
    pool.free(p, A)  # A's kernel still queued
    q, src = pool.allocate_with_source(SEG, B)
    assert (q, src) == (p, AllocationSource.STREAM_WAIT)
    trace = pool.sim.trace()
    waits = [r for r in trace if isinstance(r, StreamWaitRecord)]
    assert waits == [StreamWaitRecord(stream=B, waited_stream=A, event_seq=1)]
    assert pool.stats().stream_waits_issued == 1
    # B's work now runs after A's: finishing B completes A's first unit too.
    pool.sim.submit(B)
    pool.sim.finish(B)
    pool.free(q, B)
    r, src = pool.allocate_with_source(SEG, C)
    assert (r, src) == (p, AllocationSource.COMPLETED_EVENT)
    check(pool)


def test_priority_same_stream_beats_completed_and_pending() -> None:
    pool = make_pool()
    pa = pool.allocate(SEG, A)
    pb = pool.allocate(SEG, B)
    pc = pool.allocate(SEG, C)
    pool.sim.submit(B)
    pool.free(pb, B)  # pending on B
    pool.free(pc, C)
    pool.sim.finish(C)  # completed on C
    pool.free(pa, A)  # A's own, pending nothing
    q, src = pool.allocate_with_source(SEG, A)
    assert (q, src) == (pa, AllocationSource.SAME_STREAM)
    q2, src2 = pool.allocate_with_source(SEG, A)
    assert (q2, src2) == (pc, AllocationSource.COMPLETED_EVENT)
    q3, src3 = pool.allocate_with_source(SEG, A)
    assert (q3, src3) == (pb, AllocationSource.STREAM_WAIT)
    q4, src4 = pool.allocate_with_source(SEG, A)
    assert src4 is AllocationSource.NEW_SEGMENT
    assert q4 not in (pa, pb, pc)
    s = pool.stats()
    assert (s.same_stream, s.completed_event, s.stream_wait, s.new_segment) == (1, 1, 1, 4)
    check(pool)


def test_completed_block_preferred_over_pending_one_of_another_stream() -> None:
    pool = make_pool()
    pb = pool.allocate(SEG, B)
    pc = pool.allocate(SEG, C)
    pool.sim.submit(B)
    pool.free(pb, B)
    pool.free(pc, C)
    q, src = pool.allocate_with_source(SEG, A)
    assert (q, src) == (pc, AllocationSource.COMPLETED_EVENT)
    check(pool)


def test_blocks_are_split_and_coalesced_back_into_a_whole_segment() -> None:
    pool = make_pool(capacity_bytes=2 * MiB)
    streams = [A, B, C, A, B, C, A, B]
    ptrs = [pool.allocate(256 * KiB, s) for s in streams]
    assert pool.stats().num_segments == 1
    assert pool.stats().cached_bytes == 0
    for p, s in zip(ptrs, streams, strict=True):
        pool.sim.submit(s)
        pool.free(p, s)
    pool.sim.finish_all()
    # The whole segment is one block again: a 2 MiB request fits without a new segment (the
    # capacity allows none).
    p, src = pool.allocate_with_source(2 * MiB, A)
    assert src is not AllocationSource.NEW_SEGMENT
    assert p == min(ptrs)
    pool.free(p, A)
    blocks = pool.snapshot()
    assert len(blocks) == 1 and blocks[0].size_bytes == 2 * MiB and not blocks[0].allocated
    assert pool.release_cached() == 2 * MiB
    assert pool.stats().reserved_bytes == 0
    check(pool)


def test_pending_segment_is_not_released() -> None:
    pool = make_pool()
    p = pool.allocate(MiB, A)
    pool.sim.submit(A)
    pool.free(p, A)
    assert pool.release_cached() == 0
    pool.sim.finish(A)
    assert pool.release_cached() == 2 * MiB
    check(pool)


def test_capacity_oom_is_clean_and_loses_nothing() -> None:
    pool = make_pool(capacity_bytes=4 * MiB)
    keep = [pool.allocate(MiB, A) for _ in range(3)]
    before = pool.stats()
    live_before = {b.ptr for b in pool.snapshot() if b.allocated}
    with pytest.raises(PoolOutOfMemoryError) as info:
        pool.allocate(3 * MiB, B)
    assert info.value.reason is OOMReason.CAPACITY
    assert info.value.nbytes == 3 * MiB and info.value.stream == B
    assert "capacity" in str(info.value)
    after = pool.stats()
    assert after.allocated_bytes == before.allocated_bytes
    assert after.num_allocs == before.num_allocs
    assert after.ooms == before.ooms + 1
    assert {b.ptr for b in pool.snapshot() if b.allocated} == live_before
    # Freeing makes room again.
    for p in keep:
        pool.free(p)
    pool.allocate(3 * MiB, B)
    check(pool)


def test_oom_releases_cached_segments_then_retries() -> None:
    pool = make_pool(capacity_bytes=4 * MiB)
    small = pool.allocate(MiB, A)  # a 2 MiB segment
    big = pool.allocate(2 * MiB, B)  # another
    pool.free(small, A)
    # 4 MiB requested: only possible after the cached small segment is released.
    pool.free(big, B)
    p, src = pool.allocate_with_source(4 * MiB, C)
    assert src is AllocationSource.NEW_SEGMENT
    assert pool.stats().reserved_bytes == 4 * MiB
    pool.free(p)
    check(pool)


def test_a_new_capacity_bounds_new_segments_and_takes_nothing_held() -> None:
    pool = make_pool(capacity_bytes=64 * MiB)
    held = pool.allocate(12 * MiB, A)  # a segment of exactly 12 MiB
    pool.set_capacity(8 * MiB)  # below what is held
    assert pool.capacity_bytes == 8 * MiB and pool.stats().capacity_bytes == 8 * MiB
    with pytest.raises(PoolOutOfMemoryError) as info:
        pool.allocate(MiB, B)  # would need a new segment: none while 12 MiB > 8 MiB are held
    assert info.value.reason is OOMReason.CAPACITY
    assert pool.stats().allocated_bytes == 12 * MiB  # the held block stays valid
    pool.sim.submit(A)
    pool.free(held, A)
    pool.sim.finish(A)
    assert pool.release_cached() == 12 * MiB
    small = pool.allocate(6 * MiB, B)  # within the new capacity
    with pytest.raises(PoolOutOfMemoryError):
        pool.allocate(4 * MiB, C)  # 6 + 4 > 8
    pool.set_capacity(16 * MiB)  # raised again: the same request fits
    pool.free(pool.allocate(4 * MiB, C), C)
    pool.free(small, B)
    pool.set_capacity(None)  # as at construction with None: the simulated 1 GiB device
    assert pool.capacity_bytes == 1 << 30


@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-5, ValueError), (2.0, TypeError), ("8GiB", TypeError)]
)
def test_a_bad_new_capacity_names_the_argument(bad: object, error: type[Exception]) -> None:
    pool = make_pool()
    with pytest.raises(error, match=f"capacity_bytes={bad!r}: "):
        pool.set_capacity(bad)  # type: ignore[arg-type]
    assert pool.capacity_bytes == 64 * MiB
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.set_capacity(MiB)


def test_accounting_exact_per_stream_and_account() -> None:
    pool = make_pool()
    trial = pool.open_account("trial-0", streams=(A,))
    other = pool.open_account("trial-1")
    other.bind(B)
    pa = [pool.allocate(n, A) for n in (1, 513, 70 * KiB)]
    pb = pool.allocate(3 * MiB + 1, B)
    expected_a = round_size(1) + round_size(513) + round_size(70 * KiB)
    assert trial.stats().allocated_bytes == expected_a
    assert trial.stats().requested_bytes == 1 + 513 + 70 * KiB
    assert other.stats().allocated_bytes == round_size(3 * MiB + 1)
    assert pool.stream_stats(A).allocated_bytes == expected_a
    assert pool.stats().allocated_bytes == expected_a + round_size(3 * MiB + 1)
    for p in pa:
        pool.free(p, B)  # freed on another stream: still credited back to A's account
    assert trial.stats().allocated_bytes == 0
    assert trial.stats().peak_allocated_bytes == expected_a
    assert trial.peak_allocated_bytes == expected_a
    assert trial.stats().num_frees == 3
    pool.free(pb)
    assert pool.stats().allocated_bytes == 0
    assert pool.stats().peak_allocated_bytes == expected_a + round_size(3 * MiB + 1)
    trial.close()
    other.close()
    check(pool)


def test_quota_refuses_beyond_account_limit() -> None:
    pool = make_pool()
    trial = pool.open_account("t", streams=(A,))
    pool.set_quota(trial, MiB)
    p = pool.allocate(512 * KiB, A)
    with pytest.raises(PoolOutOfMemoryError) as info:
        pool.allocate(600 * KiB, A)
    assert info.value.reason is OOMReason.QUOTA
    assert trial.stats().ooms == 1 and trial.stats().quota_bytes == MiB
    pool.allocate(100 * KiB, B)  # other streams are not limited
    trial.set_quota(None)
    pool.allocate(600 * KiB, A)
    pool.free(p)


def test_record_stream_defers_reuse_until_that_stream_completes() -> None:
    pool = make_pool(capacity_bytes=2 * MiB)
    p = pool.allocate(2 * MiB, A)
    pool.record_stream(p, B)
    pool.sim.submit(B)  # B still reads the block
    pool.free(p, A)
    with pytest.raises(PoolOutOfMemoryError):
        pool.allocate(2 * MiB, A)  # not even A may reuse it while B's use is pending
    pool.sim.finish(B)
    q, src = pool.allocate_with_source(2 * MiB, A)
    assert (q, src) == (p, AllocationSource.SAME_STREAM)


def test_zero_bytes_gives_a_distinct_minimum_block() -> None:
    pool = make_pool()
    p, q = pool.allocate(0, A), pool.allocate(0, A)
    assert p != q and round_size(0) == 512
    assert p % 512 == 0 and q % 512 == 0


def test_stream_objects_with_cuda_stream_or_ptr_are_accepted() -> None:
    class TorchLike:
        cuda_stream = 7

    class CupyLike:
        ptr = 9

    pool = make_pool()
    pool.allocate(10, TorchLike())
    pool.allocate(10, CupyLike())
    streams = {r.stream for r in pool.sim.trace() if isinstance(r, AllocRecord)}
    assert streams == {7, 9}


@pytest.mark.parametrize(
    ("bad", "error"),
    [(-1, ValueError), (0, ValueError), (1.5, TypeError), ("1GB", TypeError), (True, TypeError)],
)
def test_bad_capacity_names_the_argument(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=f"capacity_bytes={bad!r}: "):
        StreamAwarePool(bad, backend="sim")  # type: ignore[arg-type]


def test_bad_backend_and_device_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"backend.*'gpu'"):
        StreamAwarePool(backend="gpu")
    with pytest.raises(ValueError, match="device"):
        StreamAwarePool(backend="sim", device=-1)


def test_bad_free_and_nbytes_are_value_errors() -> None:
    pool = make_pool()
    p = pool.allocate(10, A)
    pool.free(p)
    with pytest.raises(ValueError, match="ptr"):
        pool.free(p)  # double free
    with pytest.raises(ValueError, match="ptr"):
        pool.free(12345)
    with pytest.raises(ValueError, match="nbytes"):
        pool.allocate(-1, A)
    with pytest.raises(TypeError, match="stream"):
        pool.allocate(10, object())
    with pytest.raises(ValueError, match="stream"):
        pool.allocate(10, -5)


def test_stream_bound_to_two_accounts_is_refused() -> None:
    pool = make_pool()
    a = pool.open_account("a", streams=(A,))
    b = pool.open_account("b")
    with pytest.raises(ValueError, match="already bound"):
        b.bind(A)
    a.close()
    b.bind(A)  # free again after close
    with pytest.raises(ValueError, match="quota_bytes"):
        b.set_quota(-3)
    with pytest.raises(RuntimeError, match="closed"):
        a.stats()


def test_sim_only_on_sim_backend_and_backend_property() -> None:
    pool = make_pool()
    assert pool.backend is Backend.SIM
    assert pool.capacity_bytes == 64 * MiB
    assert StreamAwarePool(backend="sim").capacity_bytes == 1 << 30


def test_external_segment_source_callbacks_feed_the_pool() -> None:
    """The callback upstream (the one the cupy backend uses) on simulated events."""
    import ctypes

    buffers: dict[int, ctypes.Array[ctypes.c_char]] = {}

    def seg_alloc(nbytes: int, stream: int) -> int:
        buf = ctypes.create_string_buffer(nbytes + 512)
        addr = (ctypes.addressof(buf) + 511) // 512 * 512
        buffers[addr] = buf
        return addr

    def seg_free(ptr: int, nbytes: int) -> None:
        del buffers[ptr]

    pool = StreamAwarePool(8 * MiB, backend="sim", _segment_source=(seg_alloc, seg_free))
    p = pool.allocate(3 * MiB, A)
    assert len(buffers) == 1
    assert min(buffers) <= p < min(buffers) + 20 * MiB
    pool.free(p)
    assert pool.release_cached() > 0
    assert buffers == {}
    check(pool)


def test_finish_without_a_stream_completes_every_stream() -> None:
    pool = make_pool()
    pa, pb = pool.allocate(SEG, A), pool.allocate(SEG, B)
    pool.sim.submit(A)
    pool.sim.submit(B)
    pool.free(pa, A)
    pool.free(pb, B)
    assert [b.event_pending for b in pool.snapshot()] == [True, True]
    pool.sim.finish(0)  # the default stream only: nothing changes
    assert [b.event_pending for b in pool.snapshot()] == [True, True]
    pool.sim.finish()
    assert [b.event_pending for b in pool.snapshot()] == [False, False]
    assert pool.allocate_with_source(SEG, C)[1] is AllocationSource.COMPLETED_EVENT


def test_fragments_kept_apart_while_pending_merge_once_complete() -> None:
    """Found by the state machine: a completed block next to a pending one is not merged then,
    but must be once the event completes, even with no free in between."""
    pool = make_pool(capacity_bytes=16 * MiB)
    p = pool.allocate(SEG, 0)
    pool.sim.submit(0)
    pool.free(p, 0)  # pending on stream 0
    q = pool.allocate(0, 0)  # splits 512 bytes off the pending block
    pool.free(q, B)  # completed at once (B has no work): kept apart from the pending rest
    with pytest.raises(PoolOutOfMemoryError):
        pool.allocate(SEG, 0)  # would need a second 10 MiB segment
    pool.sim.finish()
    r, src = pool.allocate_with_source(SEG, 99)
    assert (r, src) == (p, AllocationSource.COMPLETED_EVENT)


def _has_cuda_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_has_cuda_driver(), reason="a CUDA driver is installed here")
def test_cuda_backend_without_a_driver_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"libcuda\.so\.1"):
        StreamAwarePool(backend="cuda")


def _has_cupy() -> bool:
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


@pytest.mark.skipif(_has_cupy(), reason="CuPy is installed here")
def test_cupy_backend_without_cupy_names_the_install_fix() -> None:
    with pytest.raises(RuntimeError, match=r"waterwave-hpo\[cuda\]"):
        StreamAwarePool(backend="cupy")


def test_a_stream_reusing_its_own_blocks_records_one_event_per_epoch_not_per_free() -> None:
    """1000 frees on one stream, each block reused by that stream, record at
    most one event per 64 frees (the epoch's cap) inside the pool's mutex, not one per free."""
    pool = make_pool()
    for _ in range(1000):
        p = pool.allocate(100 * KiB, A)
        pool.sim.submit(A)
        pool.free(p, A)
    stats = pool.lock_stats()
    assert stats.frees == 1000
    assert stats.events_recorded <= 1000 // 64
    check(pool)


def test_frees_of_one_epoch_share_one_event_and_another_stream_still_waits_for_them() -> None:
    """The batched event keeps cross-stream reuse safe: stream B is handed A's blocks only after
    a GPU-side wait on the one event recorded (lazily) after all of A's frees."""
    pool = make_pool()
    ptrs = [pool.allocate(SEG, A) for _ in range(4)]
    pool.sim.submit(A)  # A's kernels that use the blocks, still queued
    for p in ptrs:
        pool.free(p, A)
    assert pool.lock_stats().events_recorded == 0  # nobody needed one yet
    q, src = pool.allocate_with_source(SEG, B)
    assert q in ptrs and src is AllocationSource.STREAM_WAIT
    assert pool.lock_stats().events_recorded == 1  # one event covers the four frees
    r, src = pool.allocate_with_source(SEG, C)
    assert r in ptrs and src is AllocationSource.STREAM_WAIT
    assert pool.lock_stats().events_recorded == 1
    assert pool.sim.hazards() == []
    checker = check(pool)
    assert checker.stream_waits == 2
    pool.sim.finish_all()
    s, src = pool.allocate_with_source(SEG, C)
    assert s in ptrs and src is AllocationSource.COMPLETED_EVENT


def test_closing_an_account_closes_its_streams_epoch_while_the_stream_is_alive() -> None:
    """A trial's end records the one event of its stream's open epoch then, not later on a
    stream its owner may have destroyed; the blocks then count as freed on that stream."""
    pool = make_pool()
    account = pool.open_account("trial 0", streams=(A,))
    ptrs = [pool.allocate(100 * KiB, A) for _ in range(3)]
    pool.sim.submit(A)
    for p in ptrs:
        pool.free(p, A)
    assert pool.lock_stats().events_recorded == 0
    account.close()
    assert pool.lock_stats().events_recorded == 1
    pool.sim.finish_all()
    q, src = pool.allocate_with_source(100 * KiB, B)
    assert q in ptrs
    assert src is AllocationSource.COMPLETED_EVENT
    assert pool.lock_stats().events_recorded == 1  # B's search met a closed epoch
    check(pool)


def test_an_epoch_whose_blocks_were_all_reused_records_no_event() -> None:
    pool = make_pool()
    account = pool.open_account("trial 0", streams=(A,))
    # A whole segment: a smaller block would merge with the segment's free rest on its free,
    # and that rest (free, so never reused) would keep the epoch and its event.
    for _ in range(10):
        p = pool.allocate(SEG, A)
        pool.sim.submit(A)
        pool.free(p, A)
    pool.allocate(SEG, A)  # the last freed block is taken again by its own stream
    account.close()
    assert pool.lock_stats().events_recorded == 0
    check(pool)
