"""WaterwaveExecutor against Optuna's optimize semantics, on the CPU."""

from __future__ import annotations

import _thread
from collections.abc import Iterator
import contextlib
import logging
import threading
import time
import weakref

import optuna
from optuna.trial import TrialState
import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo.report import max_concurrent_trials


def _states(study: optuna.Study) -> list[TrialState]:
    return [t.state for t in study.get_trials(deepcopy=False)]


def _cpu(k: int = 4, **kwargs: object) -> ww.WaterwaveExecutor:
    return ww.WaterwaveExecutor(devices="cpu", trials_per_device=k, **kwargs)  # type: ignore[arg-type]


@contextlib.contextmanager
def _requeue_seen() -> Iterator[threading.Event]:
    """An event set once the executor logs that it re-queued a trial's parameters.

    The executor logs it as it records the re-run, so a neighbour of the trial that ran out
    of memory that waits for it ends only after the re-run is known: on a loaded machine the
    neighbours' outcomes can otherwise reach the executor first, and fresh trials take the slots.
    """
    seen = threading.Event()

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "re-queued" in record.getMessage():
                seen.set()

    handler = _Handler(logging.WARNING)
    logger = logging.getLogger("waterwave_hpo")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_runs_exactly_n_trials_all_complete(
    storage: optuna.storages.BaseStorage, isolation: str
) -> None:
    study = optuna.create_study(storage=storage)
    _cpu(3, isolation=isolation).optimize(
        study, lambda t: t.suggest_float("x", -1, 1) ** 2, n_trials=10
    )
    assert _states(study) == [TrialState.COMPLETE] * 10


def test_trials_really_overlap_in_time(storage: optuna.storages.BaseStorage) -> None:
    k = 4
    barrier = threading.Barrier(k, timeout=20)

    def objective(trial: optuna.trial.Trial) -> float:
        barrier.wait()  # breaks (and fails the trial) unless k trials are inside at once
        time.sleep(0.05)
        return 1.0

    study = optuna.create_study(storage=storage)
    _cpu(k).optimize(study, objective, n_trials=k)
    assert _states(study) == [TrialState.COMPLETE] * k
    assert max_concurrent_trials(study.trials) == k


def test_never_more_than_trials_per_device_at_once(storage: optuna.storages.BaseStorage) -> None:
    lock = threading.Lock()
    running = {"now": 0, "peak": 0}
    first_three_inside = threading.Barrier(3, timeout=60)

    def objective(trial: optuna.trial.Trial) -> float:
        with lock:
            running["now"] += 1
            running["peak"] = max(running["peak"], running["now"])
        if trial.number < 3:
            first_three_inside.wait()  # the peak is reached, whatever the storage's speed
        time.sleep(0.02)
        with lock:
            running["now"] -= 1
        return 0.0

    study = optuna.create_study(storage=storage)
    _cpu(3).optimize(study, objective, n_trials=15)
    assert running["peak"] == 3
    assert len(study.trials) == 15


def test_current_gives_the_trials_context_and_raises_outside(
    storage: optuna.storages.BaseStorage,
) -> None:
    seen: dict[int, ww.TrialContext] = {}

    def objective(trial: optuna.trial.Trial) -> float:
        seen[trial.number] = ww.current()
        return 0.0

    _cpu(2).optimize(optuna.create_study(storage=storage), objective, n_trials=4)
    assert sorted(seen) == [0, 1, 2, 3]
    for number, context in seen.items():
        assert context.trial_number == number
        assert context.trial.number == number
        assert context.device == torch.device("cpu")
        assert context.stream is None
        assert 0 <= context.slot < 2
    with pytest.raises(ww.NotInTrialError, match="outside a trial"):
        ww.current()
    assert ww.current_or_none() is None


def test_device_and_slot_are_system_attrs_and_user_attrs_stay_the_users(
    storage: optuna.storages.BaseStorage,
) -> None:
    study = optuna.create_study(storage=storage)
    study.enqueue_trial({}, user_attrs={"mine": 1})
    _cpu(2).optimize(study, lambda t: 0.0, n_trials=4)
    assert study.trials[0].user_attrs == {"mine": 1}  # enqueue_trial(user_attrs=) round trip
    assert [t.user_attrs for t in study.trials[1:]] == [{}] * 3
    # By default trials look as Study.optimize leaves them: Optuna's dataframe columns.
    columns = study.trials_dataframe().columns
    assert [c for c in columns if "attrs" in c] == ["user_attrs_mine", "system_attrs_fixed_params"]
    study = optuna.create_study(storage=storage)
    _cpu(2, record_trial_attrs=True).optimize(study, lambda t: 0.0, n_trials=4)
    assert [t.user_attrs for t in study.trials] == [{}] * 4
    for trial in study.trials:
        assert trial.system_attrs["waterwave:device"] == "cpu"
        assert trial.system_attrs["waterwave:slot"] in (0, 1)


