"""What a user of ``Study.optimize`` sees stays the same through the executor: Optuna's
log lines, callbacks, heartbeats, ``study.stop()``, storages that cannot work refused."""

from __future__ import annotations

import logging
from pathlib import Path
import sqlite3
import subprocess
import sys
import threading
import time

from fakes.samplers import ReseedCountingSampler
import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState
import pytest

import waterwave_hpo as ww


def _cpu(k: int) -> ww.WaterwaveExecutor:
    return ww.WaterwaveExecutor(devices="cpu", trials_per_device=k)


def test_finished_trials_are_logged_on_optunas_logger_with_optunas_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    optuna.logging.enable_propagation()
    optuna.logging.set_verbosity(optuna.logging.INFO)
    try:
        with caplog.at_level(logging.INFO, logger="optuna"):
            study = optuna.create_study()
            _cpu(2).optimize(study, lambda t: 1.5, n_trials=1)
    finally:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        optuna.logging.disable_propagation()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("optuna")]
    assert any(
        line.startswith("Trial 0 finished with value: 1.5 and parameters: {}.")
        and "Best is trial 0 with value: 1.5." in line
        for line in lines
    ), lines


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_a_failed_trial_gets_one_line_with_its_reason_not_value_none(
    caplog: pytest.LogCaptureFixture, isolation: str
) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        raise ValueError("diverged")

    with caplog.at_level(logging.WARNING, logger="optuna"):  # (captured on Optuna's logger)
        study = optuna.create_study()
        executor = ww.WaterwaveExecutor(devices="cpu", trials_per_device=1, isolation=isolation)
        with executor:
            executor.optimize(study, objective, n_trials=1, catch=(ValueError,))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("optuna")]
    # Optuna adds "Trial 0 failed with value None.", as if the objective had returned None.
    assert [line for line in lines if line.startswith("Trial 0 ")] == [
        "Trial 0 failed with parameters: {} because of the following error: ValueError('diverged')."
    ], lines


def test_executor_warnings_are_visible_without_logging_configuration() -> None:
    # A fresh interpreter, no logging set up: the executor's own warnings reach stderr.
    code = (
        "import logging, waterwave_hpo; "
        "logging.getLogger('waterwave_hpo').warning('trial 3 re-queued after OOM')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True
    )
    assert "trial 3 re-queued after OOM" in result.stderr


def test_no_callback_for_a_trial_whose_exception_propagates() -> None:
    seen: list[int] = []

    def objective(trial: optuna.trial.Trial) -> float:
        raise RuntimeError("objective bug")

    study = optuna.create_study()
    with pytest.raises(RuntimeError, match="objective bug"):
        _cpu(1).optimize(
            study, objective, n_trials=3, callbacks=[lambda s, t: seen.append(t.number)]
        )
    assert seen == []
    assert [t.state for t in study.trials] == [TrialState.FAIL]


def test_in_memory_sqlite_is_refused_before_any_trial() -> None:
    study = optuna.create_study(storage="sqlite:///:memory:")
    with pytest.raises(ValueError, match=r"sqlite:///:memory:.*in-memory SQLite"):
        _cpu(2).optimize(study, lambda t: 0.0, n_trials=2)
    assert study.trials == []


@pytest.mark.parametrize("k", [1, 4])
def test_max_trials_callback_asks_for_no_trial_after_the_stop(k: int) -> None:
    trials_at_stop: list[int] = []

    def stop_watch(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        # MaxTrialsCallback(3)'s condition, seen in the thread that asks for trials (callbacks
        # run there), so nothing is asked meanwhile.
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not trials_at_stop and len(complete) >= 3:
            trials_at_stop.append(len(study.trials))

    def objective(trial: optuna.trial.Trial) -> float:
        time.sleep(0.01)
        return 0.0

    study = optuna.create_study()
    _cpu(k).optimize(study, objective, n_trials=40, callbacks=[MaxTrialsCallback(3), stop_watch])
    assert trials_at_stop, "MaxTrialsCallback never stopped the study"
    assert len(study.trials) == trials_at_stop[0]  # no trial asked for after the stop
    # The docstring's bound: the stop's trial plus at most k - 1 running neighbours.
    assert 3 <= len(study.trials) <= 3 + k - 1
    assert all(t.state is TrialState.COMPLETE for t in study.trials)


def _heartbeat_storage(path: Path) -> optuna.storages.RDBStorage:
    return optuna.storages.RDBStorage(
        f"sqlite:///{path}",
        heartbeat_interval=1,
        grace_period=1,
        heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1),
    )


def test_a_stale_trial_of_a_dead_process_is_failed_and_retried(tmp_path: Path) -> None:
    storage = _heartbeat_storage(tmp_path / "study.db")
    study = optuna.create_study(storage=storage, study_name="s")
    dead = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    storage.record_heartbeat(dead._trial_id)  # then its process "dies": no more beats
    time.sleep(2.2)  # > grace_period
    _cpu(2).optimize(study, lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    trials = study.get_trials(deepcopy=False)
    assert trials[0].state is TrialState.FAIL
    retries = [t for t in trials if RetryHeartbeatStaleTrialCallback.retried_trial_number(t) == 0]
    assert len(retries) == 1
    assert retries[0].params == trials[0].params
    assert retries[0].state is TrialState.COMPLETE


def test_every_co_hosted_trial_records_heartbeats(tmp_path: Path) -> None:
    path = tmp_path / "study.db"
    study = optuna.create_study(storage=_heartbeat_storage(path), study_name="s")
    inside = threading.Barrier(2, timeout=60)
    beating: dict[int, bool] = {}

    def objective(trial: optuna.trial.Trial) -> float:
        inside.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the heartbeat thread's first beat is at once
            with sqlite3.connect(path) as connection:
                rows = connection.execute(
                    "SELECT trial_id FROM trial_heartbeats WHERE trial_id = ?",
                    (trial._trial_id,),
                ).fetchall()
            if rows:
                beating[trial.number] = True
                break
            time.sleep(0.05)
        inside.wait()  # both still running while the other looks
        return 0.0

    _cpu(2).optimize(study, objective, n_trials=2)
    assert beating == {0: True, 1: True}
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2


@pytest.mark.parametrize(
    ("executor", "reseeds"),
    [
        (ww.WaterwaveExecutor(devices="cpu", trials_per_device=1), 0),
        (ww.WaterwaveExecutor(devices="cpu", trials_per_device=3), 5),
        (ww.WaterwaveExecutor(devices="cpu", trials_per_device=1, fuse=2), 5),
    ],
    ids=["one-at-a-time", "three-slots", "fused"],
)
def test_the_sampler_is_reseeded_per_trial_when_trials_run_at_once(
    executor: ww.WaterwaveExecutor, reseeds: int
) -> None:
    # Study.optimize reseeds the sampler's RNG before each trial when n_jobs != 1, so that
    # threads do not share a random sequence; one trial at a time (n_jobs=1) it does not.
    sampler = ReseedCountingSampler()
    study = optuna.create_study(sampler=sampler)
    objective = (lambda t: t.suggest_float("x", 0, 1)) if executor.fuse is None else None
    if objective is None:
        executor.optimize(
            study, ww.batched(lambda ts: [t.suggest_float("x", 0, 1) for t in ts]), n_trials=5
        )
    else:
        executor.optimize(study, objective, n_trials=5)
    assert len(study.trials) == 5
    assert sampler.reseeds == reseeds
