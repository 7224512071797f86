"""Waterwave on a Ray cluster: one device-host actor per GPU, each co-hosting trials.

- :class:`RayExecutor`: ``WaterwaveExecutor`` whose device hosts are Ray actors
  (``num_gpus=1`` each) across the cluster; they reach the study through Ray, for that study
  and a host's calls only (:class:`StoragePermissionError` otherwise).
- :func:`shared_gpu`: Ray Tune resources that pack several trials on each GPU, with memory
  leases from a per-GPU broker (see :mod:`waterwave_hpo.integrations.ray_tune`).
- :func:`tune_hosts`: Ray Tune trials whose training functions run co-hosted in one actor per
  GPU (streams, the pool, the pipeline scheduler), results streamed back to Tune.
"""

from typing import TYPE_CHECKING

import lazy_loader

from waterwave_hpo.relay import StoragePermissionError

if TYPE_CHECKING:  # what type checkers see; at run time each name is imported on first use
    from waterwave_hpo.cluster._actor import ATTR_HOST
    from waterwave_hpo.cluster._actor import ATTR_NODE
    from waterwave_hpo.cluster._executor import AllHostsLostError
    from waterwave_hpo.cluster._executor import ClusterStats
    from waterwave_hpo.cluster._executor import RayExecutor
    from waterwave_hpo.cluster._shared_gpu import shared_gpu
    from waterwave_hpo.cluster._tune_hosts_api import tune_hosts

# Imported on first use, as the package's names are (waterwave_hpo/__init__.py): the actors
# whose classes live in this package's modules (the storage relay, the memory broker, the
# hosts) import this facade first, and RayExecutor's module imports torch and the executor.
__getattr__, __dir__, _lazy_names = lazy_loader.attach(
    __name__,
    submod_attrs={
        "_actor": ["ATTR_HOST", "ATTR_NODE"],
        "_executor": ["AllHostsLostError", "ClusterStats", "RayExecutor"],
        "_shared_gpu": ["shared_gpu"],
        "_tune_hosts_api": ["tune_hosts"],
    },
)

__all__ = [
    "ATTR_HOST",
    "ATTR_NODE",
    "AllHostsLostError",
    "ClusterStats",
    "RayExecutor",
    "StoragePermissionError",
    "shared_gpu",
    "tune_hosts",
]
