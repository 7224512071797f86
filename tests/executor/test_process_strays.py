"""Process isolation: the child processes a trial leaves running are ended at its end.

A warm worker runs one trial at a time and many trials in a row; a process a trial started and
did not end (a ``subprocess.Popen``, a ``multiprocessing.Process``, one forked by the
forkserver) is ended before the worker's next trial, with a warning naming the trial and the
pid. The processes a trial is still using (a ``DataLoader``'s persistent workers) are not
touched while it runs, nor are the per-process helpers of ``multiprocessing``.
"""

from __future__ import annotations

from collections.abc import Iterator
import logging
import multiprocessing
import os
from pathlib import Path
import subprocess
import sys
import threading
import time

import optuna
from optuna.trial import TrialState
import psutil
import pytest
import torch

import waterwave_hpo as ww

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start_child(kind: str) -> int:
    """A process that would run for ten minutes, started and never ended."""
    if kind == "subprocess":
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid
    context = multiprocessing.get_context("forkserver" if kind == "forkserver" else None)
    child = context.Process(target=time.sleep, args=(600,))
    child.start()
    assert child.pid is not None
    return child.pid


def _leaves_a_child(trial: optuna.trial.Trial) -> float:
    kind = trial.study.user_attrs["kind"]
    if trial.number == 0:
        trial.set_user_attr("child", _start_child(kind))
        return 0.0
    first = trial.study.get_trials(deepcopy=False)[0].user_attrs["child"]
    trial.set_user_attr("first_child_alive", _alive(first))
    if kind == "forkserver":  # its helper processes were kept: it still starts processes
        child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,))
        child.start()
        child.join()
        trial.set_user_attr("forkserver_exitcode", child.exitcode)
    return 0.0


@pytest.fixture
def worker_log(tmp_path: Path) -> Iterator[Path]:
    """The ``waterwave_hpo`` logger's warnings in a file (the workers take the handler)."""
    path = tmp_path / "waterwave.log"
    logger = logging.getLogger("waterwave_hpo")
    handler = logging.FileHandler(path)
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        handler.close()


@pytest.mark.parametrize("kind", ["subprocess", "multiprocessing", "forkserver"])
def test_a_child_left_running_is_ended_after_its_trial_with_a_warning(
    kind: str, worker_log: Path
) -> None:
    study = optuna.create_study()
    study.set_user_attr("kind", kind)
    child = None
    try:
        with ww.WaterwaveExecutor(devices="cpu", trials_per_device=1, isolation="process") as ex:
            ex.optimize(study, _leaves_a_child, n_trials=2)
        child = study.trials[0].user_attrs["child"]
        assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
        assert study.trials[1].user_attrs["first_child_alive"] is False
        assert not _alive(child)
        log = worker_log.read_text()
        # One process, the trial's: the forkserver and resource tracker it needed are kept.
        assert f"Trial 0 ended with 1 child process(es) still running: {child} (" in log
        assert "join a multiprocessing.Process, wait for a subprocess" in log
        assert "Trial 1 ended with" not in log
        if kind == "forkserver":
            assert study.trials[1].user_attrs["forkserver_exitcode"] == 0
    finally:
        if child is not None and _alive(child):  # without the fix: the test's own cleanup
            psutil.Process(child).kill()


class _WorkerPids(torch.utils.data.Dataset[torch.Tensor]):
    """Each item is the pid of the DataLoader worker that loaded it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(os.getpid())


def _persistent_loader(trial: optuna.trial.Trial) -> float:
    loader = torch.utils.data.DataLoader(
        _WorkerPids(), batch_size=2, num_workers=2, persistent_workers=True
    )
    epochs = []
    for _epoch in range(3):
        epochs.append(sorted({int(pid) for batch in loader for pid in batch}))
        time.sleep(0.5)  # several of the worker's polls while the loader's workers live
    trial.set_user_attr("worker_pids", epochs)
    del loader  # its workers shut down here: nothing of the trial is left running
    return 0.0


def test_a_dataloaders_persistent_workers_are_left_alone_while_its_trial_runs(
    worker_log: Path,
) -> None:
    study = optuna.create_study()
    with ww.WaterwaveExecutor(devices="cpu", trials_per_device=1, isolation="process") as ex:
        ex.optimize(study, _persistent_loader, n_trials=2)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for trial in study.trials:
        epochs = trial.user_attrs["worker_pids"]
        assert len(epochs[0]) == 2 and epochs == [epochs[0]] * 3  # the same two, every epoch
    assert "child process(es) still running" not in worker_log.read_text()


def _detaches_a_process(trial: optuna.trial.Trial) -> float:
    if trial.number == 0:
        # `setsid cmd &`: the shell exits at once, and the process is in a session of its own.
        done = subprocess.run(
            "setsid sleep 600 >/dev/null 2>&1 </dev/null & echo $!",
            shell=True,
            capture_output=True,
            text=True,
            check=True,
        )
        trial.set_user_attr("detached", int(done.stdout.strip()))
        return 0.0
    first = trial.study.get_trials(deepcopy=False)[0].user_attrs["detached"]
    trial.set_user_attr("detached_alive", _alive(first))
    return 0.0


def test_a_process_the_trial_detached_is_ended_after_it_with_a_warning(worker_log: Path) -> None:
    study = optuna.create_study()
    detached = None
    try:
        with ww.WaterwaveExecutor(devices="cpu", trials_per_device=1, isolation="process") as ex:
            ex.optimize(study, _detaches_a_process, n_trials=2)
        detached = study.trials[0].user_attrs["detached"]
        assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
        assert study.trials[1].user_attrs["detached_alive"] is False
        # Named by its pid (and its name then: `setsid` until it has become `sleep`).
        assert f"Trial 0 ended with 1 child process(es) still running: {detached} (" in (
            worker_log.read_text()
        )
    finally:
        if detached is not None and _alive(detached):  # without the fix: the test's own cleanup
            psutil.Process(detached).kill()


def _leaves_a_thread(trial: optuna.trial.Trial) -> float:
    if trial.number == 0:
        stop = threading.Event()
        trial.study.set_user_attr("unused", 0)
        threading.Thread(target=stop.wait, args=(600,), name="left-behind").start()
    return 0.0


def test_a_non_daemon_thread_the_trial_left_running_is_named_once(worker_log: Path) -> None:
    study = optuna.create_study()
    with ww.WaterwaveExecutor(devices="cpu", trials_per_device=1, isolation="process") as ex:
        ex.optimize(study, _leaves_a_thread, n_trials=3)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    log = worker_log.read_text()
    assert "Trial 0 ended with 1 non-daemon thread(s) still running: 'left-behind'" in log
    assert "they end with the worker" in log
    assert log.count("non-daemon thread") == 1  # named once, not after every later trial
