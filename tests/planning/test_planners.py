"""The planners: exactness against a brute force, PSO's determinism and quality, budgets."""

from __future__ import annotations

import itertools
import random

import pytest

from waterwave_hpo.planning import PLANNERS
from waterwave_hpo.planning import Placement
from waterwave_hpo.planning import PlanDoesNotFitError
from waterwave_hpo.planning import StepProfile
from waterwave_hpo.planning import Unit
from waterwave_hpo.planning import predict

BW = 1e9


def random_profile(rng: random.Random, n: int) -> StepProfile:
    units = []
    for i in range(n):
        saved = rng.randrange(1, 50) * 1_000_000
        units.append(
            Unit(
                f"u{i}",
                saved_bytes=saved,
                input_bytes=rng.randrange(1, 1 + saved // 1_000_000) * 200_000,
                forward_s=rng.uniform(0.001, 0.02),
                backward_s=rng.uniform(0.002, 0.04),
            )
        )
    return StepProfile(tuple(units), static_bytes=10_000_000, other_saved_bytes=1000)


def budget_between(profile: StepProfile, fraction: float) -> int:
    peak = predict(profile, [Placement.KEEP] * len(profile.units), BW).peak_bytes
    return int(profile.static_bytes + fraction * (peak - profile.static_bytes))


def brute_force(profile: StepProfile, budget: int) -> float | None:
    times = [
        p.step_s
        for c in itertools.product(list(Placement), repeat=len(profile.units))
        if (p := predict(profile, c, BW)).peak_bytes <= budget
    ]
    return min(times) if times else None


@pytest.mark.parametrize("seed", range(6))
def test_exhaustive_is_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    profile = random_profile(rng, rng.randrange(2, 7))
    budget = budget_between(profile, rng.uniform(0.3, 0.9))
    best = brute_force(profile, budget)
    if best is None:
        with pytest.raises(PlanDoesNotFitError):
            PLANNERS["exhaustive"](profile, budget, bandwidth_bytes_per_s=BW, seed=0)
        return
    result = PLANNERS["exhaustive"](profile, budget, bandwidth_bytes_per_s=BW, seed=0)
    assert result.prediction.step_s == best
    assert result.prediction.peak_bytes <= budget


def test_pso_is_deterministic_under_a_seed() -> None:
    profile = random_profile(random.Random(3), 12)
    budget = budget_between(profile, 0.5)
    a = PLANNERS["pso"](profile, budget, bandwidth_bytes_per_s=BW, seed=7)
    b = PLANNERS["pso"](profile, budget, bandwidth_bytes_per_s=BW, seed=7)
    assert a == b


@pytest.mark.parametrize("seed", range(4))
def test_pso_is_within_two_percent_of_the_optimum(seed: int) -> None:
    rng = random.Random(100 + seed)
    profile = random_profile(rng, 8)
    budget = budget_between(profile, 0.45)
    try:
        exact = PLANNERS["exhaustive"](profile, budget, bandwidth_bytes_per_s=BW, seed=0)
    except PlanDoesNotFitError:
        pytest.fail("the test's budget should be reachable")
    pso = PLANNERS["pso"](profile, budget, bandwidth_bytes_per_s=BW, seed=seed)
    assert pso.prediction.peak_bytes <= budget
    assert pso.prediction.step_s <= exact.prediction.step_s * 1.02


@pytest.mark.parametrize("name", ["capuchin", "exhaustive", "pso"])
def test_budget_aware_planners_keep_the_peak_within_the_budget(name: str) -> None:
    profile = random_profile(random.Random(11), 7)
    for fraction in (1.0, 0.7, 0.4):
        budget = budget_between(profile, fraction)
        result = PLANNERS[name](profile, budget, bandwidth_bytes_per_s=BW, seed=0)
        assert result.prediction.peak_bytes <= budget


@pytest.mark.parametrize("name", ["capuchin", "exhaustive", "pso"])
def test_budget_aware_planners_raise_below_every_plan(name: str) -> None:
    profile = random_profile(random.Random(5), 5)
    with pytest.raises(PlanDoesNotFitError, match="budget_bytes=10000001"):
        PLANNERS[name](profile, 10_000_001, bandwidth_bytes_per_s=BW, seed=0)


def test_exhaustive_refuses_more_than_ten_units() -> None:
    profile = random_profile(random.Random(1), 11)
    with pytest.raises(ValueError, match=r"at most 10 units.*pso"):
        PLANNERS["exhaustive"](profile, 10**12, bandwidth_bytes_per_s=BW, seed=0)


def test_capuchin_swaps_when_the_link_hides_it_and_recomputes_when_not() -> None:
    units = tuple(
        Unit(
            f"u{i}", saved_bytes=10_000_000, input_bytes=1_000_000, forward_s=0.01, backward_s=0.02
        )
        for i in range(4)
    )
    profile = StepProfile(units, static_bytes=0)
    budget = 25_000_000
    fast = PLANNERS["capuchin"](profile, budget, bandwidth_bytes_per_s=1e12, seed=0)
    slow = PLANNERS["capuchin"](profile, budget, bandwidth_bytes_per_s=1e6, seed=0)
    assert Placement.SWAP in fast.choices and Placement.RECOMPUTE not in fast.choices
    assert Placement.RECOMPUTE in slow.choices and Placement.SWAP not in slow.choices


def test_baselines_are_what_they_name() -> None:
    profile = random_profile(random.Random(2), 9)
    none = PLANNERS["none"](profile, 1, bandwidth_bytes_per_s=BW, seed=0)
    swap = PLANNERS["swap_all"](profile, 1, bandwidth_bytes_per_s=BW, seed=0)
    sqrt = PLANNERS["checkpoint_sqrt"](profile, 1, bandwidth_bytes_per_s=BW, seed=0)
    assert set(none.choices) == {Placement.KEEP}
    assert set(swap.choices) == {Placement.SWAP}
    assert sqrt.choices.count(Placement.KEEP) == 3  # sqrt(9) segment ends
