"""A trial that forks beside trials running in threads of its process is told once, with the fix.

``fork()`` copies only the calling thread: a lock a neighbour's thread held at that moment stays
locked in the child (a ``DataLoader`` worker forked while a neighbour seeds torch's generator
blocks for ever). The deadlock itself cannot be provoked on demand; the warning can.
"""

from __future__ import annotations

import logging
import os
import threading

import optuna
import pytest

import waterwave_hpo as ww
from waterwave_hpo.host import _forks


@pytest.fixture(autouse=True)
def _unwarned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_forks, "_warned", False)


def _fork_and_reap() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the platform does not fork")
def test_a_fork_beside_running_trial_threads_warns_once_with_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    both_inside = threading.Barrier(2, timeout=60)

    def objective(trial: optuna.trial.Trial) -> float:
        both_inside.wait()  # the neighbour runs while this trial forks
        if trial.number == 0:
            _fork_and_reap()
            _fork_and_reap()
        both_inside.wait()
        return 0.0

    study = optuna.create_study()
    with caplog.at_level(logging.WARNING, logger="waterwave_hpo"):
        ww.WaterwaveExecutor(devices="cpu", trials_per_device=2).optimize(
            study, objective, n_trials=2
        )
    warnings = [r.getMessage() for r in caplog.records if "forked a process" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith("Trial 0 forked a process") and "1 other trial" in warnings[0]
    # What is fast first: process isolation (measured as fast as threads), then forkserver
    # (a new interpreter per DataLoader worker: seconds per epoch).
    fast, slow = warnings[0].find("isolation='process'"), warnings[0].find("'forkserver'")
    assert 0 <= fast < slow, warnings[0]
    assert "persistent_workers=True" in warnings[0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the platform does not fork")
def test_a_fork_from_a_trial_running_alone_is_not_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        _fork_and_reap()
        return 0.0

    with caplog.at_level(logging.WARNING, logger="waterwave_hpo"):
        ww.WaterwaveExecutor(devices="cpu", trials_per_device=1).optimize(
            optuna.create_study(), objective, n_trials=2
        )
    assert not [r for r in caplog.records if "forked a process" in r.getMessage()]
