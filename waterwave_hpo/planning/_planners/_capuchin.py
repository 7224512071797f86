"""A Capuchin-style greedy planner (Peng et al., ASPLOS 2020, Sec. 4.4, on our units)."""

from __future__ import annotations

from waterwave_hpo.planning._cost import predict
from waterwave_hpo.planning._plan import Placement
from waterwave_hpo.planning._plan import StepProfile
from waterwave_hpo.planning._planners._base import PlanDoesNotFitError
from waterwave_hpo.planning._planners._base import PlannerResult
from waterwave_hpo.planning._planners._base import does_not_fit
from waterwave_hpo.planning._planners._base import result_of

#: A swap whose predicted step time is within this fraction of the plan without it counts as
#: hidden behind compute.
HIDDEN_FRACTION = 1e-9


def plan_capuchin(
    profile: StepProfile, budget_bytes: int, *, bandwidth_bytes_per_s: float, seed: int = 0
) -> PlannerResult:
    """Greedy: swap where the transfer hides behind compute, else recompute the cheapest.

    Starting from "keep everything", while the predicted peak is over ``budget_bytes``:
    swap the largest kept unit whose swap lowers the peak without lengthening the step
    (Capuchin's "swap first when the transfer is hidden"); if there is none, recompute the
    kept unit, among those whose recompute lowers the peak, with the least recompute seconds
    per byte freed (Capuchin's MSPS ranking, on forward seconds over
    ``saved_bytes - input_bytes - random_bytes``); failing that, the swap adding the least
    time per byte of peak it removes. Each step asks the cost model.

    Raises:
        PlanDoesNotFitError: If no single change lowers the peak and it is still over budget.
    """
    n = len(profile.units)
    choices = [Placement.KEEP] * n
    current = predict(profile, choices, bandwidth_bytes_per_s)
    while current.peak_bytes > budget_bytes:
        best_swap: tuple[int, int] | None = None  # (saved_bytes, unit)
        best_rec: tuple[float, int] | None = None  # (seconds per byte, unit)
        any_swap: tuple[float, int] | None = None  # (seconds added per byte freed, unit)
        for i, u in enumerate(profile.units):
            if choices[i] is not Placement.KEEP:
                continue
            trial = list(choices)
            trial[i] = Placement.SWAP
            p = predict(profile, trial, bandwidth_bytes_per_s)
            freed_swap = current.peak_bytes - p.peak_bytes
            if freed_swap > 0:
                if p.step_s <= current.step_s * (1 + HIDDEN_FRACTION):
                    if best_swap is None or u.saved_bytes > best_swap[0]:
                        best_swap = (u.saved_bytes, i)
                cost = (p.step_s - current.step_s) / freed_swap
                if any_swap is None or cost < any_swap[0]:
                    any_swap = (cost, i)
            trial[i] = Placement.RECOMPUTE
            if predict(profile, trial, bandwidth_bytes_per_s).peak_bytes < current.peak_bytes:
                freed = u.saved_bytes - u.input_bytes - u.random_bytes
                rate = u.forward_s / max(freed, 1)
                if best_rec is None or rate < best_rec[0]:
                    best_rec = (rate, i)
        if best_swap is not None:
            choices[best_swap[1]] = Placement.SWAP
        elif best_rec is not None:
            choices[best_rec[1]] = Placement.RECOMPUTE
        elif any_swap is not None:
            choices[any_swap[1]] = Placement.SWAP
        else:
            raise PlanDoesNotFitError(
                does_not_fit("capuchin", profile, budget_bytes, current.peak_bytes)
            )
        current = predict(profile, choices, bandwidth_bytes_per_s)
    return result_of(profile, tuple(choices), bandwidth_bytes_per_s)
