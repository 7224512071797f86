"""What every planner returns, and the error a budget-aware planner raises."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from waterwave_hpo.planning._cost import predict
from waterwave_hpo.planning._plan import Placement
from waterwave_hpo.planning._plan import Prediction
from waterwave_hpo.planning._plan import StepProfile


@dataclass(frozen=True)
class PlannerResult:
    """A planner's answer.

    Attributes:
        choices: One placement per unit, in forward order.
        prediction: The cost model's step seconds and peak bytes for ``choices``.
    """

    choices: tuple[Placement, ...]
    prediction: Prediction


class PlanDoesNotFitError(ValueError):
    """No plan the planner can find keeps the predicted peak within the budget."""


class Planner(Protocol):
    """The planners' common interface.

    Args:
        profile: The step's profile.
        budget_bytes: The device bytes the step may use at its peak. Budget-aware planners
            (``capuchin``, ``exhaustive``, ``pso``) return a plan within it or raise
            :class:`PlanDoesNotFitError`; the baselines ignore it.
        bandwidth_bytes_per_s: Host<->device copy rate for the cost model.
        seed: Seed of a randomized planner (only ``pso`` is).
    """

    def __call__(
        self,
        profile: StepProfile,
        budget_bytes: int,
        *,
        bandwidth_bytes_per_s: float,
        seed: int,
    ) -> PlannerResult: ...


def result_of(
    profile: StepProfile, choices: tuple[Placement, ...], bandwidth_bytes_per_s: float
) -> PlannerResult:
    """Wrap ``choices`` with their prediction."""
    return PlannerResult(choices, predict(profile, choices, bandwidth_bytes_per_s))


def does_not_fit(planner: str, profile: StepProfile, budget_bytes: int, best_peak: int) -> str:
    """The message of :class:`PlanDoesNotFitError`: budget, best peak found, floor."""
    return (
        f"planner {planner!r} found no plan within budget_bytes={budget_bytes}: its best plan "
        f"peaks at {best_peak} bytes (parameters + gradients + optimizer state + activations "
        f"kept outside the units: {profile.static_bytes + profile.other_saved_bytes} bytes). "
        "Raise the budget, use a smaller batch, or try planner='exhaustive'/'pso'."
    )
