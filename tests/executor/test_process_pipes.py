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
import contextlib
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
import psutil
import pytest

import waterwave_hpo as ww
from waterwave_hpo.workers._pool import WorkerPool

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
    submit = WorkerPool.submit
    killed: list[int] = []

    def submit_after_a_death(
        self: WorkerPool, index: int, host: Any, job: Any, frozen: bytes
    ) -> None:
        worker = self.workers[index]
        if job.trial.number == 1 and not killed and worker is not None and worker.pid:
            killed.append(worker.pid)
            os.kill(worker.pid, signal.SIGKILL)
            # The driver has seen it die and failed what it ran (nothing).
            assert worker.served.wait(_WAIT_S)
        submit(self, index, host, job, frozen)

    monkeypatch.setattr(WorkerPool, "submit", submit_after_a_death)
    study = optuna.create_study()
    assert _optimize_or_hang(_process(1), study, _x, n_trials=3) is None
    assert killed
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3


def test_a_worker_attached_twice_to_one_run_opens_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # A slot's new worker can be attached to the run twice: by the death handler's replacement
    # and again when the slot's next job comes. The worker must open the run once (one
    # begin): a second would open a second study in it and, on CUDA, a second stream.
    submit = WorkerPool.submit
    begins: list[int] = []

    def submit_after_a_second_attach(
        self: WorkerPool, index: int, host: Any, job: Any, frozen: bytes
    ) -> None:
        worker = self.workers[index]
        assert worker is not None and worker.host is host
        self._in_manager(lambda: self._attach(worker, host))  # as a second attach would
        begins.append(worker.counts["to:begin"])
        submit(self, index, host, job, frozen)

    monkeypatch.setattr(WorkerPool, "submit", submit_after_a_second_attach)
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


def _hang_outside(pid: int) -> int:
    if os.getpid() != pid:
        time.sleep(600)  # a worker opening the run hangs (here: loading the objective)
    return pid


class _HangsInWorkers:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_hang_outside, (os.getpid(),))


def test_a_worker_that_hangs_opening_the_run_fails_optimize_in_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from waterwave_hpo.workers import _pool

    state = _HangsInWorkers()

    def objective(trial: optuna.trial.Trial) -> float:
        assert state is not None
        return trial.suggest_float("x", 0.0, 1.0)

    executor = _process(1)
    executor.optimize(optuna.create_study(), _x, n_trials=1)  # its worker is warm
    monkeypatch.setattr(_pool, "ANSWER_TIMEOUT_S", 5.0)
    study = optuna.create_study()
    error = _optimize_or_hang(executor, study, objective, n_trials=2)
    assert isinstance(error, RuntimeError), error
    assert "did not answer within 5 s" in str(error)
    assert study.trials == []  # refused before any trial was asked


