"""Kills a driver process (one running ``WaterwaveExecutor.optimize``) and resumes its study.

Run as a script by ``test_driver_crash.py``. It imports the library once, then forks each driver
(so a driver asks its first trial within milliseconds, and a kill can land anywhere in its
life), SIGKILLs it, and forks a resume: a new process that opens the study and runs the
executor, then reports the trials it left RUNNING. Printed last: one JSON line.

Usage: ``python _driver_crash_harness.py DB random KILLS SEED RESUME_EVERY`` (kill each driver a
seeded random delay after it opened the study; resume after every ``RESUME_EVERY``-th kill and
after the last) or
``python _driver_crash_harness.py DB after-ask`` (the driver kills itself right after
``study.ask()`` created its second trial while the first one sleeps: the issue's scenario).
With ``WW_ISOLATION=process`` in the environment the drivers run their trials in worker
processes, kills wait up to ``WW_MAX_KILL_DELAY_S`` seconds (workers take seconds to start),
and the report also counts the workers still alive after the last resume (orphans).
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import sys
import time
from typing import Any

import optuna

import waterwave_hpo as ww

# The executor (and torch) imported here, before the drivers are forked: a driver's kill delay
# counts from when it opened the study and must land in its trials, not in its imports
# (`import waterwave_hpo` imports each name on first use; a chain of ten kills then failed no
# trial).
import waterwave_hpo.executor

HEARTBEAT_INTERVAL_S = 1  # as in the crash report this reproduces
GRACE_PERIOD_S = 2
# A resume lasts longer than the grace period plus SQLite's one-second heartbeat resolution,
# so every trial of a killed driver is stale before it ends.
RESUME_S = GRACE_PERIOD_S + 2.0
# Counted from the moment a driver has opened the study (that alone takes ~0.6 s on the 2-core VM).
MAX_KILL_DELAY_S = float(os.environ.get("WW_MAX_KILL_DELAY_S", "1.0"))
ISOLATION = os.environ.get("WW_ISOLATION", "threads")
MARKER = "WW_CRASH_HARNESS_RUN"  # in every driver's and worker's environment


def _study(db: str) -> optuna.Study:
    storage = optuna.storages.RDBStorage(
        f"sqlite:///{db}", heartbeat_interval=HEARTBEAT_INTERVAL_S, grace_period=GRACE_PERIOD_S
    )
    return optuna.create_study(storage=storage, study_name="crash", load_if_exists=True)


def _objective(trial: optuna.trial.Trial) -> float:
    x = trial.suggest_float("x", 0.0, 1.0)
    time.sleep(0.25 * x)
    return x


def _drive(db: str, timeout_s: float | None, ready_fd: int | None = None) -> optuna.Study:
    study = _study(db)
    if ready_fd is not None:  # the study is open: the killer's random delay starts now
        os.write(ready_fd, b"1")
    executor = ww.WaterwaveExecutor(devices="cpu", trials_per_device=2, isolation=ISOLATION)
    if timeout_s is not None and ISOLATION == "process":
        # The timeout counts from the call, as Study.optimize's, and a new executor's workers
        # take seconds to start on a loaded machine: start them first, so that a resume runs
        # trials for its whole timeout.
        executor.optimize(optuna.create_study(), lambda trial: 0.0, n_trials=2)
    n_trials = None if timeout_s is not None else 10_000  # a driver runs until killed
    executor.optimize(study, _objective, n_trials=n_trials, timeout=timeout_s)
    return study


def _in_child(work: object, *args: object) -> int:
    """Fork; run ``work(*args)`` in the child, which then exits. The child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            work(*args)  # type: ignore[operator]
        except BaseException as error:
            print(f"child {os.getpid()} failed: {error!r}", file=sys.stderr, flush=True)
            code = 1
        finally:
            os._exit(code)
    return pid


def _resume(db: str, report: str) -> None:
    study = _drive(db, timeout_s=RESUME_S)
    running = [
        t.number
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    ]
    with open(report, "a") as file:
        file.write(json.dumps({"running": running}) + "\n")


def _kill_after_second_ask(db: str) -> None:
    ask = optuna.Study.ask
    asked: list[optuna.trial.Trial] = []

    def ask_then_die(self: optuna.Study, *args: Any, **kwargs: Any) -> optuna.trial.Trial:
        trial = ask(self, *args, **kwargs)
        asked.append(trial)
        if len(asked) == 2:  # the neighbour was just asked; the executor wrote nothing of it yet
            os.kill(os.getpid(), signal.SIGKILL)
        return trial

    optuna.Study.ask = ask_then_die  # type: ignore[method-assign]

    def sleepy(trial: optuna.trial.Trial) -> float:
        time.sleep(30.0)
        return 0.0

    study = _study(db)
    ww.WaterwaveExecutor(devices="cpu", trials_per_device=2).optimize(study, sleepy, n_trials=2)


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return status


def main(argv: list[str]) -> None:
    db, mode = argv[0], argv[1]
    report = db + ".resumes.jsonl"
    kills = 0
    if mode == "after-ask":
        status = _wait(_in_child(_kill_after_second_ask, db))
        kills += int(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL)
        _wait(_in_child(_resume, db, report))
    else:
        n_kills, seed, resume_every = int(argv[2]), int(argv[3]), int(argv[4])
        rng = random.Random(seed)
        for i in range(n_kills):
            # The delay counts from the moment the driver has opened the study (seconds on a
            # loaded machine), so that the kills land in its trials, not all in its start-up.
            ready_r, ready_w = os.pipe()
            pid = _in_child(_drive, db, None, ready_w)
            os.close(ready_w)
            select.select([ready_r], [], [], 120.0)
            os.close(ready_r)
            time.sleep(rng.uniform(0.0, MAX_KILL_DELAY_S))
            os.kill(pid, signal.SIGKILL)
            status = _wait(pid)
            kills += int(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL)
            if (i + 1) % resume_every == 0 or i + 1 == n_kills:
                _wait(_in_child(_resume, db, report))
    with open(report) as file:
        resumes = [json.loads(line) for line in file]
    states = {s.name: 0 for s in optuna.trial.TrialState}
    for trial in _study(db).get_trials(deepcopy=False):
        states[trial.state.name] += 1
    report = {"kills": kills, "resumes": resumes, "states": states, "orphans": _orphans()}
    print(json.dumps(report), flush=True)


def _orphans(wait_s: float = 15.0) -> list[int]:
    """Processes of this run (drivers' workers) still alive after ``wait_s`` seconds."""
    import psutil

    marker = os.environ[MARKER]
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for process in psutil.process_iter():
            if process.pid == os.getpid():
                continue
            try:
                if process.environ().get(MARKER) == marker and process.status() != "zombie":
                    alive.append(process.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


if __name__ == "__main__":
    os.environ.setdefault(MARKER, str(os.getpid()))
    main(sys.argv[1:])