def test_timeout_stops_starting_trials_and_lets_running_ones_finish(
    storage: optuna.storages.BaseStorage,
) -> None:
    # The first two trials run past the timeout: no trial may start after it, both finish.
    timeout_s = 0.3
    past_timeout = threading.Event()
    timer = threading.Timer(2 * timeout_s, past_timeout.set)

    def objective(trial: optuna.trial.Trial) -> float:
        with contextlib.suppress(RuntimeError):  # started by the first trial only
            timer.start()  # optimize started before this trial: the timeout passes first
        assert past_timeout.wait(timeout=60)
        return 0.0

    study = optuna.create_study(storage=storage)
    _cpu(2).optimize(study, objective, timeout=timeout_s)
    # Both slots' trials, or one when a slow storage's ask() outlasts the timeout.
    assert _states(study) in ([TrialState.COMPLETE] * 2, [TrialState.COMPLETE])


class _SlowToStart(ww.WaterwaveExecutor):
    """An executor whose device hosts take a second to start (as worker processes do)."""

    def _hosts_up(self) -> bool:
        return False  # they start per call, as cold workers or Ray's host actors

    def _make_hosts(self, settings):  # type: ignore[no-untyped-def]
        time.sleep(1.0)
        return super()._make_hosts(settings)


def test_timeout_counts_from_the_call_as_optunas_does(caplog: pytest.LogCaptureFixture) -> None:
    study = optuna.create_study()
    with caplog.at_level(logging.WARNING, logger="waterwave_hpo"):
        _SlowToStart(devices="cpu", trials_per_device=2).optimize(
            study, lambda trial: 0.0, timeout=0.5
        )
    # Study.optimize starts no trial later than `timeout` after the call; the hosts' start-up
    # outlasted it, so none started, and the log says why.
    assert study.trials == []
    [message] = [r.getMessage() for r in caplog.records if "started no trial" in r.getMessage()]
    assert "hosts took 1." in message and "longer timeout" in message


