"""The demo end to end at tiny settings, its resume, and its command line."""

from __future__ import annotations

from collections.abc import Callable
import csv
import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import time

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
import pandas as pd
import pytest

from waterwave_hpo.cli import main
from waterwave_hpo.demo import DemoConfig
from waterwave_hpo.demo import DemoSettingError
from waterwave_hpo.demo import LivenessRule
from waterwave_hpo.demo import load_digits
from waterwave_hpo.demo import open_journal
from waterwave_hpo.demo import run_demo
from waterwave_hpo.demo._liveness import ATTR_OWNER
from waterwave_hpo.demo._liveness import requeue
from waterwave_hpo.demo._liveness import rerun_of
from waterwave_hpo.demo._process import this_process
from waterwave_hpo.demo._run import STUDY_NAME
from waterwave_hpo.demo._run import _OwnedObjective
from waterwave_hpo.executor import WaterwaveExecutor
from waterwave_hpo.report import trials_table


def _config(out: Path, trials: int, concurrency: int = 3, epochs: int = 2) -> DemoConfig:
    return DemoConfig(
        trials=trials,
        concurrency=concurrency,
        epochs=epochs,
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


def test_resume_fails_an_orphaned_running_trial_and_runs_its_params_again_uncounted(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    run_demo(_config(out, trials=2))
    storage = JournalStorage(JournalFileBackend(str(out / "study.log")))
    study = optuna.load_study(study_name=STUDY_NAME, storage=storage)
    orphan = study.ask()  # a trial whose process was killed before the objective started
    orphan.suggest_int("n_conv", 1, 3)
    summary = run_demo(_config(out, trials=4)).summary
    assert summary["n_trials"] == 4  # the orphan does not count; its re-run does
    assert summary["n_interrupted"] == 1
    trials = optuna.load_study(study_name=STUDY_NAME, storage=storage).trials
    assert trials[2].state is optuna.trial.TrialState.FAIL
    assert trials[2].system_attrs["waterwave:fail_reason"].startswith("interrupted: ")
    (rerun,) = [t for t in trials if t.system_attrs.get("waterwave:rerun_of") == 2]
    assert rerun.state.is_finished() and rerun.params["n_conv"] == orphan.params["n_conv"]
    assert len(trials) == 5
    assert not any(t.state is optuna.trial.TrialState.RUNNING for t in trials)


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


def test_cli_demo_with_process_isolation_runs_trials_in_worker_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "process"
    flags = ["--trials", "3", "--concurrency", "2", "--epochs", "1", "--device", "cpu"]
    code = main(["demo", *flags, "--isolation", "process", "--out", str(out), "--no-progress"])
    assert code == 0
    assert "3 trials" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_trials"] == 3
    assert summary["isolation"] == "process"
    study = optuna.load_study(study_name=STUDY_NAME, storage=open_journal(out / "study.log"))
    assert {t.system_attrs["waterwave:slot"] for t in study.trials} <= {0, 1}
    assert all(t.state.is_finished() for t in study.trials)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--concurrency", "0"], "--concurrency 0: must be >= 1"),
        (["--trials", "-1"], "--trials -1: must be >= 0"),
        (["--epochs", "0"], "--epochs 0: must be >= 1"),
        (["--device", "cuda:99"], "--device cuda:99: "),
        (["--device", "tpu"], "--device tpu: "),
    ],
)
def test_cli_rejects_bad_flags_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code = main(["demo", "--out", str(tmp_path / "x"), "--no-progress", *flags])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "devices" not in err and "Traceback" not in err
    assert not (tmp_path / "x" / "study.log").exists()


