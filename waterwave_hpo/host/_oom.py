"""Recognising out-of-memory errors, whoever raised them."""

from __future__ import annotations

import sys

import torch

from waterwave_hpo.memory import OOM_MARKER
from waterwave_hpo.memory import PoolOutOfMemoryError
from waterwave_hpo.scheduler import BudgetExceededError

_OOM_MESSAGES = ("cuda out of memory", "cuda error: out of memory", "out of memory")
# cuBLAS and cuDNN report a failed workspace or handle allocation with these statuses (the
# message PyTorch raises carries them, e.g. "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling
# `cublasCreate(handle)`"): the device had no memory for them, which fewer neighbours cure.
_LIBRARY_ALLOC_FAILED = ("CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


_NEVER_FITS = "_waterwave_never_fits"


def mark_never_fits(error: BaseException, reason: str) -> BaseException:
    """Mark the out-of-memory ``error`` as one no re-run can cure, ``reason`` saying why.

    For a bound that does not depend on the trial's neighbours (a worker process's lease):
    the executor then fails the trial at once instead of re-running it with fewer neighbours.

    Returns:
        ``error`` itself.
    """
    setattr(error, _NEVER_FITS, reason)
    return error


def never_fits_reason(error: BaseException | None) -> str | None:
    """Why no re-run of ``error``'s attempt can fit (:func:`mark_never_fits`), or ``None``.

    The ``__cause__``/``__context__`` chain is followed.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        reason = getattr(error, _NEVER_FITS, None)
        if isinstance(reason, str):
            return reason
        error = error.__cause__ or error.__context__
    return None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) is a device out-of-memory error.

    Recognises ``torch.cuda.OutOfMemoryError`` (raised by PyTorch's allocators, including a
    pluggable allocator returning null), a ``RuntimeError`` whose message says CUDA ran out of
    memory (older code paths and some extensions) or that cuBLAS or cuDNN could not allocate
    (``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``), CuPy's
    ``cupy.cuda.memory.OutOfMemoryError`` (a ``MemoryError``: CuPy's own pool, or the
    waterwave pool serving CuPy through ``pool.cupy_allocator()``), the pool's own
    :class:`waterwave_hpo.memory.PoolOutOfMemoryError`, and
    :class:`waterwave_hpo.scheduler.BudgetExceededError` (the NodeGroup scheduler evicting a
    trial). The ``__cause__``/``__context__`` chain is followed, so an objective that wraps the
    error in its own exception is still recognised. A plain ``MemoryError`` (the host ran out)
    is not a device out-of-memory error. CuPy is never imported here: its error type is looked
    up only when CuPy is already loaded (an error of CuPy's cannot exist otherwise).
    """
    cupy_oom = _cupy_out_of_memory_type()
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.cuda.OutOfMemoryError):
            return True
        if isinstance(current, (BudgetExceededError, PoolOutOfMemoryError)):
            return True
        if cupy_oom is not None and isinstance(current, cupy_oom):
            return True
        if isinstance(current, RuntimeError):
            if OOM_MARKER in str(current):  # the stream-aware pool, through PyTorch
                return True
            if any(status in str(current) for status in _LIBRARY_ALLOC_FAILED):
                return True
            message = str(current).lower()
            if any(text in message for text in _OOM_MESSAGES) and (
                "cuda" in message or "hip" in message or "device" in message
            ):
                return True
        current = current.__cause__ or current.__context__
    return False


def _cupy_out_of_memory_type() -> type[BaseException] | None:
    """``cupy.cuda.memory.OutOfMemoryError`` when CuPy is loaded in this process, else None."""
    module = sys.modules.get("cupy.cuda.memory")
    if module is None:
        cuda = getattr(sys.modules.get("cupy"), "cuda", None)
        module = getattr(cuda, "memory", None)
    error_type = getattr(module, "OutOfMemoryError", None)
    if isinstance(error_type, type) and issubclass(error_type, BaseException):
        return error_type
    return None
