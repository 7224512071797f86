"""``use_pool``'s allocator swap (the CUDA-only half of ``memory/_torch.py``) against fakes.

PyTorch's ``CUDAPluggableAllocator`` and ``change_current_allocator`` are recorded instead of
called, the torch shim is a stand-in (built with or without the ``record_stream`` hook, or not
buildable), and the pool is a ``sim`` pool that says it is a ``cuda`` one (``use_pool`` refuses
``sim`` pools; the library only keeps its handle). Checked: which entry points PyTorch is given,
what :func:`allocator_info` then reports, what is logged, and the refusal once CUDA allocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from waterwave_hpo.memory import Backend
from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory import _shim as shim_module
from waterwave_hpo.memory import _torch
from waterwave_hpo.memory._shim import SHIM_FREE
from waterwave_hpo.memory._shim import SHIM_MALLOC
from waterwave_hpo.memory._shim import ShimBuildError
from waterwave_hpo.memory._shim import TorchShim


class _CudaLooking(StreamAwarePool):
    @property
    def backend(self) -> Backend:
        return Backend.CUDA


class _Recorder:
    def __init__(self) -> None:
        self.allocators: list[tuple[str, str, str]] = []
        self.swapped: list[Any] = []
        self.refuse: str | None = None

    def allocator(self, path: str, malloc: str, free: str) -> Any:
        self.allocators.append((Path(path).name, malloc, free))
        return SimpleNamespace(path=path)

    def change(self, allocator: Any) -> None:
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.swapped.append(allocator)


@pytest.fixture
def torch_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorder]:
    recorder = _Recorder()
    for name, value in (
        ("_installed", {}),
        ("_passthrough", {}),
        ("_unavailable", {}),
        ("_allocator_swapped", False),
        ("_typed_oom", False),
        ("_record_stream", False),
        ("_shim_error", ""),
    ):
        monkeypatch.setattr(_torch, name, value)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", recorder.allocator)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", recorder.change)
    monkeypatch.setattr(_torch, "install_guards", lambda lookup: None)
    monkeypatch.setattr(shim_module, "_warned", False)  # ShimBuildWarning: once per process
    yield recorder
    lib = _torch.load_library()
    for device in (0, 1):
        lib.ww_torch_set_pool(device, None)
        lib.ww_torch_set_unavailable(device, b"")
    for pool in (*_torch._installed.values(), *_torch._passthrough.values()):
        pool._pinned = False


def _shim(monkeypatch: pytest.MonkeyPatch, *, record_stream: bool) -> None:
    library = SimpleNamespace(waterwave_shim_register_record_stream=lambda: 0)
    shim = TorchShim(Path("/fake/libwaterwave_torch_shim.so"), library, record_stream)  # type: ignore[arg-type]
    monkeypatch.setattr(shim_module, "torch_shim", lambda: shim)


def test_with_the_shim_pytorch_gets_typed_oom_and_record_stream(
    torch_cuda: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    _shim(monkeypatch, record_stream=True)
    pool = _CudaLooking(backend="sim")
    _torch.use_pool(pool)
    assert torch_cuda.allocators == [("libwaterwave_torch_shim.so", SHIM_MALLOC, SHIM_FREE)]
    info = _torch.allocator_info()
    assert (info.swapped, info.typed_oom, info.record_stream, info.pool_devices) == (
        True,
        True,
        True,
        (0,),
    )
    assert _torch.installed_pool(0) is pool
    _torch.use_pool(pool)  # the same pool again: nothing to do
    assert len(torch_cuda.swapped) == 1


def test_a_shim_without_record_stream_says_how_to_declare_cross_stream_uses(
    torch_cuda: _Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _shim(monkeypatch, record_stream=False)
    _torch.use_pool(_CudaLooking(backend="sim"))
    info = _torch.allocator_info()
    assert (info.typed_oom, info.record_stream) == (True, False)
    assert "pool.record_stream(tensor.untyped_storage().data_ptr(), stream)" in caplog.text


def test_without_the_shim_the_plain_entry_points_and_a_warning(
    torch_cuda: _Recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler() -> None:
        raise ShimBuildError("no C++ compiler (c++ not found)")

    monkeypatch.setattr(shim_module, "torch_shim", no_compiler)
    with pytest.warns(shim_module.ShimBuildWarning, match="no C\\+\\+ compiler"):
        _torch.use_pool(_CudaLooking(backend="sim"))
    assert [a[1:] for a in torch_cuda.allocators] == [
        ("waterwave_torch_malloc", "waterwave_torch_free")
    ]
    info = _torch.allocator_info()
    assert (info.swapped, info.typed_oom, info.record_stream) == (True, False, False)
    assert info.shim_error.startswith("no C++ compiler (c++ not found)")
    assert "translate_oom" in info.shim_error
    assert "pool.record_stream(tensor.untyped_storage().data_ptr(), stream)" in caplog.text


def test_when_pytorch_refuses_the_swap_the_error_says_to_call_use_pool_first(
    torch_cuda: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    _shim(monkeypatch, record_stream=True)
    torch_cuda.refuse = "Can't swap an already initialized allocator"
    pool = _CudaLooking(backend="sim")
    with pytest.raises(RuntimeError, match=r"Call waterwave_hpo\.memory\.use_pool\(pool\) at the"):
        _torch.use_pool(pool)
    assert _torch.installed_pool(0) is None
    assert not _torch.allocator_info().swapped


def test_every_other_visible_device_is_served_or_says_why_not(
    torch_cuda: _Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    _shim(monkeypatch, record_stream=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _torch.use_pool(_CudaLooking(backend="sim"))
    info = _torch.allocator_info()
    assert info.pool_devices == (0,)
    # No CUDA driver here: device 1's pass-through pool cannot be made, and the reason is kept
    # (every allocation there then fails with it, never as an out-of-memory error).
    assert 1 in info.passthrough_devices or "pass-through pool" in info.unavailable_devices[1]
