"""A fake CUDA for call-order checks: which happened first, the pool's install or CUDA's init.

PyTorch swaps its allocator only before CUDA initialises (``change_current_allocator`` refuses
an initialised allocator), and everything that touches a device initialises it
(``torch.cuda._lazy_init``: ``get_device_properties``, ``set_device``, ``mem_get_info``, the
first tensor). :class:`FakeCuda` makes ``torch.cuda`` report ``n`` devices, records every
initialisation and every pool install in :attr:`events`, and, like the real ``use_pool``,
refuses the first install once CUDA is initialised (the executor then runs the trials on
PyTorch's own allocator: the late path).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch


class _FakePool:
    def __init__(self, *, backend: str = "cuda", device: int = 0, **_: Any) -> None:
        self.backend = backend
        self.device = device
        self.capacity_bytes = None

    def open_account(self, name: str, streams: tuple[Any, ...] = ()) -> Any:
        raise AssertionError("no trial runs under the fake CUDA")


class _NotCapturingStream:
    """What ``torch.accelerator.current_stream`` answers under the fake: no graph capture."""

    def is_capturing(self) -> bool:
        return False


class FakeCuda:
    """``n`` fake CUDA devices; see the module docstring."""

    def __init__(self, n: int = 2, total_memory: int = 16 << 30, pool_factory: Any = None) -> None:
        self.n = n
        self.total_memory = total_memory
        self.pool_factory = pool_factory if pool_factory is not None else _FakePool
        #: Every device-wide ``torch.cuda.synchronize`` call (none may happen in a trial).
        self.device_syncs: list[str] = []
        self.initialised = False
        self.swapped = False
        self.events: list[str] = []
        self.pools: dict[int, _FakePool] = {}

    def _init(self, *_: Any, **__: Any) -> None:
        if not self.initialised:
            self.events.append("cuda init")
        self.initialised = True

    def _properties(self, device: Any = None) -> Any:
        self._init()
        return SimpleNamespace(total_memory=self.total_memory, name="fake GPU")

    def _use_pool(self, pool: _FakePool, *, require_shim: bool = False) -> None:
        if not self.swapped and self.initialised:
            raise RuntimeError(
                "use_pool() must be called before CUDA's first allocation (fake CUDA: "
                "already initialised)"
            )
        self.swapped = True
        self.pools[pool.device] = pool
        self.events.append(f"pool {pool.device}")

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        from fakes.cuda_driver import FakeDriver
        from waterwave_hpo.host import _driver
        import waterwave_hpo.memory as memory

        cuda = torch.cuda
        # The driver API (ctypes) answers for the same devices: without this, a machine with a
        # real driver would report its own GPU's memory beside the fake's.
        monkeypatch.setattr(_driver, "_driver", FakeDriver(total_bytes=self.total_memory))
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: self.n)
        monkeypatch.setattr(cuda, "is_initialized", lambda: self.initialised)
        # One distinct function per name: torch._dynamo's trace rules (built on the first
        # optimizer step) refuse one object registered under two names.
        monkeypatch.setattr(cuda, "_lazy_init", lambda: self._init())
        monkeypatch.setattr(cuda, "init", lambda: self._init())
        monkeypatch.setattr(cuda, "set_device", lambda device: self._init())
        monkeypatch.setattr(
            cuda, "synchronize", lambda device=None: self.device_syncs.append(str(device))
        )
        monkeypatch.setattr(cuda, "current_device", lambda: self._init() or 0)
        monkeypatch.setattr(cuda, "get_device_properties", lambda d=None: self._properties(d))
        monkeypatch.setattr(
            cuda, "mem_get_info", lambda device=None: self._init() or (self.total_memory,) * 2
        )
        # On torch's CUDA wheel torch.accelerator follows torch.cuda.is_available (True here),
        # and every optimizer step asks the accelerator's current stream whether it captures a
        # graph (Optimizer._accelerator_graph_capture_health_check): the real one needs a GPU.
        monkeypatch.setattr(
            torch.accelerator, "current_stream", lambda device=None: _NotCapturingStream()
        )
        monkeypatch.setattr(memory, "StreamAwarePool", self.pool_factory)
        monkeypatch.setattr(memory, "use_pool", self._use_pool)
        monkeypatch.setattr(memory, "installed_pool", lambda device=0: self.pools.get(device))
        monkeypatch.setattr(memory, "allocator_swapped", lambda: self.swapped)
        return self
