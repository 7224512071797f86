"""Warnings for the CUDA code paths, saying what of each has and has not run on a GPU.

The CUDA paths are written against the real CUDA, PyTorch and CuPy APIs and tested on the CPU
against fakes. One GPU run so far: an NVIDIA H200 on 2026-11-27 (torch 2.11.0+cu130, CuPy 14.2.0),
where ``waterwave-hpo doctor --device cuda`` passed 16 of 16 checks and ``pytest -m gpu`` 18 of
19 tests. Until each path's claims are measured there (the GPU benchmark script's results
committed with the device named), its first use in a process emits one
:class:`ExperimentalWarning`, the way Optuna's ``@experimental_func`` marks new features.
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


#: The GPU run of 2026-11-27 (one NVIDIA H200, torch 2.11.0+cu130, CuPy 14.2.0), per path.
GPU_RUN = "the H200 run of 2026-11-27 (torch 2.11.0+cu130)"
#: What each path has and has not shown on a GPU.
GPU_STATUS: dict[ExperimentalPath, str] = {
    ExperimentalPath.POOL_CUDA: (
        f"it ran on {GPU_RUN}: the doctor's pool checks passed and 18 of 19 GPU tests; the "
        "record-stream test failed there (a block a busy stream had read was handed to a third "
        "stream, and that test could not tell whether the third stream waited; it now writes "
        "the block and reads the result, and has not run on a GPU since). As PyTorch's "
        "process-wide allocator it cost 11-67% of a co-hosted study's wall time against "
        "PyTorch's caching allocator; the changes since are not measured on a GPU"
    ),
    ExperimentalPath.POOL_CUPY: (
        f"it ran on {GPU_RUN} with CuPy 14.2.0 (the doctor's CuPy check and the GPU tests' "
        "CuPy cases passed); its speed has not been measured on a GPU"
    ),
    ExperimentalPath.EXECUTOR_CUDA: (
        f"it ran on {GPU_RUN}: the demo and 16-trial studies at 4 and 8 trials at once "
        "completed every trial, but with the pool they were slower than with PyTorch's own "
        "allocator; the gain over Optuna's n_jobs and at high memory demand is not yet shown "
        "on a GPU"
    ),
    ExperimentalPath.BENCH_CUDA: (
        f"on {GPU_RUN} only resnet at light demand finished within the time given; high "
        "demand and the gpt workload have not finished on a GPU"
    ),
    ExperimentalPath.LEASES_CUDA: "it has not yet run on a GPU",
}

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
        f"{path.value} is experimental: it is tested against fakes on the CPU, and "
        f"{GPU_STATUS[path]}. Run `waterwave-hpo doctor` on your GPU and report what it finds.",
        ExperimentalWarning,
        stacklevel=stacklevel,
    )


def reset_warnings() -> None:
    """Forget which paths have warned, so each warns again (for tests)."""
    with _lock:
        _warned.clear()
