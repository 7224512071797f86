"""The hosts' storage channel: nothing new listens, one study, only a host's calls."""

from __future__ import annotations

from collections.abc import Iterator
import logging
import os
from pathlib import Path
import threading
import time
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import TrialState
import pytest

ray = pytest.importorskip("ray")

from waterwave_hpo.cluster import RayExecutor  # noqa: E402
from waterwave_hpo.cluster import StoragePermissionError  # noqa: E402
from waterwave_hpo.cluster._storage import RayStorageClient  # noqa: E402
from waterwave_hpo.cluster._storage import StorageServer  # noqa: E402

RAY_GPUS = 0  # CPU hosts (tests/conftest.py)
pytestmark = [
    pytest.mark.usefixtures("ray_cluster"),
]  # tests/conftest.py


def _listening_ports() -> set[int]:
    """TCP ports this process listens on (its socket inodes matched in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with_link = Path("/proc/self/fd", fd)
        try:
            target = os.readlink(with_link)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def _storages(tmp_path: Path) -> dict[str, BaseStorage]:
    return {
        "memory": optuna.storages.InMemoryStorage(),
        "sqlite": optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'studies.db'}"),
    }


def _two_studies(storage: BaseStorage) -> tuple[optuna.Study, optuna.Study]:
    mine = optuna.create_study(study_name="mine", storage=storage)
    other = optuna.create_study(study_name="someone-elses", storage=storage)
    for study in (mine, other):
        study.set_user_attr("owner", study.study_name)
        study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    return mine, other


def _contents(storage: BaseStorage) -> list[Any]:
    """Everything a user sees in ``storage``: studies, their attributes and trials."""
    return [
        (
            s.study_name,
            s.user_attrs,
            s.system_attrs,
            [
                (t.number, t.state, t.values, t.params, t.user_attrs, t.intermediate_values)
                for t in storage.get_all_trials(s._study_id)
            ],
        )
        for s in sorted(storage.get_all_studies(), key=lambda s: s.study_name)
    ]


@pytest.fixture(scope="module", params=["memory", "sqlite"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, ...]]:
    """A storage holding two studies, its channel serving "mine", and a client of it (one per
    storage for the module: a relay actor's process takes seconds to start)."""
    storage = _storages(tmp_path_factory.mktemp("served"))[request.param]
    mine, other = _two_studies(storage)
    with StorageServer(mine) as server:
        yield storage, mine, other, server.channel.connect()


@pytest.mark.slow  # a relay actor's process starts (seconds on a loaded machine)
def test_the_run_study_works_through_the_channel(served: tuple[Any, ...]) -> None:
    _, mine, _, client = served
    study = optuna.load_study(study_name="mine", storage=client)
    trial = study.ask()
    trial.suggest_int("n", 1, 8)
    trial.report(0.5, step=1)
    trial.set_user_attr("note", "from a host")
    study.tell(trial, 0.25)
    frozen = mine.trials[-1]
    assert (frozen.state, frozen.value, frozen.params) == (
        TrialState.COMPLETE,
        0.25,
        {"n": trial.params["n"]},
    )
    assert frozen.intermediate_values == {1: 0.5}
    assert frozen.user_attrs == {"note": "from a host"}
    assert len(study.trials) == 3
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):  # the storage's own error
        client.set_trial_state_values(frozen._trial_id, TrialState.FAIL)


def test_other_studies_and_study_level_writes_are_refused_and_nothing_changes(
    served: tuple[Any, ...],
) -> None:
    storage, mine, other, client = served
    before = _contents(storage)
    other_trial_id = other.trials[0]._trial_id
    refused: list[tuple[str, tuple[Any, ...]]] = [
        ("get_all_studies", ()),
        ("get_study_id_from_name", ("someone-elses",)),
        ("get_all_trials", (other._study_id,)),
        ("get_study_user_attrs", (other._study_id,)),
        ("get_trial", (other_trial_id,)),
        ("create_new_trial", (other._study_id,)),
        ("set_trial_user_attr", (other_trial_id, "owner", "me")),
        ("set_trial_state_values", (other_trial_id, TrialState.FAIL)),
        ("delete_study", (other._study_id,)),
        ("delete_study", (mine._study_id,)),
        ("create_new_study", ([optuna.study.StudyDirection.MINIMIZE], "new")),
        ("set_study_user_attr", (mine._study_id, "owner", "someone")),
        ("set_study_system_attr", (mine._study_id, "k", 1)),
        ("record_heartbeat", (mine.trials[0]._trial_id,)),  # no heartbeat in this storage
        ("_get_stale_trial_ids", (mine._study_id,)),
        ("__init__", ()),  # any name a client sends, not only BaseStorage's
    ]
    for method, args in refused:
        # _call: what any holder of the relay's handle could send, not only this client's API.
        with pytest.raises(StoragePermissionError, match=method):
            client._call(method, *args)
    assert _contents(storage) == before


@pytest.mark.slow  # a relay actor's process starts (seconds on a loaded machine)
def test_each_kind_of_refusal_is_logged_once_and_a_stopped_channel_answers_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mine, other = _two_studies(optuna.storages.InMemoryStorage())
    server = StorageServer(mine)
    client = server.channel.connect()
    with caplog.at_level(logging.WARNING, logger="waterwave_hpo"):
        for _ in range(3):
            with pytest.raises(StoragePermissionError):
                client.delete_study(other._study_id)
        with pytest.raises(StoragePermissionError):
            client.get_all_studies()
        assert client.get_study_id_from_name("mine") == mine._study_id
    server.stop()
    server.stop()  # idempotent
    with pytest.raises((ConnectionError, ray.exceptions.RayActorError)):
        client.get_study_id_from_name("mine")
    refusals = [r.getMessage() for r in caplog.records if "Refused" in r.getMessage()]
    assert len(refusals) == 2
    assert "delete_study" in refusals[0] and "get_all_studies" in refusals[1]


