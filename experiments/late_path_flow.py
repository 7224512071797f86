"""Memory flow between co-hosted trials under a capacity: the pool, PyTorch's allocator, routing.

When a user's script touched CUDA before the executor was built (the *late path*), PyTorch's
allocator can no longer be swapped for the stream-aware pool. This script measures, on the CPU,
what each way of serving the late path delivers to co-hosted trials under a capacity: how many
trials complete, how many attempts run out of memory, how many bytes one trial frees that
another then uses (the *flow*), and how many device-wide synchronisations it costs.

What is replayed: allocation traces of real training. One trial of each workload of
``experiments/gpu_benchmark.py`` (``build_model``, ``make_batches``: the small CNN at batch 128
and the ResNet-style CNN at batch 64, 32x32 inputs, SGD with momentum, ``foreach`` as on CUDA) is
trained on the CPU: the model is built, moved (every parameter and buffer copied, as
``.to(device)`` does), four batches are moved, ``--steps`` steps run, the trial returns its last
loss and drops everything. A ``TorchDispatchMode`` sees every storage an ATen op creates
(``allocate(id, nbytes)``), and ``weakref.finalize`` on the storage sees it die (``free(id)``):
the ordered events of one trial, what the same Python code asks of a CUDA allocator.

How it is replayed: ``--trials`` trials over K slots (one stream per slot, reused by the slot's
next trial, as the executor's slots do), interleaved event by event (each round, every running
slot does its next event, in slot order). So that the trials' peaks do not all align, slot ``s``
opens ``s * spread / K`` of a steady step late; each row is replayed ``--phases`` times, with
``spread`` 1/P, 2/P, ..., 1, and its counts are summed over them. When a trial ends, its slot
starts the next one. An attempt whose allocation fails frees everything it holds (latest first),
counts one OOM, and the executor's rules apply (``waterwave_hpo/host/_attempt.py``,
``waterwave_hpo/executor/_optimize.py``): ``release_memory`` calls ``torch.cuda.empty_cache()``
before the attempt's account (and route) closes; an attempt that had neighbours is re-queued, at
most ``--max-oom-retries`` times (the executor's default, 2), and starts first, once at most
``neighbours - 1`` trials run (fresh trials wait behind it, and fill the other slots after it
started); an attempt alone, or past the cap, fails its trial. Capacities: a factor times one
trial's solo peak reserved bytes (the trial alone on PyTorch's caching allocator, what
``gpu_benchmark.py`` sizes its high demand by): ``1.5``, ``0.75K`` (0.75 K), ``light`` (K + 1).

The allocators:

* ``pool``: the real :class:`waterwave_hpo.memory.StreamAwarePool` (``backend="sim"``, capacity C),
  one account per attempt bound to its slot's stream: the pool as PyTorch's process-wide allocator
  (possible only when installed before CUDA starts). The simulated GPU runs behind the CPU: every
  event submits one unit of work on its slot's stream, and a slot's stream completes its work
  every ``--gpu-lag`` of its events. ``empty_cache`` after an OOM is
  ``release_cached_when_idle()``.
* ``torch``: a model of PyTorch's caching allocator (below), bounded as
  ``set_per_process_memory_fraction`` bounds it (``alloc_block`` refuses a segment past C).
* ``routed``: the same model, each attempt's stream routed to its own private pool
  (``beginAllocateToPool``) whose segments come from the pool (``StreamAwarePool``, capacity C,
  through ``CUDAPluggableAllocator``), as ``waterwave_hpo/memory/_routed.py`` does. While any
  route is open ``captures_underway`` is not empty: ``malloc`` skips ``release_cached_blocks``,
  and ``empty_cache`` cannot run (``synchronize_and_free_events`` asserts no capture is
  underway; the executor suppresses the error). At an attempt's end its route ends and its pool
  is released (``endAllocateToPool``, ``releasePool``: use count 0, freeable); its segments go
  back to the pool only when no route is open (``~MemPool``'s ``emptyCache`` may run only then),
  else they are held until then.
* ``routed-slot``: the same, with one long-lived route per slot stream (its trials share it), all
  ended together at the study's end: a slot's next trial reuses its cache; no segment goes back
  while the study runs.

The model of PyTorch's caching allocator, read in ``c10/cuda/CUDACachingAllocator.cpp``
(pytorch/pytorch at 001074d25084) and ``aten/src/ATen/cuda/MemPool.cpp``: ``round_size`` (at
least 512 bytes, multiples of 512; ``roundup_power2_divisions`` unset); ``get_pool`` (requests of
at most 1 MiB in the small pool, larger in the large pool, a routed stream's in its private
pool's); ``get_free_block`` (best fit among the free blocks of the same stream in that pool:
``BlockComparatorSize`` orders by stream, size, address); ``get_allocation_size`` (a new segment
of 2 MiB for small requests, 20 MiB for requests under 10 MiB, else the request rounded up to
2 MiB); ``alloc_block`` (refused when ``total_allocated_memory + size`` passes the fraction's
bytes); ``should_split`` (a small block splits when 512 bytes or more remain, a large one when
more than 1 MiB remains); ``alloc_found_block`` (the front of the block is handed out, the rest
stays free); ``free`` and ``free_block``/``try_merge_blocks`` (a freed block merges with free
neighbours of its segment); the failure path of ``malloc``: ``release_available_cached_blocks``
(returns False when ``max_split_size`` is unset, PyTorch's default), then, only when
``captures_underway`` is empty, ``release_cached_blocks`` (``synchronize_and_free_events``, then
``release_blocks`` of the large and small pools and of freeable private pools: every cached
segment that is not split, of every stream, goes back with ``cudaFree``) and one retry
(``alloc_block(isRetry)``), then ``OutOfMemoryError``; ``emptyCache`` is
``release_cached_blocks``; ``beginAllocateToPool``, ``endAllocateToPool``, ``releasePool``
(use counts; a pool at 0 is freeable) and ``~MemPool`` (``releasePool``, then ``emptyCache``).

Simplifications: no ``max_split_size``, ``expandable_segments``, ``garbage_collection_threshold``
or ``roundup_power2_divisions`` (PyTorch's defaults); no ``record_stream`` in these traces (so
``process_events`` and its deferral under routing change nothing here, and
``synchronize_and_free_events`` waits on no event: its device-wide stall is that of the
``cudaFree`` calls that follow); ``cudaMalloc``'s placement is first fit over one address range
(like the sim pool's arena); no cuDNN or cuBLAS workspace (on a GPU they add blocks per trial);
the traces are the CPU's ATen ops (same operators as on CUDA, ``native_batch_norm`` for cuDNN's);
time is rounds of events, not seconds: a synchronisation costs nothing here, it is counted.

Measured per (workload, K, capacity, allocator), summed over the phases: trials completed (and
per phase) and failed, OOM attempts; ``flow_bytes``: bytes handed to an attempt that another
attempt freed last (physical bytes: marks survive a segment's release and re-allocation), of
which ``flow_cross_slot_bytes`` were freed on another slot and ``flow_live_bytes`` by an attempt
still running (so on another slot: memory moving between co-hosted trials);
``device_syncs``: release passes that gave at least one segment back to
the driver (``cudaFree``/``cuMemFree`` synchronise the device), and the segments so given back;
the highest peak reserved bytes (device bytes held: PyTorch's ``total_allocated_memory``, or the
pool's ``peak_reserved_bytes``); segments taken from the device; for the pool, where its
allocations came from (same stream, completed event, stream wait, new segment), per phase;
``rounds``: the replays' length.

Run (the committed results):
    python experiments/late_path_flow.py --out experiments/results/<date>-late-path-flow/
At toy scale (what the test runs; a few seconds):
    python experiments/late_path_flow.py --toy --out /tmp/late-path-flow/
"""

