"""``WaterwaveExecutor(isolation="process")``: trials in worker processes, on the CPU.

Workers are real spawned processes; crashes are real signals. Trials that must be inside at the
same moment meet through files (a barrier across processes), never through sleeps.
"""

from __future__ import annotations

import _thread
from collections.abc import Iterator
import contextlib
import ctypes
import datetime
import gc
import logging
import os
from pathlib import Path
import random
import signal
import subprocess
import sys
import threading
import time

from _barrier import arrive as _arrive
import optuna
from optuna.trial import TrialState
import psutil
import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo.workers import WORKER_MARK
from waterwave_hpo.workers import exit_reason

_WAIT_S = 120.0  # a worker's first trial waits for its interpreter and torch to import


_EXECUTORS: list[ww.WaterwaveExecutor] = []


def _process(k: int = 2, **kwargs: object) -> ww.WaterwaveExecutor:
    executor = ww.WaterwaveExecutor(
        devices="cpu",
        trials_per_device=k,
        isolation="process",
        **kwargs,  # type: ignore[arg-type]
    )
    _EXECUTORS.append(executor)
    return executor


@pytest.fixture(autouse=True)
def _close_executors() -> Iterator[None]:
    """Each test's executors are closed after it; then none of their workers is left."""
    yield
    while _EXECUTORS:
        _EXECUTORS.pop().close()
    assert _workers() == []


def _states(study: optuna.Study) -> list[TrialState]:
    return [t.state for t in study.get_trials(deepcopy=False)]


def _workers() -> list[psutil.Process]:
    """This process's live worker processes."""
    gc.collect()  # an executor an earlier test dropped ends its workers now
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if WORKER_MARK in child.cmdline() and child.status() != "zombie":
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def test_trials_run_in_worker_processes_with_optuna_semantics(
    storage: optuna.storages.BaseStorage,
) -> None:
    offset = 10.0  # a closure: cloudpickle sends it by value
    seen: list[tuple[int, str]] = []

    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0.0, 1.0)
        trial.set_user_attr("pid", os.getpid())
        context = ww.current()
        trial.set_user_attr("context", [context.trial_number, str(context.device), context.slot])
        trial.report(1.0 if trial.number % 3 == 0 else 0.1, step=0)
        if trial.should_prune():  # ThresholdPruner(upper=0.5): trials 0, 3, 6
            raise optuna.TrialPruned()
        return x + offset

    def callback(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        seen.append((frozen.number, threading.current_thread().name))

    study = optuna.create_study(storage=storage, pruner=optuna.pruners.ThresholdPruner(upper=0.5))
    _process(2, record_trial_attrs=True).optimize(
        study, objective, n_trials=7, callbacks=[callback]
    )
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [
        TrialState.PRUNED if t.number % 3 == 0 else TrialState.COMPLETE for t in trials
    ]
    for trial in trials:
        assert trial.user_attrs["pid"] != os.getpid()
        assert trial.user_attrs["context"][:2] == [trial.number, "cpu"]
        assert trial.user_attrs["context"][2] == trial.system_attrs["waterwave:slot"]
        assert trial.system_attrs["waterwave:device"] == "cpu"
        assert trial.intermediate_values == {0: 1.0 if trial.number % 3 == 0 else 0.1}
        if trial.state is TrialState.COMPLETE:
            assert trial.value == pytest.approx(trial.params["x"] + offset)
    # One worker per slot, reused across its trials.
    assert len({t.user_attrs["pid"] for t in trials}) == 2
    # Callbacks run in the driver's calling thread, once per trial.
    assert sorted(number for number, _ in seen) == list(range(7))
    assert {name for _, name in seen} == {threading.current_thread().name}


@pytest.mark.slow  # over 10 s on the 2-core CI machine
def test_a_crashed_worker_fails_its_trial_alone_with_the_signal_or_exit_code() -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0.0, 1.0)
        if trial.number == 1:
            ctypes.string_at(0)  # segmentation fault
        elif trial.number == 2:
            os.abort()
        elif trial.number == 3:
            os._exit(3)
        elif trial.number == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        trial.set_user_attr("pid", os.getpid())
        return x

    study = optuna.create_study()
    _process(2).optimize(study, objective, n_trials=9)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 9
    reasons = {t.number: t.system_attrs.get("waterwave:fail_reason", "") for t in trials}
    assert [t.number for t in trials if t.state is TrialState.FAIL] == [1, 2, 3, 4]
    assert "killed by signal SIGSEGV" in reasons[1]
    assert "killed by signal SIGABRT" in reasons[2]
    assert "exit code 3" in reasons[3]
    assert "killed by signal SIGKILL" in reasons[4]
    assert [t.state for t in trials if t.number == 0 or t.number > 4] == [TrialState.COMPLETE] * 5


