"""Storages that refuse writes, as root can be refused: SQLite's
``mode=ro`` URL and ``chattr +i`` (file modes do not stop root).

Each case: the error names the storage and what it refused, keeps the storage's own error as
``__cause__``, lists exactly the trials left RUNNING and how to end them, asks for no trial
after the refusal; a storage refused before the run is left byte for byte as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
import subprocess

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
import pytest

from badinput._helpers import assert_none_running
from badinput._helpers import file_hashes
from badinput._helpers import immutable
from badinput._helpers import make_mutable
import waterwave_hpo as ww
from waterwave_hpo.executor import StorageWriteError


def _sqlite(directory: Path) -> tuple[Path, Callable[[], optuna.storages.BaseStorage]]:
    path = directory / "study.db"
    return path, lambda: optuna.storages.RDBStorage(f"sqlite:///{path}")


def _journal(directory: Path) -> tuple[Path, Callable[[], optuna.storages.BaseStorage]]:
    path = directory / "study.log"
    return path, lambda: JournalStorage(JournalFileBackend(str(path)))


KINDS = {"sqlite": _sqlite, "journal": _journal}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_storage_refusing_before_the_run_is_named_and_left_unchanged(
    kind: str, tmp_path: Path
) -> None:
    path, make = KINDS[kind](tmp_path)
    study = optuna.create_study(storage=make(), study_name="s")
    before = file_hashes(path)
    with immutable(path):
        with pytest.raises(
            StorageWriteError, match=r"refused to create or record a new trial"
        ) as e:
            ww.WaterwaveExecutor("cpu", 2).optimize(study, lambda t: 1.0, n_trials=3)
        assert file_hashes(path) == before
    assert e.value.__cause__ is not None
    assert str(path) in str(e.value) and "No trial of this run is left RUNNING" in str(e.value)
    assert_none_running(optuna.load_study(study_name="s", storage=make()))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_storage_refusing_mid_run_names_the_trials_left_running_and_how_to_end_them(
    kind: str, tmp_path: Path
) -> None:
    path, make = KINDS[kind](tmp_path)
    study = optuna.create_study(storage=make(), study_name="s")
    asked: list[int] = []

    def objective(trial: optuna.trial.Trial) -> float:
        asked.append(trial.number)
        if trial.number == 2:
            subprocess.run(["chattr", "+i", str(path)], check=True)
        return float(trial.number)

    try:
        with pytest.raises(StorageWriteError) as caught:
            ww.WaterwaveExecutor("cpu", 1).optimize(study, objective, n_trials=10)
    finally:
        make_mutable(path)
    error = caught.value
    assert error.left_running == [2]
    assert "Trial(s) 2 are left RUNNING" in str(error) and str(path) in str(error)
    assert asked == [0, 1, 2]  # no trial asked for after the refusal
    reloaded = optuna.load_study(study_name="s", storage=make())
    assert [t.state for t in reloaded.trials] == [
        TrialState.COMPLETE,
        TrialState.COMPLETE,
        TrialState.RUNNING,
    ]
    # The fix the message gives ends them, once the storage takes writes again.
    for number in error.left_running:
        reloaded.tell(number, state=TrialState.FAIL)
    assert_none_running(reloaded)


def test_directory_of_an_sqlite_file_made_immutable(tmp_path: Path) -> None:
    # SQLite needs to create its rollback journal beside the file: the directory refuses.
    directory = tmp_path / "db"
    directory.mkdir()
    _, make = _sqlite(directory)
    study = optuna.create_study(storage=make(), study_name="s")
    before = file_hashes(directory)
    with immutable(directory):
        with pytest.raises(StorageWriteError, match=r"refused to") as caught:
            ww.WaterwaveExecutor("cpu", 2).optimize(study, lambda t: 1.0, n_trials=2)
    assert caught.value.left_running == []
    assert file_hashes(directory) == before


def test_read_only_url_passed_to_create_study_is_refused_at_optimize(tmp_path: Path) -> None:
    path = tmp_path / "study.db"
    optuna.create_study(storage=f"sqlite:///{path}", study_name="s")
    before = file_hashes(path)
    study = ww.load_study(study_name="s", storage=f"sqlite:///file:{path}?mode=ro&uri=true")
    with pytest.raises(ValueError, match=r"study='s': has a read-only storage"):
        study.optimize(lambda t: 1.0, n_trials=1, executor=ww.WaterwaveExecutor("cpu"))
    assert file_hashes(path) == before
