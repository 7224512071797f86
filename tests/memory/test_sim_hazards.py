"""The sim device's stream-hazard checker.

Every use of a block per stream is recorded (the pool notes the freeing stream's; tests note a
kernel on another stream with ``pool.sim.use``); at every handout to stream Y, each use by another
stream must have completed or have been waited on by Y. The checker must catch a pool (or a user)
breaking stream order, and pass the pool's own handouts, cross-stream use included.
"""

from __future__ import annotations

from pathlib import Path
import random
import subprocess
import sys

import pytest

from waterwave_hpo.memory import AllocationSource
from waterwave_hpo.memory import StreamAwarePool

MiB = 1 << 20
A, B, C = 1, 2, 3


def make_pool(capacity_bytes: int = 612 * MiB) -> StreamAwarePool:
    return StreamAwarePool(capacity_bytes, backend="sim")


def test_allocate_on_a_use_on_b_free_allocate_on_c_is_safe_with_record_stream() -> None:
    pool = make_pool(capacity_bytes=2 * MiB)
    p = pool.allocate(2 * MiB, A)
    pool.sim.submit(A)
    pool.sim.submit(B)
    pool.sim.use(p, 2 * MiB, B)  # a kernel on B reads the block (a tensor crossing streams)
    pool.record_stream(p, B)  # what Tensor.record_stream must reach
    pool.free(p, A)
    pool.sim.finish(A)
    pool.sim.submit(C)
    q = None
    try:
        q = pool.allocate(2 * MiB, C)
    except MemoryError:
        pass  # B's use still pending: the pool may refuse rather than hand it out
    assert pool.sim.hazards() == []
    pool.sim.finish(B)
    if q is None:
        q = pool.allocate(2 * MiB, C)
    assert q == p
    assert pool.sim.hazards() == []


def test_checker_reports_a_cross_stream_use_the_pool_was_not_told_about() -> None:
    # Without record_stream the pool cannot know B reads the block: the checker must say so.
    pool = make_pool()
    p = pool.allocate(12 * MiB, A)
    pool.sim.submit(B)
    pool.sim.use(p, 12 * MiB, B)
    pool.free(p, A)  # A queued nothing: A's own use is complete
    q, src = pool.allocate_with_source(12 * MiB, C)
    assert q == p and src is AllocationSource.COMPLETED_EVENT
    hazards = pool.sim.hazards()
    assert len(hazards) == 1
    h = hazards[0]
    assert (h.ptr, h.stream, h.other_stream, h.use_seq, h.completed) == (p, C, B, 1, 0)


def test_checker_accepts_a_gpu_side_wait_and_counts_a_missing_one() -> None:
    pool = make_pool()
    p = pool.allocate(12 * MiB, A)
    pool.sim.submit(A)
    pool.free(p, A)  # A's event pending: the pool makes C wait on it
    q, src = pool.allocate_with_source(12 * MiB, C)
    assert src is AllocationSource.STREAM_WAIT and q == p
    assert pool.sim.hazards() == []
    # A use on B noted while C holds the block, then C frees it and D takes it: B is unordered.
    pool.sim.submit(B)
    pool.sim.use(q, 12 * MiB, B)
    pool.free(q, C)
    pool.sim.finish(C)
    pool.allocate(12 * MiB, 4)
    assert [h.other_stream for h in pool.sim.hazards()] == [B]


def test_random_cross_stream_workload_with_record_stream_has_no_hazard() -> None:
    rng = random.Random(14)
    pool = make_pool(capacity_bytes=32 * MiB)
    streams = [1, 2, 3, 4]
    live: list[tuple[int, int, int]] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.45 or not live:
            s = rng.choice(streams)
            n = rng.choice([512, 4096, 100_000, 1 * MiB, 3 * MiB])
            try:
                ptr = pool.allocate(n, s)
            except MemoryError:
                pool.sim.finish(rng.choice(streams))
                continue
            pool.sim.submit(s)
            live.append((ptr, n, s))
        elif op < 0.65:
            ptr, n, s = rng.choice(live)
            other = rng.choice(streams)
            pool.sim.submit(other)
            pool.sim.use(ptr, n, other)
            pool.record_stream(ptr, other)
        elif op < 0.9:
            ptr, n, s = live.pop(rng.randrange(len(live)))
            pool.free(ptr, s)
        else:
            pool.sim.finish(rng.choice(streams))
    assert pool.sim.hazards() == []


def test_use_names_a_bad_length() -> None:
    pool = make_pool()
    with pytest.raises(ValueError, match=r"^nbytes=0: must be >= 1"):
        pool.sim.use(pool.allocate(512, A), 0, A)


