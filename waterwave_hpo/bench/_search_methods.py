"""The ways of sharing a device that the search bench runs the demo's search under."""

from __future__ import annotations

import enum


class SearchMethod(enum.Enum):
    """A way to run the demo's NAS + HPO search on one device, K trials at a time.

    ``TEMPORAL``: one trial at a time (``study.optimize``, ``n_jobs=1``). ``OPTUNA_THREADS``:
    Optuna's ``study.optimize(n_jobs=K)``, K threads on one stream and PyTorch's allocator.
    ``EXECUTOR_THREADS``: :class:`~waterwave_hpo.WaterwaveExecutor` with
    ``trials_per_device=K``, co-hosted trials in threads, a CUDA stream each and the
    stream-aware pool on a GPU. ``EXECUTOR_PROCESS``: the executor with
    ``isolation="process"``, each of the K slots a worker process. ``FUSED``: the executor with
    ``fuse=K`` on one slot, each batch of K trials trained as one fused model (HFTA,
    arXiv:2102.02344); fused models must share a structure, so the batch's first trial samples
    the whole space and the other K-1 take its architecture, optimizer and batch size and
    sample only their learning rate and dropout
    (:func:`waterwave_hpo.demo.make_fused_nas_objective`).
    """

    TEMPORAL = "temporal"
    OPTUNA_THREADS = "optuna-threads"
    EXECUTOR_THREADS = "executor-threads"
    EXECUTOR_PROCESS = "executor-process"
    FUSED = "fused"

    @property
    def label(self) -> str:
        """A short label for plots and tables."""
        return {
            SearchMethod.TEMPORAL: "one at a time",
            SearchMethod.OPTUNA_THREADS: "Optuna n_jobs=K",
            SearchMethod.EXECUTOR_THREADS: "executor, K threads",
            SearchMethod.EXECUTOR_PROCESS: 'executor, isolation="process"',
            SearchMethod.FUSED: "fused, fuse=K",
        }[self]

    @property
    def concurrent(self) -> bool:
        """Whether trials run at once (every method but ``TEMPORAL``): TPE's constant liar on."""
        return self is not SearchMethod.TEMPORAL

    @property
    def shares_cores(self) -> bool:
        """Whether K trials share the CPU's cores at once (so each gets 1/K of its threads).

        A fused batch is one model in one thread pool: it keeps all of them, as one trial at a
        time does.
        """
        return self in (
            SearchMethod.OPTUNA_THREADS,
            SearchMethod.EXECUTOR_THREADS,
            SearchMethod.EXECUTOR_PROCESS,
        )
