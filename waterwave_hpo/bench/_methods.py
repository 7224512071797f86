"""The ways of sharing one device that the bench compares, and which exist on which device."""

from __future__ import annotations

import enum

import torch


class Method(enum.Enum):
    """A way to run N trials on one device, K at a time.

    ``TEMPORAL``: one trial at a time (K = 1). ``OPTUNA_THREADS``: Optuna's
    ``study.optimize(n_jobs=K)``, threads on PyTorch's stock allocator and one stream (what
    users do today). ``SPATIAL``: K processes on the device (MPS when the machine runs it).
    ``CUDA_MALLOC_ASYNC``: K threads, one CUDA stream each, PyTorch's
    ``backend:cudaMallocAsync`` (the driver's stream-ordered pool). ``WATERWAVE_FIFO`` and
    ``WATERWAVE``: :class:`~waterwave_hpo.WaterwaveExecutor` with the stream-aware pool (CUDA)
    and NodeGroup gates, under the ``fifo`` or ``waterwave`` policy. ``WATERWAVE_PLANS``: the
    executor with ``memory_plan="home"``: each trial's model registered with
    :func:`waterwave_hpo.fit_trial_memory` instead of gates, so a trial that does not fit
    beside its neighbours runs with a HOME keep/swap/recompute plan (co-hosting
    at high memory demand with plans, beside the two without). ``FUSED``: the
    executor with ``fuse=K`` on one slot: each batch of up to K trials is grouped by model
    structure and each group trained as one horizontally fused model (HFTA, arXiv:2102.02344);
    trials of a structure no other trial of their batch shares train alone.
    """

    TEMPORAL = "temporal"
    OPTUNA_THREADS = "optuna-threads"
    SPATIAL = "spatial"
    CUDA_MALLOC_ASYNC = "cuda-malloc-async"
    WATERWAVE_FIFO = "waterwave-fifo"
    WATERWAVE = "waterwave"
    WATERWAVE_PLANS = "waterwave-plans"
    FUSED = "fused"

    @property
    def label(self) -> str:
        """A short label for plots."""
        return {
            Method.TEMPORAL: "temporal (1 at a time)",
            Method.OPTUNA_THREADS: "optuna n_jobs=K",
            Method.SPATIAL: "K processes",
            Method.CUDA_MALLOC_ASYNC: "cudaMallocAsync, K streams",
            Method.WATERWAVE_FIFO: "waterwave, fifo",
            Method.WATERWAVE: "waterwave",
            Method.WATERWAVE_PLANS: "waterwave + HOME plans",
            Method.FUSED: "fused, K per model",
        }[self]

    @property
    def gated(self) -> bool:
        """Whether its trials run with NodeGroup gates (the executor's pipeline scheduler)."""
        return self in (Method.WATERWAVE_FIFO, Method.WATERWAVE)

    @property
    def budgeted(self) -> bool:
        """Whether it runs on the executor, whose scheduler's ledger enforces the capacity."""
        return self.gated or self is Method.WATERWAVE_PLANS


def unavailable_reason(method: Method, device: torch.device) -> str | None:
    """Why ``method`` cannot run on ``device``, or ``None`` if it can.

    ``CUDA_MALLOC_ASYNC`` exists only on CUDA; every other method runs on the CPU too (the
    waterwave executor then enforces the budget with its ledger, without the pool).
    """
    if method is Method.CUDA_MALLOC_ASYNC and device.type != "cuda":
        return "not available on this device: backend:cudaMallocAsync is a CUDA driver pool"
    return None


def mps_running() -> bool:
    """Whether a CUDA MPS control daemon seems to run (its pipe directory exists)."""
    import os

    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))
