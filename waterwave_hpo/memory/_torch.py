"""The pool as PyTorch's CUDA allocator (``torch.cuda.memory.CUDAPluggableAllocator``).

The entry points are written against ``torch/csrc/cuda/CUDAPluggableAllocator.h`` (free takes a
device too, unlike the Python docstring says). Where the torch shim builds (``_shim.py``, the
normal case) PyTorch loads ``waterwave_shim_malloc``/``waterwave_shim_free`` from it: a pool OOM
is then PyTorch's own ``c10::OutOfMemoryError`` (``torch.OutOfMemoryError`` in Python, and
PyTorch's internal fallbacks such as cuDNN's smaller workspace run), and on a CUDA build of torch
``Tensor.record_stream`` reaches the pool. Otherwise the plain ``waterwave_torch_malloc``/
``waterwave_torch_free`` of the pool library are used and :func:`translate_oom` turns the
marked ``RuntimeError`` into ``torch.cuda.OutOfMemoryError``.

The swapped allocator is process-wide, so at swap time every visible CUDA device gets a pool: the
one given to :func:`use_pool`, or a *pass-through* pool (no capacity, no accounts: PyTorch-like
caching on the driver) that a later :func:`use_pool` for that device replaces while it holds no
block. A device where even that fails answers every allocation with a "no waterwave pool"
error naming the reason, never with an out-of-memory error. A pool
retains its device's CUDA primary context only at the first allocation there (the C++
upstream), so a device the study never uses keeps no context of ours (0.3-0.5 GiB each), and
an exclusive-process GPU held by another process fails only when the study allocates on it,
with a backend error, never an OOM.

The cross-stream rule: a block used on streams other than its own (PyTorch
``Tensor.record_stream``, or :meth:`StreamAwarePool.record_stream`) is handed out again only after
the work queued on every such stream at the free has completed (so is a block freed on a
stream other than its allocating one, for the allocating stream's queued work); the freeing
stream's own use follows the pool's usual order (same stream, completed event, or a GPU-side
wait).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import TYPE_CHECKING

from waterwave_hpo import _checks
from waterwave_hpo.memory._lib import library_path
from waterwave_hpo.memory._lib import load_library
from waterwave_hpo.memory._pool import Backend
from waterwave_hpo.memory._pool import StreamAwarePool
from waterwave_hpo.memory._shim import SHIM_FREE
from waterwave_hpo.memory._shim import SHIM_MALLOC
from waterwave_hpo.memory._shim import ShimBuildError
from waterwave_hpo.memory._shim import record_stream_build_error
from waterwave_hpo.memory._shim import shim_for_pool
from waterwave_hpo.memory._torch_api import install_guards

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Marker in the message of the C++ exception waterwave_torch_malloc throws on exhaustion.
OOM_MARKER = "WATERWAVE_POOL_OOM"
#: Marker of the error for an allocation on a device that has no pool (never an OOM).
NO_POOL_MARKER = "WATERWAVE_POOL_NO_POOL"

_logger = logging.getLogger(__name__)
_lock = threading.Lock()
_installed: dict[int, StreamAwarePool] = {}  # device -> pool; keeps installed pools alive
_passthrough: dict[int, StreamAwarePool] = {}  # device -> pass-through pool made at swap time
_unavailable: dict[int, str] = {}  # device -> why it has no pool at all
_allocator_swapped = False


@dataclasses.dataclass(frozen=True)
class TorchAllocatorInfo:
    """How the pool is wired into PyTorch in this process (for ``doctor`` and bug reports).

    Attributes:
        swapped: PyTorch's CUDA allocator is the pool's (process-wide).
        typed_oom: A pool OOM is thrown as ``c10::OutOfMemoryError`` (the torch shim is used).
        record_stream: ``Tensor.record_stream`` reaches the pool (shim on a CUDA build of torch).
        shim_error: Why the shim is not used (empty when it is, or before the swap).
        pool_devices: Devices with a pool given to :func:`use_pool`.
        passthrough_devices: Devices served by a pass-through pool.
        unavailable_devices: Devices with no pool, and why: every allocation there fails.
    """

    swapped: bool
    typed_oom: bool
    record_stream: bool
    shim_error: str
    pool_devices: tuple[int, ...]
    passthrough_devices: tuple[int, ...]
    unavailable_devices: dict[int, str]


_typed_oom = False
_record_stream = False
_shim_error = ""


def installed_pool(device: int = 0) -> StreamAwarePool | None:
    """The pool :func:`use_pool` installed for ``device``, or None (also for a pass-through)."""
    with _lock:
        return _installed.get(device)


def device_pool(device: int = 0) -> StreamAwarePool | None:
    """The pool that serves PyTorch's allocations on ``device``: installed or pass-through.

    None before the swap, or when ``device`` has no pool (see :func:`allocator_info`).
    """
    with _lock:
        return _installed.get(device) or _passthrough.get(device)


def allocator_swapped() -> bool:
    """True once :func:`use_pool` made the pool PyTorch's (process-wide) CUDA allocator."""
    with _lock:
        return _allocator_swapped


def allocator_info() -> TorchAllocatorInfo:
    """How the pool is wired into PyTorch in this process; see :class:`TorchAllocatorInfo`."""
    with _lock:
        return TorchAllocatorInfo(
            swapped=_allocator_swapped,
            typed_oom=_typed_oom,
            record_stream=_record_stream,
            shim_error=_shim_error,
            pool_devices=tuple(sorted(_installed)),
            passthrough_devices=tuple(sorted(_passthrough)),
            unavailable_devices=dict(_unavailable),
        )


