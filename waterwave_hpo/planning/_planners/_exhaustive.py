"""The exact optimum over all ``3**n`` plans, for small models: the planners' reference."""

from __future__ import annotations

import itertools

from waterwave_hpo.planning._cost import predict
from waterwave_hpo.planning._plan import Placement
from waterwave_hpo.planning._plan import StepProfile
from waterwave_hpo.planning._planners._base import PlanDoesNotFitError
from waterwave_hpo.planning._planners._base import PlannerResult
from waterwave_hpo.planning._planners._base import does_not_fit
from waterwave_hpo.planning._planners._base import result_of

#: Above this many units ``3**n`` predictions take too long (3**10 = 59049, about a second).
MAX_EXHAUSTIVE_UNITS = 10

_ORDER = (Placement.KEEP, Placement.SWAP, Placement.RECOMPUTE)


def plan_exhaustive(
    profile: StepProfile, budget_bytes: int, *, bandwidth_bytes_per_s: float, seed: int = 0
) -> PlannerResult:
    """The plan of least predicted step time whose predicted peak is within the budget.

    Ties go to the first plan in the order keep < swap < recompute per unit, first unit most
    significant (so "keep" wins where it costs nothing).

    Raises:
        ValueError: If the profile has more than ``MAX_EXHAUSTIVE_UNITS`` units.
        PlanDoesNotFitError: If no plan is within the budget.
    """
    n = len(profile.units)
    if n > MAX_EXHAUSTIVE_UNITS:
        raise ValueError(
            f"planner 'exhaustive' searches 3**n plans and takes at most "
            f"{MAX_EXHAUSTIVE_UNITS} units, but the model has {n}; use planner='pso'."
        )
    best: tuple[float, tuple[Placement, ...]] | None = None
    least_peak: int | None = None
    for choices in itertools.product(_ORDER, repeat=n):
        p = predict(profile, choices, bandwidth_bytes_per_s)
        if least_peak is None or p.peak_bytes < least_peak:
            least_peak = p.peak_bytes
        if p.peak_bytes <= budget_bytes and (best is None or p.step_s < best[0]):
            best = (p.step_s, choices)
    if best is None:
        raise PlanDoesNotFitError(
            does_not_fit("exhaustive", profile, budget_bytes, least_peak or 0)
        )
    return result_of(profile, best[1], bandwidth_bytes_per_s)
