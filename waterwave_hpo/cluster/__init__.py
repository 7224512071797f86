"""Waterwave on a Ray cluster: one device-host actor per GPU, each co-hosting trials.

- :class:`RayExecutor`: ``WaterwaveExecutor`` whose device hosts are Ray actors
  (``num_gpus=1`` each) across the cluster; the study is served to them through Optuna's gRPC
  storage proxy.
"""

from waterwave_hpo.cluster._actor import ATTR_HOST
from waterwave_hpo.cluster._executor import AllHostsLostError
from waterwave_hpo.cluster._executor import RayExecutor

__all__ = ["ATTR_HOST", "AllHostsLostError", "RayExecutor"]
