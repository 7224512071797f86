"""NVIDIA's Multi-Process Service (MPS): whether it runs, and what it means for the workers.

Without MPS the GPU time-slices between the CUDA contexts of different processes: kernels of
two workers never run at once, so GPU-bound trials in K workers take about as long as one at a
time (NVIDIA's MPS documentation, "When to use MPS"); only host-side work (data loading, Python,
launches) overlaps. Under MPS the workers' kernels overlap, and each client may be bounded by
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, which the driver enforces and which covers the client's
context; but a fatal GPU fault in one client (an illegal address) ends the other clients on
that GPU too, so a crash is no longer the crashing trial's alone.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
import logging
import os
import subprocess
import threading

_logger = logging.getLogger("waterwave_hpo")
PIPE_DIRECTORY_DEFAULT = "/tmp/nvidia-mps"
"""Where the MPS control daemon's pipe is when ``CUDA_MPS_PIPE_DIRECTORY`` is not set."""
MIB = 1 << 20


@dataclass(frozen=True)
class MpsStatus:
    """Whether an MPS control daemon serves this machine's CUDA clients.

    Attributes:
        running: Whether it does.
        evidence: What showed it (or what was looked at), for a log line.
    """

    running: bool
    evidence: str


def detect_mps(
    env: Mapping[str, str] | None = None,
    exists: Callable[[str], bool] = os.path.exists,
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> MpsStatus:
    """Whether MPS runs: the control daemon's pipe, else ``nvidia-smi -q``'s process list.

    Args:
        env: The environment (default ``os.environ``): ``CUDA_MPS_PIPE_DIRECTORY`` names the
            daemon's pipe directory (default :data:`PIPE_DIRECTORY_DEFAULT`).
        exists: ``os.path.exists`` (a test passes a fake).
        run: ``subprocess.run`` (a test passes a fake).
    """
    env = os.environ if env is None else env
    pipe = os.path.join(env.get("CUDA_MPS_PIPE_DIRECTORY") or PIPE_DIRECTORY_DEFAULT, "control")
    if exists(pipe):
        return MpsStatus(True, f"the MPS control daemon's pipe {pipe}")
    try:
        done = run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return MpsStatus(False, f"no {pipe}, and nvidia-smi could not run")
    if "nvidia-cuda-mps-server" in (done.stdout or ""):
        return MpsStatus(True, "nvidia-smi -q lists nvidia-cuda-mps-server")
    return MpsStatus(False, f"no {pipe}, and nvidia-smi -q lists no nvidia-cuda-mps-server")


def pinned_memory_limit(device_index: int, nbytes: int) -> dict[str, str]:
    """The environment that bounds one MPS client to ``nbytes`` on device ``device_index``.

    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` takes ``<device>=<size>`` with a unit; whole MiB,
    rounded down.
    """
    return {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{device_index}={max(1, nbytes // MIB)}M"}


_warned = threading.Event()


def say_how_workers_share(status: MpsStatus, n_workers: int) -> None:
    """Log, once per process, what ``n_workers`` worker processes on one GPU will do."""
    if _warned.is_set() or n_workers < 2:
        return
    _warned.set()
    if status.running:
        _logger.info(
            "MPS runs (%s): the %d worker processes' kernels overlap on the GPU, each bounded "
            "by CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; under MPS a fatal GPU fault in one worker "
            "(an illegal address) ends the other workers on that GPU too.",
            status.evidence,
            n_workers,
        )
        return
    _logger.warning(
        "isolation='process' without NVIDIA MPS (%s): the GPU time-slices between the %d "
        "worker processes, so their kernels never overlap and GPU-bound trials run about as "
        "fast as one at a time (only host-side work overlaps). Start MPS "
        "(nvidia-cuda-mps-control -d) to overlap them, or use isolation='threads'.",
        status.evidence,
        n_workers,
    )
