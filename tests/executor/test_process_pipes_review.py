"""The worker-process dispatch path (``isolation="process"``) under faults: no trial is lost.

Every trial a study started must end COMPLETE, PRUNED or FAIL, whatever happens to its worker
between the driver's choice of a worker and the trial's record, and whatever bytes a worker's
pipe carries. Faults are injected on the CPU: a worker killed (SIGKILL) at a chosen moment, a
worker whose run cannot begin.

A study that would hang runs in a thread the test waits for, up to a bound far above the
study's need (:data:`_WAIT_S`): the bound turns a hang into a failure; it is no measure of speed.
"""

from __future__ import annotations

from collections.abc import Iterator
import os
from pathlib import Path
import signal
import threading
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest

import waterwave_hpo as ww
from waterwave_hpo.workers._pool import WorkerProcess

_WAIT_S = 120.0  # a worker's first trial waits for its interpreter and torch to import

_EXECUTORS: list[ww.WaterwaveExecutor] = []


def _process(k: int) -> ww.WaterwaveExecutor:
    executor = ww.WaterwaveExecutor(devices="cpu", trials_per_device=k, isolation="process")
    _EXECUTORS.append(executor)
    return executor


@pytest.fixture(autouse=True)
def _close_executors() -> Iterator[None]:
    yield
    while _EXECUTORS:
        _EXECUTORS.pop().close()


def _optimize_or_hang(
    executor: ww.WaterwaveExecutor, study: optuna.Study, objective: Any, n_trials: int
) -> BaseException | None:
    """Run ``optimize`` in a thread; its exception, or ``None``. Fails the test on a hang."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            executor.optimize(study, objective, n_trials=n_trials)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(_WAIT_S)
    states = [(t.number, t.state.name) for t in study.get_trials(deepcopy=False)]
    assert not thread.is_alive(), f"optimize() never returned; the trials: {states}"
    return raised[0] if raised else None


def _x(trial: optuna.trial.Trial) -> float:
    return trial.suggest_float("x", 0.0, 1.0)


def test_a_worker_that_dies_just_before_its_next_trial_is_sent_loses_no_trial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The slot's worker dies after the driver chose it for the trial and before the trial is
    # handed to it (SIGKILL from outside, the OOM killer: at any moment), and the driver sees
    # the death first: the trial must still run (on the slot's next worker) or fail, never
    # stay RUNNING with nobody to end it.
    run = WorkerProcess.run
    killed: list[int] = []

    def run_after_a_death(self: WorkerProcess, job: Any, frozen: list[Any]) -> Any:
        if job.trial.number == 1 and not killed:
            killed.append(self.pid)
            os.kill(self.pid, signal.SIGKILL)
            self.served.wait()  # the driver has seen it die and failed what it ran (nothing)
        return run(self, job, frozen)

    monkeypatch.setattr(WorkerProcess, "run", run_after_a_death)
    study = optuna.create_study()
    assert _optimize_or_hang(_process(1), study, _x, n_trials=3) is None
    assert killed
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3


def test_a_worker_whose_run_could_not_begin_fails_the_trials_sent_to_it(tmp_path: Path) -> None:
    # Of two workers, one cannot open the run (its begin fails: here the objective's state
    # cannot be rebuilt a second time; in life a module edited or gone since the first worker
    # loaded it). The run goes on with the other; a trial sent to the one that failed must end
    # (FAIL, with the worker's error, which optimize raises as an objective's), not wait for
    # a worker that dropped it.
    marker = tmp_path / "loaded-once"

    def load_once(path: str) -> str:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))  # FileExistsError the second time
        return path

    class LoadsOnce:
        def __reduce__(self) -> tuple[Any, ...]:
            return (load_once, (str(marker),))

    state = LoadsOnce()

    def objective(trial: optuna.trial.Trial) -> float:
        assert state is not None
        return trial.suggest_float("x", 0.0, 1.0)

    study = optuna.create_study()
    error = _optimize_or_hang(_process(2), study, objective, n_trials=4)
    assert isinstance(error, RuntimeError)
    assert "could not start" in str(error)
    trials = study.get_trials(deepcopy=False)
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
    failed = [t for t in trials if t.state is TrialState.FAIL]
    assert failed
    for trial in failed:
        reason = trial.system_attrs["waterwave:fail_reason"]
        assert "could not start the run" in reason
        assert "FileExistsError" in reason
