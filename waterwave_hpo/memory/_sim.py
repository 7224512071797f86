"""The simulated device of the ``sim`` backend: virtual streams and events, and the pool's trace.

Stream ``s`` has ``submitted`` units of work of which ``completed`` are done. An event recorded on
``s`` (the pool records one at every free) captures ``seq = submitted``; it has completed once
``completed >= seq``. A stream wait of W on such an event orders W's later work after those ``seq``
units: finishing W finishes them first. So what the pool may do (hand a block to another stream
only after the freeing stream's event completed or after a wait on it) can be checked from
:meth:`SimDevice.trace` alone.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from waterwave_hpo import _checks
from waterwave_hpo.memory._errors import OOMReason
from waterwave_hpo.memory._lib import HazardStruct
from waterwave_hpo.memory._lib import TraceEntryStruct
from waterwave_hpo.memory._stats import AllocationSource
from waterwave_hpo.memory._streams import StreamLike
from waterwave_hpo.memory._streams import stream_handle

if TYPE_CHECKING:
    from waterwave_hpo.memory._pool import StreamAwarePool


class TraceKind(enum.IntEnum):
    """Kinds of trace records (values of ``ww_trace_kind``)."""

    ALLOC = 1
    FREE = 2
    STREAM_WAIT = 3
    OOM = 4
    SUBMIT = 5
    FINISH = 6
    SEGMENT_NEW = 7
    SEGMENT_RELEASE = 8


@dataclasses.dataclass(frozen=True)
class AllocRecord:
    """The pool handed ``[ptr, ptr + size_bytes)`` to ``stream``."""

    ptr: int
    size_bytes: int
    requested_bytes: int
    stream: int
    source: AllocationSource
    account_id: int | None


@dataclasses.dataclass(frozen=True)
class FreeRecord:
    """``[ptr, ptr + size_bytes)`` was freed on ``stream``; its event captured ``event_seq``."""

    ptr: int
    size_bytes: int
    stream: int
    event_seq: int
    account_id: int | None


@dataclasses.dataclass(frozen=True)
class StreamWaitRecord:
    """``stream`` waited on the GPU for ``waited_stream``'s first ``event_seq`` units."""

    stream: int
    waited_stream: int
    event_seq: int


@dataclasses.dataclass(frozen=True)
class OOMRecord:
    """An allocation of ``requested_bytes`` on ``stream`` failed."""

    requested_bytes: int
    size_bytes: int
    stream: int
    reason: OOMReason
    account_id: int | None


@dataclasses.dataclass(frozen=True)
class SubmitRecord:
    """A unit of work was enqueued on ``stream``; it now has ``submitted`` units."""

    stream: int
    submitted: int


@dataclasses.dataclass(frozen=True)
class FinishRecord:
    """``stream``'s first ``completed`` units of work have completed."""

    stream: int
    completed: int


@dataclasses.dataclass(frozen=True)
class SegmentRecord:
    """A segment was taken from (``released=False``) or given back to the upstream."""

    ptr: int
    size_bytes: int
    released: bool
    stream: int
    account_id: int | None


@dataclasses.dataclass(frozen=True)
class StreamHazard:
    """A handout of ``[ptr, ptr + size_bytes)`` to ``stream`` while ``other_stream`` used it.

    ``other_stream``'s first ``use_seq`` units of work use the range; only ``completed`` units had
    completed and ``stream`` had not been made to wait for them: on a GPU, a kernel on ``stream``
    could overwrite memory a kernel on ``other_stream`` still reads (silent corruption).
    """

    ptr: int
    size_bytes: int
    stream: int
    other_stream: int
    use_seq: int
    completed: int


TraceRecord = (
    AllocRecord
    | FreeRecord
    | StreamWaitRecord
    | OOMRecord
    | SubmitRecord
    | FinishRecord
    | SegmentRecord
)


def _account(raw: int) -> int | None:
    return None if raw < 0 else raw


