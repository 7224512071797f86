"""max_concurrent_trials on hand-built trial intervals."""

from __future__ import annotations

import datetime

import optuna
from optuna.trial import TrialState

from waterwave_hpo.report import max_concurrent_trials

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0)


def _trial(start_s: float, end_s: float | None) -> optuna.trial.FrozenTrial:
    finished = end_s is not None
    return optuna.trial.FrozenTrial(
        number=0,
        state=TrialState.COMPLETE if finished else TrialState.RUNNING,
        value=1.0 if finished else None,
        datetime_start=T0 + datetime.timedelta(seconds=start_s),
        datetime_complete=T0 + datetime.timedelta(seconds=end_s) if finished else None,
        params={},
        distributions={},
        user_attrs={},
        system_attrs={},
        intermediate_values={},
        trial_id=0,
    )


def test_disjoint_trials_never_overlap() -> None:
    assert max_concurrent_trials([_trial(0, 1), _trial(1, 2), _trial(2, 3)]) == 1


def test_nested_and_staggered_overlaps() -> None:
    trials = [_trial(0, 10), _trial(1, 3), _trial(2, 4), _trial(3.5, 5), _trial(6, 7)]
    # At t=2..3: trials 0, 1, 2 run; at t=3.5..4: trials 0, 2, 3.
    assert max_concurrent_trials(trials) == 3


def test_unfinished_trials_are_ignored_and_empty_is_zero() -> None:
    assert max_concurrent_trials([]) == 0
    assert max_concurrent_trials([_trial(0, None), _trial(0, 1)]) == 1
