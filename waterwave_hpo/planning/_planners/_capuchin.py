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
    kept unit with the least recompute seconds per byte freed (Capuchin's MSPS ranking, on
    forward seconds over ``saved_bytes - input_bytes``). Each step asks the cost model.

    Raises:
        PlanDoesNotFitError: If no step lowers the peak any more and it is still over budget.
    """
    n = len(profile.units)
    choices = [Placement.KEEP] * n
    current = predict(profile, choices, bandwidth_bytes_per_s)
    while current.peak_bytes > budget_bytes:
        best_swap: tuple[int, int] | None = None  # (saved_bytes, unit)
        best_rec: tuple[float, int] | None = None  # (seconds per byte, unit)
        for i, u in enumerate(profile.units):
            if choices[i] is not Placement.KEEP:
                continue
            trial = list(choices)
            trial[i] = Placement.SWAP
            p = predict(profile, trial, bandwidth_bytes_per_s)
            hidden = p.step_s <= current.step_s * (1 + HIDDEN_FRACTION)
            if hidden and p.peak_bytes < current.peak_bytes:
                if best_swap is None or u.saved_bytes > best_swap[0]:
                    best_swap = (u.saved_bytes, i)
            freed = u.saved_bytes - u.input_bytes
            if freed > 0:
                rate = u.forward_s / freed
                if best_rec is None or rate < best_rec[0]:
                    best_rec = (rate, i)
        if best_swap is not None:
            choices[best_swap[1]] = Placement.SWAP
        elif best_rec is not None:
            choices[best_rec[1]] = Placement.RECOMPUTE
        else:
            # Nothing hides and nothing recomputes profitably: swap the largest kept unit.
            kept = [i for i in range(n) if choices[i] is Placement.KEEP]
            if not kept:
                raise PlanDoesNotFitError(
                    does_not_fit("capuchin", profile, budget_bytes, current.peak_bytes)
                )
            choices[max(kept, key=lambda i: profile.units[i].saved_bytes)] = Placement.SWAP
        nxt = predict(profile, choices, bandwidth_bytes_per_s)
        current = nxt
    return result_of(profile, tuple(choices), bandwidth_bytes_per_s)
