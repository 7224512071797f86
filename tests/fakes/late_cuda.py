"""A fake CUDA device on which side-stream work lands *late*, as it does on a GPU.

The older fakes complete every copy and event at once, which hides the class of bug where code
assumes a copy has landed because it was issued. Here:

- **The compute stream is the host.** CPU tensors stand for device tensors and CPU kernels run
  at once, so the current stream (``torch.cuda.current_stream()`` without a ``with
  torch.cuda.stream(side)``) is *eager*: its work is done when issued.
- **Side streams are late.** ``torch.cuda.Stream()`` makes a stream whose work (a
  ``copy_(..., non_blocking=True)`` issued under ``with torch.cuda.stream(side)``, a
  ``wait_stream``/``wait_event``) only queues: it runs when the test calls
  :meth:`FakeGpu.advance`, when something synchronises it (``stream.synchronize()``,
  ``event.synchronize()``), or when an eager stream waits on it (``compute.wait_event(ev)``:
  the compute stream cannot go on before it, and the compute stream is the host).
  ``event.query()`` is False until then. A copy reads its source when issued (what the GPU
  reads if nothing overwrote it; overwriting is what the hazard check below catches) and writes
  its destination when it runs.
- **Device memory.** Inside ``with gpu.memory():`` every tensor an op makes (a
  ``TorchDispatchMode``) is device memory, and so is every ``torch.empty``/``empty_like`` with
  a ``cuda`` device; such tensors report ``is_cuda`` and ``device == cuda:0`` (the real tensor
  stays on the CPU). ``pin_memory=True`` host buffers are host memory.
  :attr:`FakeGpu.allocated_bytes` / :attr:`FakeGpu.peak_bytes` count live device storages, as
  PyTorch's ``memory_allocated`` does.
- **Stream-ordered frees** (PyTorch's caching allocator, and the waterwave pool): a device
  block freed while queued work on another stream still reads or writes it is a **hazard**
  (the allocator may hand the block to anyone once the freeing stream's own work is done),
  unless that stream was recorded on it (``Tensor.record_stream``: the block is then held until
  that stream's work queued at the free completes) or the freeing stream had waited for the
  use. Hazards are listed in :attr:`FakeGpu.hazards`; a test asserts it stays empty.

Install with :func:`install` (a ``monkeypatch`` undoes it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Iterator
import contextlib
from dataclasses import dataclass
from dataclasses import field
import itertools
import threading
from typing import Any
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes
import torch.utils._pytree as pytree

CUDA0 = torch.device("cuda", 0)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class FakeStream:
    """A stream of the fake device: eager (the host's) or late (a side stream)."""

    _handles = itertools.count(0x2000)

    def __init__(self, gpu: FakeGpu, *, eager: bool) -> None:
        self.gpu = gpu
        self.eager = eager
        self.cuda_stream = next(self._handles)
        self.submitted = 0
        self.completed = 0
        self._ops: deque[tuple[int, Callable[[], None]]] = deque()
        #: For each other stream, how much of its work this stream's later work waits for.
        self.waited: dict[FakeStream, int] = {}

    def __repr__(self) -> str:
        kind = "eager" if self.eager else "late"
        return f"FakeStream({kind}, {self.completed}/{self.submitted} done)"

    def enqueue(self, op: Callable[[], None]) -> int:
        """Queue ``op`` (run at once on an eager stream); returns its sequence number."""
        with self.gpu.lock:
            self.submitted += 1
            seq = self.submitted
            self._ops.append((seq, op))
        if self.eager:
            self.complete_to(seq)
        return seq

    def complete_to(self, seq: int) -> None:
        """Run this stream's work up to ``seq`` (and what it waits for first)."""
        while True:
            with self.gpu.lock:
                if not self._ops or self._ops[0][0] > seq:
                    self.completed = max(self.completed, min(seq, self.submitted))
                    break
                done, op = self._ops.popleft()
            op()
            with self.gpu.lock:
                self.completed = max(self.completed, done)
        self.gpu._settle()

    # -- torch.cuda.Stream's API ---------------------------------------------------------------
    def wait_stream(self, other: Any) -> None:
        if isinstance(other, FakeStream) and other is not self:
            self._wait(other, other.submitted)

    def wait_event(self, event: Any) -> None:
        if isinstance(event, FakeEvent) and event.stream is not None and event.stream is not self:
            self._wait(event.stream, event.seq)

    def _wait(self, other: FakeStream, seq: int) -> None:
        with self.gpu.lock:
            self.waited[other] = max(self.waited.get(other, 0), seq)
        self.enqueue(lambda: other.complete_to(seq))

    def synchronize(self) -> None:
        self.complete_to(self.submitted)

    def query(self) -> bool:
        return self.completed >= self.submitted

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event


class FakeEvent:
    """``torch.cuda.Event``: completes when its stream's work up to the record has run."""

    gpu: FakeGpu  # set by install()

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.stream: FakeStream | None = None
        self.seq = 0

    def record(self, stream: Any = None) -> None:
        self.stream = stream if isinstance(stream, FakeStream) else self.gpu.current_stream()
        self.seq = self.stream.submitted

    def query(self) -> bool:
        return self.stream is None or self.stream.completed >= self.seq

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.complete_to(self.seq)

    def wait(self, stream: Any = None) -> None:
        target = stream if isinstance(stream, FakeStream) else self.gpu.current_stream()
        target.wait_event(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        return float(end.seq - self.seq)


@dataclass
class _Block:
    """One device storage: its size, the stream it was made on, and queued uses by others."""

    nbytes: int
    stream: FakeStream
    serial: int
    recorded: set[FakeStream] = field(default_factory=set)
    uses: list[tuple[FakeStream, int]] = field(default_factory=list)


@dataclass(frozen=True)
class Hazard:
    """A device block freed while queued work on another stream still used it."""

    nbytes: int
    stream: FakeStream
    use_seq: int
    completed: int

    def __str__(self) -> str:
        return (
            f"a {self.nbytes}-byte device block was freed while work {self.use_seq} of "
            f"{self.stream!r} still used it (the allocator may hand it to a neighbour)"
        )


class _DeviceAllocations(TorchDispatchMode):
    """Every tensor an op makes inside ``gpu.memory()`` is device memory."""

    def __init__(self, gpu: FakeGpu) -> None:
        super().__init__()
        self.gpu = gpu

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = {
            t.untyped_storage().data_ptr()
            for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.layout is torch.strided
        }
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                if t.untyped_storage().data_ptr() not in seen:  # not a view of an input
                    self.gpu.register(t)
        return out


class FakeGpu:
    """The fake device's state; see the module docstring."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.default_stream = FakeStream(self, eager=True)
        self.side_streams: list[FakeStream] = []
        self._local = threading.local()
        self._blocks: dict[int, _Block] = {}  # storage data_ptr -> live device block
        self._pending: list[tuple[_Block, dict[FakeStream, int]]] = []  # freed, held by streams
        self._serials = itertools.count(1)
        self.allocated_bytes = 0
        self.peak_bytes = 0
        #: Bytes freed by their owner but held for a recorded stream's queued work.
        self.held_bytes = 0
        self.hazards: list[Hazard] = []
        self.record_stream_calls = 0

    # -- streams -------------------------------------------------------------------------------
    def current_stream(self) -> FakeStream:
        stream: FakeStream | None = getattr(self._local, "stream", None)
        return stream if stream is not None else self.default_stream

    def new_side_stream(self) -> FakeStream:
        stream = FakeStream(self, eager=False)
        self.side_streams.append(stream)
        return stream

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        saved = getattr(self._local, "stream", None)
        self._local.stream = stream if isinstance(stream, FakeStream) else None
        try:
            yield
        finally:
            self._local.stream = saved

    def advance(self) -> None:
        """Let the device catch up: run every queued piece of work on every stream."""
        for stream in list(self.side_streams):
            stream.synchronize()

    # -- memory --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def memory(self) -> Iterator[None]:
        """Inside the block, every tensor an op makes is device memory."""
        with _DeviceAllocations(self):
            yield

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in (fake) device memory."""
        try:
            return t.untyped_storage().data_ptr() in self._blocks
        except (RuntimeError, NotImplementedError):
            return False

    def register(self, t: torch.Tensor) -> torch.Tensor:
        """Make ``t``'s storage device memory, allocated on the current stream."""
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return t
        with self.lock:
            if ptr in self._blocks:
                return t
            block = _Block(nbytes, self.current_stream(), next(self._serials))
            self._blocks[ptr] = block
            self.allocated_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        weakref.finalize(storage, self._free, ptr, block.serial)
        return t

    def forget(self, t: torch.Tensor) -> None:
        """``t`` is host memory after all (a pinned buffer)."""
        with self.lock:
            block = self._blocks.pop(t.untyped_storage().data_ptr(), None)
            if block is not None:
                self.allocated_bytes -= block.nbytes

    def block_of(self, t: torch.Tensor) -> _Block | None:
        return self._blocks.get(t.untyped_storage().data_ptr())

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """``Tensor.record_stream``: the block is held for ``stream``'s work at its free."""
        self.record_stream_calls += 1
        self.record_stream_ptr(t.untyped_storage().data_ptr(), stream)

    def record_stream_ptr(self, ptr: int, stream: Any) -> None:
        """``StreamAwarePool.record_stream(ptr, stream)``, as the pool's own API says it."""
        block = self._blocks.get(ptr)
        if block is None:
            raise ValueError(f"The ptr argument {ptr:#x}: not a live allocation of this pool.")
        if isinstance(stream, FakeStream):
            with self.lock:
                block.recorded.add(stream)

    def _free(self, ptr: int, serial: int) -> None:
        with self.lock:
            block = self._blocks.get(ptr)
            if block is None or block.serial != serial:
                return
            del self._blocks[ptr]
            self.allocated_bytes -= block.nbytes
            holds: dict[FakeStream, int] = {}
            for stream, seq in block.uses:
                if stream is block.stream or stream.completed >= seq:
                    continue  # stream order, or already done
                if block.stream.waited.get(stream, 0) >= seq:
                    continue  # the freeing stream waited for it: the free is ordered after it
                if stream in block.recorded:
                    holds[stream] = stream.submitted  # record_stream: held until this is done
                    continue
                self.hazards.append(Hazard(block.nbytes, stream, seq, stream.completed))
            if holds:
                self.held_bytes += block.nbytes
                self._pending.append((block, holds))

    def _settle(self) -> None:
        with self.lock:
            still = []
            for block, holds in self._pending:
                if all(s.completed >= seq for s, seq in holds.items()):
                    self.held_bytes -= block.nbytes
                else:
                    still.append((block, holds))
            self._pending = still

    # -- copies --------------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, real_copy: Any) -> torch.Tensor:
        """``dst.copy_(src, non_blocking=True)`` on the current stream: queued on a side one."""
        stream = self.current_stream()
        if stream.eager:
            return real_copy(dst, src)  # type: ignore[no-any-return]
        with _disable_current_modes():  # the fake's own snapshot is no device memory
            value = src.detach().clone() if self.owns(src) else src  # device: read when issued
        dst_block, src_block = self.block_of(dst), self.block_of(src)
        if dst_block is not None:  # held weakly: freeing it before the copy is the hazard
            storage_ref = weakref.ref(dst.untyped_storage())
            view = (dst.dtype, dst.storage_offset(), dst.size(), dst.stride())

            def target() -> torch.Tensor | None:
                storage = storage_ref()
                if storage is None:
                    return None
                out = torch.empty(0, dtype=view[0])
                return out.set_(storage, view[1], view[2], view[3])
        else:
            kept = dst

            def target() -> torch.Tensor | None:
                return kept

        def run() -> None:
            out = target()
            if out is not None:
                with torch.no_grad():
                    real_copy(out, value)

        seq = stream.submitted + 1
        for block in (dst_block, src_block):
            if block is not None:
                with self.lock:
                    block.uses.append((stream, seq))
        stream.enqueue(run)
        return dst


class FakePool:
    """Stands for the waterwave pool behind a swapped allocator whose shim has no
    ``record_stream`` hook: the device's memory, told of cross-stream uses by pointer."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.recorded: list[tuple[int, Any]] = []

    def record_stream(self, ptr: int, stream: Any) -> None:
        self.recorded.append((ptr, stream))
        self.gpu.record_stream_ptr(ptr, stream)


def install(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    """Install the late-completing fake device for one test; see the module docstring."""
    gpu = FakeGpu()
    FakeEvent.gpu = gpu
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "Stream", lambda device=None, **_: gpu.new_side_stream())
    monkeypatch.setattr(cuda, "Event", FakeEvent)
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: gpu.current_stream())
    monkeypatch.setattr(cuda, "default_stream", lambda device=None: gpu.default_stream)
    monkeypatch.setattr(cuda, "stream", gpu.on_stream)
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: gpu.advance())

    base_device = torch._C.TensorBase.device
    base_copy = torch.Tensor.copy_
    empty, empty_like = torch.empty, torch.empty_like

    def device_of(t: torch.Tensor) -> torch.device:
        return CUDA0 if gpu.owns(t) else base_device.__get__(t)  # type: ignore[attr-defined,no-any-return]

    def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if non_blocking and (gpu.owns(dst) or gpu.owns(src)):
            return gpu.copy(dst, src, lambda d, s: base_copy(d, s))
        return base_copy(dst, src, non_blocking)

    def make(fn: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        pinned = bool(kwargs.pop("pin_memory", False))
        on_device = _is_cuda_device(kwargs.get("device"))
        if on_device:
            kwargs["device"] = "cpu"
        elif "device" not in kwargs and args and isinstance(args[0], torch.Tensor):
            on_device = gpu.owns(args[0])  # empty_like(x) lands where x is
        t = fn(*args, **kwargs)
        if pinned:
            gpu.forget(t)  # a dispatch mode may have counted it
        elif on_device:
            gpu.register(t)
        return t  # type: ignore[no-any-return]

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: gpu.owns(t)))
    monkeypatch.setattr(torch.Tensor, "device", property(device_of))
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda t, stream: gpu.record_stream(t, stream)
    )
    monkeypatch.setattr(torch, "empty", lambda *a, **k: make(empty, *a, **k))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: make(empty_like, *a, **k))
    return gpu
