"""The pool under each trial's stream when the user's script touched CUDA first (on the CPU).

PyTorch refuses to swap its allocator once CUDA is initialised; the executor then puts the pool
under each trial's stream through ``torch.cuda.MemPool`` and stream routing. Here ``torch.cuda``
is the fake of ``fakes.cuda_init`` (initialised by whatever the user's script did first), and
PyTorch's private pools are faked by :class:`FakeTorchPools`, which records the routing calls
and plays the caching allocator's segment requests into the pool library's torch entry point
with the routed stream, as PyTorch does for a private pool's new segment.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
from typing import Any
import warnings

from fakes.cuda_driver import FakeExternalStream
from fakes.cuda_init import FakeCuda
import pytest
import torch

from waterwave_hpo.host._memory import DeviceMemory
from waterwave_hpo.host._memory import MemoryPoolMode
from waterwave_hpo.host._memory import make_device_memory
import waterwave_hpo.memory as wm
from waterwave_hpo.memory import _routed
from waterwave_hpo.memory._lib import load_library

MiB = 1 << 20
_Pool = wm.StreamAwarePool  # the fake CUDA replaces the facade's name with its factory


class FakeTorchPools:
    """``torch.cuda.MemPool``, stream routing, and the caching allocator's segment requests."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.routes: dict[tuple[int, int], int] = {}  # pool id -> routed stream handle
        self.current_stream = 0
        self._ids = itertools.count(1)
        fake = self

        class MemPool:
            def __init__(self, allocator: Any = None, *_: Any) -> None:
                self.allocator = allocator
                self.id = (0, next(fake._ids))
                fake.calls.append(("MemPool", allocator))

        class Pluggable:
            def __init__(self, path: str, malloc: str, free: str) -> None:
                self.symbols = (malloc, free)

            def allocator(self) -> tuple[str, str]:
                return self.symbols

        self.MemPool = MemPool
        self.Pluggable = Pluggable

    def begin(self, device: int, pool_id: tuple[int, int]) -> None:
        self.calls.append(("begin", device, pool_id, self.current_stream))
        self.routes[pool_id] = self.current_stream

    def end(self, device: int, pool_id: tuple[int, int]) -> None:
        self.calls.append(("end", device, pool_id))
        self.routes.pop(pool_id, None)

    def release(self, device: int, pool_id: tuple[int, int]) -> None:
        self.calls.append(("release", device, pool_id))

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Any:
        saved, self.current_stream = self.current_stream, int(stream.cuda_stream)
        try:
            yield
        finally:
            self.current_stream = saved

    def new_segment(self, nbytes: int, stream: int) -> int:
        """What PyTorch does for a routed private pool's new segment: the allocator's malloc
        with the routed stream (the pool library's entry point, as the shim calls it)."""
        lib = load_library()
        fn = lib.waterwave_torch_try_malloc
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
        ]
        out = ctypes.c_void_p()
        assert fn(nbytes, 0, stream, ctypes.byref(out)) == 0
        return int(out.value or 0)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeTorchPools:
        monkeypatch.setattr(torch.cuda, "MemPool", self.MemPool, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", self.Pluggable)
        monkeypatch.setattr(
            torch._C, "_cuda_beginAllocateCurrentStreamToPool", self.begin, raising=False
        )
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", self.end, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_releasePool", self.release, raising=False)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(_routed, "shim_for_pool", lambda required=False: (None, "no shim"))
        return self


def _sim_pool(*_: Any, backend: str = "cuda", device: int = 0, **__: Any) -> wm.StreamAwarePool:
    return _Pool(256 * MiB, backend="sim", device=device)


@pytest.fixture
def late_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    cuda = FakeCuda(n=1, pool_factory=_sim_pool).install(monkeypatch)
    # The real routing, over PyTorch's faked private pools.
    monkeypatch.setattr(wm, "enable_stream_routing", _routed.enable_stream_routing)
    monkeypatch.setattr(wm, "routed_pool", _routed.routed_pool)
    pools = FakeTorchPools().install(monkeypatch)
    yield cuda, pools
    _routed._routed.clear()
    load_library().ww_torch_set_pool(0, None)


# What the user's script did before the executor set the device up; each initialises CUDA.
LATE_STARTS = {
    "data moved to the GPU first": lambda: torch.cuda._lazy_init(),
    "a Hugging Face Trainer moved the model_init model": lambda: torch.cuda.set_device(0),
    "a process-isolation driver read the device's properties": (
        lambda: torch.cuda.get_device_properties(0)
    ),
    "a notebook ran a process study, then a threads study": lambda: torch.cuda.mem_get_info(0),
}


@pytest.mark.parametrize("start", list(LATE_STARTS), ids=list(LATE_STARTS))
def test_the_pool_sits_under_each_trials_stream_however_the_script_started(
    late_cuda: Any, start: str
) -> None:
    cuda, pools = late_cuda
    LATE_STARTS[start]()
    assert cuda.initialised and cuda.events == ["cuda init"]
    memory = make_device_memory(
        torch.device("cuda", 0), MemoryPoolMode.AUTO, None, "fifo", max_trials=2
    )
    assert isinstance(memory, DeviceMemory)
    assert memory.routed and memory.pool is wm.routed_pool(0)
    assert cuda.pools == {}  # PyTorch's allocator was not swapped
    s1, s2 = FakeExternalStream(0x501), FakeExternalStream(0x502)
    a1 = memory.open_account(1, s1)
    a2 = memory.open_account(2, s2)
    begins = [c for c in pools.calls if c[0] == "begin"]
    assert [c[3] for c in begins] == [0x501, 0x502]  # each trial's stream, its own private pool
    assert begins[0][2] != begins[1][2]
    # PyTorch's private pools take their segments from the pool, charged to each trial.
    pools.new_segment(20 * MiB, 0x501)
    pools.new_segment(2 * MiB, 0x502)
    assert a1.stats().allocated_bytes == 20 * MiB
    assert a2.stats().allocated_bytes == 2 * MiB
    assert memory.close_account(1, a1) == 20 * MiB
    ended = [c for c in pools.calls if c[0] in ("end", "release")]
    assert ended == [("end", 0, begins[0][2]), ("release", 0, begins[0][2])]
    assert list(pools.routes.values()) == [0x502]  # the neighbour stays routed
    memory.close_account(2, a2)
    assert pools.routes == {}


def test_without_torchs_private_pools_auto_warns_with_the_cause_and_the_fix(
    late_cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool")
    torch.cuda._lazy_init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memory = make_device_memory(
            torch.device("cuda", 0), MemoryPoolMode.AUTO, None, "fifo", max_trials=2
        )
    assert memory.pool is None and not memory.routed
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "initialised CUDA in this process before the executor" in messages[0]
    assert "_cuda_beginAllocateCurrentStreamToPool" in messages[0]  # the cause, named
    assert "before the first CUDA call" in messages[0]  # the fix
    with pytest.raises(RuntimeError, match="memory_pool='on'"):
        make_device_memory(torch.device("cuda", 0), MemoryPoolMode.ON, None, "fifo", max_trials=2)


def test_before_cuda_starts_the_pool_still_replaces_pytorchs_allocator(late_cuda: Any) -> None:
    cuda, pools = late_cuda
    memory = make_device_memory(
        torch.device("cuda", 0), MemoryPoolMode.AUTO, None, "fifo", max_trials=2
    )
    assert cuda.events[0] == "pool 0" and not memory.routed
    assert pools.calls == []
