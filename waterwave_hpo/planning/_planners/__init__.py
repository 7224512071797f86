"""The planners, one module each, by name (``PLANNERS``)."""

from __future__ import annotations

from waterwave_hpo.planning._planners._base import PlanDoesNotFitError
from waterwave_hpo.planning._planners._base import Planner
from waterwave_hpo.planning._planners._base import PlannerResult
from waterwave_hpo.planning._planners._baselines import plan_checkpoint_sqrt
from waterwave_hpo.planning._planners._baselines import plan_none
from waterwave_hpo.planning._planners._baselines import plan_smallest
from waterwave_hpo.planning._planners._baselines import plan_swap_all
from waterwave_hpo.planning._planners._capuchin import plan_capuchin
from waterwave_hpo.planning._planners._exhaustive import MAX_EXHAUSTIVE_UNITS
from waterwave_hpo.planning._planners._exhaustive import plan_exhaustive
from waterwave_hpo.planning._planners._pso import plan_pso

#: Planner name -> planner. The budget-aware ones are ``BUDGET_AWARE``.
PLANNERS: dict[str, Planner] = {
    "none": plan_none,
    "swap_all": plan_swap_all,
    "checkpoint_sqrt": plan_checkpoint_sqrt,
    "capuchin": plan_capuchin,
    "exhaustive": plan_exhaustive,
    "pso": plan_pso,
}
BUDGET_AWARE = frozenset({"capuchin", "exhaustive", "pso"})

__all__ = [
    "BUDGET_AWARE",
    "MAX_EXHAUSTIVE_UNITS",
    "PLANNERS",
    "PlanDoesNotFitError",
    "Planner",
    "PlannerResult",
    "plan_capuchin",
    "plan_checkpoint_sqrt",
    "plan_exhaustive",
    "plan_none",
    "plan_pso",
    "plan_smallest",
    "plan_swap_all",
]
