"""HOME's particle swarm optimization over keep/swap/recompute plans.

What is HOME's (He et al., "HOME: A Holistic GPU Memory Management Framework for Deep
Learning", IEEE Trans. Computers 2022, Sec. 4): the whole model's placement is searched at
once by a particle swarm over the discrete per-unit choice {keep, swap, recompute}; the fitness
is the predicted step time with a penalty for a peak over the memory budget; the swarm is
seeded with known plans.

What is ours: the units (the NodeGroup profiler's atoms, not single tensors); the discrete
update (each particle holds per-unit preference scores for the three choices, pulled towards
its own best and the swarm's best; a unit samples its choice by the softmax of its scores,
with a small mutation rate); the seeds (the ``none``, ``swap_all``, ``checkpoint_sqrt``,
recompute-everything and Capuchin-style plans); the penalty's form; and a closing improvement
pass on the best plan that changes one or two units at a time.
Deterministic under ``seed`` (its own ``random.Random``, no global state).
"""

from __future__ import annotations

from collections.abc import Callable
import math
import random

from waterwave_hpo.planning._cost import predict
from waterwave_hpo.planning._plan import Placement
from waterwave_hpo.planning._plan import Prediction
from waterwave_hpo.planning._plan import StepProfile
from waterwave_hpo.planning._planners._base import PlanDoesNotFitError
from waterwave_hpo.planning._planners._base import PlannerResult
from waterwave_hpo.planning._planners._base import does_not_fit
from waterwave_hpo.planning._planners._base import result_of
from waterwave_hpo.planning._planners._baselines import plan_checkpoint_sqrt
from waterwave_hpo.planning._planners._baselines import plan_none
from waterwave_hpo.planning._planners._baselines import plan_swap_all
from waterwave_hpo.planning._planners._capuchin import plan_capuchin

_CHOICES = (Placement.KEEP, Placement.SWAP, Placement.RECOMPUTE)

#: Swarm size, iterations, inertia, pull towards the particle's and the swarm's best.
N_PARTICLES = 24
N_ITERATIONS = 60
INERTIA = 0.6
C_PERSONAL = 1.2
C_GLOBAL = 1.6
#: Probability that a unit takes a random choice in a move (keeps the swarm exploring).
MUTATION = 0.04
#: Fitness penalty per unit of relative excess over the budget, in multiples of the
#: keep-everything step time.
PENALTY = 100.0
#: Scores are clamped to [-V_MAX, V_MAX]; a choice is sampled with weight exp(score / T).
V_MAX = 4.0
TEMPERATURE = 0.5
#: The closing improvement pass also tries changing two units at once up to this many units.
PAIR_MOVES_MAX_UNITS = 32


def fitness(p: Prediction, budget_bytes: int, time_scale_s: float) -> float:
    """Predicted seconds, plus a penalty growing with the relative excess over the budget."""
    over = max(0, p.peak_bytes - budget_bytes) / max(1, budget_bytes)
    return p.step_s + (PENALTY * time_scale_s * (1.0 + over) if over > 0 else 0.0)


