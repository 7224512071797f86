"""The per-GPU memory broker: a Ray named actor around a :class:`LeaseBook`, one per GPU.

Every trial process on a GPU finds the same broker by name (``waterwave-gpu/<node>/<gpu>`` in
the ``waterwave_hpo`` namespace) and asks it for a memory lease. The actor is detached, so it
outlives the trial that happened to create it; it uses no CPU reservation and lives on the
GPU's node. Its methods return at once (the client polls), so one thread serves every trial.

Being on the node, the broker also reads what a dead holder process left there: a process that
holds a lease for its lifetime (``RayExecutor(isolation="process")``'s host actors) writes its
fatal-error report (:mod:`faulthandler`: the signal and the Python stack) to
:func:`crash_report_path`; when the driver sees it die, :meth:`GPUMemoryBroker.holder_died`
frees its lease at once (the replacement need not wait for the time-to-live) and returns the
report, so the trial's fail reason names the signal.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
import tempfile
import threading
from typing import Any

from waterwave_hpo import _experimental
from waterwave_hpo.cluster._imports import import_ray
from waterwave_hpo.memory._internal import LeaseBook
from waterwave_hpo.memory._internal import LeaseStats
from waterwave_hpo.memory._internal import MemoryLease

_logger = logging.getLogger("waterwave_hpo")
NAMESPACE = "waterwave_hpo"
CUDA_BUDGET_FRACTION = 0.9
"""Without ``memory_budget_bytes``, leases share 90 % of the GPU's memory; the rest is left for
the trial processes' CUDA contexts, which no allocator counts."""


class GPUMemoryBroker:
    """The actor: :class:`LeaseBook`'s methods, remotely."""

    def __init__(self, budget_bytes: int | None, trials_per_gpu: int | None, ttl_s: float):
        self._book = LeaseBook(budget_bytes, trials_per_gpu, ttl_s)

    def request(
        self,
        holder: str,
        nbytes: int | None,
        budget_bytes: int | None,
        trials_per_gpu: int | None,
        ttl_s: float,
    ) -> None:
        # The latest request's settings hold (a new Tune run on a long-lived cluster).
        self._book.configure(budget_bytes, trials_per_gpu, ttl_s)
        self._book.request(holder, nbytes)

    def poll(self, holder: str) -> MemoryLease | None:
        return self._book.poll(holder)

    def renew(self, holder: str) -> float | None:
        return self._book.renew(holder)

    def release(self, holder: str, peak_bytes: int | None) -> None:
        self._book.release(holder, peak_bytes)

    def stats(self) -> LeaseStats:
        return self._book.stats()

    def holder_died(self, holder: str, pid: int) -> str | None:
        """Free the lease of ``holder`` (process ``pid`` died); return its crash report."""
        self._book.release(holder, None)
        return read_crash_report(pid)


def crash_report_path(pid: int) -> Path:
    """Where process ``pid`` of this node writes its fatal-error report."""
    return Path(tempfile.gettempdir()) / "waterwave-hpo-crashes" / f"{pid}.txt"


def read_crash_report(pid: int) -> str | None:
    """The fatal-error report process ``pid`` wrote on this node (then removed), or ``None``."""
    path = crash_report_path(pid)
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    with contextlib.suppress(OSError):
        os.unlink(path)
    return text.strip() or None


def broker_name(node_id: str, gpu_id: str) -> str:
    """The broker's actor name for GPU ``gpu_id`` of node ``node_id``."""
    return f"waterwave-gpu/{node_id}/{gpu_id}"


def find_broker(node_id: str, gpu_id: str) -> Any:
    """The broker of this GPU.

    Raises:
        LookupError: If no trial on that GPU has asked for a lease yet.
    """
    ray = import_ray()
    try:
        return ray.get_actor(broker_name(node_id, gpu_id), namespace=NAMESPACE)
    except ValueError:
        raise LookupError(
            f"No memory broker for GPU {gpu_id} of node {node_id}: no trial there has taken a "
            "lease (SharedGPU.lease() or SharedGPU.wrap()) yet."
        ) from None


def get_broker(
    node_id: str, gpu_id: str, budget_bytes: int | None, trials_per_gpu: int | None, ttl_s: float
) -> Any:
    """The broker of this GPU, created on first use."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return (
        ray.remote(GPUMemoryBroker)
        .options(
            name=broker_name(node_id, gpu_id),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(budget_bytes, trials_per_gpu, ttl_s)
    )


def cuda_device() -> Any:
    """This process's current CUDA device, or ``None`` without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    return torch.device("cuda", torch.cuda.current_device())


def cap_cuda(device: Any, granted: MemoryLease) -> None:
    """Cap PyTorch's caching allocator in this process to the lease (no-op without a size)."""
    import torch

    if granted.nbytes is None:
        return
    _experimental.warn_experimental(_experimental.ExperimentalPath.LEASES_CUDA)
    total = int(torch.cuda.get_device_properties(device).total_memory)
    torch.cuda.set_per_process_memory_fraction(min(1.0, granted.nbytes / total), device)
    torch.cuda.reset_peak_memory_stats(device)


def renew_lease(broker: Any, holder: str, stop: threading.Event, every_s: float) -> None:
    """Renew ``holder``'s lease every ``every_s`` seconds until ``stop`` is set or it expired."""
    import ray

    while not stop.wait(every_s):
        try:
            ttl_s = ray.get(broker.renew.remote(holder))
        except Exception:
            return
        if ttl_s is None:
            _logger.warning("The memory lease %s expired while held.", holder)
            return
        every_s = ttl_s / 4  # another run may have changed the broker's time-to-live
