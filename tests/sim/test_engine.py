"""The simulator against hand-computed two-job cases (given profiles, given capacity)."""

from __future__ import annotations

import pytest

from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.scheduler import make_policy
from waterwave_hpo.sim import AttemptOutcome
from waterwave_hpo.sim import Sharing
from waterwave_hpo.sim import SimDevice
from waterwave_hpo.sim import SimPlan
from waterwave_hpo.sim import SimTrial
from waterwave_hpo.sim import predict_auto_packing
from waterwave_hpo.sim import simulate


def one_group(nbytes: int = 60, resident: int = 0, steps: int = 1) -> SimTrial:
    """Forward 1 s, backward 1 s, one NodeGroup of ``nbytes``."""
    return SimTrial(TrialProfile.of(resident, [nbytes]), (1.0,), (1.0,), steps)


def spans(result):  # (trial, start_s, end_s, outcome) in the order attempts ended
    return [(a.trial_index, a.start_s, a.end_s, a.outcome) for a in result.attempts]


C = AttemptOutcome.COMPLETE


@pytest.mark.parametrize("policy", ["fifo", "waterwave"])
def test_second_job_waits_when_both_do_not_fit(policy: str) -> None:
    # 60 + 60 > 100: B waits for A's backward to free its 60 bytes at t=2, then runs 2..4.
    r = simulate([one_group(), one_group()], SimDevice(100), Sharing(2, policy=policy))
    assert spans(r) == [(0, 0.0, 2.0, C), (1, 0.0, 4.0, C)]
    assert (r.makespan_s, r.peak_bytes, r.evictions, r.ooms) == (4.0, 60, 0, 0)


def test_jobs_that_fit_share_compute_equally() -> None:
    # Both fit (120 <= 120); parallelism 1: each runs at half speed, 2 s of work ends at t=4.
    r = simulate([one_group(), one_group()], SimDevice(120), Sharing(2, policy="fifo"))
    assert spans(r) == [(0, 0.0, 4.0, C), (1, 0.0, 4.0, C)]
    assert r.peak_bytes == 120 and r.max_concurrent == 2


def test_parallel_device_overlaps_jobs() -> None:
    r = simulate(
        [one_group(), one_group()],
        SimDevice(120, compute_parallelism=2.0),
        Sharing(2, policy="fifo"),
    )
    assert r.makespan_s == pytest.approx(2.0)


def test_interfering_jobs_are_slower_together_than_in_turn() -> None:
    # Parallelism 0.5: together the two progress at half a solo speed (0.25 each), so 2 s of
    # work each ends at t=8; a job alone still runs at full speed.
    r = simulate(
        [one_group(), one_group()],
        SimDevice(120, compute_parallelism=0.5),
        Sharing(2, policy="fifo"),
    )
    assert r.makespan_s == pytest.approx(8.0)
    alone = simulate([one_group()], SimDevice(120, compute_parallelism=0.5), Sharing(1))
    assert alone.makespan_s == pytest.approx(2.0)


def test_processes_start_up_before_their_first_trial() -> None:
    # Two processes each pay 3 s of start-up (in parallel, once), then run their trials.
    t = one_group(nbytes=10)
    r = simulate(
        [t, t, t, t],
        SimDevice(100, compute_parallelism=2.0, mps=True),
        Sharing(2, policy=None, processes=True, process_start_s=3.0),
    )
    assert [a.start_s for a in r.attempts] == [0.0, 0.0, 5.0, 5.0]
    assert r.makespan_s == pytest.approx(7.0)


def test_temporal_sharing_is_the_sum() -> None:
    r = simulate([one_group(), one_group(steps=3)], SimDevice(1000), Sharing(1))
    assert spans(r) == [(0, 0.0, 2.0, C), (1, 2.0, 8.0, C)]


def test_stock_allocator_ooms_and_retry_runs_alone() -> None:
    # No ledger: B's 60 bytes do not fit next to A's at t=0 -> OOM; re-run after A, 2..4.
    r = simulate([one_group(), one_group()], SimDevice(100), Sharing(2, policy=None))
    assert spans(r) == [(1, 0.0, 0.0, AttemptOutcome.OOM), (0, 0.0, 2.0, C), (1, 2.0, 4.0, C)]
    assert (r.ooms, r.n_complete, r.n_failed) == (1, 2, 0)


def test_stock_allocator_without_retry_fails_the_trial() -> None:
    r = simulate(
        [one_group(), one_group()], SimDevice(100), Sharing(2, policy=None, retry_on_oom=False)
    )
    assert (r.ooms, r.n_complete, r.n_failed, r.makespan_s) == (1, 1, 1, 2.0)


def two_groups() -> TrialProfile:
    return TrialProfile.of(10, [40, 40])  # peak 90


