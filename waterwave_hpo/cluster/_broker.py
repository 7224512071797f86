"""The per-GPU memory broker: a Ray named actor around a :class:`LeaseBook`, one per GPU.

Every trial process on a GPU finds the same broker by name (``waterwave-gpu/<node>/<gpu>`` in
the ``waterwave_hpo`` namespace) and asks it for a memory lease. The actor is detached, so it
outlives the trial that happened to create it; it uses no CPU reservation and lives on the
GPU's node. Its methods return at once (the client polls), so one thread serves every trial.
"""

from __future__ import annotations

from typing import Any

from waterwave_hpo.cluster._imports import import_ray
from waterwave_hpo.cluster._leases import LeaseBook
from waterwave_hpo.cluster._leases import LeaseStats
from waterwave_hpo.cluster._leases import MemoryLease

NAMESPACE = "waterwave_hpo"


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