def plan_pso(
    profile: StepProfile, budget_bytes: int, *, bandwidth_bytes_per_s: float, seed: int = 0
) -> PlannerResult:
    """HOME's PSO: the least predicted step time within ``budget_bytes``, searched by a swarm.

    Raises:
        PlanDoesNotFitError: If the best plan found is still over the budget.
    """
    n = len(profile.units)
    rng = random.Random(seed)
    bw = bandwidth_bytes_per_s
    keep = plan_none(profile, budget_bytes, bandwidth_bytes_per_s=bw)
    scale = max(keep.prediction.step_s, 1e-9)
    if n == 0:
        if keep.prediction.peak_bytes > budget_bytes:
            raise PlanDoesNotFitError(
                does_not_fit("pso", profile, budget_bytes, keep.prediction.peak_bytes)
            )
        return keep
    cache: dict[tuple[Placement, ...], float] = {}

    def score(x: tuple[Placement, ...]) -> float:
        f = cache.get(x)
        if f is None:
            f = fitness(predict(profile, x, bw), budget_bytes, scale)
            cache[x] = f
        return f

    seeds = [
        keep.choices,
        plan_swap_all(profile, budget_bytes, bandwidth_bytes_per_s=bw).choices,
        plan_checkpoint_sqrt(profile, budget_bytes, bandwidth_bytes_per_s=bw).choices,
        (Placement.RECOMPUTE,) * n,
    ]
    try:
        seeds.append(plan_capuchin(profile, budget_bytes, bandwidth_bytes_per_s=bw).choices)
    except PlanDoesNotFitError:
        pass
    positions = list(seeds)
    while len(positions) < N_PARTICLES:
        positions.append(tuple(rng.choice(_CHOICES) for _ in range(n)))
    velocities = [[[0.0, 0.0, 0.0] for _ in range(n)] for _ in positions]
    personal = list(positions)
    personal_f = [score(x) for x in positions]
    g = min(range(len(positions)), key=lambda i: personal_f[i])
    best, best_f = personal[g], personal_f[g]
    for _ in range(N_ITERATIONS):
        for p, x in enumerate(positions):
            v = velocities[p]
            new: list[Placement] = []
            for d in range(n):
                r1, r2 = rng.random(), rng.random()
                vd = v[d]
                for c in range(3):
                    here = 1.0 if x[d] is _CHOICES[c] else 0.0
                    pb = 1.0 if personal[p][d] is _CHOICES[c] else 0.0
                    gb = 1.0 if best[d] is _CHOICES[c] else 0.0
                    vd[c] = (
                        INERTIA * vd[c]
                        + C_PERSONAL * r1 * (pb - here)
                        + C_GLOBAL * r2 * (gb - here)
                    )
                    vd[c] = max(-V_MAX, min(V_MAX, vd[c]))
                if rng.random() < MUTATION:
                    new.append(rng.choice(_CHOICES))
                else:
                    # Sample a choice with probability growing with its score (softmax).
                    weights = [math.exp(vd[c] / TEMPERATURE) for c in range(3)]
                    new.append(rng.choices(_CHOICES, weights)[0])
            xn = tuple(new)
            positions[p] = xn
            f = score(xn)
            if f < personal_f[p]:
                personal[p], personal_f[p] = xn, f
                if f < best_f:
                    best, best_f = xn, f
    best, best_f = _improve(best, best_f, score)
    result = result_of(profile, best, bw)
    if result.prediction.peak_bytes > budget_bytes:
        raise PlanDoesNotFitError(
            does_not_fit("pso", profile, budget_bytes, result.prediction.peak_bytes)
        )
    return result


def _improve(
    x: tuple[Placement, ...], f: float, score: Callable[[tuple[Placement, ...]], float]
) -> tuple[tuple[Placement, ...], float]:
    """Change one unit, or two (up to ``PAIR_MOVES_MAX_UNITS`` units), while the fitness drops.

    Ours, after the swarm: a plan one or two changes from a better one is common when the
    budget binds (trade one unit's recompute for another's swap).
    """
    n = len(x)
    improved = True
    while improved:
        improved = False
        for d in range(n):
            for c in _CHOICES:
                if c is x[d]:
                    continue
                y = (*x[:d], c, *x[d + 1 :])
                fy = score(y)
                if fy < f:
                    x, f, improved = y, fy, True
        if improved or n > PAIR_MOVES_MAX_UNITS:
            continue
        for d in range(n):
            for e in range(d + 1, n):
                for c in _CHOICES:
                    for c2 in _CHOICES:
                        if c is x[d] or c2 is x[e]:
                            continue
                        moved = list(x)
                        moved[d], moved[e] = c, c2
                        ty = tuple(moved)
                        fy = score(ty)
                        if fy < f:
                            x, f, improved = ty, fy, True
    return x, f
