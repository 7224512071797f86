"""create_study / load_study / wrap_study: Optuna studies whose optimize takes executor=."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
import pytest

import waterwave_hpo as ww


def test_create_study_optimize_with_executor_as_in_the_readme() -> None:
    study = ww.create_study(direction="maximize")
    assert isinstance(study, optuna.Study)
    study.optimize(
        lambda t: t.suggest_float("x", 0, 1),
        n_trials=8,
        executor=ww.WaterwaveExecutor(devices="cpu", trials_per_device=4),
    )
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 8
    assert study.best_value == max(t.value for t in study.trials)


def test_without_executor_it_is_optunas_optimize() -> None:
    study = ww.create_study()
    study.optimize(lambda t: 1.0, n_trials=3, n_jobs=1)
    assert len(study.trials) == 3
    assert "waterwave:device" not in study.trials[0].user_attrs


def test_n_jobs_with_executor_is_refused() -> None:
    study = ww.create_study()
    with pytest.raises(ValueError, match="n_jobs=2 cannot be combined with executor="):
        study.optimize(lambda t: 1.0, n_trials=1, n_jobs=2, executor=ww.WaterwaveExecutor("cpu"))
    assert study.trials == []


def test_executor_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match="WaterwaveExecutor"):
        ww.create_study().optimize(lambda t: 1.0, n_trials=1, executor="threads")  # type: ignore[arg-type]


def test_load_study_resumes_a_journal_study(tmp_path: Path) -> None:
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "study.log")))
    first = ww.create_study(storage=storage, study_name="s")
    first.optimize(lambda t: 1.0, n_trials=2, executor=ww.WaterwaveExecutor("cpu", 2))
    again = ww.load_study(study_name="s", storage=storage)
    again.optimize(lambda t: 2.0, n_trials=3, executor=ww.WaterwaveExecutor("cpu", 2))
    assert sorted(t.value for t in again.trials) == [1.0, 1.0, 2.0, 2.0, 2.0]


def test_wrap_study_adopts_a_plain_study_in_place() -> None:
    plain = optuna.create_study()
    wrapped = ww.wrap_study(plain)
    assert wrapped is plain
    wrapped.optimize(lambda t: 0.0, n_trials=2, executor=ww.WaterwaveExecutor("cpu", 2))
    assert len(plain.trials) == 2
    with pytest.raises(TypeError, match=r"optuna\.Study"):
        ww.wrap_study("study")  # type: ignore[arg-type]


def test_integrations_are_importable_under_the_package() -> None:
    from waterwave_hpo.integrations.optuna import create_study

    assert create_study is ww.create_study
