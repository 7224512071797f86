"""Memory planning (HOME): keep, swap or recompute each placement unit to fit a budget.

HOME (He et al., "HOME: A Holistic GPU Memory Management Framework for Deep Learning", IEEE
Trans. Computers 2022). ``fit_memory(model, budget_bytes, example_input=...)`` profiles,
plans and installs; ``plan_of(model)`` returns the plan. The cost model (``predict``) and the
planners (``PLANNERS``) are pure functions over a :class:`StepProfile`.
"""

from __future__ import annotations

from waterwave_hpo.planning._cost import DEFAULT_BANDWIDTH_BYTES_PER_S
from waterwave_hpo.planning._cost import predict
from waterwave_hpo.planning._fit import fit_memory
from waterwave_hpo.planning._fit import memory_ledger
from waterwave_hpo.planning._fit import plan_of
from waterwave_hpo.planning._fit import remove_memory_plan
from waterwave_hpo.planning._fit import step_profile_of
from waterwave_hpo.planning._ledger import StepLedger
from waterwave_hpo.planning._plan import MemoryPlan
from waterwave_hpo.planning._plan import Placement
from waterwave_hpo.planning._plan import Prediction
from waterwave_hpo.planning._plan import StepProfile
from waterwave_hpo.planning._plan import Unit
from waterwave_hpo.planning._planners import BUDGET_AWARE
from waterwave_hpo.planning._planners import MAX_EXHAUSTIVE_UNITS
from waterwave_hpo.planning._planners import PLANNERS
from waterwave_hpo.planning._planners import PlanDoesNotFitError
from waterwave_hpo.planning._planners import PlannerResult
from waterwave_hpo.planning._rng import RecomputeMismatchError
from waterwave_hpo.planning._units import CheckpointedModelError

__all__ = [
    "BUDGET_AWARE",
    "DEFAULT_BANDWIDTH_BYTES_PER_S",
    "MAX_EXHAUSTIVE_UNITS",
    "PLANNERS",
    "CheckpointedModelError",
    "MemoryPlan",
    "Placement",
    "PlanDoesNotFitError",
    "PlannerResult",
    "Prediction",
    "RecomputeMismatchError",
    "StepLedger",
    "StepProfile",
    "Unit",
    "fit_memory",
    "memory_ledger",
    "plan_of",
    "predict",
    "remove_memory_plan",
    "step_profile_of",
]
