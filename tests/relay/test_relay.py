"""The transport-neutral relay: a study driven through RelayedStorage behaves as on its storage."""

from __future__ import annotations

import pickle
from typing import Any

import optuna
import pytest

from waterwave_hpo.relay import RelayedHeartbeatStorage
from waterwave_hpo.relay import RelayedStorage
from waterwave_hpo.relay import StoragePermissionError
from waterwave_hpo.relay import StorageService


def _pickled_transport(service: StorageService) -> Any:
    """A transport that pickles both ways, as a pipe to another process does."""

    def transport(method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        method, args = pickle.loads(pickle.dumps((method, args)))
        answer: tuple[bool, Any] = pickle.loads(pickle.dumps(service.run(method, args)))
        return answer

    return transport


def test_a_study_optimized_through_the_relay_is_the_drivers_study() -> None:
    driver = optuna.create_study(study_name="s", storage=optuna.storages.InMemoryStorage())
    relayed = optuna.load_study(
        study_name="s", storage=RelayedStorage(_pickled_transport(StorageService(driver)))
    )

    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_float("x", -1.0, 1.0)
        trial.report(x, 0)
        trial.set_user_attr("seen", True)
        return x * x

    relayed.optimize(objective, n_trials=5)
    trials = driver.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 5
    assert all(t.user_attrs == {"seen": True} and t.intermediate_values for t in trials)
    assert driver.best_value == pytest.approx(min(t.params["x"] ** 2 for t in trials))


def test_the_policy_holds_whatever_carries_the_call() -> None:
    storage = optuna.storages.InMemoryStorage()
    driver = optuna.create_study(study_name="s", storage=storage)
    other = optuna.create_study(study_name="other", storage=storage)
    other.enqueue_trial({"x": 0.0})
    other_trial_id = other.ask()._trial_id
    client = RelayedStorage(_pickled_transport(StorageService(driver)))
    with pytest.raises(StoragePermissionError, match="other"):
        client.get_study_id_from_name("other")
    with pytest.raises(StoragePermissionError, match="trial_id"):
        client.set_trial_user_attr(other_trial_id, "k", 1)
    with pytest.raises(StoragePermissionError):
        client.delete_study(0)
    assert storage.get_trial(other_trial_id).user_attrs == {}
    assert [s.study_name for s in storage.get_all_studies()] == ["s", "other"]


def test_a_storage_error_is_raised_unchanged_in_the_caller() -> None:
    driver = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    trial = driver.ask()
    driver.tell(trial, 1.0)
    client = RelayedHeartbeatStorage(_pickled_transport(StorageService(driver)))
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        client.set_trial_user_attr(trial._trial_id, "late", 1)
