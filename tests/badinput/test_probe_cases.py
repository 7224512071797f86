"""Cases a bad-input probe found: left RUNNING, silent, vague. Each failed on main at bcfa385."""

from __future__ import annotations

from pathlib import Path
import subprocess
import threading

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
import pytest
import torch
from torch import nn

from badinput._helpers import assert_none_running
from badinput._helpers import file_hashes
from badinput._helpers import immutable
from badinput._helpers import make_mutable
from badinput._helpers import read_only_sqlite_url
import waterwave_hpo as ww
from waterwave_hpo.cli import main
from waterwave_hpo.executor import StorageWriteError
from waterwave_hpo.planning import memory_ledger

# -- left RUNNING ---------------------------------------------------------------------------


def test_storage_made_read_only_mid_run_names_trials_left_running_and_stops_asking(
    tmp_path: Path,
) -> None:
    db = tmp_path / "study.db"
    study = optuna.create_study(storage=f"sqlite:///{db}", study_name="s")
    release = threading.Event()

    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 1:
            subprocess.run(["chattr", "+i", str(db)], check=True)  # not even root writes it
            release.set()
        return 1.0

    try:
        with pytest.raises(StorageWriteError, match=r"refused to record a trial's end") as caught:
            ww.WaterwaveExecutor("cpu", 1).optimize(study, objective, n_trials=5)
    finally:
        make_mutable(db)
    message = str(caught.value)
    assert "Trial(s) 1 are left RUNNING" in message
    assert "fail_stale_trials" in message and "state=optuna.trial.TrialState.FAIL" in message
    assert str(db) in message  # the storage is named
    assert "chattr -i" in message  # and the fix
    assert caught.value.left_running == [1]
    assert isinstance(caught.value.__cause__, optuna.exceptions.StorageInternalError)
    # No new trial was asked for after the refusal; only trial 1's end is missing.
    states = [t.state for t in optuna.load_study(study_name="s", storage=f"sqlite:///{db}").trials]
    assert states == [TrialState.COMPLETE, TrialState.RUNNING]


def test_read_only_sqlite_url_is_refused_before_any_trial(tmp_path: Path) -> None:
    db = tmp_path / "study.db"
    optuna.create_study(storage=f"sqlite:///{db}", study_name="s")
    before = file_hashes(db)
    study = optuna.load_study(study_name="s", storage=read_only_sqlite_url(db))
    with pytest.raises(ValueError, match=r"study='s': has a read-only storage .*mode=ro.*drop"):
        ww.WaterwaveExecutor("cpu", 2).optimize(study, lambda t: 1.0, n_trials=2)
    assert file_hashes(db) == before
    assert study.trials == []


def test_storage_refusing_ask_is_named_with_its_cause(tmp_path: Path) -> None:
    # A file made immutable before the run: the URL looks writable, ask() is refused.
    db = tmp_path / "study.db"
    study = optuna.create_study(storage=f"sqlite:///{db}", study_name="s")
    with immutable(db):
        with pytest.raises(StorageWriteError, match=r"refused to create or record a new trial"):
            ww.WaterwaveExecutor("cpu", 2).optimize(study, lambda t: 1.0, n_trials=2)
    assert_none_running(study)
    assert study.trials == []


# -- silent ---------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_fit_memory_refused_replan_keeps_the_working_plan() -> None:
    model = _mlp()
    ww.fit_memory(model, 1 << 30, example_input=torch.randn(4, 5))
    plan = ww.plan_of(model)
    with pytest.raises(ValueError, match=r"example_input=tensor of shape \(4, 3\)"):
        ww.fit_memory(model, 1 << 30, example_input=torch.randn(4, 3))
    assert ww.plan_of(model) is plan
    ledger = memory_ledger(model)
    ledger.reset_peak()
    model(torch.randn(4, 5)).sum().backward()
    assert ledger.peak_bytes > 0  # the plan's hooks still run


