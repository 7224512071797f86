"""The three plans that ignore the budget: PyTorch, vDNN and Chen et al.'s sqrt(n) checkpoints."""

from __future__ import annotations

import math

from waterwave_hpo.planning._plan import Placement
from waterwave_hpo.planning._plan import StepProfile
from waterwave_hpo.planning._planners._base import PlannerResult
from waterwave_hpo.planning._planners._base import result_of


def plan_none(
    profile: StepProfile, budget_bytes: int, *, bandwidth_bytes_per_s: float, seed: int = 0
) -> PlannerResult:
    """Keep everything on the device: what PyTorch does."""
    return result_of(profile, (Placement.KEEP,) * len(profile.units), bandwidth_bytes_per_s)


def plan_swap_all(
    profile: StepProfile, budget_bytes: int, *, bandwidth_bytes_per_s: float, seed: int = 0
) -> PlannerResult:
    """Swap every unit out after its forward and prefetch it before its backward.

    vDNN (Rhu et al., MICRO 2016) offloads every layer's feature maps to host memory; here
    every placement unit is swapped.
    """
    return result_of(profile, (Placement.SWAP,) * len(profile.units), bandwidth_bytes_per_s)


def plan_checkpoint_sqrt(
    profile: StepProfile, budget_bytes: int, *, bandwidth_bytes_per_s: float, seed: int = 0
) -> PlannerResult:
    """Keep about ``sqrt(n)`` evenly spaced units, recompute the others.

    Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016), Sec. 4: ``sqrt(n)``
    segments whose boundaries are stored and whose insides are recomputed. Our units are
    checkpointed one by one, so a recompute unit stores its input (the segment boundary) and
    the kept units are the ``sqrt(n)`` ends of segments (ours: the mapping onto units).
    """
    n = len(profile.units)
    if n == 0:
        return result_of(profile, (), bandwidth_bytes_per_s)
    segment = max(1, math.ceil(math.sqrt(n)))
    choices = tuple(
        Placement.KEEP if (i + 1) % segment == 0 or i == n - 1 else Placement.RECOMPUTE
        for i in range(n)
    )
    return result_of(profile, choices, bandwidth_bytes_per_s)


def plan_smallest(profile: StepProfile, *, bandwidth_bytes_per_s: float) -> PlannerResult:
    """Of the budget-blind plans, the one with the smallest predicted peak.

    Among ``swap_all``, ``checkpoint_sqrt`` and recompute-everything (ties: the faster).
    HOME's swarm is seeded with all three (``_pso``), so ``pso`` and ``exhaustive`` find a plan
    for any budget at or above this peak; the executor uses it as the smallest footprint a
    trial can be planned down to (ours).
    """
    n = len(profile.units)
    candidates = [
        plan_swap_all(profile, 0, bandwidth_bytes_per_s=bandwidth_bytes_per_s),
        plan_checkpoint_sqrt(profile, 0, bandwidth_bytes_per_s=bandwidth_bytes_per_s),
        result_of(profile, (Placement.RECOMPUTE,) * n, bandwidth_bytes_per_s),
    ]
    return min(candidates, key=lambda r: (r.prediction.peak_bytes, r.prediction.step_s))
