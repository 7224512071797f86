"""The pool as PyTorch's CUDA allocator (``torch.cuda.memory.CUDAPluggableAllocator``).

The entry points are ``waterwave_torch_malloc``/``waterwave_torch_free`` in the pool library,
written against ``torch/csrc/cuda/CUDAPluggableAllocator.h`` (free takes a device too, unlike the
Python docstring says). What a pluggable allocator loses is given back here: typed OOM
(:func:`translate_oom`), stats per trial (accounts) and a snapshot (``pool.snapshot()``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

from waterwave_hpo.memory._lib import library_path
from waterwave_hpo.memory._lib import load_library
from waterwave_hpo.memory._pool import Backend
from waterwave_hpo.memory._torch_api import install_guards

if TYPE_CHECKING:
    from collections.abc import Iterator

    from waterwave_hpo.memory._pool import StreamAwarePool

#: Marker in the message of the C++ exception waterwave_torch_malloc throws on exhaustion.
OOM_MARKER = "WATERWAVE_POOL_OOM"

_lock = threading.Lock()
_installed: dict[int, StreamAwarePool] = {}  # device -> pool; keeps installed pools alive
_allocator_swapped = False


def installed_pool(device: int = 0) -> StreamAwarePool | None:
    """The pool :func:`use_pool` installed for ``device``, or None."""
    with _lock:
        return _installed.get(device)


def use_pool(pool: StreamAwarePool) -> None:
    """Makes ``pool`` PyTorch's CUDA allocator for ``pool.device``.

    Must be called before CUDA's first allocation in this process (PyTorch cannot swap an
    allocator that is initialized). Several pools on several devices may be installed; the first
    call swaps the allocator. The pool stays alive for the rest of the process.

    From then on ``torch.cuda.memory_stats``/``memory_allocated``/``max_memory_allocated``
    answer from the pool, ``torch.cuda.empty_cache`` releases its cached segments,
    ``reset_peak_memory_stats`` and cuDNN's benchmark mode are ignored with a one-time warning,
    and CUDA graph capture raises (see :mod:`waterwave_hpo.memory._torch_api`).

    PyTorch turns a pool exhaustion inside an op into a ``RuntimeError`` (pluggable allocators
    cannot raise ``torch.cuda.OutOfMemoryError`` themselves, pytorch/pytorch issue 133280); run
    trial code under :func:`translate_oom` to get ``torch.cuda.OutOfMemoryError``.

    Args:
        pool: A ``cuda`` or ``cupy`` backend pool.

    Raises:
        ValueError: ``pool`` is a ``sim`` pool, or another pool is installed for its device.
        RuntimeError: CUDA has already allocated memory with PyTorch's own allocator (call
            ``use_pool`` first thing, before any tensor is put on the GPU).
    """
    import torch

    global _allocator_swapped
    if pool.backend is Backend.SIM:
        raise ValueError(
            "The pool argument is a 'sim' pool; PyTorch needs a 'cuda' or 'cupy' pool."
        )
    with _lock:
        current = _installed.get(pool.device)
        if current is pool:
            return
        if current is not None:
            raise ValueError(
                f"Another pool ({current!r}) is already PyTorch's allocator for device "
                f"{pool.device}; a process has one pool per device."
            )
        lib = load_library()
        if not _allocator_swapped:
            if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                raise RuntimeError(
                    "use_pool() must be called before CUDA's first allocation: PyTorch has already "
                    "initialized CUDA and its own caching allocator in this process. Call "
                    "waterwave_hpo.memory.use_pool(pool) at the start of the process, before any "
                    "tensor is created on the GPU."
                )
            lib.ww_torch_set_pool(pool.device, pool._handle())
            allocator = torch.cuda.memory.CUDAPluggableAllocator(
                str(library_path()), "waterwave_torch_malloc", "waterwave_torch_free"
            )
            try:
                torch.cuda.memory.change_current_allocator(allocator)
            except RuntimeError as exc:
                lib.ww_torch_set_pool(pool.device, None)
                raise RuntimeError(
                    "use_pool() must be called before CUDA's first allocation; PyTorch refused to "
                    f"swap its allocator ({exc}). Call waterwave_hpo.memory.use_pool(pool) at the "
                    "start of the process."
                ) from exc
            _allocator_swapped = True
        else:
            lib.ww_torch_set_pool(pool.device, pool._handle())
        _installed[pool.device] = pool
        pool._pinned = True  # PyTorch may call into it until the process ends
    # PyTorch's stats, empty_cache, cuDNN benchmark mode and graph capture under the pool.
    install_guards(installed_pool)


def is_pool_oom(exc: BaseException) -> bool:
    """True if ``exc`` is the error PyTorch raised for an exhausted waterwave pool.

    That is a ``RuntimeError`` (a ``MemoryError`` through some pybind11 bindings) whose message
    carries :data:`OOM_MARKER`.
    """
    return isinstance(exc, (RuntimeError, MemoryError)) and OOM_MARKER in str(exc)


@contextlib.contextmanager
def translate_oom() -> Iterator[None]:
    """Re-raises a pool exhaustion inside PyTorch as ``torch.cuda.OutOfMemoryError``.

    Usable as a context manager or a decorator around a trial's code; the executor's OOM isolation
    relies on the typed error. Other exceptions pass through unchanged.

    Raises:
        torch.cuda.OutOfMemoryError: The pool could not serve an allocation of a PyTorch op.
    """
    try:
        yield
    except (RuntimeError, MemoryError) as exc:
        if not is_pool_oom(exc):
            raise
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        raise torch.cuda.OutOfMemoryError(str(exc)) from exc
