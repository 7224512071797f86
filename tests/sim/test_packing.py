"""predict_packing: the simulator's choice of trials_per_device."""

from __future__ import annotations

import pytest

from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.scheduler import make_policy
from waterwave_hpo.sim import SimPlan
from waterwave_hpo.sim import SimTrial
from waterwave_hpo.sim import predict_auto_packing
from waterwave_hpo.sim import predict_packing


def test_compute_bound_device_gains_nothing_from_packing() -> None:
    p = predict_packing([TrialProfile.of(0, [10])] * 4, 1000, compute_parallelism=1.0)
    assert p.best_k == 1 and p.speedup == pytest.approx(1.0)
    assert [o.k for o in p.options] == [1, 2, 3, 4]


def test_parallel_device_packs_up_to_its_parallelism() -> None:
    # 6 trials of 4 s alone; the device overlaps 3: k=3 runs two waves of 4 s (8 s).
    trial = SimTrial.uniform(TrialProfile.of(10, [40, 40]), 1.0, steps=4)
    p = predict_packing([trial] * 6, 400, "waterwave", compute_parallelism=3.0)
    assert p.best_k == 3
    assert p.option(3).makespan_s == pytest.approx(8.0)
    assert p.speedup == pytest.approx(3.0)


def test_packing_that_fails_trials_is_never_chosen() -> None:
    # Without a ledger, two 60-byte trials do not fit 100 bytes: k >= 2 ooms; and with
    # retries off they would fail, so k=1 is kept.
    trial = SimTrial((p := TrialProfile.of(0, [60])), (1.0,), (1.0,))
    pred = predict_packing([trial] * 3, 100, None, compute_parallelism=2.0)
    assert pred.option(2).ooms >= 1
    assert not pred.option(2).fits
    assert all(o.n_failed == 0 for o in pred.options if o.k == pred.best_k)
    assert p.peak_bytes == 60


def test_auto_packing_stops_where_residents_starve_the_pipeline() -> None:
    # 100 resident + 220 of activations (peak 320), capacity 1000: the ledger fits 7 at once
    # (700 + 220 <= 1000), but every trial past the fourth takes 100 bytes the pipeline needs
    # for the others' forwards, so the simulated makespan gets worse beyond 4.
    profile = TrialProfile.of(100, [50, 60, 70, 40])
    assert make_policy("waterwave").fits([profile] * 7, 1000)
    pred = predict_auto_packing(profile, 1000, "waterwave", max_k=8)
    assert [o.k for o in pred.options] == list(range(1, 9))
    assert pred.best_k == 4
    assert pred.option(5).makespan_s > pred.option(4).makespan_s
    assert pred.option(7).makespan_s > pred.option(4).makespan_s
    assert pred.speedup > 3.0  # four trials overlap well on a device that runs them at once


def test_auto_packing_of_a_profile_too_big_for_the_device_says_so() -> None:
    with pytest.raises(ValueError, match="capacity_bytes=100"):
        predict_auto_packing(TrialProfile.of(60, [60]), 100, "waterwave", max_k=4)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_k=0"):
        predict_packing([TrialProfile.of(0, [1])], 10, max_k=0)
    with pytest.raises(ValueError, match="capacity_bytes=10"):
        predict_packing([TrialProfile.of(0, [11])], 10)
    with pytest.raises(ValueError, match="trials is empty"):
        predict_packing([], 10)
    with pytest.raises(KeyError, match="k=9"):
        predict_packing([TrialProfile.of(0, [1])], 10).option(9)


def test_predict_packing_with_memory_plans_packs_more_trials_than_without() -> None:
    # Activation-heavy trials (peak 300 of a 400-byte device): without plans only one runs at
    # a time's worth of memory; with plans (smallest 170 bytes, 1.3x slower) a second runs
    # planned beside the first, and on a device that overlaps 4 trials that is faster.
    trial = SimTrial.uniform(TrialProfile.of(100, [50, 50, 50, 50]), 1.0, 4, plan=SimPlan(170, 1.3))
    without = predict_packing([trial] * 8, 400, "waterwave", max_k=4, compute_parallelism=4.0)
    with_plans = predict_packing(
        [trial] * 8, 400, "waterwave", max_k=4, compute_parallelism=4.0, memory_plans=True
    )
    assert without.best_k == 1
    assert with_plans.best_k >= 2
    best = with_plans.option(with_plans.best_k)
    assert best.makespan_s < without.option(without.best_k).makespan_s
    assert best.n_failed == 0
    auto = predict_auto_packing(TrialProfile.of(100, [50, 50, 50, 50]), 400, "waterwave", 4)
    auto_plans = predict_auto_packing(
        TrialProfile.of(100, [50, 50, 50, 50]), 400, "waterwave", 4, plan=SimPlan(170, 1.3)
    )
    assert auto_plans.best_k > auto.best_k


def test_a_trial_too_big_alone_fits_with_memory_plans_when_its_plan_does() -> None:
    trial = SimTrial.uniform(TrialProfile.of(100, [300]), 1.0, 2, plan=SimPlan(150, 1.5))
    with pytest.raises(ValueError, match="needs 400 bytes alone"):
        predict_packing([trial] * 2, 200, "waterwave")
    pred = predict_packing([trial] * 2, 200, "waterwave", memory_plans=True)
    assert all(o.n_failed == 0 for o in pred.options)
