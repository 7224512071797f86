"""The storages the executor's behavioural tests run over, as Optuna's ``STORAGE_MODES``: the
executor calls ``ask``/``tell`` from many threads, so every behaviour must hold on each."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend
import pytest

STORAGE_MODES = ("inmemory", "journal", "sqlite")


def make_storage(mode: str, directory: Path) -> optuna.storages.BaseStorage:
    """A fresh storage of kind ``mode`` (one of :data:`STORAGE_MODES`) under ``directory``."""
    if mode == "inmemory":
        return optuna.storages.InMemoryStorage()
    if mode == "journal":
        return optuna.storages.JournalStorage(JournalFileBackend(str(directory / "journal.log")))
    if mode == "sqlite":
        return optuna.storages.RDBStorage(f"sqlite:///{directory / 'study.db'}")
    raise ValueError(f"mode={mode!r} is not one of {STORAGE_MODES}")


@pytest.fixture(params=STORAGE_MODES)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> optuna.storages.BaseStorage:
    """One storage per mode; a test taking it runs once on each."""
    return make_storage(str(request.param), tmp_path)
