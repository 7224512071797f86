"""The driver process itself dies (SIGKILL) at any moment: the next process that opens the
study and runs the executor fails every trial the dead one had asked.

A real process on a SQLite file storage with heartbeats (``heartbeat_interval=1,
grace_period=2``, as the issue's report), killed from outside after seeded random delays, or
right after ``study.ask()`` created a trial whose first heartbeat is not written yet.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
from typing import Any

import pytest

_HARNESS = Path(__file__).with_name("_driver_crash_harness.py")


def _run(db: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, str(_HARNESS), str(db), *args],
        env=None if env is None else {**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "failed:" not in result.stderr, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.slow
def test_a_driver_killed_right_after_ask_leaves_no_trial_running_after_a_resume(
    tmp_path: Path,
) -> None:
    # One trial sleeps, its neighbour was just created by ask(): no heartbeat of it exists yet.
    report = _run(tmp_path / "study.db", "after-ask")
    assert report["kills"] == 1
    assert report["resumes"] == [{"running": []}]
    assert report["states"]["RUNNING"] == 0
    assert report["states"]["FAIL"] >= 2  # the sleeping trial and its neighbour


@pytest.mark.slow
def test_every_random_kill_of_the_driver_is_cleaned_up_by_the_next_resume(
    tmp_path: Path,
) -> None:
    report = _run(tmp_path / "study.db", "random", "4", "1", "1")
    assert report["kills"] == 4
    assert report["resumes"] == [{"running": []}] * 4
    assert report["states"]["RUNNING"] == 0
    assert report["states"]["COMPLETE"] > 0


@pytest.mark.slow
def test_a_chain_of_random_driver_kills_then_one_resume_leaves_no_trial_running(
    tmp_path: Path,
) -> None:
    # Each driver starts while the trials of the previous ones may still look alive.
    # Ten drivers in a row, each killed within a second of its start: every one starts inside
    # the heartbeat grace period (2 s) of trials the previous ones left RUNNING.
    report = _run(tmp_path / "study.db", "random", "10", "2", "10")
    assert report["kills"] == 10
    assert report["resumes"] == [{"running": []}]
    assert report["states"]["RUNNING"] == 0
    assert report["states"]["FAIL"] > 0


@pytest.mark.slow
def test_random_kills_of_a_driver_with_worker_processes_leave_no_trial_running_or_orphan(
    tmp_path: Path,
) -> None:
    # The driver writes the heartbeats; its workers exit when its pipe closes.
    env = {"WW_ISOLATION": "process", "WW_MAX_KILL_DELAY_S": "8"}
    report = _run(tmp_path / "study.db", "random", "4", "3", "2", env=env)
    assert report["kills"] == 4
    assert report["resumes"] == [{"running": []}] * 2
    assert report["states"]["RUNNING"] == 0
    assert report["states"]["COMPLETE"] > 0
    assert report["orphans"] == []