def _convert(e: TraceEntryStruct) -> TraceRecord:
    kind = TraceKind(e.kind)
    if kind is TraceKind.ALLOC:
        return AllocRecord(
            e.ptr, e.size, e.requested, e.stream, AllocationSource(e.source), _account(e.account)
        )
    if kind is TraceKind.FREE:
        return FreeRecord(e.ptr, e.size, e.stream, e.seq, _account(e.account))
    if kind is TraceKind.STREAM_WAIT:
        return StreamWaitRecord(e.stream, e.other_stream, e.seq)
    if kind is TraceKind.OOM:
        return OOMRecord(e.requested, e.size, e.stream, OOMReason(e.source), _account(e.account))
    if kind is TraceKind.SUBMIT:
        return SubmitRecord(e.stream, e.seq)
    if kind is TraceKind.FINISH:
        return FinishRecord(e.stream, e.seq)
    return SegmentRecord(
        e.ptr, e.size, kind is TraceKind.SEGMENT_RELEASE, e.stream, _account(e.account)
    )


class SimDevice:
    """Control of a ``sim`` pool's simulated GPU, and the pool's trace. Get it as ``pool.sim``.

    Thread-safe; any integer is a stream handle (0 is the default stream).
    """

    def __init__(self, pool: StreamAwarePool) -> None:
        self._pool = pool

    def submit(self, stream: StreamLike) -> int:
        """Enqueues one unit of GPU work on ``stream`` (0 is the default stream).

        Returns:
            The number of units submitted to ``stream`` so far.
        """
        return int(self._pool._lib.ww_sim_submit(self._pool._handle(), stream_handle(stream)))

    def finish(self, stream: StreamLike = None) -> None:
        """Completes the work submitted so far on ``stream``, or on every stream.

        Completing a stream first completes what it was made to wait on.

        Args:
            stream: The stream (0 is the default stream); None completes every stream.
        """
        everything = stream is None
        self._pool._lib.ww_sim_finish(
            self._pool._handle(), 0 if everything else stream_handle(stream), int(everything)
        )

    def finish_all(self) -> None:
        """Completes all work submitted on every stream (same as ``finish()``)."""
        self.finish(None)

    def use(self, ptr: int, nbytes: int, stream: StreamLike) -> None:
        """Records that ``stream``'s work queued so far uses ``[ptr, ptr + nbytes)``.

        The stream-hazard checker keeps every use until the stream's work
        up to it completes; the pool notes the freeing stream's use itself at every free. Call
        this for a kernel on a stream other than the block's own (after :meth:`submit` on that
        stream), as PyTorch code does when a tensor crosses streams.

        Args:
            ptr: Start of the range (a pointer from the pool, or inside a block).
            nbytes: Length of the range in bytes (> 0).
            stream: The stream whose queued work uses the range.

        Raises:
            TypeError: ``nbytes`` is not an int.
            ValueError: ``nbytes`` is not positive.
        """
        _checks.check_int("nbytes", nbytes, minimum=1, fix="pass a size in bytes")
        self._pool._lib.ww_sim_use(self._pool._handle(), ptr, nbytes, stream_handle(stream))

    def hazards(self) -> list[StreamHazard]:
        """Every stream hazard the checker found so far (empty when the pool kept stream order).

        A hazard is a handout of a range to stream Y while a use of it by another stream X was
        neither complete nor waited on by Y. Checked at every handout, whatever its source.
        """
        lib = self._pool._lib
        handle = self._pool._handle()
        n = int(lib.ww_sim_hazards(handle, None, 0))
        buf = (HazardStruct * max(n, 1))()
        m = min(n, int(lib.ww_sim_hazards(handle, buf, n)))
        return [
            StreamHazard(h.ptr, h.size, h.stream, h.other_stream, h.use_seq, h.completed)
            for h in buf[:m]
        ]

    def trace(self, start: int = 0) -> list[TraceRecord]:
        """What the pool and the simulated device did, in order, from record ``start`` on.

        Returns:
            Allocations (pointer, size, stream, source), frees, stream waits (which stream waited
            on which stream's event), OOMs, submits, finishes and segment moves.
        """
        lib = self._pool._lib
        handle = self._pool._handle()
        out: list[TraceRecord] = []
        chunk = 4096
        buf = (TraceEntryStruct * chunk)()
        pos = start
        while True:
            n = int(lib.ww_trace_read(handle, pos, buf, chunk))
            out.extend(_convert(buf[i]) for i in range(n))
            pos += n
            if n < chunk:
                return out

    def trace_length(self) -> int:
        """The number of trace records so far."""
        return int(self._pool._lib.ww_trace_count(self._pool._handle()))

    def clear_trace(self) -> None:
        """Drops the trace recorded so far (long runs)."""
        self._pool._lib.ww_trace_clear(self._pool._handle())