def _swap_allocator_locked(pool: StreamAwarePool, require_shim: bool = False) -> None:
    """Makes the pool library PyTorch's allocator; gives every other visible device a pool."""
    import torch

    global _allocator_swapped, _typed_oom, _record_stream, _shim_error
    lib = load_library()
    shim, _shim_error = shim_for_pool(required=require_shim)  # warns once, or raises if required
    if shim is not None:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(str(shim.path), SHIM_MALLOC, SHIM_FREE)
    else:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            str(library_path()), "waterwave_torch_malloc", "waterwave_torch_free"
        )
    lib.ww_torch_set_pool(pool.device, pool._handle())
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
    _typed_oom = shim is not None
    if shim is not None and shim.has_record_stream:
        _record_stream = shim.library.waterwave_shim_register_record_stream() == 0
    if not _record_stream:
        why = record_stream_build_error(shim.path) if shim is not None else _shim_error
        _logger.warning(
            "Tensor.record_stream does not reach the waterwave pool in this process (%s); a "
            "tensor used on a stream other than its own must be declared with "
            "pool.record_stream(tensor.untyped_storage().data_ptr(), stream).",
            why.splitlines()[-1] if why else "torch has no CUDA allocator hook here",
        )
    # The swapped allocator serves every device: give each other visible device a pool now.
    for device in range(int(torch.cuda.device_count())):
        if device == pool.device:
            continue
        try:
            other = StreamAwarePool(backend=pool.backend, device=device)
        except (RuntimeError, ValueError, OSError) as exc:
            reason = f"its pass-through pool could not be created: {exc}"
            _unavailable[device] = reason
            lib.ww_torch_set_unavailable(device, reason.encode("utf-8", "replace"))
            continue
        other._pinned = True
        _passthrough[device] = other
        lib.ww_torch_set_pool(device, other._handle())


def use_pool(pool: StreamAwarePool, *, require_shim: bool = False) -> None:
    """Makes ``pool`` PyTorch's CUDA allocator for ``pool.device``.

    Must be called before CUDA's first allocation in this process (PyTorch cannot swap an
    allocator that is initialized). Several pools on several devices may be installed; the first
    call swaps the allocator. The pool stays alive for the rest of the process.

    From then on ``torch.cuda.memory_stats``/``memory_allocated``/``max_memory_allocated``
    answer from the pool, ``torch.cuda.empty_cache`` releases its cached segments,
    ``reset_peak_memory_stats`` and cuDNN's benchmark mode are ignored with a one-time warning,
    and CUDA graph capture raises (see :mod:`waterwave_hpo.memory._torch_api`).

    The first call builds (once per torch version, cached) and loads the torch shim, so a pool
    exhaustion inside an op raises ``torch.OutOfMemoryError`` itself, and on a CUDA build of
    torch ``Tensor.record_stream`` reaches the pool. If the shim (or its CUDA variant) cannot be
    built, ``require_shim`` raises with the compiler's message; otherwise a
    :class:`~waterwave_hpo.memory._shim.ShimBuildWarning` says so once per process, and without
    the shim PyTorch raises a ``RuntimeError`` that :func:`translate_oom` turns into
    ``torch.cuda.OutOfMemoryError`` (pytorch/pytorch issue 133280). The first call also gives
    every other visible device a pass-through pool (see the module docstring); a later call for
    such a device replaces it while it holds no block.

    Args:
        pool: A ``cuda`` or ``cupy`` backend pool.
        require_shim: Refuse to swap the allocator without the complete torch shim
            (``WaterwaveExecutor(memory_pool="on")``).

    Raises:
        TypeError: ``pool`` is not a :class:`StreamAwarePool`.
        ValueError: ``pool`` is a ``sim`` pool, or another pool is installed for its device, or
            its device's pass-through pool already holds blocks.
        RuntimeError: CUDA has already allocated memory with PyTorch's own allocator (call
            ``use_pool`` first thing, before any tensor is put on the GPU).
        ShimBuildError: ``require_shim`` and the shim could not be built (a ``RuntimeError``;
            the message holds the compiler's).
    """
    import torch

    if not isinstance(pool, StreamAwarePool):
        raise _checks.type_error(
            "pool", pool, "a StreamAwarePool", "pass StreamAwarePool(backend='cuda')"
        )
    if pool.backend is Backend.SIM:
        raise _checks.value_error(
            "pool", pool, "is a 'sim' pool", "PyTorch needs a 'cuda' or 'cupy' pool"
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
            _swap_allocator_locked(pool, require_shim)
        else:
            if require_shim and _shim_error:
                raise ShimBuildError(
                    f"PyTorch's allocator was swapped to the pool without the complete torch "
                    f"shim (an earlier use_pool without require_shim): {_shim_error}"
                )
            passthrough = _passthrough.get(pool.device)
            if passthrough is not None and passthrough.stats().allocated_bytes != 0:
                raise ValueError(
                    f"Device {pool.device} already serves PyTorch tensors from its pass-through "
                    "pool; call use_pool for every device before CUDA work starts on it."
                )
            lib.ww_torch_set_pool(pool.device, pool._handle())
            if passthrough is not None:
                del _passthrough[pool.device]
                passthrough.release_cached()  # stays pinned: PyTorch may still hold its pointer
            _unavailable.pop(pool.device, None)
            lib.ww_torch_set_unavailable(pool.device, b"")
        _installed[pool.device] = pool
        pool._pinned = True  # PyTorch may call into it until the process ends
    # PyTorch's stats, empty_cache, cuDNN benchmark mode and graph capture under the pool.
    install_guards(device_pool)


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
