"""Conformance checks every scheduling policy must pass (run them from a test).

Each check drives a :class:`PipelineScheduler` with the policy from simulated trial threads
(no torch, no GPU), bounded in time, and raises ``AssertionError`` on a violation::

    from waterwave_hpo.scheduler.testing import check_policy

    def test_my_policy() -> None:
        check_policy(MyPolicy)

What is checked: granted reservations never overlap beyond the budget (counted independently
of the ledger), every trial ends (no hang) under random budgets and trial mixes, a contrived
deadlock is resolved with one eviction that the stats record, and ``trial_finished`` frees a
trial's bytes and wakes the trials waiting for them.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
import random
import threading
import time

from waterwave_hpo.scheduler._errors import BudgetExceededError
from waterwave_hpo.scheduler._ledger import Phase
from waterwave_hpo.scheduler._policy import Policy
from waterwave_hpo.scheduler._scheduler import PipelineScheduler
from waterwave_hpo.scheduler._stats import ResolutionKind
from waterwave_hpo.scheduler._trial_profile import TrialProfile


@dataclass(frozen=True)
class SimulatedRun:
    """What :func:`run_simulated_trials` saw.

    Attributes:
        completed: Trials that ran all their steps.
        evicted: Trials whose gate raised ``BudgetExceededError``.
        max_granted_bytes: The most bytes granted and not yet given back at once, counted by
            the simulated trials themselves (independently of the ledger).
        hung: Trials still running when the time limit passed (must be empty).
        scheduler: The scheduler, for its stats.
    """

    completed: tuple[int, ...]
    evicted: tuple[int, ...]
    max_granted_bytes: int
    hung: tuple[int, ...]
    scheduler: PipelineScheduler


def run_simulated_trials(
    scheduler: PipelineScheduler,
    trials: Sequence[TrialProfile],
    *,
    steps: int = 3,
    seed: int = 0,
    declare: bool = True,
    time_limit_s: float = 20.0,
) -> SimulatedRun:
    """Run one thread per profile, each doing ``steps`` training steps of gate calls.

    A step acquires the groups in order (forward), then releases them in reverse (backward),
    with random tiny pauses; a trial's resident bytes are acquired once before its first step.

    Args:
        scheduler: The scheduler under test (fresh).
        trials: One profile per trial; trial numbers are the indices.
        steps: Training steps per trial.
        seed: Seeds the pauses.
        declare: Declare each trial's profile to the scheduler first (as the gates do).
        time_limit_s: Seconds to wait for all threads; those still alive are reported hung.
    """
    lock = threading.Lock()
    granted = [0]
    peak = [0]
    completed: list[int] = []
    evicted: list[int] = []

    def count(delta: int) -> None:
        with lock:
            granted[0] += delta
            peak[0] = max(peak[0], granted[0])

    def trial(n: int, profile: TrialProfile) -> None:
        rng = random.Random(seed * 1000 + n)
        mine = 0
        scheduler.trial_started(n, None)
        try:
            if declare:
                scheduler.declare_profile(n, profile)
            if profile.resident_bytes:
                scheduler.acquire(n, -1, profile.resident_bytes, Phase.RESIDENT)
                mine += profile.resident_bytes
                count(profile.resident_bytes)
            for _ in range(steps):
                held = []
                for g, nbytes in enumerate(profile.group_bytes):
                    r = scheduler.acquire(n, g, nbytes)
                    count(nbytes)
                    mine += nbytes
                    held.append(r)
                    time.sleep(rng.random() * 1e-4)
                for r in reversed(held):
                    count(-r.nbytes)
                    mine -= r.nbytes
                    scheduler.release(r)
                    time.sleep(rng.random() * 1e-4)
            with lock:
                completed.append(n)
        except BudgetExceededError:
            with lock:
                evicted.append(n)
        finally:
            count(-mine)
            scheduler.trial_finished(n)

    threads = [
        threading.Thread(target=trial, args=(n, p), daemon=True) for n, p in enumerate(trials)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + time_limit_s
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = tuple(n for n, t in enumerate(threads) if t.is_alive())
    return SimulatedRun(tuple(sorted(completed)), tuple(sorted(evicted)), peak[0], hung, scheduler)


def check_budget_and_liveness(policy_factory: Callable[[], Policy], seeds: int = 6) -> None:
    """Random budgets and trial mixes: never over budget, never a hang, all accounted for."""
    for seed in range(seeds):
        rng = random.Random(seed)
        trials = [
            TrialProfile.of(
                rng.randint(0, 20), [rng.randint(0, 40) for _ in range(rng.randint(1, 5))]
            )
            for _ in range(rng.randint(1, 5))
        ]
        smallest = max(p.peak_bytes for p in trials)  # each trial fits alone
        budget = rng.randint(smallest, sum(p.peak_bytes for p in trials) + 1)
        scheduler = PipelineScheduler(budget, policy_factory())
        run = run_simulated_trials(scheduler, trials, seed=seed, declare=bool(seed % 2))
        assert run.hung == (), f"seed {seed}: trials {run.hung} hung (budget {budget}, {trials})"
        assert run.max_granted_bytes <= budget, (
            f"seed {seed}: {run.max_granted_bytes} bytes granted at once > budget {budget}"
        )
        assert sorted(run.completed + run.evicted) == list(range(len(trials)))
        stats = scheduler.stats()
        assert stats.peak_bytes <= budget
        assert stats.used_bytes == 0, f"seed {seed}: {stats.used_bytes} bytes leaked"
        assert stats.evictions == len(run.evicted)


def check_contrived_deadlock(policy_factory: Callable[[], Policy]) -> None:
    """Two trials each hold 45 of 100 bytes and ask 30 more: one is evicted, one finishes."""
    scheduler = PipelineScheduler(100, policy_factory())
    ready = threading.Barrier(2, timeout=10)
    outcome: dict[int, str] = {}

    def trial(n: int) -> None:
        scheduler.trial_started(n, None)
        try:
            scheduler.acquire(n, 0, 45)
            ready.wait()
            scheduler.acquire(n, 1, 30)
            outcome[n] = "completed"
        except BudgetExceededError:
            outcome[n] = "evicted"
        finally:
            scheduler.trial_finished(n)

    threads = [threading.Thread(target=trial, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "the contrived deadlock hung"
    assert sorted(outcome.values()) == ["completed", "evicted"], outcome
    stats = scheduler.stats()
    assert stats.evictions == 1 and stats.deadlocks_resolved >= 1
    evictions = [r for r in stats.resolutions if r.kind is ResolutionKind.EVICTED]
    victim = next(n for n, o in outcome.items() if o == "evicted")
    assert evictions[0].trial_number == victim and evictions[0].nbytes == 30
    assert stats.used_bytes == 0


def check_trial_finished_wakes_waiters(policy_factory: Callable[[], Policy]) -> None:
    """A trial waiting for bytes another trial holds gets them when that trial finishes."""
    scheduler = PipelineScheduler(100, policy_factory())
    scheduler.trial_started(0, None)
    scheduler.trial_started(1, None)
    scheduler.acquire(0, 0, 80)
    got: list[int] = []
    waiter = threading.Thread(
        target=lambda: got.append(scheduler.acquire(1, 0, 50).nbytes), daemon=True
    )
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got, "admitted beyond the budget"
    scheduler.trial_finished(0)
    scheduler.trial_finished(0)  # idempotent
    waiter.join(timeout=10)
    assert got == [50]
    scheduler.trial_finished(1)
    assert scheduler.stats().used_bytes == 0


def check_policy(policy_factory: Callable[[], Policy]) -> None:
    """Run every conformance check on fresh instances from ``policy_factory``."""
    check_budget_and_liveness(policy_factory)
    check_contrived_deadlock(policy_factory)
    check_trial_finished_wakes_waiters(policy_factory)