from __future__ import annotations

import argparse
import bisect
from collections import deque
import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
from pathlib import Path
import platform
import subprocess
import sys
import time
from typing import Any
from typing import NamedTuple
import weakref

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_benchmark as gb

from waterwave_hpo.memory import AllocRecord
from waterwave_hpo.memory import FreeRecord
from waterwave_hpo.memory import PoolOutOfMemoryError
from waterwave_hpo.memory import SegmentRecord
from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory import SubmitRecord

ALLOCATORS = ("pool", "torch", "routed", "routed-slot")
MIB = 1 << 20

# PyTorch's constants (c10/cuda/CUDACachingAllocator.cpp).
K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_LARGE_BUFFER = 20 << 20
K_ROUND_LARGE = 2 << 20

#: Stream handles of the marker submits that date an attempt's end in the pool's trace.
_END_MARKER = 1 << 32


# -- one trial's allocation trace ------------------------------------------------------------------


class Event(NamedTuple):
    """One allocator call of a trial: ``nbytes > 0`` allocates ``tid``; ``nbytes == 0`` frees it."""

    tid: int
    nbytes: int


@dataclasses.dataclass
class Trace:
    """The ordered allocator calls of one trial, and what they add up to.

    Attributes:
        workload: The workload's name.
        steps: SGD steps the trial ran.
        events: Allocations and frees, in order; every allocation is freed.
        step_events: Events of one steady-state step (the last one).
        peak_allocated_bytes: Most bytes live at once (storage sizes, before any rounding).
        allocations: Number of allocations.
    """

    workload: str
    steps: int
    events: list[Event]
    step_events: int
    peak_allocated_bytes: int
    allocations: int


class _Recorder(TorchDispatchMode):
    """Every storage an ATen op creates is an allocation; its death (finalizer) is the free."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self._live: dict[int, int] = {}  # storage data_ptr -> tid
        self._ids = itertools.count(1)

    def _free(self, ptr: int, tid: int) -> None:
        if self._live.get(ptr) == tid:
            del self._live[ptr]
        self.events.append(Event(tid, 0))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self._live:  # a view, in place, or seen
                continue
            tid = next(self._ids)
            self._live[ptr] = tid
            self.events.append(Event(tid, nbytes))
            weakref.finalize(storage, self._free, ptr, tid)
        return out

    @property
    def live(self) -> int:
        return len(self._live)


def record_trace(wl: gb.WorkloadDef, steps: int, seed: int = 0) -> Trace:
    """Train one trial of ``wl`` on the CPU as ``gpu_benchmark.train_trial`` does; its events.

    Raises:
        RuntimeError: A storage the trial made outlived it (the trace would not be balanced).
    """
    torch.manual_seed(seed)
    model = gb.build_model(wl)  # built on the CPU, as on a GPU; .to(device) copies it below
    host_batches = gb.make_batches(wl, "cpu", seed=seed)
    recorder = _Recorder()
    marks: list[int] = []
    with recorder:
        with torch.no_grad():
            for t in itertools.chain(model.parameters(), model.buffers()):
                t.data = t.data.clone()  # model.to(device): one device copy per tensor
            del t  # the loop's name would keep the last parameter (and its gradient) alive
            batches = [(x.clone(), y.clone()) for x, y in host_batches]  # make_batches(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
        loss = None
        for step in range(steps):
            marks.append(len(recorder.events))
            x, y = batches[step % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
        marks.append(len(recorder.events))
        assert loss is not None
        float(loss.detach().item())
        del model, opt, batches, loss, x, y
        gc.collect()
    if recorder.live:
        raise RuntimeError(f"{recorder.live} storages of the {wl.name} trial outlived it")
    events = recorder.events
    live = peak = 0
    size: dict[int, int] = {}
    for ev in events:
        if ev.nbytes:
            size[ev.tid] = ev.nbytes
            live += ev.nbytes
            peak = max(peak, live)
        else:
            live -= size[ev.tid]
    return Trace(
        workload=wl.name,
        steps=steps,
        events=events,
        step_events=marks[-1] - marks[-2],
        peak_allocated_bytes=peak,
        allocations=len(size),
    )


# -- who freed which bytes last: the flow ----------------------------------------------------------


class FlowLedger:
    """For every byte of the device, the attempt that freed it last (while it is free).

    An allocation handed ``[addr, addr + size)`` counts the bytes another attempt freed last as
    flow, and as live flow when that attempt has not ended. Marks are kept by address and survive
    a segment's release and re-allocation (the same physical bytes).
    """

    def __init__(self, slot_of: dict[int, int]) -> None:
        self.slot_of = slot_of
        self._starts: list[int] = []
        self._spans: dict[int, tuple[int, int]] = {}  # start -> (end, attempt)
        self._ended: set[int] = set()
        self.handed_bytes = 0
        self.flow_bytes = 0
        self.flow_live_bytes = 0
        self.flow_cross_slot_bytes = 0

    def end(self, attempt: int) -> None:
        self._ended.add(attempt)

    def _cut(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """Removes the marks over ``[a, b)`` (trimming those that stick out); returns them."""
        starts, spans = self._starts, self._spans
        i = bisect.bisect_right(starts, a) - 1
        if i < 0 or spans[starts[i]][0] <= a:
            i += 1
        taken: list[tuple[int, int, int]] = []
        while i < len(starts) and starts[i] < b:
            s = starts[i]
            e, who = spans.pop(s)
            del starts[i]
            if s < a:
                spans[s] = (a, who)
                starts.insert(i, s)
                i += 1
            if e > b:
                spans[b] = (e, who)
                starts.insert(i, b)
                i += 1
            taken.append((max(s, a), min(e, b), who))
        return taken

    def freed(self, addr: int, size: int, attempt: int) -> None:
        self._cut(addr, addr + size)
        bisect.insort(self._starts, addr)
        self._spans[addr] = (addr + size, attempt)

    def handed(self, addr: int, size: int, attempt: int) -> None:
        self.handed_bytes += size
        for s, e, who in self._cut(addr, addr + size):
            if who == attempt:
                continue
            self.flow_bytes += e - s
            if who not in self._ended:
                self.flow_live_bytes += e - s
            if self.slot_of[who] != self.slot_of[attempt]:
                self.flow_cross_slot_bytes += e - s

    def counts(self) -> dict[str, int]:
        return {
            "handed_bytes": self.handed_bytes,
            "flow_bytes": self.flow_bytes,
            "flow_live_bytes": self.flow_live_bytes,
            "flow_cross_slot_bytes": self.flow_cross_slot_bytes,
        }


# -- the attempts the replay runs ------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Attempt:
    """One run of a trial's parameters on a slot (a re-run after OOM is a new attempt)."""

    aid: int
    trial: int
    number: int  # 0 for the first run, 1 for the first re-run, ...
    slot: int
    pos: int = 0

    @property
    def stream(self) -> int:
        return self.slot + 1  # stream 0 is the default stream, which no slot uses