def test_callbacks_see_every_finished_trial_in_the_calling_thread(
    storage: optuna.storages.BaseStorage,
) -> None:
    calls: list[tuple[int, TrialState, str]] = []

    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        calls.append((trial.number, trial.state, threading.current_thread().name))

    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number % 3 == 0:
            raise optuna.TrialPruned()
        return 1.0

    study = optuna.create_study(storage=storage)
    _cpu(2).optimize(study, objective, n_trials=6, callbacks=[callback])
    assert sorted(number for number, _, _ in calls) == list(range(6))
    assert {thread for _, _, thread in calls} == {threading.current_thread().name}
    for number, state, _ in calls:
        assert state is (TrialState.PRUNED if number % 3 == 0 else TrialState.COMPLETE)


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_study_stop_in_callback_stops_the_study(
    storage: optuna.storages.BaseStorage, isolation: str
) -> None:
    def callback(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if trial.number >= 2:
            study.stop()

    study = optuna.create_study(storage=storage)
    _cpu(1, isolation=isolation).optimize(study, lambda t: 0.0, n_trials=50, callbacks=[callback])
    assert len(study.trials) == 3
    assert all(state is TrialState.COMPLETE for state in _states(study))


def test_study_stop_in_objective_stops_the_study(storage: optuna.storages.BaseStorage) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 1:
            trial.study.stop()
        return 0.0

    study = optuna.create_study(storage=storage)
    _cpu(1).optimize(study, objective, n_trials=50)
    assert len(study.trials) == 2


def test_pruned_trials_end_pruned_with_their_last_report(
    storage: optuna.storages.BaseStorage,
) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        trial.report(0.5, step=0)
        raise optuna.TrialPruned()

    study = optuna.create_study(storage=storage)
    _cpu(2).optimize(study, objective, n_trials=4)
    assert _states(study) == [TrialState.PRUNED] * 4
    assert [t.value for t in study.trials] == [0.5] * 4


def test_caught_exception_fails_only_its_trial(storage: optuna.storages.BaseStorage) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 1:
            raise ValueError("bad hyperparameters")
        time.sleep(0.02)
        return 1.0

    study = optuna.create_study(storage=storage)
    _cpu(2, record_trial_attrs=True).optimize(study, objective, n_trials=6, catch=(ValueError,))
    states = _states(study)
    assert states[1] is TrialState.FAIL
    assert states.count(TrialState.COMPLETE) == 5
    assert (
        "ValueError: bad hyperparameters" in study.trials[1].system_attrs["waterwave:fail_reason"]
    )


def test_catch_accepts_a_single_type_and_a_list_like_optuna(
    storage: optuna.storages.BaseStorage,
) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        raise KeyError("x")

    for catch in (KeyError, [KeyError]):
        study = optuna.create_study(storage=storage)
        _cpu(2).optimize(study, objective, n_trials=2, catch=catch)  # type: ignore[arg-type]
        assert _states(study) == [TrialState.FAIL] * 2


def test_uncaught_exception_propagates_after_neighbours_finish_and_are_told(
    storage: optuna.storages.BaseStorage,
) -> None:
    neighbours_inside = threading.Barrier(3, timeout=20)

    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number < 3:
            neighbours_inside.wait()
        if trial.number == 0:
            raise RuntimeError("objective bug")
        time.sleep(0.3)  # still running when trial 0 fails
        return 1.0

    study = optuna.create_study(storage=storage)
    with pytest.raises(RuntimeError, match="objective bug"):
        _cpu(3).optimize(study, objective, n_trials=20)
    trials = study.get_trials(deepcopy=False)
    assert trials[0].state is TrialState.FAIL
    assert [t.state for t in trials[1:3]] == [TrialState.COMPLETE] * 2
    assert TrialState.RUNNING not in _states(study)
    assert len(trials) <= 4  # no trial is started after the failure is seen


@pytest.mark.filterwarnings("ignore:The value None could not be cast to float")
def test_invalid_return_value_fails_the_trial_without_raising(
    storage: optuna.storages.BaseStorage,
) -> None:
    study = optuna.create_study(storage=storage)
    _cpu(2).optimize(study, lambda t: None, n_trials=2)  # type: ignore[arg-type,return-value]
    assert _states(study) == [TrialState.FAIL] * 2


def test_out_of_memory_fails_only_its_trial_with_on_oom_fail(
    storage: optuna.storages.BaseStorage,
) -> None:
    inside = threading.Barrier(3, timeout=20)

    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number < 3:
            inside.wait()
        if trial.number == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        time.sleep(0.1)
        return 1.0

    study = optuna.create_study(storage=storage)
    _cpu(3, on_oom="fail", record_trial_attrs=True).optimize(study, objective, n_trials=6)
    states = _states(study)
    assert len(states) == 6
    assert states[1] is TrialState.FAIL
    assert states.count(TrialState.COMPLETE) == 5
    assert "out of device memory" in study.trials[1].system_attrs["waterwave:fail_reason"]


def test_out_of_memory_with_neighbours_is_retried_with_fewer_neighbours(
    storage: optuna.storages.BaseStorage,
) -> None:
    inside = threading.Barrier(3, timeout=20)
    lock = threading.Lock()
    running = {"now": 0}
    concurrency_at_start: dict[int, int] = {}

    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0, 1)
        with lock:
            running["now"] += 1
            concurrency_at_start[trial.number] = running["now"]
        try:
            if trial.number < 3:
                inside.wait()
            if trial.number == 0:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
            time.sleep(0.2)
            return x
        finally:
            with lock:
                running["now"] -= 1

    study = optuna.create_study(storage=storage)
    _cpu(3).optimize(study, objective, n_trials=3)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 4  # three configurations, one re-run
    retry = trials[3]
    assert trials[0].state is TrialState.FAIL
    assert retry.state is TrialState.COMPLETE
    assert retry.params == trials[0].params
    assert retry.system_attrs["waterwave:retry_of"] == 0
    assert retry.system_attrs["waterwave:attempt"] == 1
    # It failed beside two neighbours; its re-run may have at most one.
    assert concurrency_at_start[3] <= 2