def test_the_exit_reason_names_the_signal_or_the_code() -> None:
    assert exit_reason(-signal.SIGSEGV, 7) == (
        "its worker process (pid 7) died: killed by signal SIGSEGV (Segmentation fault)"
    )
    assert "(kill -9, or the kernel's OOM killer)" in exit_reason(-signal.SIGKILL, 7)
    assert exit_reason(3, 7) == "its worker process (pid 7) died: exit code 3"


def test_an_executor_dropped_after_its_optimize_raised_ends_its_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        raise KeyError("the objective's bug")

    executor = ww.WaterwaveExecutor("cpu", trials_per_device=2, isolation="process")
    # No log record of the failure: pytest keeps records, with the error's traceback (so the
    # executor), until the test ends; a script's handlers keep none.
    with (
        caplog.at_level(logging.CRITICAL + 1, "optuna"),
        caplog.at_level(logging.CRITICAL + 1, "waterwave_hpo"),
        pytest.raises(KeyError, match="the objective's bug"),
    ):
        executor.optimize(optuna.create_study(), objective, n_trials=2)
    assert _workers()
    del executor  # never closed: the user dropped it, as after any failed call
    assert _workers() == []


def test_an_objective_that_cannot_be_pickled_is_refused_before_any_trial() -> None:
    lock = threading.Lock()

    def objective(trial: optuna.trial.Trial) -> float:
        with lock:
            return 0.0

    study = optuna.create_study()
    with pytest.raises(TypeError, match=r"func=.*picklable, since isolation='process'.*lock"):
        _process(2).optimize(study, objective, n_trials=2)
    assert study.trials == []


def test_isolation_is_checked_with_the_argument_named() -> None:
    with pytest.raises(ValueError, match=r"isolation='fork': is not one of 'threads', 'process'"):
        ww.WaterwaveExecutor("cpu", isolation="fork")
    with pytest.raises(ValueError, match=r"trials_per_device='auto'.*isolation='process'"):
        ww.WaterwaveExecutor("cpu", trials_per_device="auto", isolation="process")
    assert "isolation='process'" in repr(_process(2))
    assert ww.WaterwaveExecutor("cpu").isolation is ww.executor.Isolation.THREADS


@pytest.mark.slow  # over 10 s on the 2-core CI machine
def test_caught_and_uncaught_exceptions_end_as_with_threads(tmp_path: Path) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 1:
            raise ValueError("bad hyperparameters")
        if trial.number == 3:
            _arrive(tmp_path, "three", 2)  # its neighbour is running when it fails
            raise KeyError("objective bug")
        if trial.number == 4:
            _arrive(tmp_path, "three", 2)
            time.sleep(0.3)
        return 1.0

    study = optuna.create_study()
    with pytest.raises(KeyError, match="objective bug"):
        _process(2, record_trial_attrs=True).optimize(
            study, objective, n_trials=20, catch=(ValueError,)
        )
    trials = study.get_trials(deepcopy=False)
    assert trials[1].state is TrialState.FAIL
    assert "ValueError: bad hyperparameters" in trials[1].system_attrs["waterwave:fail_reason"]
    assert trials[3].state is TrialState.FAIL
    assert trials[4].state is TrialState.COMPLETE  # the neighbour finished and was told
    assert TrialState.RUNNING not in _states(study)
    assert len(trials) <= 6  # no trial is started after the failure is seen