class Replayed:
    """What the replay asks of an allocator under test."""

    name = ""

    def begin(self, a: Attempt) -> None:
        """The attempt starts on its slot (its account opens, its route begins)."""

    def malloc(self, a: Attempt, tid: int, nbytes: int) -> bool:
        """Allocates for ``a``; False when out of memory (nothing changed)."""
        raise NotImplementedError

    def free(self, a: Attempt, tid: int) -> None:
        raise NotImplementedError

    def release_all(self, a: Attempt) -> None:
        """Frees what ``a`` still holds (its OOM unwound), latest first."""
        raise NotImplementedError

    def end(self, a: Attempt) -> None:
        """The attempt ended (its account closes, its route ends)."""

    def after_oom(self) -> None:
        """The executor's ``torch.cuda.empty_cache()`` after an OOM."""

    def gpu(self, slot: int) -> None:
        """One unit of the slot's GPU work was queued."""

    def finish(self) -> None:
        """The study ended."""

    def metrics(self, ledger: FlowLedger) -> dict[str, Any]:
        """The allocator's counts and the flow (``ledger``'s, unless it keeps its own)."""
        raise NotImplementedError

    def close(self) -> None:
        """Frees what the allocator under test holds (a sim pool's arena)."""


def _pool_trace_summary(
    pool: StreamAwarePool, ledger: FlowLedger | None, attempt_of: dict[int, int]
) -> dict[str, int]:
    """Segment moves and release passes from the pool's trace; with ``ledger``, its flow.

    The releases of one pass (``cuMemFree`` calls with no allocation or free between them)
    synchronise the device once.
    """
    passes = seg_allocs = seg_frees = 0
    in_pass = False
    for rec in pool.sim.trace():
        if isinstance(rec, SegmentRecord):
            if rec.released:
                seg_frees += 1
                passes += not in_pass
                in_pass = True
            else:
                seg_allocs += 1
            continue
        if isinstance(rec, AllocRecord | FreeRecord):
            in_pass = False
        if ledger is None:
            continue
        if isinstance(rec, AllocRecord):
            assert rec.account_id is not None
            ledger.handed(rec.ptr, rec.size_bytes, attempt_of[rec.account_id])
        elif isinstance(rec, FreeRecord):
            assert rec.account_id is not None
            ledger.freed(rec.ptr, rec.size_bytes, attempt_of[rec.account_id])
        elif isinstance(rec, SubmitRecord) and rec.stream >= _END_MARKER:
            ledger.end(rec.stream - _END_MARKER)
    return {"device_syncs": passes, "segment_allocs": seg_allocs, "segment_frees": seg_frees}


class _SimGpu:
    """The simulated GPU behind a sim pool: a slot's stream completes every ``lag`` events."""

    def __init__(self, pool: StreamAwarePool, lag: int) -> None:
        self._pool = pool
        self._lag = lag
        self._queued: dict[int, int] = {}

    def queue(self, stream: int) -> None:
        self._pool.sim.submit(stream)
        n = self._queued.get(stream, 0) + 1
        if n >= self._lag:
            self._pool.sim.finish(stream)
            n = 0
        self._queued[stream] = n


