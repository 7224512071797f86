"""Warnings for the code paths that have never run on a GPU.

The CUDA paths are written against the real CUDA, PyTorch and CuPy APIs and tested on the CPU
against fakes only. Until ``waterwave-hpo doctor`` passes on a GPU and its report is committed,
their first use in a process emits one :class:`ExperimentalWarning` each, the way Optuna's
``@experimental_func`` marks new features.
"""

from __future__ import annotations

import enum
import threading
import warnings

import optuna


class ExperimentalWarning(optuna.exceptions.ExperimentalWarning):
    """A waterwave-hpo code path that has not yet run on a GPU was used.

    A subclass of Optuna's ``ExperimentalWarning``, so a filter that silences Optuna's also
    silences this one (``warnings.filterwarnings("ignore", category=...)``).
    """


class ExperimentalPath(enum.Enum):
    """The never-run CUDA paths; each value says what the path is."""

    POOL_CUDA = "StreamAwarePool(backend='cuda') (the CUDA driver upstream)"
    POOL_CUPY = "StreamAwarePool(backend='cupy') (CuPy's allocator as upstream)"
    EXECUTOR_CUDA = "the executor's CUDA path (a stream per trial, the pool on the device)"
    BENCH_CUDA = "the bench's methods on a CUDA device"
    LEASES_CUDA = "shared_gpu()'s memory leases on a CUDA device"


_warned: set[ExperimentalPath] = set()
_lock = threading.Lock()


def warn_experimental(path: ExperimentalPath, *, stacklevel: int = 3) -> None:
    """Emit :class:`ExperimentalWarning` for ``path``, the first time only in this process.

    Args:
        path: The code path being used.
        stacklevel: As for :func:`warnings.warn`; the default points at the caller's caller.
    """
    with _lock:
        if path in _warned:
            return
        _warned.add(path)
    warnings.warn(
        f"{path.value} is experimental: it has been tested against fakes on the CPU but has not "
        "yet run on a GPU. Run `waterwave-hpo doctor` on your GPU and report what it finds.",
        ExperimentalWarning,
        stacklevel=stacklevel,
    )


def reset_warnings() -> None:
    """Forget which paths have warned, so each warns again (for tests)."""
    with _lock:
        _warned.clear()
