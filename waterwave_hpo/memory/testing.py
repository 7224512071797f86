"""A conformance checker for the pool, for this package's tests and anyone else's.

:class:`TraceChecker` replays ``pool.sim.trace()`` (a ``sim`` pool) against an independent model of
the simulated device and asserts the pool's rules:

* live blocks never overlap and lie inside live segments;
* reserved bytes never exceed the capacity;
* the safety rule: memory freed on stream A is handed to stream B != A only if A's event (the
  work A had queued when it freed) had completed, or B was made to wait on it;
* a segment is released only when nothing in it is live and its last uses completed;
* a STREAM_WAIT allocation is preceded by the wait, and every free matches a live block.

Usage::

    checker = TraceChecker(capacity_bytes=pool.capacity_bytes)
    checker.feed(pool.sim.trace(checker.records_seen))   # as often as wanted, incrementally
    assert checker.allocated_bytes == pool.stats().allocated_bytes
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import TYPE_CHECKING

from waterwave_hpo.memory._sim import AllocRecord
from waterwave_hpo.memory._sim import FinishRecord
from waterwave_hpo.memory._sim import FreeRecord
from waterwave_hpo.memory._sim import OOMRecord
from waterwave_hpo.memory._sim import SegmentRecord
from waterwave_hpo.memory._sim import StreamWaitRecord
from waterwave_hpo.memory._sim import SubmitRecord
from waterwave_hpo.memory._stats import AllocationSource

if TYPE_CHECKING:
    from collections.abc import Iterable
    from collections.abc import Iterator
    from collections.abc import Sequence

    from waterwave_hpo.memory._pool import StreamAwarePool
    from waterwave_hpo.memory._sim import TraceRecord
    from waterwave_hpo.memory._stats import DriverStats


class TraceViolation(AssertionError):
    """The trace shows the pool breaking one of its rules."""


@dataclasses.dataclass
class _Freed:
    end: int
    stream: int
    seq: int


class _IntervalMap:
    """Non-overlapping half-open intervals ``[start, end)`` with a payload, by start address."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.items: dict[int, _Freed] = {}

    def overlapping(self, lo: int, hi: int) -> list[tuple[int, _Freed]]:
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        out = []
        while i < len(self.starts) and self.starts[i] < hi:
            s = self.starts[i]
            item = self.items[s]
            if item.end > lo:
                out.append((s, item))
            i += 1
        return out

    def add(self, start: int, item: _Freed) -> None:
        bisect.insort(self.starts, start)
        self.items[start] = item

    def remove_range(self, lo: int, hi: int) -> None:
        """Drops ``[lo, hi)``, keeping the parts of overlapping intervals outside it."""
        for s, item in self.overlapping(lo, hi):
            self.starts.pop(bisect.bisect_left(self.starts, s))
            del self.items[s]
            if s < lo:
                self.add(s, _Freed(lo, item.stream, item.seq))
            if item.end > hi:
                self.add(hi, _Freed(item.end, item.stream, item.seq))


