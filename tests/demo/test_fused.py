"""The demo's fused search (``--fuse K``): one structure, numbers only, each trial on its own."""

from __future__ import annotations

import json
from pathlib import Path
import warnings

import optuna
from optuna.trial import TrialState
import pytest

import waterwave_hpo as ww
from waterwave_hpo.cli import main
from waterwave_hpo.demo import load_digits
from waterwave_hpo.demo import make_fused_objective
from waterwave_hpo.demo import open_journal
from waterwave_hpo.demo._run import STUDY_NAME


class _PruneNumbers(optuna.pruners.BasePruner):
    """Prunes the given trial numbers at their first report."""

    def __init__(self, numbers: set[int]) -> None:
        self.numbers = numbers

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        return trial.number in self.numbers


@pytest.mark.slow
def test_cli_demo_fuse_runs_a_numbers_only_search(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fused"
    args = ["demo", "--trials", "5", "--concurrency", "1", "--epochs", "1", "--device", "cpu"]
    code = main([*args, "--fuse", "4", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fuse"] == 4
    assert summary["n_trials"] == 5 and summary["n_complete"] == 5
    study = optuna.load_study(study_name=STUDY_NAME, storage=open_journal(out / "study.log"))
    trials = study.get_trials(deepcopy=False)
    assert {frozenset(t.params) for t in trials} == {
        frozenset({"lr", "weight_decay", "momentum", "dropout"})
    }
    assert [t.system_attrs["waterwave:batch"] for t in trials] == [[0, 1, 2, 3]] * 4 + [[4]]
    assert all(0.0 <= t.value <= 1.0 for t in trials)  # type: ignore[operator]


def test_cli_rejects_fuse_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--out", str(tmp_path / "x"), "--no-progress", "--fuse", "0"])
    assert code == 2
    assert "--fuse 0: must be >= 1" in capsys.readouterr().err


def _run_fused_four(third_lr: float) -> list[optuna.trial.FrozenTrial]:
    study = optuna.create_study(direction="maximize", pruner=_PruneNumbers({1}))
    study.enqueue_trial({"lr": 0.05, "weight_decay": 1e-4, "momentum": 0.9, "dropout": 0.0})
    study.enqueue_trial({"lr": 0.05, "weight_decay": 1e-4, "momentum": 0.5, "dropout": 0.2})
    study.enqueue_trial({"lr": third_lr, "weight_decay": 1e-4, "momentum": 0.9, "dropout": 0.3})
    study.enqueue_trial({"lr": 0.1, "weight_decay": 1e-5, "momentum": 0.8, "dropout": 0.0})
    objective = make_fused_objective(load_digits(), epochs=3, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Optuna: lr 1e9 is out of its range
        ww.WaterwaveExecutor("cpu", trials_per_device=1, fuse=4).optimize(
            study, objective, n_trials=4
        )
    return study.get_trials(deepcopy=False)


def test_pruned_and_diverged_trials_leave_the_fused_model_alone() -> None:
    trials = _run_fused_four(third_lr=1e9)  # trial 2 diverges
    assert [t.state for t in trials] == [
        TrialState.COMPLETE,
        TrialState.PRUNED,
        TrialState.FAIL,  # NaN: this trial alone
        TrialState.COMPLETE,
    ]
    assert sorted(trials[1].intermediate_values) == [0]  # pruned at its first report
    for survivor in (trials[0], trials[3]):  # trained all 3 epochs after the others left
        assert sorted(survivor.intermediate_values) == [0, 1, 2]
        assert survivor.value is not None and survivor.value > 0.8
    # The survivors (no dropout: deterministic) learn exactly as beside a healthy neighbour.
    healthy = _run_fused_four(third_lr=0.05)
    assert healthy[2].state is TrialState.COMPLETE
    for number in (0, 3):
        assert trials[number].intermediate_values == pytest.approx(
            healthy[number].intermediate_values, abs=1e-6
        )
