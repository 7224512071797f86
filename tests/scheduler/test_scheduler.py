"""PipelineScheduler: admission, errors, deadlock resolution, stats, admits(), promise."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
import threading

import optuna
import pytest

from waterwave_hpo.scheduler import BudgetExceededError
from waterwave_hpo.scheduler import FifoPolicy
from waterwave_hpo.scheduler import Phase
from waterwave_hpo.scheduler import PipelineScheduler
from waterwave_hpo.scheduler import PolicyName
from waterwave_hpo.scheduler import ResolutionKind
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.scheduler import WaterwavePolicy
from waterwave_hpo.scheduler.testing import run_simulated_trials


def blocked_acquire(
    scheduler: PipelineScheduler,
    trial: int,
    group: int,
    nbytes: int,
    phase: Phase = Phase.FORWARD,
) -> tuple[threading.Thread, list[object]]:
    """Start ``acquire`` in a thread; return it and a list that gets its result or error."""
    result: list[object] = []

    def run() -> None:
        try:
            result.append(scheduler.acquire(trial, group, nbytes, phase))
        except BudgetExceededError as e:
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def test_policy_argument() -> None:
    assert isinstance(PipelineScheduler(10, "fifo").policy, FifoPolicy)
    assert isinstance(PipelineScheduler(10, PolicyName.WATERWAVE).policy, WaterwavePolicy)
    assert isinstance(PipelineScheduler(10).policy, WaterwavePolicy)
    with pytest.raises(
        ValueError, match=r"^policy='lifo': is not a known policy; pass one of \['fifo'"
    ):
        PipelineScheduler(10, "lifo")
    with pytest.raises(
        TypeError, match=r"^policy=3: must be a str, a PolicyName or a Policy, not int"
    ):
        PipelineScheduler(10, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("budget", "error"), [(0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_budget_argument(budget: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"^budget_bytes={budget!r}: must be "):
        PipelineScheduler(budget)  # type: ignore[arg-type]


def test_acquire_needs_a_started_trial_and_valid_bytes() -> None:
    s = PipelineScheduler(100)
    with pytest.raises(ValueError, match=r"Call scheduler.trial_started\(3, trial\)"):
        s.acquire(3, 0, 10)
    s.trial_started(3)
    with pytest.raises(ValueError, match=r"^nbytes=-1: must be >= 0"):
        s.acquire(3, 0, -1)


def test_request_larger_than_the_budget_raises_with_the_fix() -> None:
    s = PipelineScheduler(100)
    s.trial_started(5)
    s.acquire(5, 0, 40)
    with pytest.raises(BudgetExceededError) as info:
        s.acquire(5, 1, 70)
    e = info.value
    assert (e.trial_number, e.nbytes, e.held_bytes, e.budget_bytes, e.evicted) == (
        5,
        70,
        40,
        100,
        False,
    )
    assert isinstance(e, RuntimeError)
    msg = str(e)
    assert "Trial 5 wanted 70 bytes" in msg and "100 bytes" in msg
    assert "smaller batch size" in msg and "memory_budget_bytes" in msg


def test_fifo_is_head_of_line() -> None:
    s = PipelineScheduler(100, "fifo")
    for n in range(3):
        s.trial_started(n)
    first = s.acquire(0, 0, 70)
    t1, r1 = blocked_acquire(s, 1, 0, 50)  # does not fit: waits
    t1.join(timeout=0.2)
    t2, r2 = blocked_acquire(s, 2, 0, 10)  # fits, but arrived after a waiting request
    t2.join(timeout=0.2)
    assert t1.is_alive() and t2.is_alive()
    s.release(first)
    t1.join(timeout=10)
    t2.join(timeout=10)
    assert [type(r1[0]).__name__, type(r2[0]).__name__] == ["Reservation", "Reservation"]
    assert s.stats().deadlocks_resolved == 0


def test_waterwave_keeps_a_new_forward_from_starving_a_running_one() -> None:
    """Trial 0 is mid-forward (needs 40 more); trial 1's first group (30) fits the free 50
    bytes but would leave 20 < 40: waterwave holds it back, fifo admits it."""
    profile = TrialProfile.of(0, [50, 40])
    for policy, admitted in (("waterwave", False), ("fifo", True)):
        s = PipelineScheduler(100, policy)
        for n in (0, 1):
            s.trial_started(n)
            s.declare_profile(n, profile)
        s.acquire(0, 0, 50)
        t, _ = blocked_acquire(s, 1, 0, 30)
        t.join(timeout=0.3)
        assert (not t.is_alive()) == admitted, policy
        s.trial_finished(0)
        t.join(timeout=10)
        assert not t.is_alive()
        s.trial_finished(1)


def test_waterwave_pipelines_two_trials_at_their_solo_peak() -> None:
    """Budget = both residents + one forward peak: waterwave runs both with no eviction."""
    profile = TrialProfile.of(10, [30, 30, 30, 30])
    budget = 2 * 10 + profile.activation_bytes
    for seed in range(3):
        run = run_simulated_trials(
            PipelineScheduler(budget, "waterwave"), [profile, profile], steps=4, seed=seed
        )
        assert run.hung == ()
        assert run.completed == (0, 1), run
        assert run.scheduler.stats().evictions == 0


def test_waterwave_a_trial_not_yet_admitted_does_not_stall_a_running_one() -> None:
    """Trial 1's parameters would leave trial 0 unable to finish its step, so trial 1 waits;
    trial 0 keeps going without any deadlock resolution, and trial 1 starts when 0 ends."""
    profile = TrialProfile.of(20, [30, 30])
    s = PipelineScheduler(90, "waterwave")
    for n in (0, 1):
        s.trial_started(n)
        s.declare_profile(n, profile)
    s.acquire(0, -1, 20, Phase.RESIDENT)
    g0 = s.acquire(0, 0, 30)
    t, r = blocked_acquire(s, 1, -1, 20, Phase.RESIDENT)
    t.join(timeout=0.2)
    assert t.is_alive()
    g1 = s.acquire(0, 1, 30)  # would be refused if trial 1's unmet claim counted
    s.release(g1)
    s.release(g0)
    assert s.stats().deadlocks_resolved == 0
    s.trial_finished(0)
    t.join(timeout=10)
    assert not t.is_alive() and r[0].nbytes == 20  # type: ignore[union-attr]


def test_deadlock_resolution_prefers_admitting_what_fits() -> None:
    """FIFO head does not fit, a later request does, and every trial waits: admit the later."""
    s = PipelineScheduler(100, "fifo")
    s.trial_started(0)
    s.trial_started(1)
    s.acquire(0, 0, 60)
    t1, r1 = blocked_acquire(s, 1, 0, 50)  # head: does not fit
    t1.join(timeout=0.2)
    assert t1.is_alive()
    # trial 0 now waits too, for something that fits: a deadlock under strict FIFO
    r0 = s.acquire(0, 1, 30)
    assert r0.nbytes == 30
    stats = s.stats()
    assert stats.deadlocks_resolved == 1
    assert stats.resolutions[0].kind is ResolutionKind.ADMITTED_OUT_OF_ORDER
    assert stats.resolutions[0].trial_number == 0
    assert stats.resolutions[0].waiting_trials == (0, 1)
    s.trial_finished(0)
    t1.join(timeout=10)
    assert not t1.is_alive() and r1[0].nbytes == 50  # type: ignore[union-attr]


def test_eviction_waits_for_trial_finished_before_reusing_memory() -> None:
    s = PipelineScheduler(100, "fifo")
    s.trial_started(0)
    s.trial_started(1)
    s.acquire(0, 0, 45)
    s.acquire(1, 0, 45)
    t0, r0 = blocked_acquire(s, 0, 1, 30)
    t0.join(timeout=0.2)
    t1, r1 = blocked_acquire(s, 1, 1, 30)  # now both wait: trial 1 (youngest) is evicted
    t1.join(timeout=10)
    assert isinstance(r1[0], BudgetExceededError) and r1[0].evicted
    assert "Trial 1 was evicted to resolve a deadlock" in str(r1[0])
    t0.join(timeout=0.2)
    assert t0.is_alive(), "the victim's bytes were reused before its trial finished"
    with pytest.raises(BudgetExceededError):  # an evicted trial's gates keep raising
        s.acquire(1, 2, 1)
    s.trial_finished(1)
    t0.join(timeout=10)
    assert r0[0].nbytes == 30  # type: ignore[union-attr]
    assert s.stats().trial(1).evicted


def test_trial_finished_releases_everything_and_is_idempotent() -> None:
    s = PipelineScheduler(100)
    s.trial_started(0)
    s.acquire(0, -1, 10, Phase.RESIDENT)
    s.acquire(0, 0, 20)
    assert s.held_bytes(0) == 30
    s.trial_finished(0)
    s.trial_finished(0)
    s.trial_finished(99)  # never started: no error
    assert s.used_bytes == 0
    assert s.stats().trial(0).finished


def test_release_is_idempotent_and_release_later_applies() -> None:
    s = PipelineScheduler(100)
    s.trial_started(0)
    a = s.acquire(0, 0, 20)
    b = s.acquire(0, 1, 30)
    s.release(a)
    s.release(a)
    assert s.used_bytes == 30
    s.release_later((b, b))
    assert s.used_bytes == 0


def test_stats_count_waits_and_wait_time() -> None:
    s = PipelineScheduler(100, "fifo")
    s.trial_started(0)
    s.trial_started(1)
    r = s.acquire(0, 0, 90)
    t, _ = blocked_acquire(s, 1, 0, 20)
    t.join(timeout=0.1)
    s.release(r)
    t.join(timeout=10)
    stats = s.stats()
    assert stats.trial(1).waits == 1 and stats.trial(1).wait_s > 0.05
    assert stats.trial(0).waits == 0 and stats.trial(0).acquires == 1
    assert stats.peak_bytes == 90 and stats.budget_bytes == 100
    with pytest.raises(KeyError, match="trial 7 is not in these stats"):
        stats.trial(7)


def test_admits_from_profiles() -> None:
    profile = TrialProfile.of(10, [20, 20])  # peak 50
    ww = PipelineScheduler(70, "waterwave")
    fifo = PipelineScheduler(70, "fifo")
    for s in (ww, fifo):
        assert s.admits()  # nothing running, nothing known: the first trial may start
        s.trial_started(0)
        assert not s.admits()  # running without a profile yet: wait for it
        s.declare_profile(0, profile)
        assert s.admits(profile=TrialProfile.of(10, [5])) is True
    assert ww.admits()  # 10 + 10 + 40 <= 70: pipelined
    assert not fifo.admits()  # 50 + 50 > 70: fifo needs both peaks at once
    assert not ww.admits(100)  # an int is a solo peak with no pipeline gain


@dataclass
class _FakeFrozen:
    number: int
    intermediate_values: dict[int, float]


@dataclass
class _FakeStudy:
    direction: optuna.study.StudyDirection
    frozen: list[_FakeFrozen] = field(default_factory=list)

    def get_trials(self, deepcopy: bool, states: object) -> list[_FakeFrozen]:
        return self.frozen


@dataclass
class _FakeTrial:
    study: _FakeStudy


def test_more_promising_trial_is_admitted_first() -> None:
    study = _FakeStudy(
        optuna.study.StudyDirection.MINIMIZE,
        [_FakeFrozen(1, {0: 0.9, 1: 0.8}), _FakeFrozen(2, {0: 0.5, 1: 0.1})],
    )
    s = PipelineScheduler(100, "waterwave", promise_refresh_s=0.0)
    s.trial_started(0)
    s.trial_started(1, _FakeTrial(study))
    s.trial_started(2, _FakeTrial(study))
    s.acquire(0, 0, 100)
    order: list[int] = []
    threads = []
    for n in (1, 2):  # trial 1 asks first but is worse (loss 0.8 > 0.1)
        t = threading.Thread(target=lambda n=n: (s.acquire(n, 0, 60), order.append(n)))
        t.start()
        t.join(timeout=0.2)
        threads.append(t)
    s.trial_finished(0)  # frees 100: only one of the two 60-byte requests fits
    for t in threads:
        t.join(timeout=0.3)
    assert order == [2]
    s.trial_finished(2)
    for t in threads:
        t.join(timeout=10)
    assert order == [2, 1]


def test_room_bytes_is_the_budget_less_the_other_trials_claims_or_holdings() -> None:
    s = PipelineScheduler(1000)
    s.trial_started(1)
    s.trial_started(2)
    s.trial_started(3)
    s.declare_profile(1, TrialProfile.of(100, [200]))  # claims 300, holds 0
    s.acquire(2, -1, 150, Phase.RESIDENT)  # no profile: holds 150
    assert s.room_bytes(3) == 1000 - 300 - 150
    assert s.room_bytes(1) == 1000 - 150
    s.trial_finished(1)
    assert s.room_bytes(3) == 1000 - 150