@pytest.mark.slow  # a relay actor's process starts (seconds on a loaded machine)
@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed:UserWarning")
def test_heartbeat_calls_are_allowed_for_the_study_trials_only(tmp_path: Path) -> None:
    storage = optuna.storages.RDBStorage(
        f"sqlite:///{tmp_path / 'hb.db'}", heartbeat_interval=60, grace_period=120
    )
    mine, other = _two_studies(storage)
    running = mine.ask()
    with StorageServer(mine) as server:
        client = server.channel.connect()
        assert isinstance(client, BaseHeartbeat) and is_heartbeat_enabled(client)
        assert client.get_heartbeat_interval() == 60
        client.record_heartbeat(running._trial_id)
        assert client._get_stale_trial_ids(mine._study_id) == []
        with pytest.raises(StoragePermissionError):
            client.record_heartbeat(other.trials[0]._trial_id)
        with pytest.raises(StoragePermissionError):
            client._get_stale_trial_ids(other._study_id)


def _objective_probing_the_storage(trial: optuna.trial.Trial) -> float:
    storage = trial.study._storage
    assert isinstance(storage, RayStorageClient)
    refused = []
    for call in (
        storage.get_all_studies,
        lambda: storage.delete_study(trial.study._study_id + 1),
        lambda: storage.delete_study(trial.study._study_id),
    ):
        try:
            call()
        except StoragePermissionError:
            refused.append(True)
    trial.set_user_attr("refused", len(refused))
    return trial.suggest_float("x", 0.0, 1.0)


@pytest.mark.slow  # a relay actor's process starts (seconds on a loaded machine)
def test_a_run_opens_no_port_and_its_hosts_reach_only_their_study(tmp_path: Path) -> None:
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'studies.db'}")
    mine, _ = _two_studies(storage)
    before = _contents(storage)
    executor = RayExecutor(n_hosts=1, trials_per_device=2, num_gpus_per_host=0)
    ports_before = _listening_ports()
    opened: set[int] = set()
    channels = []

    def look(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:  # in the driver
        opened.update(_listening_ports() - ports_before)
        if executor._server is not None:
            channels.append(executor._server.channel)

    executor.optimize(mine, _objective_probing_the_storage, n_trials=4, callbacks=[look])
    # Nothing listens for the run; a port that did would have to refuse a client without
    # credentials (Optuna's gRPC storage client, as the reporter used).
    assert opened == set()
    for port in opened:
        proxy = optuna.storages.GrpcStorageProxy(host="127.0.0.1", port=port)
        with pytest.raises(Exception):  # noqa: B017 - any refusal
            proxy.get_all_studies()
    new = [t for t in mine.trials if t.number >= 2]
    assert [t.state for t in new] == [TrialState.COMPLETE] * 4
    assert [t.user_attrs["refused"] for t in new] == [3] * 4
    after = _contents(storage)
    assert after[1] == before[1]  # "someone-elses" untouched
    assert after[0][:3] == before[0][:3]  # "mine": its attributes untouched
    # The channel closed with the run.
    assert channels
    with pytest.raises((ConnectionError, ray.exceptions.RayActorError)):
        channels[0].connect().get_study_id_from_name("mine")


def _objective_failing_on_its_second_trial(trial: optuna.trial.Trial) -> float:
    if trial.number == 1:
        raise ZeroDivisionError("not in catch")
    return 1.0


@pytest.mark.slow  # host and relay actors start
def test_the_channel_closes_when_the_run_ends_with_an_exception() -> None:
    study = optuna.create_study()
    executor = RayExecutor(n_hosts=1, trials_per_device=1, num_gpus_per_host=0)
    channels = []

    def look(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if executor._server is not None:
            channels.append(executor._server.channel)

    with pytest.raises(ZeroDivisionError):
        executor.optimize(
            study, _objective_failing_on_its_second_trial, n_trials=4, callbacks=[look]
        )
    assert channels
    with pytest.raises((ConnectionError, ray.exceptions.RayActorError)):
        channels[0].connect().get_study_id_from_name(study.study_name)
    assert all(t.state != TrialState.RUNNING for t in study.trials)


class _SlowAttrStorage(optuna.storages.InMemoryStorage):
    """Setting the trial attribute "slow" waits for ``release`` (an RDB lock, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        if key == "slow":
            self.release.wait(timeout=60)
        super().set_trial_user_attr(trial_id, key, value)


@pytest.mark.slow  # a relay actor's process starts
def test_a_slow_storage_call_does_not_hold_up_the_other_hosts() -> None:
    storage = _SlowAttrStorage()
    mine, _ = _two_studies(storage)
    trial_id = mine.ask()._trial_id
    with StorageServer(mine) as server:
        client = server.channel.connect()
        assert client.get_study_id_from_name("mine") == mine._study_id  # the relay is up
        slow = threading.Thread(target=client.set_trial_user_attr, args=(trial_id, "slow", 1))
        slow.start()
        time.sleep(0.5)  # the slow call is in the driver now
        started = time.perf_counter()
        assert client.get_trial(trial_id).user_attrs == {}  # answered while "slow" waits
        assert time.perf_counter() - started < 30.0
        assert slow.is_alive()
        storage.release.set()
        slow.join(timeout=30)
        assert client.get_trial(trial_id).user_attrs == {"slow": 1}
