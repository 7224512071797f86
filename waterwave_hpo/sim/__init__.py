"""A discrete-event model of one shared device, for decisions before launching trials.

``simulate(trials, device, sharing)`` runs co-hosted trials (NodeGroup profiles in bytes, solo
timings in seconds) on a device with a memory capacity and shared compute, under the same
scheduler policies as the executor (or the stock allocator, or separate processes);
``predict_packing(trials, capacity_bytes, policy)`` picks ``trials_per_device`` from it, and
``predict_auto_packing`` is the prediction the executor's ``trials_per_device="auto"`` follows.
"""

from __future__ import annotations

from waterwave_hpo.sim._engine import simulate
from waterwave_hpo.sim._packing import PackingOption
from waterwave_hpo.sim._packing import PackingPrediction
from waterwave_hpo.sim._packing import predict_auto_packing
from waterwave_hpo.sim._packing import predict_packing
from waterwave_hpo.sim._result import AttemptOutcome
from waterwave_hpo.sim._result import SimAttempt
from waterwave_hpo.sim._result import SimResult
from waterwave_hpo.sim._spec import PLAN_SHRINK
from waterwave_hpo.sim._spec import Sharing
from waterwave_hpo.sim._spec import SimDevice
from waterwave_hpo.sim._spec import SimPlan
from waterwave_hpo.sim._spec import SimTrial

__all__ = [
    "PLAN_SHRINK",
    "AttemptOutcome",
    "PackingOption",
    "PackingPrediction",
    "Sharing",
    "SimAttempt",
    "SimDevice",
    "SimPlan",
    "SimResult",
    "SimTrial",
    "predict_auto_packing",
    "predict_packing",
    "simulate",
]
