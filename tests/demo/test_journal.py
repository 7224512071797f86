"""The demo's journal check: a cut last line is repaired (with a backup), anything else refused."""

from __future__ import annotations

import logging
from pathlib import Path

import optuna
import pytest

from waterwave_hpo.demo import JournalDamagedError
from waterwave_hpo.demo import check_journal
from waterwave_hpo.demo import open_journal


def _journal_with_trials(path: Path, n: int) -> None:
    study = optuna.create_study(storage=open_journal(path), study_name="s")
    for _ in range(n):
        study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)


def test_whole_journal_is_left_alone(tmp_path: Path) -> None:
    journal = tmp_path / "study.log"
    _journal_with_trials(journal, 2)
    before = journal.read_bytes()
    assert check_journal(journal) is None
    assert journal.read_bytes() == before
    assert list(tmp_path.glob("study.log.damaged-*")) == []


def test_cut_last_line_is_removed_backed_up_and_reported_then_resume_appends_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = tmp_path / "study.log"
    _journal_with_trials(journal, 2)
    whole = journal.read_bytes()
    cut = whole + b'{"op_code":5,"worker_id":"x","trial_id":1,"param_na'  # a kill mid-append
    journal.write_bytes(cut)

    with caplog.at_level(logging.WARNING, logger="waterwave_hpo.demo"):
        storage = open_journal(journal)
    assert "cut line" in caplog.text and "study.log.damaged-" in caplog.text
    assert journal.read_bytes() == whole
    (backup,) = tmp_path.glob("study.log.damaged-*")
    assert backup.read_bytes() == cut
    # Appending after the repair leaves a journal Optuna reads whole (before: a glued line).
    study = optuna.load_study(study_name="s", storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    reloaded = optuna.load_study(study_name="s", storage=open_journal(journal))
    assert [t.state.name for t in reloaded.trials] == ["COMPLETE"] * 3


def test_a_stray_line_inside_is_refused_with_file_line_and_fix(tmp_path: Path) -> None:
    journal = tmp_path / "study.log"
    _journal_with_trials(journal, 2)
    lines = journal.read_bytes().split(b"\n")
    lines.insert(3, b"hello, I was pasted here")
    journal.write_bytes(b"\n".join(lines))
    before = journal.read_bytes()
    with pytest.raises(JournalDamagedError, match=r"study\.log, line 4 of \d+ .*Fix: "):
        open_journal(journal)
    assert journal.read_bytes() == before  # nothing appended, nothing cut


def test_a_whole_last_line_that_is_not_a_record_is_refused(tmp_path: Path) -> None:
    journal = tmp_path / "study.log"
    _journal_with_trials(journal, 1)
    journal.write_bytes(journal.read_bytes() + b'{"not": "a record"}\n')
    n_lines = journal.read_bytes().count(b"\n")
    with pytest.raises(JournalDamagedError, match=f"line {n_lines} of {n_lines}"):
        check_journal(journal)
