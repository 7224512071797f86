"""What a trial costs on a worker's pipe (``isolation="process"``), and what posted writes keep.

A trial's writes to its own trial (parameters, attributes, intermediate values) are posted: the
worker sends them with its next message and does not wait. These tests count the pipe's
messages and the round trips a worker waits on, and check what a user sees when the driver's
storage refuses a posted write, against ``Study.optimize``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
import threading
import time

import optuna
from optuna.trial import TrialState
import pytest

import waterwave_hpo as ww

_EXECUTORS: list[ww.WaterwaveExecutor] = []


def _process(k: int, **kwargs: object) -> ww.WaterwaveExecutor:
    executor = ww.WaterwaveExecutor(
        devices="cpu",
        trials_per_device=k,
        isolation="process",
        **kwargs,  # type: ignore[arg-type]
    )
    _EXECUTORS.append(executor)
    return executor


@pytest.fixture(autouse=True)
def _close_executors() -> Iterator[None]:
    yield
    while _EXECUTORS:
        _EXECUTORS.pop().close()


def _pipe_counts(executor: ww.WaterwaveExecutor) -> Counter[str]:
    total: Counter[str] = Counter()
    for pool in executor._workers.pools.values():  # type: ignore[union-attr]
        for worker in pool.workers:
            total.update(worker.counts)
    return total


def _clear_counts(executor: ww.WaterwaveExecutor) -> None:
    for pool in executor._workers.pools.values():  # type: ignore[union-attr]
        for worker in pool.workers:
            worker.counts.clear()


def _trivial(trial: optuna.trial.Trial) -> float:
    trial.set_user_attr("u", 1)
    x = trial.suggest_float("x", -1.0, 1.0)
    trial.report(x, step=0)
    return x * x


def test_a_trivial_trial_costs_one_message_each_way_and_no_round_trip() -> None:
    # RandomSampler reads nothing of the study (TPE's reads are calls: the sampler's, not the
    # dispatch's).
    executor = _process(2)
    executor.optimize(optuna.create_study(), _trivial, n_trials=2)  # the workers are warm
    _clear_counts(executor)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    n_trials = 20
    executor.optimize(study, _trivial, n_trials=n_trials)
    counts = _pipe_counts(executor)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * n_trials
    assert all(t.user_attrs == {"u": 1} for t in study.trials)
    assert all(t.intermediate_values == {0: t.params["x"]} for t in study.trials)
    # Opening the study is the run's, not the trials': a few calls per worker (begin).
    per_run = 2 * 4
    assert counts["from:call"] <= per_run  # no round trip per trial (three writes each)
    assert counts["from:post"] == 3 * n_trials  # parameter, user attribute, report
    assert counts["to:submit"] == n_trials
    # Writes and record in one message; the worker's flush every 0.1 s may land mid-trial on
    # a busy machine and send that trial's writes on their own.
    assert counts["received"] - counts["from:flush"] <= n_trials + per_run
    assert counts["sent"] <= n_trials + per_run  # the submit; no neighbour counts


def test_a_write_the_storage_refuses_fails_the_trial_as_under_study_optimize() -> None:
    # The study knows "x" as categorical; the worker never read that trial (RandomSampler
    # reads no trials), so it posts the float and the driver's storage refuses it
    # (ValueError), as Optuna's storage does.
    def objective(trial: optuna.trial.Trial) -> float:
        return trial.suggest_float("x", 0.0, 1.0)

    def study_with_categorical_x() -> optuna.Study:
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        study.enqueue_trial({"x": "a"})
        study.optimize(lambda t: float(len(t.suggest_categorical("x", ["a", "b"]))), n_trials=1)
        return study

    expected = study_with_categorical_x()
    with pytest.raises(ValueError) as by_optuna:
        expected.optimize(objective, n_trials=1)
    study = study_with_categorical_x()
    with pytest.raises(ValueError) as by_worker:
        _process(1).optimize(study, objective, n_trials=1)
    assert str(by_worker.value) == str(by_optuna.value)
    assert [t.state for t in study.trials] == [t.state for t in expected.trials]
    assert study.trials[1].state is TrialState.FAIL
    assert "x" not in study.trials[1].params

    caught = study_with_categorical_x()
    _process(1, record_trial_attrs=True).optimize(
        caught, objective, n_trials=2, catch=(ValueError,)
    )
    assert [t.state for t in caught.trials] == [TrialState.COMPLETE] + [TrialState.FAIL] * 2
    reason = caught.trials[1].system_attrs["waterwave:fail_reason"]
    assert "ValueError" in reason and "set_trial_param" in reason


def test_a_distribution_the_worker_saw_is_checked_at_the_call() -> None:
    # The same worker ran trial 0 with "x" as a float: trial 1's categorical "x" raises at
    # suggest_categorical, where the objective can catch it, as under Study.optimize.
    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 0:
            return trial.suggest_float("x", 0.0, 1.0)
        try:
            trial.suggest_categorical("x", ["a", "b"])
        except ValueError:
            return -1.0
        return 1.0

    expected = optuna.create_study()
    expected.optimize(objective, n_trials=2)
    study = optuna.create_study()
    _process(1).optimize(study, objective, n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert [t.value for t in study.trials][1] == [t.value for t in expected.trials][1] == -1.0


def test_a_running_trials_writes_reach_the_driver_while_it_runs(tmp_path: Path) -> None:
    # Posted writes go with the worker's next message, or within a tenth of a second: a long
    # trial that makes no call has its attributes in the driver's storage (for whoever watches
    # it) while it runs.
    study = optuna.create_study()
    go = tmp_path / "go"

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for trial in study.get_trials(deepcopy=False):
                if trial.user_attrs.get("step") == 1 and trial.state is TrialState.RUNNING:
                    go.touch()
                    return
            time.sleep(0.01)

    def objective(trial: optuna.trial.Trial) -> float:
        trial.set_user_attr("step", 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if go.exists():  # the driver saw the write: no call of the trial's sent it
                return 1.0
            time.sleep(0.01)
        return 0.0

    threading.Thread(target=watch, daemon=True).start()
    _process(1).optimize(study, objective, n_trials=1)
    assert study.trials[0].value == 1.0
