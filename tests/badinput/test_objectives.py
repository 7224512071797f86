"""Objectives that return or do the unexpected, and calls in the wrong order or place.

Each case: what Optuna's own ``Study.optimize`` does for the same objective (a trial FAIL, or
the error propagating after the running trials were told), and never a trial left RUNNING.
"""

from __future__ import annotations

from collections.abc import Callable
import math
import threading
from typing import Any

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import optuna
from optuna.trial import TrialState
import pytest
import torch
from torch import nn

from badinput._helpers import assert_none_running
import waterwave_hpo as ww
from waterwave_hpo.executor import NotInTrialError


def _run(
    func: Callable[[optuna.trial.Trial], Any], n_trials: int = 2, **study: Any
) -> optuna.Study:
    s = optuna.create_study(**study)
    ww.WaterwaveExecutor("cpu", 2).optimize(s, func, n_trials=n_trials)
    return s


@pytest.mark.parametrize(
    ("returned", "state"),
    [
        (None, TrialState.FAIL),
        ("abc", TrialState.FAIL),
        (math.nan, TrialState.FAIL),
        ([1.0, 2.0], TrialState.FAIL),  # two values for a single-objective study
        (object(), TrialState.FAIL),
        (torch.tensor(1.5), TrialState.COMPLETE),  # Optuna takes what float() takes
        (3, TrialState.COMPLETE),
    ],
    ids=["none", "str", "nan", "list", "object", "tensor", "int"],
)
def test_unexpected_return_values_end_as_optuna_ends_them(
    returned: object, state: TrialState
) -> None:
    ours = _run(lambda t: returned)
    theirs = optuna.create_study()
    theirs.optimize(lambda t: returned, n_trials=2)  # type: ignore[arg-type,return-value]
    assert [t.state for t in ours.trials] == [t.state for t in theirs.trials] == [state] * 2
    assert_none_running(ours)


def test_multi_objective_wrong_count_fails_each_trial() -> None:
    study = _run(lambda t: 1.0, directions=["minimize", "minimize"])
    assert [t.state for t in study.trials] == [TrialState.FAIL] * 2


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    returned=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(min_value=-(2**53), max_value=2**53),
        st.none(),
        st.text(max_size=3),
        st.lists(st.floats(allow_nan=False), max_size=3),
        st.booleans(),
    )
)
def test_any_return_value_ends_its_trial(returned: object) -> None:
    """Whatever an objective returns, its trial ends; COMPLETE exactly when Optuna completes it."""
    ours = _run(lambda t: returned, n_trials=1)
    assert_none_running(ours)
    theirs = optuna.create_study()
    try:
        theirs.optimize(lambda t: returned, n_trials=1)  # type: ignore[arg-type,return-value]
        expected = theirs.trials[0].state
    except AssertionError:  # Optuna's own "Should not reach." for a str float() takes ("0")
        expected = TrialState.FAIL
    assert [t.state for t in ours.trials] == [expected]


def _exit(trial: optuna.trial.Trial) -> float:
    raise SystemExit(3)


def _nested(trial: optuna.trial.Trial) -> float:
    trial.study.optimize(lambda t: 1.0, n_trials=1)
    return 1.0


def _two_distributions(trial: optuna.trial.Trial) -> float:
    trial.suggest_float("x", 0.0, 1.0)
    trial.suggest_int("x", 0, 3)
    return 1.0


@pytest.mark.parametrize(
    ("func", "error", "match"),
    [
        (_exit, SystemExit, "3"),
        (_nested, RuntimeError, "Nested invocation"),
        (_two_distributions, ValueError, "different distribution"),
    ],
    ids=["system-exit", "nested-optimize", "two-distributions"],
)
def test_objective_errors_propagate_after_every_trial_is_told(
    func: Callable[[optuna.trial.Trial], float], error: type[BaseException], match: str
) -> None:
    study = optuna.create_study()
    with pytest.raises(error, match=match):
        ww.WaterwaveExecutor("cpu", 2).optimize(study, func, n_trials=4)
    assert_none_running(study)
    assert {t.state for t in study.trials} == {TrialState.FAIL}


def test_current_from_a_thread_the_objective_started_says_how_to_pass_it_on() -> None:
    seen: list[BaseException] = []

    def objective(trial: optuna.trial.Trial) -> float:
        def worker() -> None:
            try:
                ww.current()
            except NotInTrialError as error:
                seen.append(error)

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        return 1.0

    study = _run(objective, n_trials=1)
    assert study.trials[0].state is TrialState.COMPLETE
    assert len(seen) == 1 and "A thread the objective starts" in str(seen[0])


# -- the wrong order or place ---------------------------------------------------------------


def test_one_executor_optimizes_twice_and_two_threads_share_a_study() -> None:
    executor = ww.WaterwaveExecutor("cpu", 2)
    study = optuna.create_study()
    executor.optimize(study, lambda t: 1.0, n_trials=2)
    executor.optimize(study, lambda t: 2.0, n_trials=2)  # after the first one's teardown
    threads = [
        threading.Thread(
            target=lambda: ww.WaterwaveExecutor("cpu", 2).optimize(study, lambda t: 3.0, n_trials=3)
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(study.trials) == 10
    assert {t.state for t in study.trials} == {TrialState.COMPLETE}


def test_optimize_from_inside_a_callback_is_refused() -> None:
    study = optuna.create_study()
    executor = ww.WaterwaveExecutor("cpu", 1)

    def callback(s: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        executor.optimize(s, lambda t: 1.0, n_trials=1)

    with pytest.raises(RuntimeError, match="Nested invocation"):
        executor.optimize(study, lambda t: 1.0, n_trials=2, callbacks=[callback])
    assert_none_running(study)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))


def test_plans_and_gates_in_the_wrong_order() -> None:
    model = _mlp()
    x = torch.randn(4, 5)
    ww.fit_memory(model, 1 << 30, example_input=x)
    ww.fit_memory(model, 1 << 30, example_input=x)  # twice: re-plans
    ww.planning.remove_memory_plan(model)
    with pytest.raises(ValueError, match=r"model Sequential has no memory plan; call"):
        ww.plan_of(model)  # after teardown
    ww.planning.remove_memory_plan(model)  # twice: a no-op
    gated = ww.pipeline(_mlp())
    with pytest.raises(RuntimeError, match=r"not profiled yet: run one training step"):
        ww.node_groups(gated)  # before its first step
    gated(x).sum().backward()
    assert len(ww.node_groups(gated)) >= 1