def _read_only_directory(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        path = tmp_path / "read-only"
        path.mkdir()
        path.chmod(0o555)
        return path
    return Path("/sys")  # root may write any directory with mode 0o555, not sysfs's root


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_cli_rejects_an_out_that_is_not_a_writable_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    if kind == "file":
        out = tmp_path / "notes.txt"
        out.write_text("mine")
        expected = f"--out {out}: is a file, not a directory"
    else:
        out = _read_only_directory(tmp_path)
        expected = f"--out {out}: is not a directory the demo can write"
    code = main(["demo", "--out", str(out), "--no-progress", "--device", "cpu"])
    assert code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def _demo_process(out: Path, *flags: str) -> subprocess.Popen[str]:
    # From out's parent, not the repository root (the checkout would shadow the package).
    command = [sys.executable, "-m", "waterwave_hpo", "demo", "--device", "cpu", "--no-progress"]
    return subprocess.Popen(
        [*command, "--out", str(out), *flags],
        cwd=out.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def _trials(out: Path) -> list[optuna.trial.FrozenTrial]:
    if not (out / "study.log").exists():
        return []
    storage = JournalStorage(JournalFileBackend(str(out / "study.log")))
    try:
        return optuna.load_study(study_name=STUDY_NAME, storage=storage).trials
    except KeyError:  # the study is not created yet
        return []


def _running_owned_by(out: Path, pid: int) -> list[optuna.trial.FrozenTrial]:
    return [
        t
        for t in _trials(out)
        if t.state is TrialState.RUNNING and t.system_attrs.get(ATTR_OWNER, {}).get("pid") == pid
    ]


@pytest.mark.slow
def test_two_processes_share_one_out_and_the_first_survives_a_neighbour_failing_its_trial(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    flags = ("--trials", "4", "--epochs", "3", "--concurrency", "2", "--seed", "1")
    first = _demo_process(out, *flags)
    try:
        _wait_for(lambda: bool(_running_owned_by(out, first.pid)), 90, "a running trial")
        # A neighbour's mistake: one of the first process's running trials is told FAIL.
        victim = _running_owned_by(out, first.pid)[0].number
        storage = JournalStorage(JournalFileBackend(str(out / "study.log")))
        study = optuna.load_study(study_name=STUDY_NAME, storage=storage)
        study.tell(victim, state=TrialState.FAIL)
        # A second demo process on the same --out, while the first runs trials.
        second = run_demo(
            DemoConfig(4, 2, 3, "cpu", 1, out, show_progress_bar=False), LivenessRule()
        )
        _, err = first.communicate(timeout=180)
    finally:
        first.kill()
    assert first.returncode == 0, err
    assert second.summary["n_interrupted"] == 0
    trials = _trials(out)
    assert all(t.state.is_finished() for t in trials)
    assert [t.number for t in trials if t.state is TrialState.FAIL] == [victim]
    assert not any(rerun_of(t) is not None for t in trials)  # nothing judged stale
    owners = {t.system_attrs[ATTR_OWNER]["pid"] for t in trials}
    assert first.pid in owners and os.getpid() in owners  # both processes ran trials


@pytest.mark.slow
def test_ctrl_c_writes_what_finished_says_how_to_resume_and_reruns_the_interrupted(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    flags = ("--trials", "4", "--epochs", "2", "--concurrency", "2", "--seed", "1")
    process = _demo_process(out, *flags)
    try:
        _wait_for(
            lambda: (
                any(t.state.is_finished() for t in _trials(out))
                and bool(_running_owned_by(out, process.pid))
            ),
            120,
            "a finished and a running trial",
        )
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "Resume with:" in err and f"--out {out}" in err and "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    assert summary["n_interrupted"] >= 1
    table = pd.read_csv(out / "trials.csv")
    assert len(table) == len(_trials(out))
    interrupted = {t.number: t.params for t in _trials(out) if t.state is TrialState.FAIL}
    reasons = [t.system_attrs.get("waterwave:fail_reason") for t in _trials(out)]
    assert len(interrupted) == summary["n_interrupted"], reasons

    resumed = run_demo(_config(out, trials=4, concurrency=2, epochs=2)).summary
    assert resumed["n_trials"] == 4  # the interrupted ones did not count
    trials = _trials(out)
    assert not any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials)
    reruns = {rerun_of(t): t.params for t in trials if rerun_of(t) is not None}
    for number, params in interrupted.items():
        assert params.items() <= reruns[number].items()  # the same parameters ran again


def test_a_resumed_rerun_shows_the_trial_it_reruns_as_an_integer(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_demo(_config(out, trials=1, concurrency=1, epochs=1))
    storage = JournalStorage(JournalFileBackend(str(out / "study.log")))
    study = optuna.load_study(study_name=STUDY_NAME, storage=storage)
    requeue(study, study.trials[0])  # as when trial 0 was interrupted
    run_demo(_config(out, trials=1, concurrency=1, epochs=1))  # runs the re-run
    with open(out / "trials.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["rerun_of"] for row in rows] == ["", "0"]  # not "0.0"


def test_seed_repeats_parameters_and_accuracies_with_concurrency_1(tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b"):
        run_demo(_config(tmp_path / name, trials=3, concurrency=1, epochs=1))
        runs.append([(t.params, t.value) for t in _trials(tmp_path / name)])
    assert runs[0] == runs[1]


def test_resume_with_other_epochs_is_refused_naming_both_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    common = ["demo", "--trials", "1", "--concurrency", "1", "--device", "cpu", "--no-progress"]
    assert main([*common, "--epochs", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*common, "--epochs", "2", "--out", str(out), "--trials", "2"]) == 2
    err = capsys.readouterr().err
    assert "--epochs 2: the study in" in err and "was run with --epochs 1" in err
    assert "Resume with --epochs 1" in err
    with pytest.raises(DemoSettingError, match=r"epochs=3: .*run with epochs=1"):
        run_demo(_config(out, trials=2, epochs=3))
    assert len(_trials(out)) == 1  # no trial added


@pytest.mark.filterwarnings("ignore:.*could not be cast to float:UserWarning")
@pytest.mark.filterwarnings("ignore:.*is not acceptable:UserWarning")
def test_fail_reason_is_recorded_for_nan_none_and_str_returns(tmp_path: Path) -> None:
    study = optuna.create_study(storage=open_journal(tmp_path / "study.log"))
    returns = iter([float("nan"), None, "high"])
    objective = _OwnedObjective(lambda trial: next(returns), this_process())  # type: ignore[arg-type,return-value]
    WaterwaveExecutor(devices="cpu", trials_per_device=1).optimize(study, objective, n_trials=3)
    table = trials_table(study)
    assert list(table["state"]) == ["FAIL"] * 3
    reasons = list(table["fail_reason"])
    assert "returned nan" in reasons[0]
    assert "returned None" in reasons[1]
    assert "returned 'high' (str)" in reasons[2]
