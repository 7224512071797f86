"""trials_table and plot_timeline on a study run by the executor."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

import waterwave_hpo as ww
from waterwave_hpo.report import plot_timeline
from waterwave_hpo.report import trials_table


@pytest.fixture(scope="module")
def study() -> optuna.Study:
    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0, 1)
        trial.report(x, 0)
        if trial.number == 1:
            raise optuna.TrialPruned()
        if trial.number == 2:
            raise ValueError("no good")
        return x

    study = optuna.create_study()
    executor = ww.WaterwaveExecutor("cpu", 2, record_trial_attrs=True)
    executor.optimize(study, objective, n_trials=5, catch=(ValueError,))
    return study


def test_one_row_per_trial_with_the_documented_columns(study: optuna.Study) -> None:
    table = trials_table(study)
    assert list(table["number"]) == [0, 1, 2, 3, 4]
    assert list(table["state"]) == ["COMPLETE", "PRUNED", "FAIL", "COMPLETE", "COMPLETE"]
    for column in (
        "value",
        "params",
        "datetime_start",
        "datetime_complete",
        "duration_s",
        "device",
        "slot",
        "fail_reason",
        "param_x",
    ):
        assert column in table.columns
    assert (table["device"] == "cpu").all()
    assert (table["duration_s"] >= 0).all()
    assert json.loads(table["params"][0]) == study.trials[0].params
    assert table["value"][1] == study.trials[1].intermediate_values[0]  # pruned: last report
    assert "ValueError: no good" in table["fail_reason"][2]


def test_timeline_is_a_png(study: optuna.Study, tmp_path: Path) -> None:
    path = plot_timeline(study.trials, tmp_path / "timeline.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5_000


def test_a_fused_batch_is_drawn_as_its_trials_each_with_its_own_state_and_end(
    tmp_path: Path,
) -> None:
    from waterwave_hpo.report._timeline import timeline_bars

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[object]:
        return [
            optuna.TrialPruned() if t.number % 3 == 1 else float(t.suggest_float("x", 0, 1))
            for t in trials
        ]

    study = optuna.create_study()
    ww.WaterwaveExecutor("cpu", 1, fuse=3, record_trial_attrs=True).optimize(
        study, objective, n_trials=3
    )
    bars = timeline_bars(study.trials)
    assert [b.number for b in bars] == [0, 1, 2]
    assert [b.state.name for b in bars] == ["COMPLETE", "PRUNED", "COMPLETE"]
    assert len({b.row for b in bars}) == 1  # one slot ...
    assert len({b.y for b in bars}) == 3  # ... split into one thin row per trial
    assert all(abs(b.height - 0.7 / 3) < 1e-9 for b in bars)
    assert max(b.y for b in bars) - min(b.y for b in bars) < 0.7  # within the slot's row
    t0 = min(t.datetime_start.timestamp() for t in study.trials if t.datetime_start)
    for bar, trial in zip(bars, study.trials, strict=True):
        assert trial.datetime_complete is not None
        own_end_s = trial.datetime_complete.timestamp() - t0
        assert abs(bar.left_s + bar.width_s - own_end_s) < 1e-3  # its own end
    assert plot_timeline(study.trials, tmp_path / "fused.png").stat().st_size > 0


def test_unfused_trials_keep_one_full_row_per_slot(study: optuna.Study) -> None:
    from waterwave_hpo.report._timeline import timeline_bars

    bars = timeline_bars(study.trials)
    assert {b.height for b in bars} == {0.7}
    assert all(b.y == int(b.y) for b in bars)
