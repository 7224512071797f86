"""SearchRun and Target: what a search found by its budget, and the accuracy it had to reach."""

from __future__ import annotations

from waterwave_hpo.bench import SearchRun
from waterwave_hpo.bench import Target
from waterwave_hpo.bench import TrialOutcome
from waterwave_hpo.bench import time_to_target


def _trial(number: int, state: str, end_s: float | None, value: float | None = None):
    return TrialOutcome(number, state, value, None if end_s is None else end_s - 1, end_s)


def _run(*trials: TrialOutcome, budget_s: float = 10.0, available: bool = True) -> SearchRun:
    return SearchRun("temporal", 0, 1, budget_s, available=available, trials=list(trials))


RUN = _run(
    _trial(0, "COMPLETE", 3.0, 0.5),
    _trial(1, "COMPLETE", 2.0, 0.7),  # ended before trial 0: the trajectory follows end times
    _trial(2, "PRUNED", 4.0),
    _trial(3, "COMPLETE", 11.0, 0.99),  # after the budget: does not count
    _trial(4, "COMPLETE", 5.0, 0.6),  # no improvement
    _trial(5, "FAIL", 6.0),
    _trial(6, "COMPLETE", 7.0, 0.8),
    _trial(7, "COMPLETE", 10.0, 0.85),  # exactly at the budget: counts
    _trial(8, "RUNNING", None),
)


def test_the_trajectory_is_the_best_so_far_of_trials_completed_within_the_budget() -> None:
    assert RUN.trajectory() == [(2.0, 0.7), (7.0, 0.8), (10.0, 0.85)]
    assert RUN.best_value_at_budget() == 0.85
    assert [t.number for t in RUN.in_budget("COMPLETE")] == [0, 1, 4, 6, 7]
    assert [t.number for t in RUN.in_budget("PRUNED")] == [2]
    assert [t.number for t in RUN.in_budget("FAIL")] == [5]


def test_time_to_target_is_the_first_time_the_best_reached_it() -> None:
    assert RUN.time_to(0.7) == 2.0
    assert RUN.time_to(0.75) == 7.0
    assert RUN.time_to(0.85) == 10.0
    assert RUN.time_to(0.9) is None  # 0.99 came after the budget
    assert time_to_target([], 0.1) is None
    assert _run(_trial(0, "PRUNED", 1.0)).best_value_at_budget() is None


def test_the_target_is_a_fraction_of_the_best_any_run_found_within_its_budget() -> None:
    other = _run(_trial(0, "COMPLETE", 1.0, 0.9))
    skipped = _run(_trial(0, "COMPLETE", 1.0, 1.0), available=False)
    target = Target.of([RUN, other, skipped], 0.9)
    assert target.best_any_run == 0.9 and target.value == 0.9 * 0.9
    assert "90% of the best" in target.describe() and "0.8100" in target.describe()
    nothing = Target.of([_run(_trial(0, "PRUNED", 1.0))], 0.99)
    assert nothing.value is None and nothing.describe().startswith("none")
