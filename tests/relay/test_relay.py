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


@pytest.mark.parametrize("study_attrs", [False, True])
def test_study_attributes_are_the_runs_own_to_set_only_where_the_policy_says(
    study_attrs: bool,
) -> None:
    storage = optuna.storages.InMemoryStorage()
    driver = optuna.create_study(study_name="s", storage=storage)
    other = optuna.create_study(study_name="other", storage=storage)
    client = RelayedStorage(_pickled_transport(StorageService(driver, study_attrs=study_attrs)))
    mine = driver._study_id
    if study_attrs:  # what NSGA-II, QMC and trial.study.set_user_attr do under optimize
        client.set_study_user_attr(mine, "owner", "me")
        client.set_study_system_attr(mine, "generation", 1)
        assert driver.user_attrs == {"owner": "me"}
        assert storage.get_study_system_attrs(mine)["generation"] == 1
    else:
        with pytest.raises(StoragePermissionError, match="set_study_user_attr"):
            client.set_study_user_attr(mine, "owner", "me")
        with pytest.raises(StoragePermissionError, match="set_study_system_attr"):
            client.set_study_system_attr(mine, "generation", 1)
    # Whatever the setting: no other study, no deleting or creating one.
    with pytest.raises(StoragePermissionError, match="set_study_user_attr"):
        client.set_study_user_attr(other._study_id, "owner", "me")
    with pytest.raises(StoragePermissionError):
        client.delete_study(mine)
    with pytest.raises(StoragePermissionError):
        client.create_new_study([optuna.study.StudyDirection.MINIMIZE], "new")
    assert other.user_attrs == {} and len(storage.get_all_studies()) == 2


def test_a_storage_error_is_raised_unchanged_in_the_caller() -> None:
    driver = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    trial = driver.ask()
    driver.tell(trial, 1.0)
    client = RelayedHeartbeatStorage(_pickled_transport(StorageService(driver)))
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        client.set_trial_user_attr(trial._trial_id, "late", 1)