def test_an_out_of_memory_re_run_keeps_fewer_neighbours_while_it_runs(
    storage: optuna.storages.BaseStorage,
) -> None:
    # Fresh trials wait behind the re-run, and once it runs they may not fill the slots it
    # needed free: it failed beside two neighbours, so until it ends at most one runs beside it.
    inside = threading.Barrier(3, timeout=20)
    lock = threading.Lock()
    running: set[int] = set()
    first_x: list[float] = []
    rerun: list[int] = []  # the re-run's trial number (it has trial 0's parameters)
    beside_rerun: list[int] = []  # neighbours seen while the re-run ran
    fresh_done_during_rerun = threading.Semaphore(0)
    rerun_started = threading.Event()
    pair = threading.Barrier(2, timeout=1.0)

    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0, 1)
        is_rerun = trial.number > 0 and bool(first_x) and x == first_x[0]
        if trial.number >= 3 and not is_rerun:
            # A fresh trial starts only after the re-run (they wait behind it), but the re-run's
            # thread may reach this objective after it (a loaded machine): wait for it to say so.
            assert rerun_started.wait(timeout=60)
        with lock:
            if trial.number == 0:
                first_x.append(x)
            elif is_rerun:
                rerun.append(trial.number)
            running.add(trial.number)
            if rerun and rerun[0] in running:
                beside_rerun.append(len(running) - 1)
        if is_rerun:
            rerun_started.set()
        try:
            if trial.number < 3:
                inside.wait()
            if trial.number == 0:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
            if trial.number < 3:  # trial 0's neighbours until its re-run was queued
                assert requeued.wait(timeout=30)
            if rerun and trial.number == rerun[0]:  # runs until two fresh trials ended beside it
                for _ in range(2):
                    assert fresh_done_during_rerun.acquire(timeout=60)
            elif rerun and trial.number > rerun[0] and rerun[0] in running:
                try:  # two fresh trials beside the re-run meet here; one alone goes on after 1 s
                    pair.wait()
                except threading.BrokenBarrierError:
                    pass
            return x
        finally:
            with lock:
                running.discard(trial.number)
                if rerun and trial.number > rerun[0] and rerun[0] in running:
                    fresh_done_during_rerun.release()

    study = optuna.create_study(storage=storage)
    with _requeue_seen() as requeued:
        _cpu(3).optimize(study, objective, n_trials=8)
    assert len(rerun) == 1
    assert study.trials[rerun[0]].system_attrs["waterwave:retry_of"] == 0
    assert _states(study).count(TrialState.COMPLETE) == 8
    assert beside_rerun and max(beside_rerun) <= 1, beside_rerun


def test_out_of_memory_alone_is_not_retried(storage: optuna.storages.BaseStorage) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    study = optuna.create_study(storage=storage)
    _cpu(1).optimize(study, objective, n_trials=2)
    assert _states(study) == [TrialState.FAIL] * 2


def test_keyboard_interrupt_tells_every_running_trial_fail(
    storage: optuna.storages.BaseStorage,
) -> None:
    inside = threading.Barrier(3, timeout=20)
    finished_loop = threading.Event()

    def objective(trial: optuna.trial.Trial) -> float:
        inside.wait()
        if trial.number == 0:
            _thread.interrupt_main()
        for step in range(200):  # a long training loop
            time.sleep(0.02)
            trial.report(float(step), step)
        finished_loop.set()
        return 1.0

    study = optuna.create_study(storage=storage)
    with pytest.raises(KeyboardInterrupt):
        _cpu(3, record_trial_attrs=True).optimize(study, objective, n_trials=10)
    assert not finished_loop.is_set()  # interrupted inside the loop, not after it
    states = _states(study)
    assert len(states) == 3
    assert states == [TrialState.FAIL] * 3
    assert "interrupted" in study.trials[0].system_attrs["waterwave:fail_reason"]


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_multi_objective_study(storage: optuna.storages.BaseStorage, isolation: str) -> None:
    study = optuna.create_study(storage=storage, directions=["minimize", "maximize"])
    _cpu(2, isolation=isolation).optimize(
        study, lambda t: (t.suggest_float("x", 0, 1), 1.0), n_trials=4
    )
    assert _states(study) == [TrialState.COMPLETE] * 4
    assert all(len(t.values) == 2 for t in study.trials)


def test_nested_optimize_is_refused(storage: optuna.storages.BaseStorage) -> None:
    study = optuna.create_study(storage=storage)
    executor = _cpu(1)

    def objective(trial: optuna.trial.Trial) -> float:
        executor.optimize(study, lambda t: 0.0, n_trials=1)
        return 0.0

    # The inner call raises in the trial's thread; that exception is not caught, so it
    # propagates from the outer call.
    with pytest.raises(RuntimeError, match="Nested"):
        executor.optimize(study, objective, n_trials=1)
    assert _states(study) == [TrialState.FAIL]


