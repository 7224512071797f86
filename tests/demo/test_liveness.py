"""Which RUNNING trials are stale: by their owner's liveness and heartbeat, never by state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
import subprocess
import sys
import time

import optuna
from optuna.trial import TrialState
import psutil
import pytest

from waterwave_hpo.demo import LivenessRule
from waterwave_hpo.demo import open_journal
from waterwave_hpo.demo._liveness import ATTR_OWNER
from waterwave_hpo.demo._liveness import HEARTBEAT_PREFIX
from waterwave_hpo.demo._liveness import counted_trials
from waterwave_hpo.demo._liveness import requeue_and_fail
from waterwave_hpo.demo._liveness import rerun_of
from waterwave_hpo.demo._liveness import stale_trials
from waterwave_hpo.demo._process import ProcessIdentity
from waterwave_hpo.demo._process import this_process

RULE = LivenessRule(heartbeat_interval_s=1.0, grace_period_s=30.0)


@pytest.fixture
def neighbour() -> Iterator[tuple[subprocess.Popen[bytes], ProcessIdentity]]:
    """Another live process on this host (it sleeps), and its identity."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    identity = ProcessIdentity(
        this_process().hostname, child.pid, psutil.Process(child.pid).create_time()
    )
    yield child, identity
    child.kill()
    child.wait()


def _study(tmp_path: Path) -> optuna.Study:
    return optuna.create_study(storage=open_journal(tmp_path / "study.log"), study_name="s")


def _running_trial(study: optuna.Study, owner: ProcessIdentity | None) -> optuna.trial.Trial:
    trial = study.ask()
    trial.suggest_int("n", 0, 9)
    if owner is not None:
        study._storage.set_trial_system_attr(trial._trial_id, ATTR_OWNER, owner.to_json())
    return trial


def _beat(study: optuna.Study, owner: ProcessIdentity, at_s: float) -> None:
    study._storage.set_study_system_attr(
        study._study_id, HEARTBEAT_PREFIX + owner.key, {"owner": owner.to_json(), "at_s": at_s}
    )


def test_a_live_neighbours_running_trial_is_not_stale_until_its_process_dies(
    tmp_path: Path, neighbour: tuple[subprocess.Popen[bytes], ProcessIdentity]
) -> None:
    study = _study(tmp_path)
    child, owner = neighbour
    _running_trial(study, owner)
    assert stale_trials(study, this_process(), RULE) == []
    child.kill()
    child.wait()
    ((trial, why),) = stale_trials(study, this_process(), RULE)
    assert trial.number == 0
    assert f"pid {owner.pid}" in why and "is gone" in why


def test_an_ownerless_trial_is_stale_only_without_a_live_neighbour(
    tmp_path: Path, neighbour: tuple[subprocess.Popen[bytes], ProcessIdentity]
) -> None:
    study = _study(tmp_path)
    child, owner = neighbour
    _running_trial(study, None)  # asked; its process died before the objective's first line
    _beat(study, owner, time.time())
    assert stale_trials(study, this_process(), RULE) == []  # the neighbour may own it
    child.kill()
    child.wait()
    ((_, why),) = stale_trials(study, this_process(), RULE)
    assert "no other demo process" in why


def test_a_trial_of_another_host_is_stale_by_its_heartbeat_age(tmp_path: Path) -> None:
    study = _study(tmp_path)
    remote = ProcessIdentity("some-other-host", 4242, 1.0)
    _running_trial(study, remote)
    _beat(study, remote, time.time() - 5)
    assert stale_trials(study, this_process(), RULE) == []
    _beat(study, remote, time.time() - 45)
    ((_, why),) = stale_trials(study, this_process(), RULE)
    assert "some-other-host" in why and "no heartbeat for 45 s" in why


def test_requeue_and_fail_queues_the_params_once_and_the_rerun_counts_not_the_original(
    tmp_path: Path,
) -> None:
    study = _study(tmp_path)
    study.optimize(lambda t: t.suggest_int("n", 0, 9), n_trials=1)
    trial = _running_trial(study, None)
    frozen = study.trials[trial.number]
    assert requeue_and_fail(study, frozen, "interrupted: test")
    assert not requeue_and_fail(study, frozen, "interrupted: test")  # finished: not twice
    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING]
    assert study.trials[1].system_attrs["waterwave:fail_reason"] == "interrupted: test"
    assert [t.number for t in counted_trials(study.trials)] == [0]  # WAITING, interrupted: no
    study.optimize(lambda t: t.suggest_int("n", 0, 9), n_trials=1)  # pops the re-run
    rerun = study.trials[2]
    assert rerun_of(rerun) == 1 and rerun.params == frozen.params
    assert [t.number for t in counted_trials(study.trials)] == [0, 2]