def test_study_stop_in_an_objective_and_invalid_values_and_multi_objective() -> None:
    def objective(trial: optuna.trial.Trial) -> object:
        if trial.number == 1:
            return None  # invalid: the trial fails, optimize goes on
        if trial.number == 2:
            trial.study.stop()
        return (1.0, 2.0)

    study = optuna.create_study(directions=["minimize", "maximize"])
    _process(1).optimize(study, objective, n_trials=50)  # type: ignore[arg-type]
    assert _states(study) == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert study.trials[0].values == [1.0, 2.0]


def test_fused_batches_run_in_one_worker_each() -> None:
    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        return [float(os.getpid()) for _ in trials]

    study = optuna.create_study()
    _process(2, fuse=3).optimize(study, objective, n_trials=6)
    values = [t.value for t in study.trials]
    assert _states(study) == [TrialState.COMPLETE] * 6
    assert 1 <= len(set(values)) <= 2
    assert all(value != float(os.getpid()) for value in values)


@pytest.mark.slow  # over 10 s on the 2-core CI machine
def test_out_of_memory_beside_another_worker_is_retried(tmp_path: Path) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0, 1)
        if trial.number < 2:
            _arrive(tmp_path, "both", 2)
        if trial.number == 0:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        if trial.number == 1:  # still running when trial 0 ends
            time.sleep(1.0)
        return x

    study = optuna.create_study()
    _process(2, record_trial_attrs=True).optimize(study, objective, n_trials=2)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 3
    assert trials[0].state is TrialState.FAIL
    assert (
        "out of device memory with 1 neighbour(s)"
        in trials[0].system_attrs["waterwave:fail_reason"]
    )
    assert trials[2].state is TrialState.COMPLETE
    assert trials[2].params == trials[0].params
    assert trials[2].system_attrs["waterwave:retry_of"] == 0


@pytest.mark.slow  # over 10 s on the 2-core CI machine
def test_ctrl_c_fails_every_running_trial_and_ends_the_workers(tmp_path: Path) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        (tmp_path / f"inside.{trial.number}").touch()
        for step in range(3000):  # a long training loop
            time.sleep(0.02)
            trial.report(float(step), step)
        return 1.0

    def interrupt_when_both_run() -> None:
        deadline = time.monotonic() + _WAIT_S
        while len(list(tmp_path.glob("inside.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        _thread.interrupt_main()

    study = optuna.create_study()
    threading.Thread(target=interrupt_when_both_run, daemon=True).start()
    with _process(2, record_trial_attrs=True) as executor, pytest.raises(KeyboardInterrupt):
        executor.optimize(study, objective, n_trials=10)
    assert _states(study) == [TrialState.FAIL] * 2
    assert "interrupted" in study.trials[0].system_attrs["waterwave:fail_reason"]
    assert _workers() == []


def _sigkill_workers(n_kills: int, n_trials: int, seed: int, tmp_path: Path) -> None:
    """Kill a random worker at random moments while a study runs; nothing may be lost."""

    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0.0, 1.0)
        time.sleep(0.2 + 0.3 * x)
        return x

    rng = random.Random(seed)
    kills: list[int] = []
    done = threading.Event()

    def killer() -> None:
        while len(kills) < n_kills and not done.is_set():
            time.sleep(rng.uniform(0.1, 1.0))
            workers = _workers()
            if workers:
                victim = rng.choice(workers)
                with contextlib.suppress(psutil.NoSuchProcess):
                    victim.kill()
                kills.append(victim.pid)

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}")
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    _process(2, record_trial_attrs=True).optimize(study, objective, n_trials=n_trials)
    done.set()
    thread.join()
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == n_trials
    assert TrialState.RUNNING not in _states(study)
    failed = [t for t in trials if t.state is TrialState.FAIL]
    assert len(failed) <= len(kills)
    for trial in failed:
        assert "killed by signal SIGKILL" in trial.system_attrs["waterwave:fail_reason"]
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
    assert len(trials) - len(failed) > 0


@pytest.mark.slow  # over 10 s on the 2-core CI machine
def test_sigkill_of_workers_mid_trial_loses_nothing(tmp_path: Path) -> None:
    _sigkill_workers(n_kills=3, n_trials=12, seed=0, tmp_path=tmp_path)


@pytest.mark.slow
def test_many_sigkills_of_workers_at_random_moments_lose_nothing(tmp_path: Path) -> None:
    _sigkill_workers(n_kills=15, n_trials=36, seed=1, tmp_path=tmp_path)


_DRIVER = """
import os, sys, time, optuna, waterwave_hpo as ww
def objective(trial):
    # One write per line: under PYTHONUNBUFFERED, print writes each argument apart, and the two
    # workers' writes interleave (a CI run read "workerworker 5156" and " 5157").
    sys.stdout.write(f"worker {os.getpid()}\\n")
    sys.stdout.flush()
    time.sleep(600)
    return 0.0
if __name__ == "__main__":
    study = optuna.create_study()
    ww.WaterwaveExecutor("cpu", 2, isolation="process").optimize(study, objective, n_trials=2)
"""


@pytest.mark.slow  # over 10 s on the 2-core CI machine
def test_workers_exit_when_their_driver_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        assert driver.stdout is not None
        lines = [driver.stdout.readline() for _ in range(2)]
        # An empty line is the end of the driver's output: it exited before both trials began.
        assert all(line.startswith("worker ") for line in lines), (lines, driver.poll())
        workers = [psutil.Process(int(line.split()[1])) for line in lines]
        driver.kill()
        driver.wait(timeout=30)
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert alive == []
    finally:
        driver.kill()


def _seeded_mlp(trial: optuna.trial.Trial | optuna.trial.FixedTrial) -> float:
    """Seeds torch, trains a small MLP with dropout (which draws from torch's generator)."""
    seed = trial.suggest_int("seed", 0, 10_000)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(128, 16), torch.randn(128, 1)
    loss = torch.zeros(())
    for _ in range(40):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss.item())