@pytest.mark.parametrize("isolation", ["threads", "process"])
def test_executor_can_be_reused_for_several_studies(
    storage: optuna.storages.BaseStorage, isolation: str
) -> None:
    executor = _cpu(2, isolation=isolation)
    for _ in range(2):
        study = optuna.create_study(storage=storage)
        executor.optimize(study, lambda t: 0.0, n_trials=3)
        assert _states(study) == [TrialState.COMPLETE] * 3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"trials_per_device": 0}, ValueError, "trials_per_device=0: must be >= 1"),
        ({"trials_per_device": -2}, ValueError, "trials_per_device=-2"),
        ({"trials_per_device": "4"}, TypeError, "trials_per_device='4': must be an int"),
        ({"trials_per_device": True}, TypeError, "trials_per_device=True"),
        ({"devices": "cuda:99"}, ValueError, "cuda:99"),
        ({"devices": "tpu"}, ValueError, "'tpu'"),
        ({"devices": []}, ValueError, "names no device"),
        ({"devices": 3.5}, TypeError, "devices=3.5"),
        ({"on_oom": "explode"}, ValueError, "on_oom='explode'"),
        ({"max_oom_retries": -1}, ValueError, "max_oom_retries=-1"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ww.WaterwaveExecutor(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n_trials": -1}, ValueError, "n_trials=-1: must be >= 0"),
        ({"n_trials": 2.5}, TypeError, "n_trials=2.5"),
        ({"timeout": 0}, ValueError, "timeout=0: must be > 0"),
        ({"timeout": "1"}, TypeError, "timeout='1'"),
        ({"catch": "ValueError"}, TypeError, "catch"),
        ({"catch": (ValueError, 3)}, TypeError, r"catch\[1\]=3: must be an exception type"),
        ({"callbacks": lambda s, t: None}, TypeError, "callbacks"),
        ({"callbacks": [3]}, TypeError, r"callbacks\[0\]=3: must be a callable"),
    ],
)
def test_bad_optimize_arguments_fail_before_any_trial(
    kwargs: dict[str, object],
    error: type[Exception],
    match: str,
) -> None:
    study = optuna.create_study()
    with pytest.raises(error, match=match):
        _cpu(2).optimize(study, lambda t: 0.0, **kwargs)  # type: ignore[arg-type]
    assert study.trials == []


def test_bad_study_and_func_are_refused() -> None:
    with pytest.raises(TypeError, match=r"study='study': must be an optuna\.Study"):
        _cpu().optimize("study", lambda t: 0.0, n_trials=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="func=3: must be callable"):
        _cpu().optimize(optuna.create_study(), 3, n_trials=1)  # type: ignore[arg-type]


def test_n_trials_zero_runs_nothing() -> None:
    study = optuna.create_study()
    _cpu().optimize(study, lambda t: 0.0, n_trials=0)
    assert study.trials == []


def test_out_of_memory_frees_the_failed_trials_objects_before_its_retry(
    storage: optuna.storages.BaseStorage,
) -> None:
    class Activations:
        pass

    refs: list[weakref.ref[Activations]] = []
    inside = threading.Barrier(2, timeout=20)
    freed_before_retry: list[bool] = []

    def objective(trial: optuna.trial.Trial) -> float:
        if ww.current().attempt == 1:
            freed_before_retry.append(refs[0]() is None)
            return 0.0
        if trial.number < 2:
            inside.wait()
        if trial.number == 0:
            activations = Activations()  # held only by this frame, then by the traceback
            refs.append(weakref.ref(activations))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        time.sleep(0.1)
        return 1.0

    study = optuna.create_study(storage=storage)
    _cpu(2).optimize(study, objective, n_trials=2)
    assert freed_before_retry == [True]


def test_out_of_memory_rerun_runs_even_behind_trials_the_user_enqueued(
    storage: optuna.storages.BaseStorage,
) -> None:
    inside = threading.Barrier(2, timeout=20)

    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", 0, 1)
        if trial.number < 2:
            inside.wait()
        if trial.number == 0:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        time.sleep(0.05)
        return x

    study = optuna.create_study(storage=storage)
    for x in (0.1, 0.2, 0.3, 0.4):
        study.enqueue_trial({"x": x})
    _cpu(2).optimize(study, objective, n_trials=3)
    trials = study.get_trials(deepcopy=False)
    assert all(t.state.is_finished() for t in trials)  # nothing left WAITING or RUNNING
    reruns = [t for t in trials if t.system_attrs.get("waterwave:retry_of") == 0]
    assert len(reruns) == 1
    assert reruns[0].state is TrialState.COMPLETE
    assert reruns[0].params == trials[0].params