def test_record_stream_on_the_allocating_stream_is_kept_when_freed_on_another() -> None:
    # The free's stream argument may differ from the allocating stream; a record_stream on the
    # allocating stream must then still hold the block until that stream's use completed.
    pool = make_pool()
    p = pool.allocate(12 * MiB, A)
    pool.sim.submit(A)
    pool.sim.use(p, 12 * MiB, A)
    pool.record_stream(p, A)
    pool.free(p, B)
    pool.sim.finish(B)
    q = pool.allocate(12 * MiB, C)
    assert q != p  # still in use on A: a new segment
    assert pool.sim.hazards() == []
    pool.sim.finish(A)
    pool.free(q, C)
    pool.sim.finish(C)
    assert p in {pool.allocate(12 * MiB, C), pool.allocate(12 * MiB, C)}
    assert pool.sim.hazards() == []


def test_a_block_freed_on_another_stream_waits_for_its_allocating_streams_queued_work() -> None:
    # Found by the checker (hypothesis): the first owner's kernel on A still reads p; p is reused
    # on A (safe, stream order), then freed on B by the second owner. Handing it to B at once
    # would let B overwrite memory A's queued kernel still reads.
    pool = make_pool()
    p = pool.allocate(512, A)
    pool.sim.submit(A)
    pool.free(p)  # pending on A
    assert pool.allocate(512, A) == p  # same stream: safe
    pool.free(p, B)  # B is declared the last user; A's first kernel is still queued
    q = pool.allocate(512, B)
    assert q != p
    assert pool.sim.hazards() == []
    pool.sim.finish(A)
    assert pool.allocate(512, B) == p
    assert pool.sim.hazards() == []


def test_a_recorded_block_freed_while_its_reader_runs_never_reaches_a_third_stream_early() -> None:
    # The GPU record-stream test's sequence: x on A (a 4 MiB block of a 20 MiB segment), B
    # waits for A, reads x and allocates y beside it, x.record_stream(B), x freed on A while B
    # runs; then C allocates x's size, over and over, and B finishes only at the end.
    pool = make_pool()
    x = pool.allocate(4 * MiB, A)
    pool.sim.submit(A)
    pool.sim.finish(A)
    pool.sim.submit(B)  # B's spin and its read of x
    pool.sim.use(x, 4 * MiB, B)
    y = pool.allocate(4 * MiB, B)
    pool.record_stream(x, B)
    pool.free(x, A)
    taken = []
    for _ in range(4):  # C takes every free block it can; x must not be one of them yet
        z = pool.allocate(4 * MiB, C)
        pool.sim.submit(C)
        pool.sim.use(z, 4 * MiB, C)  # C writes what it was handed
        taken.append(z)
    assert x not in taken
    assert pool.sim.hazards() == []
    pool.sim.finish(B)
    for z in taken:
        pool.free(z, C)
    pool.free(y, B)
    pool.free(pool.allocate(512, C), C)  # an allocation looks at the recorded blocks again
    # Once B's read completed, x's memory is free for any stream.
    assert all(not b.event_pending for b in pool.snapshot() if b.ptr <= x < b.ptr + b.size_bytes)
    assert pool.sim.hazards() == []


_PING_PONG = """
import sys
from waterwave_hpo.memory import AllocationSource, StreamAwarePool
MiB = 1 << 20
pool = StreamAwarePool(4 * MiB, backend="sim")
A, B, D = 1, 2, 4
p = pool.allocate(2 * MiB, A)
pool.sim.submit(A)
pool.free(p, A)
waits = 0
for i in range(64):  # one block handed back and forth, neither stream's work completing
    s = (A, B)[(i + 1) % 2]
    p, src = pool.allocate_with_source(2 * MiB, s)
    waits += src is AllocationSource.STREAM_WAIT
    pool.sim.submit(s)
    pool.free(p, s)
q = pool.allocate(2 * MiB, A)
pool.sim.submit(D)
pool.sim.use(q, 2 * MiB, D)  # a kernel on D reads q; the pool was not told
pool.free(q, A)
assert pool.allocate(2 * MiB, A) == q  # has A waited for D? a search through A's waits
print(waits, len(pool.sim.hazards()))
"""


def test_the_hazard_check_searches_a_web_of_stream_waits_in_polynomial_time(
    tmp_path: Path,
) -> None:
    # Two streams handing one block back and forth make a wait record per handout, each
    # pointing at the other stream: a search that followed every path took 64^64 steps (the
    # pool's mutex held meanwhile), so a sim pool under many pending cross-stream waits hung.
    script = tmp_path / "ping_pong.py"
    script.write_text(_PING_PONG)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    waits, hazards = map(int, done.stdout.split())
    assert waits == 64  # every handout waited on the other stream
    assert hazards == 1  # D's use, which no wait covers, is found
