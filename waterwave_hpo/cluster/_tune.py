"""``SharedGPU``: a Ray Tune resource request that packs several trials on each GPU.

``SharedGPU``: a Ray Tune resource request that packs several trials on each GPU, with
memory leases so that their peaks do not collide. Imports Ray Tune; see :func:`shared_gpu`.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import functools
import logging
import os
import threading
import time
from typing import Any
import uuid

from ray.tune import PlacementGroupFactory

from waterwave_hpo import _checks
from waterwave_hpo.cluster._broker import CUDA_BUDGET_FRACTION as _CUDA_BUDGET_FRACTION
from waterwave_hpo.cluster._broker import cap_cuda as _cap_cuda
from waterwave_hpo.cluster._broker import cuda_device as _cuda_device
from waterwave_hpo.cluster._broker import find_broker
from waterwave_hpo.cluster._broker import get_broker
from waterwave_hpo.cluster._broker import renew_lease as _renew
from waterwave_hpo.cluster._imports import import_ray
from waterwave_hpo.memory._internal import LeaseStats
from waterwave_hpo.memory._internal import MemoryLease

_logger = logging.getLogger("waterwave_hpo")
_POLL_S = 0.05


class LeaseTimeoutError(TimeoutError):
    """Raised by :meth:`SharedGPU.lease` when no lease was granted within ``timeout_s``."""


class SharedGPU(PlacementGroupFactory):
    """What :func:`waterwave_hpo.shared_gpu` returns.

    What :func:`waterwave_hpo.shared_gpu` returns: a ``tune.PlacementGroupFactory`` with one
    bundle ``{"CPU": cpus_per_trial, "GPU": 1 / trials_per_gpu}``, plus the memory lease that
    trainables take through :meth:`lease` or :meth:`wrap`.

    Pass it as ``tune.with_resources(trainable, ...)`` or ``tune.run(...,
    resources_per_trial=...)``. Build it with :func:`waterwave_hpo.shared_gpu`, which checks
    the arguments. With Tune's ``reuse_actors=True`` a finished trial's process runs the next
    trial instead of a new process starting for each (Ray's worker, torch and the trainable's
    imports: 8 trials of a small model took 10-11 s instead of 46-48 s on a 2-core CPU VM,
    ``experiments/tune_reuse_actors.py``); leases are still taken and given back per trial.

    It also reads as the mapping Tune's callers take for ``resources_per_trial``:
    ``resources["gpu"]`` is the GPU share (``1 / trials_per_gpu``), ``resources["cpu"]`` the
    CPUs, so ``resources.get("gpu", 0)`` (transformers' Ray backend) works.

    When Ray places a trial (:meth:`to_placement_group`) on a cluster that has no GPU, it
    raises at once, instead of leaving the trials PENDING (``on_no_gpu="error"``, default);
    ``on_no_gpu="wait"`` keeps Tune's behaviour, for an autoscaling cluster that adds GPU nodes.

    Attributes:
        trials_per_gpu: Trials Ray places on one GPU (the bundle asks ``1 / trials_per_gpu``).
        auto: ``trials_per_gpu="auto"``: up to ``trials_per_gpu`` are placed and the leases,
            sized by measured peaks, decide how many train at once.
        cpus_per_trial: CPUs per trial.
        memory_budget_bytes: The bytes per GPU the trials' leases share; ``None``: 90 % of the
            GPU's total memory (CUDA), and no coordination without CUDA.
        memory_per_trial_bytes: A trial's lease when it does not ask for a size; ``None``:
            ``memory_budget_bytes / trials_per_gpu``, or the measured median peak with "auto".
        lease_ttl_s: A lease whose process stops renewing it (died, stopped by Tune) expires
            after this many seconds.
        on_no_gpu: ``"error"`` or ``"wait"``: what placing a trial on a cluster without GPUs
            does.
    """

    def __init__(
        self,
        trials_per_gpu: int,
        auto: bool,
        cpus_per_trial: float,
        memory_budget_bytes: int | None,
        memory_per_trial_bytes: int | None,
        lease_ttl_s: float,
        on_no_gpu: str = "error",
    ) -> None:
        bundle = {"CPU": float(cpus_per_trial), "GPU": _gpu_share(trials_per_gpu)}
        super().__init__([bundle])
        self.trials_per_gpu = trials_per_gpu
        self.auto = auto
        self.cpus_per_trial = float(cpus_per_trial)
        self.memory_budget_bytes = memory_budget_bytes
        self.memory_per_trial_bytes = memory_per_trial_bytes
        self.lease_ttl_s = float(lease_ttl_s)
        self.on_no_gpu = on_no_gpu

    # The mapping Tune's callers read (resources_per_trial={"cpu": ..., "gpu": ...}).
    def _as_dict(self) -> dict[str, float]:
        bundle = self.bundles[0]
        return {"cpu": float(bundle.get("CPU", 0.0)), "gpu": float(bundle.get("GPU", 0.0))}

    def __getitem__(self, key: str) -> float:
        """``resources["cpu"]`` / ``resources["gpu"]``: one trial's CPUs and GPU share."""
        return self._as_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        """``resources.get("gpu", 0)``, as on the dict Tune's callers expect."""
        return self._as_dict().get(key, default)

    def keys(self) -> Any:
        """``("cpu", "gpu")``."""
        return self._as_dict().keys()

    def values(self) -> Any:
        """The CPUs and the GPU share."""
        return self._as_dict().values()

    def items(self) -> Any:
        """``[("cpu", cpus), ("gpu", share)]``."""
        return self._as_dict().items()

    def __iter__(self) -> Iterator[str]:
        return iter(self._as_dict())

    def __len__(self) -> int:
        return 2

    def __contains__(self, key: object) -> bool:
        return key in self._as_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (Tune copies a trial's resources in the driver): refuses a GPU-less cluster."""
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._refuse_a_cluster_without_gpus()

    def _refuse_a_cluster_without_gpus(self) -> None:
        if getattr(self, "on_no_gpu", "error") != "error":
            return
        ray = import_ray()
        if not ray.is_initialized():
            return
        gpus = ray.cluster_resources().get("GPU", 0)
        if not gpus:
            raise RuntimeError(
                "waterwave_hpo.shared_gpu(): this Ray cluster has no GPU "
                f"(ray.cluster_resources() counts GPU={gpus}), so Tune would keep every "
                "trial PENDING. Start Ray on a machine with GPUs (or ray.init(num_gpus=N) "
                "for logical GPUs), use CPU resources ({'cpu': 1}) without shared_gpu(), "
                "or pass shared_gpu(..., on_no_gpu='wait') on an autoscaling cluster that "
                "adds GPU nodes."
            )

    def to_placement_group(self) -> Any:
        """Ray's placement group for one trial; refuses a cluster without GPUs.

        Tune calls this when it places a trial. With ``on_no_gpu="error"`` a cluster whose
        resources count no GPU raises here, within seconds of the start, instead of leaving
        every trial PENDING.

        Raises:
            RuntimeError: If the cluster has no GPU and ``on_no_gpu="error"``.
        """
        self._refuse_a_cluster_without_gpus()
        return super().to_placement_group()  # type: ignore[no-untyped-call]

    def __repr__(self) -> str:
        return (
            f"SharedGPU(trials_per_gpu={'auto' if self.auto else self.trials_per_gpu}, "
            f"cpus_per_trial={self.cpus_per_trial:g}, gpu_share={self.bundles[0].get('GPU')}, "
            f"memory_budget_bytes={self.memory_budget_bytes}, "
            f"memory_per_trial_bytes={self.memory_per_trial_bytes})"
        )

    @contextlib.contextmanager
    def lease(
        self, nbytes: int | None = None, timeout_s: float | None = None
    ) -> Iterator[MemoryLease]:
        """Hold a lease of this trial's GPU memory while the ``with`` block runs.

        Call it inside a Tune trial placed with this request. It asks the GPU's broker for
        ``nbytes`` (``None``: ``memory_per_trial_bytes``, else sized by the broker) and blocks
        until the leases already granted on the GPU leave room (first come, first served; a
        trial alone on its GPU is always granted). On CUDA, PyTorch's per-process memory
        fraction is then set to the lease, so a trial that outgrows it gets
        ``torch.cuda.OutOfMemoryError`` in its own process instead of its neighbours. A
        background thread renews the lease; on exit it is released with the process's measured
        peak (``torch.cuda.max_memory_reserved``: what PyTorch's caching allocator held), which
        sizes later "auto" leases.

        Args:
            nbytes: Bytes to lease (> 0), or ``None``.
            timeout_s: Give up after this many seconds of waiting (> 0); ``None``: wait.

        Yields:
            The :class:`MemoryLease` granted.

        Raises:
            RuntimeError: Outside a Ray task or actor that holds a GPU share.
            LeaseTimeoutError: If no lease was granted within ``timeout_s``.
            ValueError: If ``nbytes`` or ``timeout_s`` is not > 0.
        """
        if nbytes is not None and (isinstance(nbytes, bool) or not nbytes > 0):
            raise _checks.value_error("nbytes", nbytes, "must be > 0", "pass bytes, or None")
        if timeout_s is not None and not timeout_s > 0:
            raise _checks.value_error(
                "timeout_s", timeout_s, "must be > 0", "pass seconds, or None"
            )
        ray = import_ray()
        if not ray.is_initialized():
            raise RuntimeError(
                "SharedGPU.lease() must run inside a Ray Tune trial (Ray is not initialized "
                "in this process)."
            )
        gpu_ids = ray.get_gpu_ids()
        if not gpu_ids:
            raise RuntimeError(
                "SharedGPU.lease() ran in a Ray worker that holds no GPU share. Place the "
                "trial with resources_per_trial=waterwave_hpo.shared_gpu(...) (or "
                "tune.with_resources(trainable, waterwave_hpo.shared_gpu(...)))."
            )
        node_id = ray.get_runtime_context().get_node_id()
        gpu_id = str(gpu_ids[0])
        cuda = _cuda_device()
        budget = self.memory_budget_bytes
        if budget is None and cuda is not None:
            import torch

            total = int(torch.cuda.get_device_properties(cuda).total_memory)
            budget = int(total * _CUDA_BUDGET_FRACTION)
        per_gpu = None if self.auto else self.trials_per_gpu
        broker = get_broker(node_id, gpu_id, budget, per_gpu, self.lease_ttl_s)
        holder = f"{node_id[:8]}/pid{os.getpid()}/{uuid.uuid4().hex[:8]}"
        wanted = nbytes if nbytes is not None else self.memory_per_trial_bytes
        ray.get(broker.request.remote(holder, wanted, budget, per_gpu, self.lease_ttl_s))
        start = time.monotonic()
        try:
            while True:
                granted: MemoryLease | None = ray.get(broker.poll.remote(holder))
                if granted is not None:
                    break
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise LeaseTimeoutError(
                        f"No memory lease of {wanted} bytes on GPU {gpu_id} within "
                        f"timeout_s={timeout_s}; the trials on that GPU hold the rest of its "
                        f"{budget} bytes. Raise timeout_s, lower nbytes, or lower trials_per_gpu."
                    )
                time.sleep(_POLL_S)
        except BaseException:
            with contextlib.suppress(Exception):
                ray.get(broker.release.remote(holder, None))
            raise
        stop = threading.Event()
        renewer = threading.Thread(
            target=_renew, args=(broker, holder, stop, self.lease_ttl_s / 4), daemon=True
        )
        renewer.start()
        if cuda is not None:
            _cap_cuda(cuda, granted)
        peak: int | None = None
        try:
            yield granted
        finally:
            stop.set()
            if cuda is not None:
                with contextlib.suppress(Exception):
                    import torch

                    peak = int(torch.cuda.max_memory_reserved(cuda))
            with contextlib.suppress(Exception):
                ray.get(broker.release.remote(holder, peak))

    def wrap(self, trainable: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        """Return a function trainable that runs ``trainable(config)`` holding a :meth:`lease`.

        Raises:
            TypeError: If ``trainable`` is a class (a class trainable takes the lease itself:
                enter ``resources.lease()`` in ``setup`` and exit it in ``cleanup``).
        """
        if isinstance(trainable, type) or not callable(trainable):
            raise TypeError(
                f"wrap() takes a function trainable, got {trainable!r}. For a class "
                "trainable, hold SharedGPU.lease() from setup() to cleanup()."
            )
        resources = self

        @functools.wraps(trainable)
        def leased(config: dict[str, Any]) -> Any:
            with resources.lease():
                return trainable(config)

        return leased


def lease_stats(gpu_id: str | int | None = None, node_id: str | None = None) -> LeaseStats:
    """The memory leases of one GPU now, from its broker.

    Args:
        gpu_id: The GPU's Ray id (``ray.get_gpu_ids()``); ``None``: this worker's GPU.
        node_id: The node's Ray id; ``None``: this process's node.

    Raises:
        LookupError: If no trial on that GPU has taken a lease yet.
        ValueError: If ``gpu_id`` is ``None`` and this process holds no GPU.
    """
    ray = import_ray()
    if gpu_id is None:
        ids = ray.get_gpu_ids()
        if not ids:
            raise ValueError(
                "gpu_id=None means this worker's GPU, but it holds none; pass gpu_id=0 (the "
                "GPU's Ray id)."
            )
        gpu_id = ids[0]
    node = node_id if node_id is not None else ray.get_runtime_context().get_node_id()
    stats: LeaseStats = ray.get(find_broker(node, str(gpu_id)).stats.remote())
    return stats


def _gpu_share(trials_per_gpu: int) -> float:
    # Ray keeps resource amounts to 4 decimals; round down so k shares fit one GPU.
    return int(10_000 / trials_per_gpu) / 10_000
