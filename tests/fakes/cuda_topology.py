"""The CUDA topology on the CPU, assembled: a fake CUDA device, fake streams and events, a
simulated pool standing in as PyTorch's allocator (its guards on), every backward on one shared
autograd worker, and tripwires on what nothing may call while the pool is installed.

``install(monkeypatch)`` returns a :class:`Topology`; after running code under it, assert
``topology.device_syncs == []`` (no device-wide ``torch.cuda.synchronize``) and
``topology.stats_calls == []`` (no per-device stats API of PyTorch's). ``torch.cuda.stream(s)``
makes ``s`` the thread's current stream; events complete late (see :class:`FakeStream`); for
copies that land late and device memory, see ``late_cuda.py``. Tensors stay on the CPU:
``.to("cuda:N")`` is a no-op here, so code written for CUDA runs its CUDA branches.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
from dataclasses import dataclass
from dataclasses import field
import itertools
import threading
from typing import Any

import pytest
import torch
from torch import nn

from .autograd_worker import SharedAutogradWorker
from .cuda_init import FakeCuda

MIB = 1 << 20
STATS_APIS = (
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "memory_summary",
    "memory_snapshot",
)


class FakeStream:
    """A slot's stream: a raw handle; ``synchronize`` waits for this stream only (allowed).

    Its work completes late, as on a GPU: an event recorded on it has not completed (``query()``
    is False, ``elapsed_time`` raises as CUDA's ``cudaErrorNotReady`` does) until the stream,
    or that event or a later one on it, is synchronised.
    """

    _handles = itertools.count(0x1000)

    def __init__(self, device: Any = None) -> None:
        self.cuda_stream = next(self._handles)
        self.device = device
        self.synchronized = 0
        self.recorded = 0  # events recorded on it so far
        self.completed = 0  # of which this many have completed

    def synchronize(self) -> None:
        self.synchronized += 1
        self.completed = self.recorded


_current = threading.local()


def _current_stream(device: Any = None) -> FakeStream:
    stream: FakeStream | None = getattr(_current, "stream", None)
    if stream is None:
        stream = _current.stream = FakeStream(device)  # the thread's default stream
    return stream


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    saved = getattr(_current, "stream", None)
    _current.stream = stream
    try:
        yield
    finally:
        _current.stream = saved


class FakeEvent:
    """A timing event: each record is 1 ms after the previous one; completes late (above)."""

    _ticks = itertools.count()

    def __init__(self, enable_timing: bool = False) -> None:
        self.stream: FakeStream | None = None
        self.seq = 0
        self.tick = -1

    def record(self, stream: Any = None) -> None:
        self.stream = stream if isinstance(stream, FakeStream) else _current_stream()
        self.stream.recorded += 1
        self.seq = self.stream.recorded
        self.tick = next(self._ticks)

    def query(self) -> bool:
        return self.stream is None or self.stream.completed >= self.seq

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.completed = max(self.stream.completed, self.seq)

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready (fake: an event has not completed)")
        return float(end.tick - self.tick)


@dataclass
class Topology:
    """What the fakes recorded."""

    cuda: FakeCuda
    worker: SharedAutogradWorker
    pools: list[Any] = field(default_factory=list)
    stats_calls: list[str] = field(default_factory=list)

    @property
    def device_syncs(self) -> list[str]:
        return self.cuda.device_syncs


def _is_cuda(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, str):
        return target.startswith("cuda")
    return isinstance(target, torch.device) and target.type == "cuda"


def install(monkeypatch: pytest.MonkeyPatch) -> Topology:
    """Install every fake for one test; see the module docstring."""
    from waterwave_hpo.host import _streams
    import waterwave_hpo.memory as memory
    from waterwave_hpo.memory import StreamAwarePool
    from waterwave_hpo.memory._torch_api import install_guards
    from waterwave_hpo.memory._torch_api import remove_guards

    pools: list[Any] = []

    def sim_pool(**kwargs: Any) -> StreamAwarePool:
        pools.append(StreamAwarePool(capacity_bytes=256 * MIB, backend="sim"))
        return pools[-1]

    cuda = FakeCuda(n=1, pool_factory=sim_pool).install(monkeypatch)
    fake_use_pool = cuda._use_pool

    def use_pool(pool: StreamAwarePool, *, require_shim: bool = False) -> None:
        fake_use_pool(pool, require_shim=require_shim)
        install_guards(lambda index: cuda.pools.get(index))  # as the real use_pool does

    monkeypatch.setattr(memory, "use_pool", use_pool)
    monkeypatch.setattr(_streams, "acquire_stream", FakeStream)
    monkeypatch.setattr(_streams, "release_stream", lambda stream: stream.synchronize())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", _on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", _current_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "pluggable")
    tensor_to, module_to = torch.Tensor.to, nn.Module.to

    def to_tensor(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self if _is_cuda(args, kwargs) else tensor_to(self, *args, **kwargs)

    def to_module(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self if _is_cuda(args, kwargs) else module_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to_tensor)
    monkeypatch.setattr(nn.Module, "to", to_module)
    worker = SharedAutogradWorker(timeout_s=60)
    worker.install(monkeypatch)
    topology = Topology(cuda=cuda, worker=worker, pools=pools)
    for name in STATS_APIS:
        monkeypatch.setattr(
            torch.cuda, name, lambda *a, _n=name, **k: topology.stats_calls.append(_n)
        )

    def undo() -> None:
        worker.close()
        remove_guards()
        for pool in pools:
            pool._pinned = False

    topology_undo.append(undo)  # the caller's monkeypatch undoes the patches themselves
    return topology


#: Cleanups of installed topologies; :func:`uninstall` runs them.
topology_undo: list[Any] = []


def uninstall() -> None:
    """Stop the worker, take the guards off (call in the fixture's teardown)."""
    while topology_undo:
        topology_undo.pop()()