def test_a_slow_storage_call_of_one_worker_holds_up_no_other_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Trial 0's read of the study waits in the driver's storage until trial 1 (the other
    # worker) has been told; the driver must serve the other worker meanwhile.
    from waterwave_hpo import _optuna_compat

    study = optuna.create_study()
    storage = _optuna_compat.storage_of(study)
    original = storage.get_study_user_attrs
    released = threading.Event()
    waited: list[bool] = []

    def slow(study_id: int) -> dict[str, Any]:
        if threading.current_thread() is not threading.main_thread() and not waited:
            waited.append(released.wait(_WAIT_S))
        return original(study_id)

    monkeypatch.setattr(storage, "get_study_user_attrs", slow)

    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 0:
            return float(len(trial.study.user_attrs))
        return 1.0

    def callback(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        if frozen.number == 1:
            released.set()

    _process(2).optimize(study, objective, n_trials=2, callbacks=[callback])
    assert waited == [True]  # trial 1 was told while trial 0's call waited
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2


_FAKE_WORKERS = r"""
import itertools, os, subprocess, sys, threading, time
import psutil, torch
from waterwave_hpo.workers import _pool
from waterwave_hpo.workers._lease_service import DeviceLeases
from waterwave_hpo.workers._starters import SpawnStarter

# Fake workers: BAD writes a frame header no message has (size -4), as a stream corrupted by a
# second writer would; GOOD says it is warm, as a worker does, and answers each message after
# the init with "ended"; DEAF says it is warm and never reads; DIES is killed before it warms.
WARM = (
    "import os, pickle, sys, time; from multiprocessing.connection import Connection;"
    " c = Connection(int(sys.argv[1])); c.send_bytes(pickle.dumps(('warm', os.getpid())));"
)
BAD = (
    "import os, struct, sys, time; os.write(int(sys.argv[1]), struct.pack('!i', -4) + b'abcd');"
    " time.sleep(600)"
)
GOOD = WARM + (
    " c.recv_bytes()\nwhile True: c.recv_bytes(); c.send_bytes(pickle.dumps(('ended',)))"
)
DEAF = WARM + " time.sleep(600)"
DIES = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
launched = []

# Every fake as started, in order (BAD may be served and replaced before make_pool returns:
# the pool's slot then holds its successor); their pids also go to a file the test kills them
# by, whatever happens here.
started = []

class FakeStarter(SpawnStarter):
    def __init__(self, peers, *args):
        super().__init__(*args)
        self.peers = peers
    def command(self, fd):
        launched.append(fd)
        peer = self.peers[min(len(launched) - 1, len(self.peers) - 1)]
        return [sys.executable, "-c", peer, str(fd)]
    def start(self, worker, theirs, env):
        super().start(worker, theirs, env)
        started.append(worker)
        if worker.pid is not None:
            with open("fake_pids", "a") as pids:
                print(worker.pid, file=pids, flush=True)

def left_running():
    # The fakes alive after a close (none, if the close ended every worker it started).
    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return [w.pid for w in started if w.pid is not None and alive(w.pid)]

def wait_for(condition):
    deadline = time.monotonic() + 60
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()

def make_pool(peers, n):
    supervisor = _pool._Supervisor()
    supervisor._starter = FakeStarter(
        peers, supervisor.manager, supervisor._started, supervisor._exited
    )
    cpu = torch.device("cpu")
    before = len(started)
    pool = _pool.WorkerPool(supervisor, cpu, n, DeviceLeases(cpu, n, None), "off", {})
    supervisor.pools["cpu"] = pool
    wait_for(lambda: len(started) >= before + n)
    return supervisor, pool

supervisor, pool = make_pool([BAD, GOOD, DEAF], 3)
bad, good, deaf = started[:3]
served = bad.served.wait(60)
print("bad served:", served, flush=True)
if not served:
    os._exit(1)
print("bad reason:", bad.exit_reason(), flush=True)
print("good warm:", wait_for(lambda: good.is_warm and deaf.is_warm), flush=True)
# A message far larger than the pipe's buffer to a worker that does not read: the sender
# returns at once, and the manager goes on serving the others.
big = threading.Thread(target=deaf.send, args=(("begin", b"x" * (16 << 20)),), daemon=True)
big.start()
big.join(30)
print("big send returned:", not big.is_alive(), flush=True)
good.send(("end",))
print("others served:", wait_for(lambda: good.ended_run), flush=True)
supervisor.close()
print("left running after the first close:", left_running(), flush=True)

# A worker killed before it warms up, every time: started a few times, not without end; a
# run tries the given-up slot again, as many times (the run is bound once the slot is given up:
# bound while a start is still pending, the run would take over that start's count).
launched.clear()
supervisor, pool = make_pool([DIES], 1)
print("given up:", wait_for(lambda: 0 in pool._broken), flush=True)
print("starts before the run:", len(launched), flush=True)
launched.clear()
host = type("Host", (), {"payload": b""})()
try:
    pool.bind(host, 60)
except RuntimeError as error:
    print("bind:", error, flush=True)
print("starts in the run:", len(launched), flush=True)
supervisor.close()
print("left running after the second close:", left_running(), flush=True)
os._exit(0)
"""


def _kill_sleeping_fake(pid: int) -> None:
    """Kill the process group of fake worker ``pid`` if it still sleeps (BAD and DEAF sleep
    600 s; a pid the system gave to another process since is left alone)."""
    with contextlib.suppress(psutil.Error, ProcessLookupError):
        if "time.sleep(600)" in " ".join(psutil.Process(pid).cmdline()):
            os.killpg(pid, signal.SIGKILL)


_FAKE_WORKERS_BACKSTOP_S = 600.0  # past the sum of the script's own deadlines (390 s)


def test_a_bad_frame_a_deaf_worker_and_a_worker_dying_at_start_hold_up_no_other_worker(
    tmp_path: Path,
) -> None:
    # The manager must not spin on a malformed frame (a size of -4 once made it loop without
    # end, and then no worker of the pool was served): the driver ends the worker that sent
    # it, as a message it cannot read, and serves the others. A send larger than the pipe's
    # buffer to a worker that does not read never blocks the sender nor the manager. A worker
    # killed before it warms up is started again a few times, then its slot is given up; the
    # next run tries the slot again, as many times.
    # Each step of the script waits on its condition with a deadline of its own (390 s in
    # all); this bound only turns a hang past all of them into a failure that shows how far
    # the script got (beside two busy loops, the steps took over 180 s in all once).
    # A pool's close ends every worker it started, the fakes that never read their pipe too.
    # The output goes to a file and the script's own exit ends the wait: a fake worker the
    # script left behind (an orphan still holding a pipe) once kept a captured pipe open for
    # the whole backstop after the script had exited. Every fake (each in a session of its
    # own, as workers are) is killed at the end by the pid the script wrote, whatever happened.
    out_path = tmp_path / "fake_workers.out"
    with out_path.open("w") as out_file:
        script = subprocess.Popen(
            [sys.executable, "-c", _FAKE_WORKERS],
            stdout=out_file,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,  # `-c` puts the working directory first: not the source checkout
            start_new_session=True,
        )
        try:
            script.wait(timeout=_FAKE_WORKERS_BACKSTOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the fake workers' script hung; its output so far:\n{out_path.read_text()}"
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(script.pid, signal.SIGKILL)
            pids_path = tmp_path / "fake_pids"
            for pid in pids_path.read_text().split() if pids_path.exists() else []:
                _kill_sleeping_fake(int(pid))
    out = out_path.read_text()
    assert "bad served: True" in out, out
    assert "could not read" in out, out
    assert "good warm: True" in out, out
    assert "big send returned: True" in out, out
    assert "others served: True" in out, out
    assert "bind: Every worker process of cpu died at start" in out, out
    assert "given up: True" in out, out
    assert "starts before the run: 3" in out, out
    assert "starts in the run: 3" in out, out
    assert "left running after the first close: []" in out, out
    assert "left running after the second close: []" in out, out