class TraceChecker:
    """Replays a ``sim`` pool's trace and raises :class:`TraceViolation` on any broken rule.

    Args:
        capacity_bytes: The pool's capacity (bytes); None skips the capacity check.
    """

    def __init__(self, capacity_bytes: int | None) -> None:  # noqa: D107 - Args: above
        self.capacity_bytes = capacity_bytes
        self.records_seen = 0
        self.submitted: dict[int, int] = collections.defaultdict(int)
        self.completed: dict[int, int] = collections.defaultdict(int)
        self.waited: dict[tuple[int, int], int] = {}
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (size, stream)
        self._live_starts: list[int] = []
        self.freed = _IntervalMap()
        self.segments: dict[int, int] = {}  # ptr -> size
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.allocated_by_stream: dict[int, int] = collections.defaultdict(int)
        self.allocated_by_account: dict[int, int] = collections.defaultdict(int)
        self.sources: collections.Counter[AllocationSource] = collections.Counter()
        self.stream_waits = 0
        self.ooms = 0
        self.frees = 0
        self._last: TraceRecord | None = None

    # -- helpers ---------------------------------------------------------------------------

    def _fail(self, record: TraceRecord, why: str) -> None:
        raise TraceViolation(f"trace record {self.records_seen} {record}: {why}")

    def _done(self, stream: int, seq: int) -> bool:
        return self.completed[stream] >= seq

    def _segment_of(self, ptr: int, size: int) -> int | None:
        for base, seg_size in self.segments.items():
            if base <= ptr and ptr + size <= base + seg_size:
                return base
        return None

    def _live_overlap(self, lo: int, hi: int) -> int | None:
        i = bisect.bisect_right(self._live_starts, lo) - 1
        for j in (i, i + 1):
            if 0 <= j < len(self._live_starts):
                s = self._live_starts[j]
                if s < hi and s + self.live[s][0] > lo:
                    return s
        return None

    # -- replay ----------------------------------------------------------------------------

    def feed(self, records: Iterable[TraceRecord]) -> None:
        """Checks ``records`` (the continuation of what was fed before).

        Raises:
            TraceViolation: A record breaks one of the pool's rules.
        """
        for r in records:
            self._one(r)
            # Another thread's simulated work (submit/finish take only the sim's lock, not the
            # pool's) may be recorded between a stream wait and the allocation it served.
            if not isinstance(r, (SubmitRecord, FinishRecord)):
                self._last = r
            self.records_seen += 1

    def _one(self, r: TraceRecord) -> None:
        if isinstance(r, SubmitRecord):
            self.submitted[r.stream] = r.submitted
        elif isinstance(r, FinishRecord):
            if r.completed > self.submitted[r.stream]:
                self._fail(r, "finished more work than was submitted")
            self.completed[r.stream] = max(self.completed[r.stream], r.completed)
        elif isinstance(r, StreamWaitRecord):
            key = (r.stream, r.waited_stream)
            self.waited[key] = max(self.waited.get(key, 0), r.event_seq)
            self.stream_waits += 1
        elif isinstance(r, SegmentRecord):
            self._segment(r)
        elif isinstance(r, AllocRecord):
            self._alloc(r)
        elif isinstance(r, FreeRecord):
            self._free(r)
        elif isinstance(r, OOMRecord):
            self.ooms += 1

    def _segment(self, r: SegmentRecord) -> None:
        lo, hi = r.ptr, r.ptr + r.size_bytes
        if not r.released:
            for base, size in self.segments.items():
                if base < hi and base + size > lo:
                    self._fail(r, f"new segment overlaps live segment {base:#x}")
            self.segments[r.ptr] = r.size_bytes
            self.freed.remove_range(lo, hi)  # fresh memory: no pending use
            self.reserved_bytes += r.size_bytes
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
            if self.capacity_bytes is not None and self.reserved_bytes > self.capacity_bytes:
                self._fail(r, f"reserved {self.reserved_bytes} > capacity {self.capacity_bytes}")
            return
        if self.segments.get(r.ptr) != r.size_bytes:
            self._fail(r, "released a segment that is not live")
        if self._live_overlap(lo, hi) is not None:
            self._fail(r, "released a segment with live blocks")
        for _s, f in self.freed.overlapping(lo, hi):
            if not self._done(f.stream, f.seq):
                self._fail(r, f"released memory whose last use on stream {f.stream} is pending")
        self.freed.remove_range(lo, hi)
        del self.segments[r.ptr]
        self.reserved_bytes -= r.size_bytes

    def _alloc(self, r: AllocRecord) -> None:
        lo, hi = r.ptr, r.ptr + r.size_bytes
        if r.size_bytes < r.requested_bytes:
            self._fail(r, "block smaller than requested")
        if self._segment_of(r.ptr, r.size_bytes) is None:
            self._fail(r, "block outside every live segment")
        other = self._live_overlap(lo, hi)
        if other is not None:
            self._fail(r, f"overlaps live block {other:#x}")
        if r.source is AllocationSource.STREAM_WAIT and not (
            isinstance(self._last, StreamWaitRecord) and self._last.stream == r.stream
        ):
            self._fail(r, "STREAM_WAIT allocation without a preceding wait of its stream")
        for _s, f in self.freed.overlapping(lo, hi):
            if f.stream == r.stream or self._done(f.stream, f.seq):
                continue
            if self.waited.get((r.stream, f.stream), 0) >= f.seq:
                continue
            self._fail(
                r,
                f"SAFETY: memory freed on stream {f.stream} (event seq {f.seq}, completed "
                f"{self.completed[f.stream]}) handed to stream {r.stream} without a wait",
            )
        self.freed.remove_range(lo, hi)
        self.live[r.ptr] = (r.size_bytes, r.stream)
        bisect.insort(self._live_starts, r.ptr)
        self.allocated_bytes += r.size_bytes
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        self.allocated_by_stream[r.stream] += r.size_bytes
        if r.account_id is not None:
            self.allocated_by_account[r.account_id] += r.size_bytes
        self.sources[r.source] += 1

    def _free(self, r: FreeRecord) -> None:
        entry = self.live.get(r.ptr)
        if entry is None or entry[0] != r.size_bytes:
            self._fail(r, "free of a block that is not live (or of another size)")
            return
        size, alloc_stream = entry
        del self.live[r.ptr]
        self._live_starts.pop(bisect.bisect_left(self._live_starts, r.ptr))
        self.allocated_bytes -= size
        self.allocated_by_stream[alloc_stream] -= size
        if r.account_id is not None:
            self.allocated_by_account[r.account_id] -= size
        if r.event_seq > self.submitted[r.stream]:
            self._fail(r, "event captured more work than was submitted")
        self.freed.add(r.ptr, _Freed(r.ptr + size, r.stream, r.event_seq))
        self.frees += 1


