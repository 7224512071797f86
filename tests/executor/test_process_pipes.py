"""The worker-process dispatch path (``isolation="process"``) under faults: no trial is lost.

Every trial a study started must end COMPLETE, PRUNED or FAIL, whatever happens to its worker
between the driver's choice of a worker and the trial's record, and whatever bytes a worker's
pipe carries. Faults are injected on the CPU: a worker killed (SIGKILL) at a chosen moment, a
worker whose run cannot begin, a fake worker that writes a frame header no message has.

A study that would hang runs in a thread the test waits for, up to a bound far above the
study's need (:data:`_WAIT_S`): the bound turns a hang into a failure; it is no measure of speed.
"""

from __future__ import annotations

from collections.abc import Iterator
import os
from pathlib import Path
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest

import waterwave_hpo as ww
from waterwave_hpo.workers._pool import WorkerProcess

_WAIT_S = 120.0  # a worker's first trial waits for its interpreter and torch to import

_EXECUTORS: list[ww.WaterwaveExecutor] = []


def _process(k: int) -> ww.WaterwaveExecutor:
    executor = ww.WaterwaveExecutor(devices="cpu", trials_per_device=k, isolation="process")
    _EXECUTORS.append(executor)
    return executor


@pytest.fixture(autouse=True)
def _close_executors() -> Iterator[None]:
    yield
    while _EXECUTORS:
        _EXECUTORS.pop().close()


def _optimize_or_hang(
    executor: ww.WaterwaveExecutor, study: optuna.Study, objective: Any, n_trials: int
) -> BaseException | None:
    """Run ``optimize`` in a thread; its exception, or ``None``. Fails the test on a hang."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            executor.optimize(study, objective, n_trials=n_trials)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(_WAIT_S)
    states = [(t.number, t.state.name) for t in study.get_trials(deepcopy=False)]
    assert not thread.is_alive(), f"optimize() never returned; the trials: {states}"
    return raised[0] if raised else None


def _x(trial: optuna.trial.Trial) -> float:
    return trial.suggest_float("x", 0.0, 1.0)


def test_a_worker_that_dies_just_before_its_next_trial_is_sent_loses_no_trial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The slot's worker dies after the driver chose it for the trial and before the trial is
    # handed to it (SIGKILL from outside, the OOM killer: at any moment), and the driver sees
    # the death first: the trial must still run (on the slot's next worker) or fail, never
    # stay RUNNING with nobody to end it.
    run = WorkerProcess.run
    killed: list[int] = []

    def run_after_a_death(self: WorkerProcess, job: Any, frozen: list[Any]) -> Any:
        if job.trial.number == 1 and not killed:
            killed.append(self.pid)
            os.kill(self.pid, signal.SIGKILL)
            self.served.wait()  # the driver has seen it die and failed what it ran (nothing)
        return run(self, job, frozen)

    monkeypatch.setattr(WorkerProcess, "run", run_after_a_death)
    study = optuna.create_study()
    assert _optimize_or_hang(_process(1), study, _x, n_trials=3) is None
    assert killed
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3


def test_a_worker_attached_twice_to_one_run_opens_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A slot's new worker can be attached to the run by two threads at once: the death
    # handler's replacement and the slot's next submit. The worker must open the run once
    # (one begin): a second would open a second study in it and, on CUDA, a second stream.
    run = WorkerProcess.run
    begins: list[int] = []

    def run_after_a_second_attach(self: WorkerProcess, job: Any, frozen: list[Any]) -> Any:
        assert self.host is not None
        self.attach(self.host)  # as the other thread would
        begins.append(self.counts["to:begin"])
        return run(self, job, frozen)

    monkeypatch.setattr(WorkerProcess, "run", run_after_a_second_attach)
    study = optuna.create_study()
    assert _optimize_or_hang(_process(2), study, _x, n_trials=4) is None
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert begins == [1] * 4


def test_a_worker_whose_run_could_not_begin_fails_the_trials_sent_to_it(tmp_path: Path) -> None:
    # Of two workers, one cannot open the run (its begin fails: here the objective's state
    # cannot be rebuilt a second time; in life a module edited or gone since the first worker
    # loaded it). The run goes on with the other; a trial sent to the one that failed must end
    # (FAIL, with the worker's error, which optimize raises as an objective's), not wait for
    # a worker that dropped it.
    marker = tmp_path / "loaded-once"

    def load_once(path: str) -> str:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))  # FileExistsError the second time
        return path

    class LoadsOnce:
        def __reduce__(self) -> tuple[Any, ...]:
            return (load_once, (str(marker),))

    state = LoadsOnce()

    def objective(trial: optuna.trial.Trial) -> float:
        assert state is not None
        return trial.suggest_float("x", 0.0, 1.0)

    study = optuna.create_study()
    error = _optimize_or_hang(_process(2), study, objective, n_trials=4)
    assert isinstance(error, RuntimeError)
    assert "could not start" in str(error)
    trials = study.get_trials(deepcopy=False)
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
    failed = [t for t in trials if t.state is TrialState.FAIL]
    assert failed
    for trial in failed:
        reason = trial.system_attrs["waterwave:fail_reason"]
        assert "could not start the run" in reason
        assert "FileExistsError" in reason


def test_a_thread_the_trial_left_running_gets_its_answer_while_the_worker_waits_for_work(
    tmp_path: Path,
) -> None:
    # Trial 0 leaves a thread that reads the study after the trial has ended. The driver sends
    # nothing meanwhile (its callback for trial 0 waits for that read), so the worker's slot
    # thread waits for its next request, reading the pipe: it must hand the answer on.
    told = tmp_path / "told"
    answered = tmp_path / "answered"

    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 0:
            study = trial.study

            def read_later() -> None:
                while not told.exists():
                    time.sleep(0.01)
                answered.write_text(str(study.user_attrs["k"]))

            threading.Thread(target=read_later, daemon=True).start()
        return trial.suggest_float("x", 0.0, 1.0)

    def callback(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        if frozen.number != 0:
            return
        told.touch()
        deadline = time.monotonic() + _WAIT_S
        while not answered.exists():  # a bound on a hang, not a measure of speed
            assert time.monotonic() < deadline, "the left thread's read got no answer"
            time.sleep(0.01)

    study = optuna.create_study()
    study.set_user_attr("k", 7)
    _process(1).optimize(study, objective, n_trials=2, callbacks=[callback])
    assert answered.read_text() == "7"
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2


_FAKE_WORKERS = r"""
import itertools, os, pickle, socket, struct, subprocess, sys, threading
import torch
from waterwave_hpo.workers._lease_service import LeaseServer
from waterwave_hpo.workers._pool import WorkerPool, WorkerProcess

