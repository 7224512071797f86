"""Ctrl+C, once or many times, leaves no trial RUNNING, on a busy machine, on SQLite.

A real process is interrupted with real SIGINTs while four trial threads write to a SQLite
study: the first Ctrl+C tells the running trials FAIL, and the ones after it land while those
tells run. In the slow variant two busy loops load the cores as another job would (the
clean-up's storage calls then take long enough for the next Ctrl+C to land inside one). The
study is read afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
from pathlib import Path
import signal
import subprocess
import sys
import time

import optuna
from optuna.trial import TrialState
import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

# Four ~1 s trials at a time, each writing an intermediate value every 10 ms.
_SCRIPT = """
import sys, time
import optuna
import waterwave_hpo as ww

study = optuna.create_study(storage=sys.argv[1], study_name="ctrl-c")

def objective(trial):
    print(f"started {trial.number}", flush=True)
    for step in range(100):
        time.sleep(0.01)
        trial.report(float(step), step)
    return 0.0

ww.WaterwaveExecutor(devices="cpu", trials_per_device=4).optimize(study, objective, n_trials=1000)
"""


@contextlib.contextmanager
def _busy_cores(n: int = 2) -> Iterator[None]:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def _interrupt(directory: Path, n_sigints: int, gap_s: float) -> tuple[list[TrialState], str]:
    """Run the script, Ctrl+C it ``n_sigints`` times once 4 trials run; its states and stderr."""
    url = f"sqlite:///{directory / 'study.db'}"
    child = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, url],
        cwd=directory,  # not the checkout, which would shadow the installed package
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        started = 0
        while started < 4:
            line = child.stdout.readline()
            assert line, f"the script ended before 4 trials started: {child.communicate()[1]}"
            started += line.startswith("started ")
        for _ in range(n_sigints):
            child.send_signal(signal.SIGINT)
            time.sleep(gap_s)
        _, err = child.communicate(timeout=120)
    finally:
        child.kill()
        child.wait()
    study = optuna.load_study(study_name="ctrl-c", storage=url)
    return [t.state for t in study.get_trials(deepcopy=False)], err


def _check(states: list[TrialState], err: str) -> None:
    assert states, err
    assert TrialState.RUNNING not in states, (states, err[-4000:])
    assert set(states) <= {TrialState.COMPLETE, TrialState.FAIL}, states
    assert "KeyboardInterrupt" in err
    # One line says what became of the running trials; none of Optuna's "Skipped telling".
    assert err.count("are told FAIL") == 1, err[-4000:]
    assert "Skipped telling" not in err, err[-4000:]


def test_a_burst_of_ctrl_c_leaves_no_trial_running(tmp_path: Path) -> None:
    # Five Ctrl+C 20 ms apart: the ones after the first land while the running trials are
    # being told FAIL (the slow variant below loads the cores too, which widens that window).
    states, err = _interrupt(tmp_path, n_sigints=5, gap_s=0.02)
    _check(states, err)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("n_sigints", "gap_s"), [(2, 0.2), (6, 0.05)], ids=["a-persons-pace", "a-burst"]
)
def test_repeated_ctrl_c_on_a_busy_machine_leaves_no_trial_running(
    tmp_path: Path, n_sigints: int, gap_s: float
) -> None:
    # Ctrl+C again at a person's pace (200 ms: the second lands in the tells) and in a burst
    # (50 ms: several land in one storage call), with both cores loaded.
    with _busy_cores():
        states, err = _interrupt(tmp_path, n_sigints=n_sigints, gap_s=gap_s)
    _check(states, err)