class PoolReplay(Replayed):
    """The stream-aware pool as PyTorch's process-wide allocator."""

    name = "pool"

    def __init__(self, capacity_bytes: int, gpu_lag: int) -> None:
        self.pool = StreamAwarePool(capacity_bytes=capacity_bytes, backend="sim")
        self.capacity = capacity_bytes
        self._gpu = _SimGpu(self.pool, gpu_lag)
        self._accounts: dict[int, Any] = {}
        self._attempt_of: dict[int, int] = {}  # account id -> attempt id
        self._live: dict[int, dict[int, int]] = {}  # attempt -> tid -> ptr
        self.ooms = 0
        self.oom_free_bytes = 0  # summed over OOMs: capacity not in live blocks

    def begin(self, a: Attempt) -> None:
        account = self.pool.open_account(f"attempt {a.aid}", streams=(a.stream,))
        self._accounts[a.aid] = account
        self._attempt_of[account.id] = a.aid
        self._live[a.aid] = {}

    def malloc(self, a: Attempt, tid: int, nbytes: int) -> bool:
        try:
            self._live[a.aid][tid] = self.pool.allocate(nbytes, a.stream)
        except PoolOutOfMemoryError:
            self.ooms += 1
            self.oom_free_bytes += self.capacity - self.pool.stats().allocated_bytes
            return False
        return True

    def free(self, a: Attempt, tid: int) -> None:
        self.pool.free(self._live[a.aid].pop(tid))

    def release_all(self, a: Attempt) -> None:
        live = self._live[a.aid]
        for tid in reversed(list(live)):
            self.pool.free(live.pop(tid))

    def end(self, a: Attempt) -> None:
        self._accounts.pop(a.aid).close()
        del self._live[a.aid]
        self.pool.sim.submit(_END_MARKER + a.aid)  # dates the end in the trace (the ledger's)

    def after_oom(self) -> None:
        self.pool.release_cached_when_idle()  # what empty_cache() does under the pool

    def gpu(self, slot: int) -> None:
        self._gpu.queue(slot + 1)

    def metrics(self, ledger: FlowLedger) -> dict[str, Any]:
        # The flow is read from the pool's own trace (which block went where), in trace order;
        # the replay's ledger has seen every attempt end by now, so a fresh one is used.
        own = FlowLedger(ledger.slot_of)
        s = self.pool.stats()
        out = _pool_trace_summary(self.pool, own, self._attempt_of)
        out.update(own.counts())
        out.update(
            peak_reserved_bytes=s.peak_reserved_bytes,
            sync_calls=None,
            oom_free_bytes=self.oom_free_bytes,
            sources={
                "same_stream": s.same_stream,
                "completed_event": s.completed_event,
                "stream_wait": s.stream_wait,
                "new_segment": s.new_segment,
                "stream_waits_issued": s.stream_waits_issued,
            },
        )
        return out

    def close(self) -> None:
        self.pool.close()


# -- PyTorch's caching allocator (see the module docstring for the source) -------------------------


