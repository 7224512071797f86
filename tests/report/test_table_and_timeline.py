"""trials_table and plot_timeline on a study run by the executor."""

from __future__ import annotations

import csv
import io
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


def test_integer_columns_stay_integers_in_the_csv_where_some_are_missing() -> None:
    # A re-run after an out-of-memory error beside a trial that is none: pandas would make the
    # column float (NaN) and write "0.0".
    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(value=1.0, system_attrs={"waterwave:slot": 1}))
    study.add_trial(
        optuna.trial.create_trial(
            value=2.0, system_attrs={"waterwave:retry_of": 0, "waterwave:peak_bytes": 4096}
        )
    )
    cells = list(csv.DictReader(io.StringIO(trials_table(study).to_csv(index=False))))
    assert [(c["slot"], c["retry_of"], c["peak_bytes"]) for c in cells] == [
        ("1", "", ""),
        ("", "0", "4096"),
    ]


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


def _users_png(path: Path) -> None:
    """A PNG the user drew with matplotlib: an image, but not a timeline of ours."""
    from matplotlib.figure import Figure

    figure = Figure()
    figure.add_subplot().plot([0, 1], [1, 0])
    figure.savefig(path)


@pytest.mark.parametrize("theirs", ["notes", "png", "symlink"])
def test_timeline_refuses_a_file_it_did_not_write_and_leaves_it(
    theirs: str, tmp_path: Path
) -> None:
    path = tmp_path / "timeline.png"
    if theirs == "notes":
        path.write_bytes(b"my notes")
    elif theirs == "png":
        _users_png(path)
    else:
        (tmp_path / "elsewhere.png").write_bytes(b"my notes")
        path.symlink_to(tmp_path / "elsewhere.png")
    before = path.read_bytes()
    problem = "is not a regular file" if theirs == "symlink" else "is not a timeline"
    with pytest.raises(FileExistsError) as refused:
        plot_timeline([], path)
    assert str(refused.value).startswith(f"path={str(path)!r}: exists and {problem}")
    assert str(refused.value).endswith(
        "; nothing was written; pass a new path, or overwrite=True to replace it."
    )
    assert path.read_bytes() == before


def test_timeline_rewrites_its_own_png_an_empty_file_or_any_file_with_overwrite(
    study: optuna.Study, tmp_path: Path
) -> None:
    ours = plot_timeline(study.trials, tmp_path / "timeline.png", title="first")
    first = ours.read_bytes()
    assert plot_timeline(study.trials, ours, title="second").read_bytes() != first
    empty = tmp_path / "empty.png"  # e.g. a file made by tempfile.mkstemp for it to fill
    empty.touch()
    assert plot_timeline([], empty).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    theirs = tmp_path / "theirs.png"
    _users_png(theirs)
    assert plot_timeline([], theirs, overwrite=True).read_bytes() != first
    assert plot_timeline([], theirs).exists()  # now it is ours: no overwrite needed
    no_suffix = plot_timeline([], tmp_path / "timeline")  # a PNG at exactly that path
    assert no_suffix.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_overwrite_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"^overwrite='yes': must be a bool, not str; pass Tru"):
        plot_timeline([], tmp_path / "t.png", overwrite="yes")  # type: ignore[arg-type]