def test_seeded_trials_give_bit_identical_values_at_k4_as_alone() -> None:
    seeds = [3, 14, 15, 92, 65, 35, 89, 79]
    alone = [_seeded_mlp(optuna.trial.FixedTrial({"seed": seed})) for seed in seeds]
    study = optuna.create_study()
    for seed in seeds:
        study.enqueue_trial({"seed": seed})
    _process(4).optimize(study, _seeded_mlp, n_trials=len(seeds))
    assert [t.value for t in study.trials] == alone  # exact: the same bits


def test_timeout_stops_asking_and_the_running_trial_finishes() -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        time.sleep(1.0)  # outlasts the timeout
        return 0.0

    executor = _process(1)
    executor.optimize(optuna.create_study(), lambda trial: 0.0, n_trials=1)  # warm workers
    study = optuna.create_study()
    executor.optimize(study, objective, timeout=0.5)
    assert _states(study) == [TrialState.COMPLETE]


def test_a_tiny_timeout_on_warm_workers_runs_a_trial_per_slot_as_optunas_threads() -> None:
    # Study.optimize's threads check the timeout as they start: optimize(timeout=0.01) runs
    # a trial on each (Optuna's test_optimize_with_progbar_timeout wants "Best trial: 0"). The
    # run's own set-up (pickling the objective for the workers) does not count against it.
    executor = _process(2)
    executor.optimize(optuna.create_study(), lambda trial: 0.0, n_trials=2)  # warm workers
    study = optuna.create_study()
    executor.optimize(study, lambda trial: 0.0, timeout=0.01)
    assert len(study.trials) >= 2 and _states(study) == [TrialState.COMPLETE] * len(study.trials)


def test_timeout_counts_from_the_call_including_the_workers_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    study = optuna.create_study()
    called = datetime.datetime.now()
    with caplog.at_level(logging.WARNING, logger="waterwave_hpo"):
        _process(1).optimize(study, lambda trial: 0.0, timeout=0.5)
    # As Study.optimize: no trial starts later than `timeout` after the call (a new executor's
    # workers start in it: an interpreter, torch, a training step; seconds on a CI machine).
    latest = called + datetime.timedelta(seconds=0.5 + 0.25)  # an ask begun before the limit
    starts = [t.datetime_start for t in study.get_trials(deepcopy=False)]
    assert all(start is not None and start <= latest for start in starts), (called, starts)
    if not starts:  # the workers took longer than the timeout: said so, with the fix
        [message] = [r.getMessage() for r in caplog.records if "started no trial" in r.getMessage()]
        assert "optimize(timeout=0.5) started no trial" in message
        assert "counts from the call" in message and "longer timeout" in message