class _Recording:
    """A pickling transport that records each call's method and how many trials it answered."""

    def __init__(self, service: StorageService) -> None:
        self.service = service
        self.calls: list[tuple[str, int]] = []
        self._send = _pickled_transport(service)

    def __call__(self, method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        ok, payload = self._send(method, args)
        size = len(payload) if ok and isinstance(payload, list) else 0
        self.calls.append((method, size))
        return ok, payload


def test_a_process_receives_each_finished_trial_once_and_sees_others_finish() -> None:
    driver = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    for x in range(3):
        driver.enqueue_trial({"x": float(x)})
        driver.optimize(lambda t: t.suggest_float("x", 0, 9), n_trials=1)
    running = driver.ask()  # another host runs it
    recording = _Recording(StorageService(driver))
    client = RelayedStorage(recording)
    study_id = driver._study_id
    first = client.get_all_trials(study_id)
    assert [t.state.name for t in first] == ["COMPLETE"] * 3 + ["RUNNING"]
    # Another process tells the running trial: the next answer must show it, not a kept copy.
    driver.tell(running, 5.0)
    driver.optimize(lambda t: t.suggest_float("x", 0, 9), n_trials=1)
    second = client.get_all_trials(study_id, states=(optuna.trial.TrialState.COMPLETE,))
    assert [t.number for t in second] == [0, 1, 2, 3, 4]
    assert second[3].values == [5.0]
    # The first call carried the whole study; the second only the trial unfinished at the
    # first call and the new one (finished trials never change in Optuna).
    assert recording.calls == [("get_trials_since", 4), ("get_trials_since", 2)]
    # deepcopy=True (Optuna's default) hands out copies: changing one changes no later answer.
    second[0].user_attrs["mutated"] = True
    assert client.get_all_trials(study_id)[0].user_attrs == {}


def test_a_kept_trial_list_never_answers_for_another_study() -> None:
    storage = optuna.storages.InMemoryStorage()
    driver = optuna.create_study(study_name="s", storage=storage)
    other = optuna.create_study(study_name="other", storage=storage)
    other.optimize(lambda t: t.suggest_float("secret", 0, 1), n_trials=2)
    driver.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    client = RelayedStorage(_pickled_transport(StorageService(driver)))
    assert len(client.get_all_trials(driver._study_id)) == 1
    with pytest.raises(StoragePermissionError, match="study_id"):
        client.get_all_trials(other._study_id)
    with pytest.raises(StoragePermissionError, match="trial_id"):
        client.get_trial(other.trials[0]._trial_id)


def test_an_adopted_trial_is_read_locally_and_written_through() -> None:
    driver = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    asked = driver.ask()
    driver._storage.set_trial_system_attr(asked._trial_id, "waterwave:host", "h1")
    recording = _Recording(StorageService(driver))
    client = RelayedStorage(recording, defer_finish=True)
    client.adopt(driver._storage.get_trial(asked._trial_id))
    relayed = optuna.load_study(
        study_name=driver.study_name, storage=client, sampler=optuna.samplers.RandomSampler()
    )
    recording.calls.clear()
    trial = optuna.trial.Trial(relayed, asked._trial_id)  # reads its trial: no round trip
    client.set_trial_system_attr(asked._trial_id, "waterwave:host", "h1")  # stored already
    assert recording.calls == []
    assert trial.suggest_float("x", 0.0, 1.0) == driver.trials[0].params["x"]
    trial.report(0.5, 1)
    assert [m for m, _ in recording.calls] == ["set_trial_param", "set_trial_intermediate_value"]
    assert client.get_trial(asked._trial_id).intermediate_values == {1: 0.5}
    # The executor's tell is kept for the driver (defer_finish): the storage still has it
    # RUNNING until the driver tells it from release()'s answer.
    relayed.tell(trial, 0.25)
    assert driver.trials[0].state is optuna.trial.TrialState.RUNNING
    assert client.get_trial(asked._trial_id).state is optuna.trial.TrialState.COMPLETE
    assert client.release(asked._trial_id) == (optuna.trial.TrialState.COMPLETE, [0.25])
    assert client.release(asked._trial_id) is None


def test_a_write_to_an_adopted_trial_the_driver_finished_raises_as_the_storage_does() -> None:
    driver = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    asked = driver.ask()
    driver._storage.set_trial_system_attr(asked._trial_id, "waterwave:slot", 0)
    client = RelayedStorage(_pickled_transport(StorageService(driver)), defer_finish=True)
    client.adopt(driver._storage.get_trial(asked._trial_id))
    driver.tell(asked, state=optuna.trial.TrialState.FAIL)  # the driver stops it (Ctrl+C)
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        client.set_trial_user_attr(asked._trial_id, "k", 1)
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        client.set_trial_param(
            asked._trial_id, "x", 0.5, optuna.distributions.FloatDistribution(0, 1)
        )
    assert driver.trials[0].user_attrs == {} and driver.trials[0].params == {}


def test_the_policy_finds_a_trial_the_driver_asked_without_reading_the_whole_study() -> None:
    class Counting(optuna.storages.InMemoryStorage):
        scans = 0

        def get_all_trials(self, *args: Any, **kwargs: Any) -> list[optuna.trial.FrozenTrial]:
            Counting.scans += 1
            return super().get_all_trials(*args, **kwargs)

    storage = Counting()
    driver = optuna.create_study(study_name="s", storage=storage)
    other = optuna.create_study(study_name="other", storage=storage)
    other_trial = other.ask()
    client = RelayedStorage(_pickled_transport(StorageService(driver)))
    for _ in range(3):
        trial = driver.ask()
        Counting.scans = 0
        client.set_trial_user_attr(trial._trial_id, "k", 1)
        assert Counting.scans == 0
    with pytest.raises(StoragePermissionError, match="trial_id"):
        client.set_trial_user_attr(other_trial._trial_id, "k", 1)
    with pytest.raises(StoragePermissionError, match="trial_id"):
        client.set_trial_user_attr(10_000, "k", 1)
    assert storage.get_trial(other_trial._trial_id).user_attrs == {}


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
def test_bookkeeping_attrs_set_together_are_stored_and_refused_on_a_finished_trial(
    backend: str, tmp_path: Any
) -> None:
    from waterwave_hpo import _optuna_compat

    url = None if backend == "memory" else f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(storage=url)
    trial = study.ask()
    attrs: dict[str, object] = {"waterwave:host": "h", "waterwave:slot": 1, "waterwave:batch": [0]}
    _optuna_compat.set_system_attrs(study, trial._trial_id, attrs)
    assert {k: study.trials[0].system_attrs[k] for k in attrs} == attrs
    study.tell(trial, 1.0)
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        _optuna_compat.set_system_attrs(study, trial._trial_id, {"waterwave:slot": 2})
    assert study.trials[0].system_attrs["waterwave:slot"] == 1