def test_fifo_deadlocks_and_evicts_the_younger_job() -> None:
    # Capacity 130. t=0: A and B each hold 10 + 40 (100 used); both forwards of group 0 share
    # the device and end at t=2; both then ask 40 with 30 free -> deadlock, B (younger) is
    # evicted. A: group 1 forward 2..3, backward 3..4, group 0 backward 4..5. B re-runs alone
    # (it had one neighbour, so it waits for none): 4 s of work, 5..9.
    t = SimTrial(two_groups(), (1.0, 1.0), (1.0, 1.0))
    r = simulate([t, t], SimDevice(130), Sharing(2, policy="fifo"))
    assert spans(r) == [
        (1, 0.0, 2.0, AttemptOutcome.EVICTED),
        (0, 0.0, 5.0, C),
        (1, 5.0, 9.0, C),
    ]
    assert r.evictions == 1


def test_waterwave_policy_avoids_the_deadlock() -> None:
    # Same jobs: the banker's check refuses B's group 0 while A's step could starve (granting
    # it would leave 30 free, A and B each still needing 40). A runs alone 0..4 and B 4..8;
    # no eviction, one second sooner than fifo.
    t = SimTrial(two_groups(), (1.0, 1.0), (1.0, 1.0))
    r = simulate([t, t], SimDevice(130), Sharing(2, policy="waterwave"))
    assert spans(r) == [(0, 0.0, 4.0, C), (1, 0.0, 8.0, C)]
    assert (r.evictions, r.peak_bytes) == (0, 100)


def test_processes_pay_a_context_and_time_slice_without_mps() -> None:
    t = one_group(nbytes=10)
    device = SimDevice(100, compute_parallelism=2.0, context_bytes=40)
    r = simulate([t, t], device, Sharing(2, policy=None, processes=True))
    # Both fit (2 * 50), but without MPS the two processes time-slice: 4 s, not 2.
    assert (r.makespan_s, r.peak_bytes, r.ooms) == (4.0, 100, 0)
    mps = simulate(
        [t, t],
        SimDevice(100, compute_parallelism=2.0, context_bytes=40, mps=True),
        Sharing(2, policy=None, processes=True),
    )
    assert mps.makespan_s == pytest.approx(2.0)


def test_host_work_is_shared_by_co_hosted_trials_only() -> None:
    # Host-bound passes: 1 s of host each, no device work. One process: the GIL serializes
    # them (4 s for two trials of 2 passes); separate processes: 2 s.
    t = SimTrial(TrialProfile.of(0, [1]), (0.0,), (0.0,), 1, host_s=1.0)
    shared = simulate([t, t], SimDevice(100), Sharing(2, policy="fifo"))
    separate = simulate([t, t], SimDevice(100), Sharing(2, policy=None, processes=True))
    assert shared.makespan_s == pytest.approx(4.0)
    assert separate.makespan_s == pytest.approx(2.0)


def test_auto_concurrency_does_not_start_trials_that_could_only_wait() -> None:
    # Capacity 120, each trial 10 resident + two 40-byte groups (peak 90). waterwave's fits
    # admits 4 (4 * 10 + 80 = 120), but next to one trial's step (90) a second trial's resident
    # and first group (10 + 40) never fit: only one step runs at a time, so extra trials could
    # only wait. "auto" runs one at a time and loses nothing against 4 at once.
    t = SimTrial(two_groups(), (1.0, 1.0), (1.0, 1.0))
    assert make_policy("waterwave").fits([two_groups()] * 4, 120)
    device = SimDevice(120, compute_parallelism=4.0)
    auto = simulate([t] * 6, device, Sharing("auto", policy="waterwave"))
    four = simulate([t] * 6, device, Sharing(4, policy="waterwave"))
    assert auto.max_concurrent == 1
    assert auto.makespan_s == pytest.approx(24.0) == four.makespan_s
    fifo = simulate([t] * 6, SimDevice(120), Sharing("auto", policy="fifo"))
    assert fifo.max_concurrent == 1  # 2 * 90 > 120
    assert fifo.makespan_s == pytest.approx(24.0)


def test_auto_concurrency_stops_where_the_prediction_does_below_what_fits() -> None:
    # 30 resident + two 20-byte groups, capacity 200: fits admits 5 (150 + 40 <= 200), the
    # prediction picks fewer; "auto" starts that many and is not slower than 5 at once.
    profile = TrialProfile.of(30, [20, 20])
    t = SimTrial.uniform(profile, 1.0, steps=2)
    fitting = max(k for k in range(1, 9) if make_policy("waterwave").fits([profile] * k, 200))
    best_k = predict_auto_packing(profile, 200, "waterwave", 16).best_k
    assert fitting == 5 and 2 <= best_k < fitting
    device = SimDevice(200, compute_parallelism=16.0)
    auto = simulate([t] * 10, device, Sharing("auto", policy="waterwave"))
    at_fit = simulate([t] * 10, device, Sharing(fitting, policy="waterwave"))
    assert auto.max_concurrent == best_k
    assert auto.makespan_s <= at_fit.makespan_s + 1e-9