def test_a_worker_that_cannot_load_the_objective_raises_before_any_trial(
    tmp_path: Path,
) -> None:
    # A module the driver imported from a path the workers do not have: pickled by reference,
    # it cannot be imported in a fresh interpreter.
    (tmp_path / "gone_module.py").write_text("def objective(trial):\n    return 0.0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import gone_module  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
        (tmp_path / "gone_module.py").unlink()
    study = optuna.create_study()
    try:
        with pytest.raises(RuntimeError, match=r"could not start.*gone_module"):
            _process(1).optimize(study, gone_module.objective, n_trials=3)
    finally:
        sys.modules.pop("gone_module", None)
    assert _states(study) == []  # refused before any trial was asked


@pytest.mark.gpu
def test_workers_run_on_the_slots_device_each_on_its_own_current_stream() -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        context = ww.current()
        assert context.stream is not None
        trial.set_user_attr("device", str(context.device))
        trial.set_user_attr("stream", int(context.stream.cuda_stream))
        trial.set_user_attr("current", int(torch.cuda.current_stream().cuda_stream))
        trial.set_user_attr("pid", os.getpid())
        return float(torch.ones(1 << 20, device=context.device).sum())

    study = optuna.create_study()
    ww.WaterwaveExecutor("cuda:0", 2, isolation="process").optimize(study, objective, n_trials=4)
    assert _states(study) == [TrialState.COMPLETE] * 4
    for trial in study.trials:
        assert trial.user_attrs["device"] == "cuda:0"
        assert trial.user_attrs["current"] == trial.user_attrs["stream"]
    assert len({t.user_attrs["pid"] for t in study.trials}) == 2


def test_a_cuda_error_that_may_poison_the_context_retires_its_worker() -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        trial.set_user_attr("pid", os.getpid())
        if trial.number == 0:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 0.0

    study = optuna.create_study()
    _process(1, record_trial_attrs=True).optimize(
        study, objective, n_trials=3, catch=(RuntimeError,)
    )
    trials = study.trials
    assert _states(study) == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert "illegal memory access" in trials[0].system_attrs["waterwave:fail_reason"]
    pids = [t.user_attrs["pid"] for t in trials]
    assert pids[1] != pids[0]  # a new worker after the poisoning error
    assert pids[2] == pids[1]  # reused again afterwards


def test_memory_plans_run_in_workers_each_within_its_share_of_the_budget() -> None:
    from test_memory_plans import PLAIN_BYTES
    from test_memory_plans import SMALLEST_BYTES
    from test_memory_plans import _mlp
    from test_memory_plans import _register
    from test_memory_plans import _train

    def objective(trial: optuna.trial.Trial) -> float:
        return _train(_register(_mlp()), 1)

    budget = PLAIN_BYTES  # two workers: half each, below the plain step, above the smallest plan
    assert budget // 2 >= SMALLEST_BYTES
    study = optuna.create_study()
    _process(2, memory_budget_bytes=budget, memory_plan="home", record_trial_attrs=True).optimize(
        study, objective, n_trials=2
    )
    assert _states(study) == [TrialState.COMPLETE] * 2
    for trial in study.trials:
        plan = ww.executor.trial_memory_plan(trial)
        assert plan is not None
        assert plan.predicted_peak_bytes <= plan.budget_bytes <= budget // 2


def test_an_objective_may_start_dataloader_workers() -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        data = torch.utils.data.TensorDataset(torch.arange(64.0).reshape(16, 4))
        loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2)
        return float(sum(batch[0].sum() for batch in loader))

    study = optuna.create_study()
    _process(1).optimize(study, objective, n_trials=1)
    trial = study.trials[0]
    assert trial.state is TrialState.COMPLETE, trial.system_attrs.get("waterwave:fail_reason")
    assert trial.value == float(torch.arange(64.0).sum())


