"""One process executor reused across ``optimize`` calls: what a run leaves in its warm workers
must not reach the next run (``workers/_pool.py``, ``workers/_worker.py``).

Optuna's own ``test_study.py`` through one executor for the whole session (the conformance
run) met each of these: a ``study.stop()`` of one call stopping the next, two threads' calls
binding the same workers, a neighbour count left from the last run.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import threading
import time

from _barrier import arrive as _arrive
import optuna
from optuna.trial import TrialState
import pytest
import torch

import waterwave_hpo as ww

pytestmark = pytest.mark.filterwarnings("ignore::waterwave_hpo.ExperimentalWarning")

_WAIT_S = 120.0


def _value(trial: optuna.trial.Trial) -> float:
    return trial.suggest_float("x", 0.0, 1.0)


def _stop_at(number: int) -> Callable[[optuna.trial.Trial], float]:
    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == number:
            trial.study.stop()
        return float(trial.number)

    return objective


class _SamplerReadingTheStudy(optuna.samplers.RandomSampler):
    """Optuna's test_before_trial sampler: ``before_trial`` reads the study's trials."""

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        assert len(study.trials) - 1 == trial.number


@pytest.fixture
def executor() -> Iterator[ww.WaterwaveExecutor]:
    with ww.WaterwaveExecutor("cpu", 1, isolation="process") as made:
        yield made


def test_a_study_stopped_by_its_objective_does_not_stop_the_next_call(
    executor: ww.WaterwaveExecutor,
) -> None:
    # Optuna's test_stop_in_objective, on one executor's warm worker.
    study = optuna.create_study()
    executor.optimize(study, _stop_at(2), n_trials=10)
    assert len(study.trials) == 3
    for stop in (5, 8, 11):
        executor.optimize(study, _stop_at(stop), n_trials=10)
        assert len(study.trials) == stop + 1
    other = optuna.create_study()
    executor.optimize(other, _value, n_trials=4)
    assert [t.state for t in other.trials] == [TrialState.COMPLETE] * 4


def test_two_threads_optimizing_through_one_executor_run_every_trial(
    executor: ww.WaterwaveExecutor,
) -> None:
    # Optuna's test_optimize_with_thread_pool_executor: the second call waits for the workers.
    executor.optimize(optuna.create_study(), _value, n_trials=1)  # they are warm
    study = optuna.create_study()
    pool = ThreadPoolExecutor(2)
    try:
        futures = [pool.submit(executor.optimize, study, _value, n_trials=3) for _ in range(2)]
        for future in futures:
            future.result(timeout=_WAIT_S)
    finally:
        pool.shutdown(wait=False)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 6


def test_optimize_from_its_own_callback_says_to_use_a_second_executor(
    executor: ww.WaterwaveExecutor,
) -> None:
    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        executor.optimize(optuna.create_study(), _value, n_trials=1)

    study = optuna.create_study()
    with pytest.raises(RuntimeError, match=r"called again while its run.*second WaterwaveExecutor"):
        executor.optimize(study, _value, n_trials=3, callbacks=[callback])
    assert [t.state for t in study.trials] == [TrialState.COMPLETE]
    executor.optimize(study, _value, n_trials=2)  # the workers are free again
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3


def test_a_second_call_counts_the_other_workers_trials_as_neighbours(tmp_path: Path) -> None:
    def first_run(trial: optuna.trial.Trial) -> float:
        _arrive(tmp_path, "first", 2)
        if trial.number == 0:  # slot 1's trial ends first: its worker last heard "1 neighbour"
            time.sleep(1.0)
        return 0.0

    def second_run(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0.0, 1.0)
        if trial.number < 2:
            _arrive(tmp_path, "second", 2)
        if trial.number == 1:  # slot 1, beside trial 0 (its count has arrived meanwhile)
            time.sleep(1.0)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        if trial.number == 0:
            time.sleep(3.0)
        return x

    with ww.WaterwaveExecutor("cpu", 2, isolation="process", record_trial_attrs=True) as executor:
        executor.optimize(optuna.create_study(), first_run, n_trials=2)
        study = optuna.create_study()
        executor.optimize(study, second_run, n_trials=2)
    trials = study.get_trials(deepcopy=False)
    assert trials[1].state is TrialState.FAIL
    assert (
        "out of device memory with 1 neighbour(s)"
        in trials[1].system_attrs["waterwave:fail_reason"]
    )
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert trials[2].params == trials[1].params


def test_a_sampler_reading_the_study_in_before_trial_runs_every_trial(
    executor: ww.WaterwaveExecutor,
) -> None:
    # The worker makes each trial (the sampler's before_trial, its relative sampling) where
    # the study's reads can be answered; the pipe's reader thread would wait for itself.
    study = optuna.create_study(sampler=_SamplerReadingTheStudy())
    run = threading.Thread(
        target=executor.optimize, args=(study, _value), kwargs={"n_trials": 3}, daemon=True
    )
    run.start()
    run.join(_WAIT_S)
    assert not run.is_alive(), "optimize() hung"
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