def torch_round_size(nbytes: int) -> int:
    """``round_size``: at least 512 bytes, a multiple of 512 (no power-of-two divisions)."""
    if nbytes < K_MIN_BLOCK:
        return K_MIN_BLOCK
    return K_MIN_BLOCK * ((nbytes + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def torch_allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a request of ``size`` (rounded) bytes makes."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


@dataclasses.dataclass(eq=False)
class _Block:
    addr: int
    size: int
    stream: int
    pool: _BlockPool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


class _BlockPool:
    """``BlockPool``: free blocks ordered by (stream, size, address), ``BlockComparatorSize``."""

    def __init__(self, is_small: bool, owner: _PrivatePool | None = None) -> None:
        self.is_small = is_small
        self.owner = owner
        self._keys: list[tuple[int, int, int]] = []
        self._blocks: dict[tuple[int, int, int], _Block] = {}

    def insert(self, b: _Block) -> None:
        key = (b.stream, b.size, b.addr)
        bisect.insort(self._keys, key)
        self._blocks[key] = b

    def remove(self, b: _Block) -> None:
        key = (b.stream, b.size, b.addr)
        del self._keys[bisect.bisect_left(self._keys, key)]
        del self._blocks[key]

    def take_best_fit(self, stream: int, size: int) -> _Block | None:
        """``get_free_block``: the smallest free block of ``stream`` of at least ``size``."""
        i = bisect.bisect_left(self._keys, (stream, size, -1))
        if i == len(self._keys) or self._keys[i][0] != stream:
            return None
        block = self._blocks.pop(self._keys.pop(i))
        return block

    def free_blocks(self) -> list[_Block]:
        return list(self._blocks.values())


class _PrivatePool:
    """``PrivatePool``: a graph's (here a route's) own small and large pools."""

    def __init__(self) -> None:
        self.large = _BlockPool(False, self)
        self.small = _BlockPool(True, self)
        self.use_count = 1
        self.segments = 0  # cudaMalloc_count


class _DriverUpstream:
    """``cudaMalloc``/``cudaFree`` over one address range, first fit; each free syncs."""

    synchronising = True

    def __init__(self) -> None:
        self._free: list[tuple[int, int]] = [(1 << 40, 1 << 46)]  # (address, size), by address

    def alloc(self, size: int, stream: int) -> int | None:
        for i, (addr, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    del self._free[i]
                else:
                    self._free[i] = (addr + size, n - size)
                return addr
        return None  # pragma: no cover - 64 TiB of addresses

    def free(self, addr: int, size: int) -> None:
        i = bisect.bisect_left(self._free, (addr, 0))
        self._free.insert(i, (addr, size))
        if i + 1 < len(self._free) and addr + size == self._free[i + 1][0]:
            self._free[i] = (addr, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == addr:
            prev = self._free[i - 1]
            self._free[i - 1] = (prev[0], prev[1] + self._free.pop(i)[1])


class _PoolUpstream:
    """Segments from the stream-aware pool (``CUDAPluggableAllocator`` over its shim)."""

    synchronising = False  # a segment given back is cached by the pool, not cudaFree'd

    def __init__(self, pool: StreamAwarePool) -> None:
        self.pool = pool

    def alloc(self, size: int, stream: int) -> int | None:
        try:
            return self.pool.allocate(size, stream)
        except PoolOutOfMemoryError:
            return None

    def free(self, addr: int, size: int) -> None:
        self.pool.free(addr)


class CachingModel(Replayed):
    """PyTorch's caching allocator, optionally with streams routed to private pools.

    Args:
        routing: ``"none"`` (PyTorch's own pools), ``"trial"`` (a private pool per attempt) or
            ``"slot"`` (a private pool per slot stream, ended at the study's end).
        capacity_bytes: The device bytes: the fraction's bound (``"none"``) or the pool's
            capacity (routed).
        ledger: Where handed and freed blocks are marked.
        running: The attempts running now (the replay's).
        gpu_lag: The simulated GPU's lag (routed: the pool's streams).
    """

    def __init__(self, routing: str, capacity_bytes: int, ledger: FlowLedger, gpu_lag: int) -> None:
        self.name = {"none": "torch", "trial": "routed", "slot": "routed-slot"}[routing]
        self.routing = routing
        self.ledger = ledger
        self.pool: StreamAwarePool | None = None
        self._gpu: _SimGpu | None = None
        self._accounts: dict[int, Any] = {}
        self.upstream: _DriverUpstream | _PoolUpstream
        if routing == "none":
            self.allowed: int | None = capacity_bytes  # set_per_process_memory_fraction
            self.upstream = _DriverUpstream()
        else:
            self.allowed = None  # the fraction is not set; the pool bounds the segments
            self.pool = StreamAwarePool(capacity_bytes=capacity_bytes, backend="sim")
            self._gpu = _SimGpu(self.pool, gpu_lag)
            self.upstream = _PoolUpstream(self.pool)
        self.large = _BlockPool(False)
        self.small = _BlockPool(True)
        self.private: dict[int, _PrivatePool] = {}  # route key (attempt or slot) -> pool
        self.freeable: list[_PrivatePool] = []
        self.routes_open = 0  # len(captures_underway)
        self._live: dict[int, dict[int, _Block]] = {}
        self.capacity = capacity_bytes
        self.total = 0  # total_allocated_memory
        self.allocated = 0  # bytes in live blocks
        self.oom_free_bytes = 0  # summed over OOMs: capacity not in live blocks
        self.peak = 0
        self.segment_allocs = 0  # num_device_alloc
        self.segment_frees = 0  # num_device_free
        self.sync_calls = 0  # num_sync_all_streams
        self.release_passes = 0  # release_cached_blocks calls that gave a segment back
        self.ooms = 0

    # -- routes ----------------------------------------------------------------------------------

    def _route_key(self, a: Attempt) -> int:
        return a.aid if self.routing == "trial" else a.slot

    def begin(self, a: Attempt) -> None:
        self._live[a.aid] = {}
        if self.pool is not None:
            self._accounts[a.aid] = self.pool.open_account(f"attempt {a.aid}", streams=(a.stream,))
        if self.routing == "trial" or (self.routing == "slot" and a.slot not in self.private):
            self.private[self._route_key(a)] = _PrivatePool()  # MemPool(allocator)
            self.routes_open += 1  # beginAllocateToPool

    def end(self, a: Attempt) -> None:
        del self._live[a.aid]
        if self.pool is not None:
            self._accounts.pop(a.aid).close()
        if self.routing == "trial":
            self._end_route(self.private[a.aid])

    def _end_route(self, pp: _PrivatePool) -> None:
        self.routes_open -= 1  # endAllocateToPool
        pp.use_count -= 1  # releasePool: freeable at 0
        self.freeable.append(pp)
        if self.routes_open == 0:
            self._release_cached_blocks()  # ~MemPool's emptyCache, allowed only now

    def finish(self) -> None:
        if self.routing == "slot":
            for pp in list(self.private.values()):
                self._end_route(pp)

    def after_oom(self) -> None:
        if self.routes_open == 0:  # else synchronize_and_free_events asserts; suppressed
            self._release_cached_blocks()

    def gpu(self, slot: int) -> None:
        if self._gpu is not None:
            self._gpu.queue(slot + 1)

    # -- malloc and free -------------------------------------------------------------------------

    def _pool_for(self, a: Attempt, size: int) -> _BlockPool:
        if self.routing == "none":
            return self.small if size <= K_SMALL_SIZE else self.large
        pp = self.private[self._route_key(a)]
        return pp.small if size <= K_SMALL_SIZE else pp.large

    def _alloc_block(self, pool: _BlockPool, stream: int, alloc_size: int) -> _Block | None:
        if self.allowed is not None and self.total + alloc_size > self.allowed:
            return None
        addr = self.upstream.alloc(alloc_size, stream)
        if addr is None:
            return None
        self.total += alloc_size
        self.peak = max(self.peak, self.total)
        self.segment_allocs += 1
        if pool.owner is not None:
            pool.owner.segments += 1
        return _Block(addr, alloc_size, stream, pool)

    def malloc(self, a: Attempt, tid: int, nbytes: int) -> bool:
        size = torch_round_size(nbytes)
        pool = self._pool_for(a, size)
        block = pool.take_best_fit(a.stream, size)
        if block is None:
            alloc_size = torch_allocation_size(size)
            block = self._alloc_block(pool, a.stream, alloc_size)
            # release_available_cached_blocks: False with max_split_size unset (the default).
            if block is None and self.routes_open == 0:  # captures_underway.empty()
                self._release_cached_blocks()
                block = self._alloc_block(pool, a.stream, alloc_size)
            if block is None:
                self.ooms += 1
                self.oom_free_bytes += self.capacity - self.allocated
                return False
        remaining = block.size - size
        split = remaining >= K_MIN_BLOCK if pool.is_small else remaining > K_SMALL_SIZE
        if split:  # alloc_found_block: hand out the front, keep the rest free
            rest = _Block(
                block.addr + size, remaining, block.stream, pool, False, block, block.next
            )
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.insert(rest)
        block.allocated = True
        self.allocated += block.size
        self._live[a.aid][tid] = block
        self.ledger.handed(block.addr, block.size, a.aid)
        return True

    def _free_block(self, block: _Block, a: Attempt) -> None:
        self.ledger.freed(block.addr, block.size, a.aid)
        block.allocated = False
        self.allocated -= block.size
        pool = block.pool
        for nb in (block.prev, block.next):  # try_merge_blocks
            if nb is None or nb.allocated:
                continue
            pool.remove(nb)
            if nb is block.prev:
                block.addr = nb.addr
                block.prev = nb.prev
                if nb.prev is not None:
                    nb.prev.next = block
            else:
                block.next = nb.next
                if nb.next is not None:
                    nb.next.prev = block
            block.size += nb.size
        pool.insert(block)

    def free(self, a: Attempt, tid: int) -> None:
        self._free_block(self._live[a.aid].pop(tid), a)

    def release_all(self, a: Attempt) -> None:
        live = self._live[a.aid]
        for tid in reversed(list(live)):
            self._free_block(live.pop(tid), a)

    # -- the failure path --------------------------------------------------------------------------

    def _release_blocks(self, pool: _BlockPool) -> int:
        n = 0
        for b in pool.free_blocks():
            if b.prev is None and b.next is None:  # a whole segment, free
                pool.remove(b)
                self.upstream.free(b.addr, b.size)
                self.total -= b.size
                self.segment_frees += 1
                if pool.owner is not None:
                    pool.owner.segments -= 1
                n += 1
        return n

    def _release_cached_blocks(self) -> None:
        self.sync_calls += 1  # synchronize_and_free_events (no record_stream events here)
        n = self._release_blocks(self.large) + self._release_blocks(self.small)
        for pp in list(self.freeable):
            n += self._release_blocks(pp.small) + self._release_blocks(pp.large)
            if pp.segments == 0:
                self.freeable.remove(pp)
                for key, value in list(self.private.items()):
                    if value is pp:
                        del self.private[key]
        self.release_passes += n > 0

    def metrics(self, ledger: FlowLedger) -> dict[str, Any]:
        if self.pool is None:
            out: dict[str, Any] = {
                "device_syncs": self.release_passes,
                "segment_allocs": self.segment_allocs,
                "segment_frees": self.segment_frees,
                "peak_reserved_bytes": self.peak,
            }
        else:  # the device's segments are the pool's
            out = _pool_trace_summary(self.pool, None, {})
            out["peak_reserved_bytes"] = self.pool.stats().peak_reserved_bytes
            out["private_segment_allocs"] = self.segment_allocs
            out["private_segment_frees"] = self.segment_frees
        out["sync_calls"] = self.sync_calls
        out["oom_free_bytes"] = self.oom_free_bytes
        out["sources"] = None
        out.update(ledger.counts())
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


# -- the replay: K slots, the executor's rules -----------------------------------------------------


@dataclasses.dataclass
class RunCounts:
    """What one replay of ``trials`` trials over K slots came to."""

    trials: int
    completed: int = 0
    failed: int = 0
    oom_attempts: int = 0
    attempts: int = 0
    rounds: int = 0


def make_allocator(name: str, capacity_bytes: int, ledger: FlowLedger, gpu_lag: int) -> Replayed:
    """The allocator under test called ``name`` (one of :data:`ALLOCATORS`)."""
    if name == "pool":
        return PoolReplay(capacity_bytes, gpu_lag)
    routing = {"torch": "none", "routed": "trial", "routed-slot": "slot"}[name]
    return CachingModel(routing, capacity_bytes, ledger, gpu_lag)


def replay(
    trace: Trace,
    allocator: str,
    *,
    capacity_bytes: int,
    trials: int,
    k: int,
    max_oom_retries: int = 2,
    gpu_lag: int = 8,
    spread: float = 1.0,
) -> dict[str, Any]:
    """Replays ``trials`` trials of ``trace`` over ``k`` slots on ``allocator``; their counts.

    Slot ``s`` opens ``s * spread / k`` of a steady step late (``spread`` 1: the slots' first
    trials are spread over one step).
    """
    slot_of: dict[int, int] = {}
    ledger = FlowLedger(slot_of)
    alloc = make_allocator(allocator, capacity_bytes, ledger, gpu_lag)
    events = trace.events
    open_at = [int(s * spread * trace.step_events / k) for s in range(k)]
    fresh = deque(range(trials))
    retries: deque[tuple[int, int, int]] = deque()  # (trial, attempt number, most running)
    slots: list[Attempt | None] = [None] * k
    ids = itertools.count()
    counts = RunCounts(trials)

    def start(slot: int, trial: int, number: int) -> None:
        a = Attempt(next(ids), trial, number, slot)
        slot_of[a.aid] = slot
        slots[slot] = a
        counts.attempts += 1
        alloc.begin(a)

    def stop(a: Attempt) -> None:
        alloc.end(a)
        ledger.end(a.aid)
        slots[a.slot] = None

    rnd = 0
    while fresh or retries or any(s is not None for s in slots):
        for s in range(k):  # the executor's dispatch: a pending re-run first, fresh ones behind
            if slots[s] is not None or rnd < open_at[s]:
                continue
            running = sum(x is not None for x in slots)
            if retries:
                trial, number, most = retries[0]
                if running > most:
                    break
                retries.popleft()
                start(s, trial, number)
            elif fresh:
                start(s, fresh.popleft(), 0)
        for s in range(k):
            a = slots[s]
            if a is None:
                continue
            ev = events[a.pos]
            alloc.gpu(s)
            if ev.nbytes:
                if not alloc.malloc(a, ev.tid, ev.nbytes):
                    neighbours = sum(x is not None for x in slots) - 1
                    counts.oom_attempts += 1
                    # host/_attempt.py: the traceback's tensors are freed and empty_cache()
                    # runs (release_memory) before the attempt's account and route close.
                    alloc.release_all(a)
                    alloc.after_oom()
                    stop(a)
                    if neighbours > 0 and a.number < max_oom_retries:
                        retries.append((a.trial, a.number + 1, max(0, neighbours - 1)))
                    else:
                        counts.failed += 1
                    continue
            else:
                alloc.free(a, ev.tid)
            a.pos += 1
            if a.pos == len(events):
                counts.completed += 1
                stop(a)
        rnd += 1
    alloc.finish()
    counts.rounds = rnd
    out: dict[str, Any] = dataclasses.asdict(counts)
    out.update(alloc.metrics(ledger))
    alloc.close()
    return out


def smallest_capacity(
    trace: Trace,
    allocator: str,
    solo_peak_bytes: int,
    *,
    k: int,
    trials: int,
    phases: int,
    resolution: float,
    max_oom_retries: int = 2,
    gpu_lag: int = 8,
) -> float | None:
    """The least capacity, in solo peaks, at which no replay of any phase runs out of memory.

    Bisection over multiples of ``resolution`` in ``(0, trials + 1]``; it assumes that more
    capacity never adds an OOM (not checked at every point). None: ``trials + 1`` solo peaks
    do not suffice.
    """

    def fits(i: int) -> bool:
        capacity = int(i * resolution * solo_peak_bytes)
        return all(
            replay(
                trace,
                allocator,
                capacity_bytes=capacity,
                trials=trials,
                k=k,
                max_oom_retries=max_oom_retries,
                gpu_lag=gpu_lag,
                spread=(j + 1) / phases,
            )["oom_attempts"]
            == 0
            for j in range(phases)
        )

    lo, hi = 0, math.ceil((trials + 1) / resolution)
    if not fits(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi * resolution


# -- the run ---------------------------------------------------------------------------------------


def capacity_factor(token: str, k: int) -> tuple[str, float]:
    """A capacity in solo peaks: ``"light"`` is K + 1, ``"<x>K"`` is x times K, else a number.

    Raises:
        ValueError: ``token`` is none of these, or not positive.
    """
    if token == "light":
        return f"light ({k + 1})", float(k + 1)
    try:
        factor = float(token[:-1]) * k if token.endswith("K") else float(token)
    except ValueError:
        factor = math.nan
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(
            f"The capacity factor {token!r} is neither 'light', a positive number of solo "
            "peaks (2.5) nor a positive multiple of K (0.75K)."
        )
    label = token if not token.endswith("K") else f"{token} ({factor:g})"
    return label, factor


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _git(*args: str) -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _meta(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import optuna

    import waterwave_hpo

    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": "python experiments/late_path_flow.py " + " ".join(argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, CPU only",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "optuna": optuna.__version__,
        "waterwave_hpo": getattr(waterwave_hpo, "__version__", "unknown"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "load_start": _load(),
        "args": vars(args),
    }


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Records the traces, replays every configuration; the results (``results.json``)."""
    meta = _meta(args, argv)
    if args.toy:
        wls = [gb.WorkloadDef("small-cnn", 32, 32, 16)]
    else:
        wls = [w for w in gb.workloads(False) if w.name in args.workloads]
    workloads: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for wl in wls:
        t0 = time.time()
        trace = record_trace(wl, args.steps)
        roomy = max(1 << 30, 16 * trace.peak_allocated_bytes)  # no capacity binds one trial

        def solo_peak(name: str, trace: Trace = trace, roomy: int = roomy) -> int:
            return int(
                replay(trace, name, capacity_bytes=roomy, trials=1, k=1)["peak_reserved_bytes"]
            )

        solo = {name: solo_peak(name) for name in args.allocators}
        base = solo["torch"] if "torch" in solo else solo_peak("torch")
        workloads[wl.name] = {
            "workload": dataclasses.asdict(wl),
            "steps": trace.steps,
            "events": len(trace.events),
            "allocations": trace.allocations,
            "step_events": trace.step_events,
            "peak_allocated_bytes": trace.peak_allocated_bytes,
            "solo_peak_reserved_bytes": base,
            "solo_peak_reserved_bytes_by_allocator": solo,
            "record_s": round(time.time() - t0, 1),
        }
        print(
            f"{wl.name}: {len(trace.events)} events ({trace.allocations} allocations, "
            f"{trace.step_events} a step), peak allocated {trace.peak_allocated_bytes / MIB:.1f} "
            f"MiB, solo peak reserved {base / MIB:.1f} MiB",
            flush=True,
        )
        for k in args.ks:
            for label, factor in (capacity_factor(f, k) for f in args.factors):
                capacity = int(factor * base)
                for name in args.allocators:
                    t1 = time.time()
                    runs = [
                        replay(
                            trace,
                            name,
                            capacity_bytes=capacity,
                            trials=args.trials,
                            k=k,
                            max_oom_retries=args.max_oom_retries,
                            gpu_lag=args.gpu_lag,
                            spread=(j + 1) / args.phases,
                        )
                        for j in range(args.phases)
                    ]
                    row = {
                        "workload": wl.name,
                        "k": k,
                        "capacity": label,
                        "factor": factor,
                        "capacity_bytes": capacity,
                        "allocator": name,
                        **aggregate(runs),
                        "replay_s": round(time.time() - t1, 2),
                        "phases": runs,
                    }
                    rows.append(row)
                    print(_row_line(row), flush=True)
            if args.resolution > 0:
                least = workloads[wl.name].setdefault("smallest_capacity", {})[f"K={k}"] = {}
                for name in args.allocators:
                    least[name] = smallest_capacity(
                        trace,
                        name,
                        base,
                        k=k,
                        trials=args.trials,
                        phases=args.phases,
                        resolution=args.resolution,
                        max_oom_retries=args.max_oom_retries,
                        gpu_lag=args.gpu_lag,
                    )
                print(f"  {wl.name} K={k}: least capacity without an OOM (solo peaks): {least}")
    meta["load_end"] = _load()
    return {"meta": meta, "workloads": workloads, "rows": rows}


#: Counts that add up over a row's phases; the rest is a maximum (peaks) or kept per phase.
_SUMMED = (
    "trials",
    "completed",
    "failed",
    "oom_attempts",
    "attempts",
    "rounds",
    "device_syncs",
    "segment_allocs",
    "segment_frees",
    "handed_bytes",
    "flow_bytes",
    "flow_live_bytes",
    "flow_cross_slot_bytes",
    "oom_free_bytes",
)


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row's replays (one per phase) summed; peaks are the highest; completed per phase."""
    out: dict[str, Any] = {key: sum(int(r[key]) for r in runs) for key in _SUMMED}
    out["completed_by_phase"] = [r["completed"] for r in runs]
    ooms = out["oom_attempts"]
    out["oom_free_bytes_mean"] = out.pop("oom_free_bytes") // ooms if ooms else None
    out["peak_reserved_bytes"] = max(int(r["peak_reserved_bytes"]) for r in runs)
    calls = [r["sync_calls"] for r in runs]
    out["sync_calls"] = None if None in calls else sum(calls)
    return out


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.0f}"


def _row_line(r: dict[str, Any]) -> str:
    return (
        f"  {r['workload']} K={r['k']} C={r['capacity']:<9} {r['allocator']:<11} "
        f"done {r['completed']:>2}/{r['trials']} {r['completed_by_phase']} "
        f"fail {r['failed']:>2} oom {r['oom_attempts']:>2} "
        f"flow {_mib(r['flow_cross_slot_bytes'])} MiB (live {_mib(r['flow_live_bytes'])}) "
        f"syncs {r['device_syncs']} peak {_mib(r['peak_reserved_bytes'])} MiB "
        f"segs {r['segment_allocs']} rounds {r['rounds']} ({r['replay_s']} s)"
    )


def table(results: dict[str, Any]) -> str:
    """The results as one markdown table, a block per workload."""
    lines = []
    for name, w in results["workloads"].items():
        lines += [
            "",
            f"**{name}**: {w['events']} events a trial ({w['allocations']} allocations, "
            f"{w['steps']} steps, {w['step_events']} events a step); peak allocated "
            f"{_mib(w['peak_allocated_bytes'])} MiB; solo peak reserved on PyTorch's allocator "
            f"{_mib(w['solo_peak_reserved_bytes'])} MiB (by allocator: "
            + ", ".join(
                f"{a} {_mib(v)}" for a, v in w["solo_peak_reserved_bytes_by_allocator"].items()
            )
            + ").",
            "",
        ]
        least = w.get("smallest_capacity")
        if least:
            names = list(next(iter(least.values())))
            lines += [
                "Least capacity at which no attempt runs out of memory, in solo peaks (bisection, "
                f"every phase; {results['meta']['args']['resolution']} resolution; '>' : more "
                f"than trials + 1):",
                "",
                "| K | " + " | ".join(names) + " |",
                "|---|" + "---|" * len(names),
            ]
            for k_label, by in least.items():
                cells = [
                    f">{results['meta']['args']['trials'] + 1}" if v is None else f"{v:g}"
                    for v in by.values()
                ]
                lines.append(f"| {k_label[2:]} | " + " | ".join(cells) + " |")
            lines.append("")
        lines += [
            "| K | capacity (solo peaks) | allocator | completed (by phase) | failed | "
            "OOM attempts | free at an OOM MiB | flow from other slots MiB | of it live MiB | "
            "device syncs (segments freed) | peak reserved MiB | segments from device | rounds |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["rows"]:
            if r["workload"] != name:
                continue
            lines.append(
                f"| {r['k']} | {r['capacity']} = {_mib(r['capacity_bytes'])} MiB | "
                f"{r['allocator']} | {r['completed']}/{r['trials']} "
                f"({', '.join(map(str, r['completed_by_phase']))}) | {r['failed']} | "
                f"{r['oom_attempts']} | {_mib(r['oom_free_bytes_mean'])} | "
                f"{_mib(r['flow_cross_slot_bytes'])} | "
                f"{_mib(r['flow_live_bytes'])} | "
                f"{r['device_syncs']} ({r['segment_frees']}) | {_mib(r['peak_reserved_bytes'])} | "
                f"{r['segment_allocs']} | {r['rounds']} |"
            )
    return "\n".join(lines) + "\n"


def readme(results: dict[str, Any]) -> str:
    """The results folder's README: what ran, where, and the table."""
    m = results["meta"]
    return (
        "# Memory flow between co-hosted trials on the late path "
        f"({m['date_utc'][:10]})\n\n"
        "`experiments/late_path_flow.py` (its docstring says what is replayed, the model of "
        "PyTorch's caching allocator and its sources, and the simplifications): allocation "
        "traces of the GPU benchmark's trials, recorded on the CPU, replayed over K slots under "
        "a capacity through the stream-aware pool (`sim` backend), a model of PyTorch's caching "
        "allocator, and that model with each trial's stream routed to a private pool "
        "(`routed`: one per trial; `routed-slot`: one per slot, all ended at the end). "
        "**Counts, not times; no GPU ran.**\n\n"
        f"- Machine: {m['machine']} ({m['platform']}); load average at start {m['load_start']}, "
        f"at end {m['load_end']}.\n"
        f"- Versions: Python {m['python']}, torch {m['torch']}, Optuna {m['optuna']}, "
        f"waterwave-hpo {m['waterwave_hpo']} at {m['git_commit']}.\n"
        f"- Command: `{m['command']}`\n\n"
        f"Each row sums {m['args']['phases']} replays of {m['args']['trials']} trials (the "
        "slots' starts spread over 1/P, 2/P, ..., 1 of a step). Columns: *free at an OOM*: the "
        "capacity not in live blocks when an allocation failed, averaged (large: fragmentation "
        "or cached blocks out of reach; small: the trials' live bytes did not fit); *flow from "
        "other slots*: bytes handed to a trial's attempt that an attempt on another slot freed "
        "last (`results.json` also has `flow_bytes`, which counts the slot's own earlier trials "
        "too); *live*: of those, bytes freed by an attempt still running (memory moving between "
        "co-hosted trials); *device syncs*: release passes that gave segments back to the "
        "driver (`cudaFree`/`cuMemFree` synchronise the device), with the segments freed; "
        "*rounds*: the replays' length in rounds of one event per running slot (not time).\n"
        + table(results)
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results.json, README.md")
    p.add_argument("--workloads", nargs="+", default=["small-cnn", "resnet"])
    p.add_argument("--steps", type=int, default=20, help="SGD steps a trial trains")
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--ks", type=int, nargs="+", default=[4, 8])
    p.add_argument(
        "--factors",
        nargs="+",
        default=["1.5", "2.5", "0.75K", "light"],
        help="capacities in solo peaks: a number, a multiple of K (0.75K), 'light' (K + 1)",
    )
    p.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=ALLOCATORS)
    p.add_argument("--max-oom-retries", type=int, default=2)
    p.add_argument("--gpu-lag", type=int, default=8, help="events a stream's GPU work lags")
    p.add_argument(
        "--resolution",
        type=float,
        default=0.25,
        help="grid (solo peaks) of the search for the least capacity without an OOM; 0: none",
    )
    p.add_argument(
        "--phases",
        type=int,
        default=3,
        help="replays per row, the slots' starts spread over 1/P, 2/P, ... 1 of a step",
    )
    p.add_argument("--toy", action="store_true", help="a tiny CNN, 3 steps, 6 trials, K=2")
    args = p.parse_args(argv)
    if min(args.steps, args.trials, *args.ks, args.gpu_lag, args.phases) < 1:
        p.error("--steps, --trials, --ks, --gpu-lag and --phases must be >= 1")
    if args.toy:
        args.steps, args.trials, args.ks = min(args.steps, 3), min(args.trials, 6), [2]
    for f in args.factors:
        try:
            capacity_factor(f, 1)
        except ValueError as error:
            p.error(f"--factors: {error}")
    results = run(args, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (args.out / "README.md").write_text(readme(results))
    print(f"wrote {args.out / 'results.json'} and {args.out / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