def test_a_dead_workers_processes_are_ended_with_it_and_its_trial_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pids = tmp_path / "pids"

    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 0:
            child = os.fork()  # a helper that would outlive it, holding the pipe
            if child == 0:
                time.sleep(300)
                os._exit(0)
            # A process detached from it (its own session), as `setsid cmd &` makes.
            detached = subprocess.run(
                "setsid sleep 300 >/dev/null 2>&1 </dev/null & echo $!",
                shell=True,
                capture_output=True,
                text=True,
                check=True,
            )
            pids.write_text(f"{child} {detached.stdout.strip()}")
            os.kill(os.getpid(), signal.SIGKILL)
        return 1.0

    study = optuna.create_study()
    started: list[int] = []
    try:
        with caplog.at_level("WARNING", logger="waterwave_hpo"):
            _process(1).optimize(study, objective, n_trials=2)
        started = [int(pid) for pid in pids.read_text().split()]
        assert _states(study) == [TrialState.FAIL, TrialState.COMPLETE]
        assert "killed by signal SIGKILL" in study.trials[0].system_attrs["waterwave:fail_reason"]
        # Ended with their worker (optimize did not wait for their 300 s), and named.
        _, alive = psutil.wait_procs(
            [psutil.Process(pid) for pid in started if psutil.pid_exists(pid)], timeout=_WAIT_S
        )
        assert alive == []
        for pid in started:
            assert f"{pid} (" in caplog.text
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class _DriverOnly:
    """A value that can be pickled in the driver but not loaded in a worker process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_in, (self.pid,))


def _rebuild_in(pid: int) -> _DriverOnly:
    if os.getpid() != pid:
        raise RuntimeError("this value cannot be rebuilt outside the driver")
    return _DriverOnly(pid)


def test_a_trial_the_worker_cannot_read_fails_with_the_reason_and_the_worker_goes_on() -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        trial.set_user_attr("pid", os.getpid())
        return 1.0

    study = optuna.create_study()
    study.enqueue_trial({}, user_attrs={"blob": _DriverOnly(os.getpid())})
    _process(1, record_trial_attrs=True).optimize(study, objective, n_trials=3)
    assert _states(study) == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    reason = study.trials[0].system_attrs["waterwave:fail_reason"]
    assert "could not read the trial the driver sent" in reason
    assert "cannot be rebuilt outside the driver" in reason
    assert study.trials[1].user_attrs["pid"] == study.trials[2].user_attrs["pid"]


_THREAD_LEFT_RUNNING = """
import sys, threading, optuna, waterwave_hpo as ww

def objective(trial):
    return trial.suggest_float("x", 0.0, 1.0)

def run():
    study = optuna.create_study(storage="sqlite:///{db}", study_name="left")
    with ww.WaterwaveExecutor("cpu", 2, isolation="process") as executor:
        executor.optimize(study, objective, n_trials=6)

threading.Thread(target=run).start()  # a service's or a notebook helper's
"""


def test_an_optimize_in_a_thread_the_main_thread_left_runs_every_trial(tmp_path: Path) -> None:
    # The main thread returns at once: the interpreter's exit waits for the thread (it is not
    # a daemon), and the workers must serve it until it ends.
    script = tmp_path / "left.py"
    script.write_text(_THREAD_LEFT_RUNNING.format(db=tmp_path / "study.db"))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="left", storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert _states(study) == [TrialState.COMPLETE] * 6, done.stderr[-3000:]


@pytest.mark.slow  # over 10 s on the 2-core CI machine
def test_a_message_the_driver_cannot_read_fails_the_trial_with_that_reason() -> None:
    def rebuild(pid: int) -> Exception:
        if os.getpid() != pid:
            raise RuntimeError("this error cannot be rebuilt outside the worker")
        return ValueError("rebuilt")

    class WorkerOnlyError(Exception):
        def __reduce__(self) -> tuple[object, ...]:
            return (rebuild, (os.getpid(),))

    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 0:
            raise WorkerOnlyError("boom")
        return 1.0

    study = optuna.create_study()
    _process(1).optimize(study, objective, n_trials=2, catch=(Exception,))
    assert _states(study) == [TrialState.FAIL, TrialState.COMPLETE]
    reason = study.trials[0].system_attrs["waterwave:fail_reason"]
    assert "sent a message the driver could not read" in reason
    assert "cannot be rebuilt outside the worker" in reason
    assert "SIGKILL" not in reason