# Fake workers: the first writes a frame header no message has (size -4), as a stream
# corrupted by a second writer would; the second says it is warm, as a worker does.
PEERS = [
    "import os, struct, sys, time; os.write(int(sys.argv[1]), struct.pack('!i', -4) + b'abcd');"
    " time.sleep(600)",
    "import os, pickle, sys, time; from multiprocessing.connection import Connection;"
    " c = Connection(int(sys.argv[1])); c.send_bytes(pickle.dumps(('warm', os.getpid())));"
    " time.sleep(600)",
]
launched = itertools.count()

def launch(fd):
    return subprocess.Popen(
        [sys.executable, "-c", PEERS[next(launched)], str(fd)], pass_fds=(fd,)
    )

cpu = torch.device("cpu")
pool = WorkerPool(cpu, 1, LeaseServer(cpu, 1, None), "off", launch)
bad = pool.workers[0]
served = bad.served.wait(60)
print("bad served:", served, flush=True)
if not served:
    os._exit(1)
print("bad reason:", bad.exit_reason(), flush=True)
good = WorkerProcess(pool, 1)
print("good warm:", good.warm.wait(60) and good.is_warm, flush=True)
pool.workers.append(good)
pool.close()
os._exit(0)
"""


def test_a_frame_header_no_message_has_ends_that_worker_and_the_others_are_still_served(
    tmp_path: Path,
) -> None:
    # The pool's one pipe server must not spin on a malformed frame (a size of -4 once made it
    # loop without end, and then no worker of the pool was served): the driver ends the
    # worker that sent it, as a message it cannot read, and serves the others.
    done = subprocess.run(
        [sys.executable, "-c", _FAKE_WORKERS],
        capture_output=True,
        text=True,
        timeout=_WAIT_S + 60,
        check=False,
        cwd=tmp_path,  # `-c` puts the working directory first: not the source checkout
    )
    out = done.stdout
    assert "bad served: True" in out, out + done.stderr
    assert "could not read" in out, out + done.stderr
    assert "good warm: True" in out, out + done.stderr