def test_memory_timeline_returns_to_zero() -> None:
    r = simulate([one_group()] * 3, SimDevice(200), Sharing(3, policy="waterwave"))
    assert r.memory_timeline[-1][1] == 0
    assert max(b for _, b in r.memory_timeline) == r.peak_bytes == 180


def test_bad_inputs_name_the_argument() -> None:
    with pytest.raises(ValueError, match="trials is empty"):
        simulate([], SimDevice(1))
    with pytest.raises(TypeError, match=r"trials\[0\]"):
        simulate([TrialProfile.of(0, [1])], SimDevice(1))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="capacity_bytes=0"):
        SimDevice(0)
    with pytest.raises(ValueError, match="compute_parallelism"):
        SimDevice(1, compute_parallelism=0.0)
    with pytest.raises(ValueError, match="concurrency=0"):
        Sharing(0)
    with pytest.raises(ValueError, match="one forward_s and one backward_s per NodeGroup"):
        SimTrial(TrialProfile.of(0, [1, 2]), (1.0,), (1.0,))
    with pytest.raises(ValueError, match="not a known policy"):
        simulate([one_group()], SimDevice(100), Sharing(1, policy="lifo"))


def test_trial_larger_than_capacity_is_evicted_or_ooms() -> None:
    big = one_group(nbytes=200)
    assert simulate([big], SimDevice(100), Sharing(1)).attempts[0].outcome is (
        AttemptOutcome.EVICTED
    )
    r = simulate([big], SimDevice(100), Sharing(1, policy=None))
    assert (r.ooms, r.n_failed) == (1, 1)


def test_with_memory_plans_a_trial_that_does_not_fit_runs_planned_beside_its_neighbour() -> None:
    # A holds 60 of 100; B's plain 60 do not fit the 40 left, so B runs with a plan for 40:
    # 2/3 of the way from its plain peak (60) to its smallest plan (30), so its steps take
    # 1 + 0.5 * 2/3 = 4/3 as long, beside A (parallelism 2). Without plans B waits for A.
    trials = [
        one_group(),
        SimTrial(TrialProfile.of(0, [60]), (1.0,), (1.0,), plan=SimPlan(30, 1.5)),
    ]
    device = SimDevice(100, compute_parallelism=2)
    plain = simulate(trials, device, Sharing(2))
    planned = simulate(trials, device, Sharing(2, memory_plans=True))
    assert plain.makespan_s == pytest.approx(4.0) and plain.n_planned == 0
    assert planned.makespan_s == pytest.approx(8 / 3) and planned.n_planned == 1
    assert [(a.trial_index, a.peak_held_bytes) for a in planned.attempts] == [(0, 60), (1, 40)]
    assert planned.peak_bytes <= 100


def test_with_memory_plans_an_oom_reruns_at_once_with_a_plan_for_half_its_footprint() -> None:
    # No ledger: B (two groups of 30) meets A's 60 at t=1 and runs out of memory. Without
    # plans it re-runs once alone (t=2); with plans at once, planned for PLAN_SHRINK * 60 = 30
    # bytes: 3/4 of the way to its smallest plan (20), so its 4 s take 1 + 1.0 * 3/4 as long.
    b = SimTrial(TrialProfile.of(0, [30, 30]), (1.0, 1.0), (1.0, 1.0), plan=SimPlan(20, 2.0))
    device = SimDevice(100, compute_parallelism=2)
    plain = simulate([b, one_group()], device, Sharing(2, policy=None))
    planned = simulate([b, one_group()], device, Sharing(2, policy=None, memory_plans=True))
    assert (plain.ooms, planned.ooms) == (1, 1)
    assert [(a.trial_index, a.attempt, a.start_s) for a in plain.attempts][-1] == (0, 1, 2.0)
    rerun = planned.attempts[-1]
    assert (rerun.trial_index, rerun.attempt, rerun.start_s) == (0, 1, 1.0)
    assert rerun.peak_held_bytes == 30 and rerun.end_s == pytest.approx(1.0 + 4 * 1.75)
    assert planned.n_planned == 1 and planned.n_failed == 0


def test_sim_plan_interpolates_between_the_plain_step_and_the_smallest_plan() -> None:
    plan = SimPlan(30, 1.5)
    assert plan.at(60, 100) == (60, 1.0)
    assert plan.at(60, 45) == (45, pytest.approx(1.25))
    assert plan.at(60, 30) == (30, pytest.approx(1.5))
    assert plan.at(60, 29) is None
    with pytest.raises(ValueError, match=r"slowdown=0\.5"):
        SimPlan(30, 0.5)
    with pytest.raises(TypeError, match=r"peak_bytes=1\.5"):
        SimPlan(1.5)  # type: ignore[arg-type]
