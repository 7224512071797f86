"""The demo end to end at tiny settings, its resume, and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
import pandas as pd
import pytest

from waterwave_hpo.cli import main
from waterwave_hpo.demo import DemoConfig
from waterwave_hpo.demo import load_digits
from waterwave_hpo.demo import run_demo
from waterwave_hpo.demo._run import STUDY_NAME


def _config(out: Path, trials: int) -> DemoConfig:
    return DemoConfig(
        trials=trials,
        concurrency=3,
        epochs=2,
        device="cpu",
        seed=1,
        out=out,
        show_progress_bar=False,
    )


def test_digits_are_the_real_bundled_images() -> None:
    data = load_digits()
    assert data.x_train.shape[1:] == (1, 8, 8)
    assert data.x_train.shape[0] + data.x_val.shape[0] == 1797
    assert float(data.x_train.max()) == 1.0
    assert sorted(set(data.y_val.tolist())) == list(range(10))


def test_demo_writes_every_file_and_resumes_adding_only_missing_trials(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = run_demo(_config(out, trials=6))
    for name in ("study.log", "trials.csv", "summary.json", "timeline.png"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary == first.summary
    assert summary["n_trials"] == 6
    assert summary["n_complete"] + summary["n_pruned"] + summary["n_fail"] == 6
    assert summary["n_complete"] >= 1
    assert 0.0 < summary["best_value"] <= 1.0
    assert set(summary["best_params"]) >= {"n_conv", "optimizer", "lr", "batch_size", "dropout"}
    assert summary["max_concurrent_trials"] >= 2  # trials really overlapped
    assert summary["device"] == ["cpu"]
    assert summary["wall_time_s"] > 0
    table = pd.read_csv(out / "trials.csv")
    assert list(table["number"]) == list(range(6))
    for column in (
        "number",
        "state",
        "value",
        "params",
        "datetime_start",
        "datetime_complete",
        "duration_s",
        "device",
    ):
        assert column in table.columns

    second = run_demo(_config(out, trials=8))
    assert second.summary["n_trials"] == 8
    assert second.summary["n_trials_this_run"] == 2
    study = optuna.load_study(
        study_name=STUDY_NAME, storage=JournalStorage(JournalFileBackend(str(out / "study.log")))
    )
    assert len(study.trials) == 8
    assert all(t.state.is_finished() for t in study.trials)


def test_resume_fails_trials_a_killed_run_left_running(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_demo(_config(out, trials=2))
    storage = JournalStorage(JournalFileBackend(str(out / "study.log")))
    study = optuna.load_study(study_name=STUDY_NAME, storage=storage)
    study.ask()  # a trial a killed process never finished
    summary = run_demo(_config(out, trials=4)).summary
    assert summary["n_trials"] == 4
    study = optuna.load_study(study_name=STUDY_NAME, storage=storage)
    stale = study.trials[2]
    assert stale.state is optuna.trial.TrialState.FAIL
    assert "stale" in stale.system_attrs["waterwave:fail_reason"]


def test_cli_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    code = main(
        [
            "demo",
            "--trials",
            "3",
            "--concurrency",
            "3",
            "--epochs",
            "1",
            "--device",
            "cpu",
            "--seed",
            "2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "3 trials" in printed
    assert "best: trial" in printed
    assert json.loads((out / "summary.json").read_text())["n_trials"] == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "0"], "--concurrency 0 must be >= 1"),
        (["--trials", "-1"], "--trials -1 must be >= 0"),
        (["--epochs", "0"], "--epochs 0 must be >= 1"),
        (["--device", "cuda:99"], "cuda:99"),
    ],
)
def test_cli_rejects_bad_flags_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code = main(["demo", "--out", str(tmp_path / "x"), "--no-progress", *flags])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x" / "study.log").exists()