#: Activation sizes (bytes) of the synthetic training step of :func:`run_training_steps`: a small
#: CNN at batch 128 (conv activations of 4-8 MiB, a flatten, small heads), rounded by hand.
STEP_ACTIVATION_BYTES = (8 << 20, 8 << 20, 4 << 20, 4 << 20, 2 << 20, 1 << 20, 256 << 10, 5120)
#: Parameter sizes (bytes) of the same model: each step frees and re-makes its gradients
#: (``zero_grad(set_to_none=True)``, PyTorch's default) and one optimizer temporary per tensor.
STEP_PARAMETER_BYTES = (3456, 73728, 294912, 1179648, 4718592, 20480)


def run_training_steps(
    pool: StreamAwarePool, streams: Sequence[int], steps: int, *, warmup: int = 0
) -> DriverStats:
    """Plays training steps of one synthetic model per stream, interleaved op by op.

    The allocation pattern of a co-hosted trial's step as PyTorch's allocator sees it
    (forward: an activation per layer; backward: a gradient per activation, the activation
    freed as its gradient is made, then a gradient per parameter; optimizer: one temporary per
    parameter; the parameter gradients freed at the next step's ``zero_grad``), every stream
    advancing one allocation or free at a time, as trials on a GPU do. No stream waits on the
    CPU; on a ``sim`` pool no simulated work completes (the worst case for cross-stream reuse).
    Each step makes 28 allocations and 28 frees per stream.

    Args:
        pool: The pool; its backend's streams are the integers in ``streams``.
        streams: One stream handle per trial.
        steps: Training steps per trial after the warm-up.
        warmup: Steps per trial before counting starts.

    Returns:
        What the ``steps`` steps of every trial cost the pool (:meth:`StreamAwarePool.
        driver_stats`), without the warm-up and without each trial's set-up and tear-down.
    """

    def one_trial(stream: int) -> Iterator[bool]:
        params = [pool.allocate(n, stream) for n in STEP_PARAMETER_BYTES]
        grads: list[int] = []
        for _ in range(warmup + steps):
            yield True  # a step starts
            for g in grads:  # zero_grad(set_to_none=True)
                pool.free(g, stream)
                yield False
            acts = []
            for n in STEP_ACTIVATION_BYTES:
                acts.append(pool.allocate(n, stream))
                yield False
            upstream = None
            for n in reversed(STEP_ACTIVATION_BYTES):
                grad_in = pool.allocate(n, stream)
                yield False
                pool.free(acts.pop(), stream)
                if upstream is not None:
                    pool.free(upstream, stream)
                upstream = grad_in
                yield False
            if upstream is not None:
                pool.free(upstream, stream)
            grads = [pool.allocate(n, stream) for n in STEP_PARAMETER_BYTES]
            yield False
            for n in STEP_PARAMETER_BYTES:  # the optimizer's temporaries
                pool.free(pool.allocate(n, stream), stream)
                yield False
        yield True  # the last step ended
        for p in grads + params:  # the trial ends
            pool.free(p, stream)

    trials = [one_trial(s) for s in streams]
    readings: list[DriverStats] = []
    boundary = 0
    while trials:
        # Every trial runs the same sequence, so all of them reach a step boundary in one round.
        marks = [next(t, None) for t in trials]
        if marks and all(marks):
            if boundary in (warmup, warmup + steps):
                readings.append(pool.driver_stats())
            boundary += 1
        trials = [t for t, m in zip(trials, marks, strict=True) if m is not None]
    return readings[1] - readings[0]