def test_demo_refuses_another_projects_journal_and_leaves_it_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = tmp_path / "study.log"
    optuna.create_study(storage=JournalStorage(JournalFileBackend(str(journal))), study_name="x")
    before = file_hashes(tmp_path)
    code = main(["demo", "--out", str(tmp_path), "--trials", "1", "--epochs", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--out {tmp_path}: {journal} was not written by waterwave-hpo" in err
    assert "pass a new or empty directory" in err and "Traceback" not in err
    assert file_hashes(tmp_path) == before


def test_trials_per_device_absurd_is_refused_before_allocating() -> None:
    with pytest.raises(ValueError, match=r"trials_per_device=2000000: must be <= 1024.*e\.g\. 4"):
        ww.WaterwaveExecutor("cpu", trials_per_device=2_000_000)
    with pytest.raises(ValueError, match=r"max_trials_per_device=5000: must be <= 1024"):
        ww.WaterwaveExecutor("cpu", "auto", max_trials_per_device=5000)


def test_objective_that_tells_its_own_trial_then_returns_is_an_error() -> None:
    study = optuna.create_study()

    def objective(trial: optuna.trial.Trial) -> float:
        trial.study.tell(trial, 1.0)
        return 2.0

    with pytest.raises(
        optuna.exceptions.UpdateFinishedTrialError,
        match=r"func returned 2\.0 for trial 0, which was already finished \(COMPLETE.*must not "
        r"tell its own trial",
    ):
        ww.WaterwaveExecutor("cpu", 1).optimize(study, objective, n_trials=3)
    assert [(t.state, t.value) for t in study.trials] == [(TrialState.COMPLETE, 1.0)]


def test_refused_demo_resume_appends_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["demo", "--out", str(tmp_path), "--trials", "0", "--epochs", "1", "--no-progress"]
    assert main([*args, "--device", "cpu"]) == 0
    before = file_hashes(tmp_path / "study.log")
    for flags in (["--seed", "7"], ["--epochs", "2"], ["--fuse", "2"]):
        capsys.readouterr()
        assert main([*args, *flags]) == 2
        assert "was run with" in capsys.readouterr().err
        assert file_hashes(tmp_path / "study.log") == before


# -- vague ----------------------------------------------------------------------------------


def test_negative_device_index_names_devices() -> None:
    with pytest.raises(ValueError, match=r"devices=-1: is a negative CUDA device index; pass"):
        ww.WaterwaveExecutor(devices=-1)


def test_objective_without_argument_is_refused_before_any_trial() -> None:
    study = optuna.create_study()
    with pytest.raises(TypeError, match=r"func=.*cannot be called with one argument, a trial"):
        ww.WaterwaveExecutor("cpu", 2).optimize(study, lambda: 1.0, n_trials=2)
    assert study.trials == []


def test_create_study_with_a_path_names_storage_and_suggests_a_journal(tmp_path: Path) -> None:
    path = str(tmp_path / "x.log")
    with pytest.raises(ValueError, match=r"storage='.*x\.log': is not a database URL.*Journal"):
        ww.create_study(storage=path)
    assert not (tmp_path / "x.log").exists()


@pytest.mark.parametrize(
    ("example_input", "error", "match"),
    [
        (torch.randn(4, 3), ValueError, r"example_input=tensor of shape \(4, 3\).*mat1 and mat2"),
        (None, TypeError, r"example_input=None: must be a tensor or a tuple"),
    ],
)
def test_fit_memory_wrong_example_input_names_it(
    example_input: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match) as caught:
        ww.fit_memory(_mlp(), 1 << 30, example_input=example_input)
    if example_input is not None:
        assert isinstance(caught.value.__cause__, RuntimeError)  # torch's own error, kept


def test_ray_optimize_checks_arguments_before_starting_ray() -> None:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    executor = ww.RayExecutor(n_hosts=1, num_gpus_per_host=0)
    study = optuna.create_study()
    with pytest.raises(ValueError, match=r"n_trials=-3: must be >= 0"):
        executor.optimize(study, lambda t: 1.0, n_trials=-3)
    with pytest.raises(TypeError, match=r"func=.*cannot be called with one argument"):
        executor.optimize(study, lambda: 1.0, n_trials=1)
    assert not ray.is_initialized()


@pytest.mark.parametrize("device", ["cuda", "cuda:x", "-1"])
def test_demo_device_error_names_the_flag_once(
    device: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--device", device, "--out", str(tmp_path / "d"), "--trials", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("--device") >= 1
    assert f"--device {device}: --device" not in err
    assert err.startswith(f"waterwave-hpo demo: error: --device {device}: ")
    assert not (tmp_path / "d").exists()
