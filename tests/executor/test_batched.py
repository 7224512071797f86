"""Batched objectives with ``WaterwaveExecutor(fuse=K)``: every trial of a batch ends on its own."""

from __future__ import annotations

import _thread
import math
import threading
import time

import optuna
from optuna.trial import TrialState
import pytest
import torch

import waterwave_hpo as ww


def _states(study: optuna.Study) -> list[TrialState]:
    return [t.state for t in study.get_trials(deepcopy=False)]


def _cpu(fuse: int | None, k: int = 1, **kwargs: object) -> ww.WaterwaveExecutor:
    return ww.WaterwaveExecutor(  # type: ignore[arg-type]
        devices="cpu", trials_per_device=k, fuse=fuse, record_trial_attrs=True, **kwargs
    )


@ww.batched
def _squares(trials: list[optuna.trial.Trial]) -> list[float]:
    return [t.suggest_float("x", -1, 1) ** 2 for t in trials]


def test_each_trial_of_a_batch_ends_on_its_own(storage: optuna.storages.BaseStorage) -> None:
    seen_batches: list[list[int]] = []

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[object]:
        seen_batches.append([t.number for t in trials])
        entries: list[object] = []
        for t in trials:
            x = t.suggest_float("x", 0, 1)
            t.report(x, step=0)
            entries.append(
                {
                    0: optuna.TrialPruned("slow"),
                    1: ValueError("diverged"),
                    2: math.nan,
                }.get(t.number % 4, x)
            )
        return entries

    reported: list[int] = []
    study = optuna.create_study(storage=storage)
    _cpu(4).optimize(
        study, objective, n_trials=8, callbacks=[lambda s, ft: reported.append(ft.number)]
    )
    assert seen_batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [
        TrialState.PRUNED,
        TrialState.FAIL,
        TrialState.FAIL,
        TrialState.COMPLETE,
    ] * 2
    assert trials[3].value == trials[3].params["x"]
    assert trials[3].intermediate_values == {0: trials[3].params["x"]}
    assert trials[1].system_attrs["waterwave:fail_reason"] == "ValueError: diverged"
    assert trials[5].system_attrs["waterwave:batch"] == [4, 5, 6, 7]
    assert sorted(reported) == list(range(8))  # a callback per trial


@pytest.mark.parametrize(("fuse", "k"), [(3, 1), (4, 2), (8, 1)])
def test_exactly_n_trials_when_fuse_does_not_divide_it(
    storage: optuna.storages.BaseStorage, fuse: int, k: int
) -> None:
    sizes: list[int] = []

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        sizes.append(len(trials))
        return _squares(trials)

    study = optuna.create_study(storage=storage)
    _cpu(fuse, k).optimize(study, objective, n_trials=10)
    assert _states(study) == [TrialState.COMPLETE] * 10
    assert sum(sizes) == 10
    assert max(sizes) <= fuse
    if k == 1:  # one slot asks full batches until n_trials is reached
        assert sizes == [fuse] * (10 // fuse) + ([10 % fuse] if 10 % fuse else [])


def test_multi_objective_values_per_trial(storage: optuna.storages.BaseStorage) -> None:
    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[tuple[float, float]]:
        return [(t.suggest_float("x", 0, 1), float(t.number)) for t in trials]

    study = optuna.create_study(storage=storage, directions=["minimize", "maximize"])
    _cpu(3).optimize(study, objective, n_trials=5)
    assert _states(study) == [TrialState.COMPLETE] * 5
    assert [t.values[1] for t in study.trials] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_wrong_number_of_entries_fails_every_trial_of_the_batch(
    storage: optuna.storages.BaseStorage,
) -> None:
    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        return [1.0] * (len(trials) - 1)

    study = optuna.create_study(storage=storage)
    _cpu(3).optimize(study, objective, n_trials=3)
    assert _states(study) == [TrialState.FAIL] * 3
    reason = study.trials[0].system_attrs["waterwave:fail_reason"]
    assert "returned 2 entries for a batch of 3 trials" in reason


def test_objective_raising_fails_the_batch_and_propagates_unless_caught(
    storage: optuna.storages.BaseStorage,
) -> None:
    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        raise RuntimeError("loader broke")

    study = optuna.create_study(storage=storage)
    _cpu(2).optimize(study, objective, n_trials=4, catch=(RuntimeError,))
    assert _states(study) == [TrialState.FAIL] * 4

    study = optuna.create_study(storage=storage, study_name="uncaught")
    with pytest.raises(RuntimeError, match="loader broke"):
        _cpu(2).optimize(study, objective, n_trials=4)
    assert _states(study) == [TrialState.FAIL] * 2  # the first batch; no more asked


def test_objective_raising_pruned_prunes_the_batch() -> None:
    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        raise optuna.TrialPruned()

    study = optuna.create_study()
    _cpu(3).optimize(study, objective, n_trials=3)
    assert _states(study) == [TrialState.PRUNED] * 3


def test_out_of_memory_re_runs_each_trial_alone() -> None:
    sizes: list[int] = []

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        sizes.append(len(trials))
        if len(trials) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return _squares(trials)

    study = optuna.create_study()
    _cpu(3).optimize(study, objective, n_trials=3)
    trials = study.trials
    assert [t.state for t in trials[:3]] == [TrialState.FAIL] * 3
    assert [t.state for t in trials[3:]] == [TrialState.COMPLETE] * 3
    assert sizes == [3, 1, 1, 1]
    assert sorted(t.system_attrs["waterwave:retry_of"] for t in trials[3:]) == [0, 1, 2]
    assert "fused batch of 3" in trials[0].system_attrs["waterwave:fail_reason"]


def test_stop_from_a_callback_asks_no_more() -> None:
    study = optuna.create_study()
    callback = optuna.study.MaxTrialsCallback(5, states=(TrialState.COMPLETE,))
    _cpu(2).optimize(study, _squares, n_trials=100, callbacks=[callback])
    # The batch running when the 5th trial completes finishes; nothing is asked after it.
    assert 5 <= len(study.trials) <= 6
    assert _states(study) == [TrialState.COMPLETE] * len(study.trials)


@pytest.mark.parametrize("slow_tells", [False, True], ids=["tells", "slow-tells"])
def test_keyboard_interrupt_leaves_no_trial_running(
    storage: optuna.storages.BaseStorage, monkeypatch: pytest.MonkeyPatch, slow_tells: bool
) -> None:
    if slow_tells:
        # Each FAIL the interrupt tells takes 0.2 s (a slow storage, a loaded machine): the
        # batches report meanwhile, so a batch-mate of a trial already told FAIL raises in
        # report() (UpdateFinishedTrialError) before its own turn comes.
        from waterwave_hpo.executor import _optimize

        tell = _optimize._fail_quietly

        def slow_tell(*args: object, **kwargs: object) -> bool:
            told = tell(*args, **kwargs)  # type: ignore[arg-type]
            time.sleep(0.2)
            return told

        monkeypatch.setattr(_optimize, "_fail_quietly", slow_tell)
    inside = threading.Barrier(2, timeout=20)

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        inside.wait()
        if trials[0].number == 0:
            _thread.interrupt_main()
        for step in range(200):
            time.sleep(0.02)
            for t in trials:
                t.report(float(step), step)
        return [1.0] * len(trials)

    study = optuna.create_study(storage=storage)
    with pytest.raises(KeyboardInterrupt):
        _cpu(3, k=2).optimize(study, objective, n_trials=20)
    assert _states(study) == [TrialState.FAIL] * 6
    # What the user reads for each: the interrupt, not a batch-mate's refused report().
    reasons = [t.system_attrs["waterwave:fail_reason"] for t in study.trials]
    assert all("interrupted" in reason for reason in reasons), reasons


@pytest.mark.parametrize("ending", ["value", "raises", "pruned"])
def test_a_trials_tell_that_loses_a_race_with_ctrl_c_keeps_the_interrupt(
    storage: optuna.storages.BaseStorage, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    # Optuna's tell checks skip_if_finished, then writes: the executor's FAIL on Ctrl+C, told
    # from the main thread, can land in between, and the trial thread's write then raises
    # UpdateFinishedTrialError. Here it lands there on purpose, on the first trial's end: that
    # trial stays FAIL with the interrupt as its reason, and the study goes on (seen on CI, on
    # a loaded machine, as a fail reason "waterwave-hpo could not run or tell this trial").
    study = optuna.create_study(storage=storage)
    inner = study._storage
    write = inner.set_trial_state_values
    raced: list[int] = []

    def racing_write(trial_id: int, state: TrialState, values: list[float] | None = None) -> bool:
        if not raced:
            raced.append(trial_id)
            inner.set_trial_system_attr(
                trial_id, "waterwave:fail_reason", "optimize() was interrupted: KeyboardInterrupt"
            )
            write(trial_id, TrialState.FAIL)
        return write(trial_id, state, values)

    monkeypatch.setattr(inner, "set_trial_state_values", racing_write)

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[object]:
        trial = trials[0]
        return [
            {"value": 1.0, "raises": ValueError("diverged"), "pruned": optuna.TrialPruned()}.get(
                ending if trial.number == 0 else "value", 1.0
            )
        ]

    _cpu(1).optimize(study, objective, n_trials=3)
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[0].system_attrs["waterwave:fail_reason"] == (
        "optimize() was interrupted: KeyboardInterrupt"
    )


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"fuse=0: must be >= 1"):
        ww.WaterwaveExecutor("cpu", fuse=0)
    with pytest.raises(TypeError, match=r"fuse='8'"):
        ww.WaterwaveExecutor("cpu", fuse="8")  # type: ignore[arg-type]
    study = optuna.create_study()
    with pytest.raises(TypeError, match=r"func=.*must be a batched objective, since fuse=4"):
        ww.WaterwaveExecutor("cpu", fuse=4).optimize(study, lambda t: 0.0, n_trials=1)
    with pytest.raises(ValueError, match=r"fuse=None: must be set.*batched objective"):
        ww.WaterwaveExecutor("cpu").optimize(study, _squares, n_trials=1)
    with pytest.raises(TypeError, match=r"func=3"):
        ww.batched(3)  # type: ignore[arg-type]
    assert study.trials == []


def test_ray_executor_checks_fuse_against_the_objective_before_starting_ray() -> None:
    # RayExecutor runs fused batches with WaterwaveExecutor's own checks, made
    # before Ray is started: a batched objective needs fuse=K, fuse=K needs a batched one.
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # an instance a Ray test module ran in this xdist worker kept
        ray.shutdown()
    fused = ww.RayExecutor(n_hosts=1, num_gpus_per_host=0, fuse=2)
    with pytest.raises(TypeError, match="fuse"):
        fused.optimize(optuna.create_study(), lambda trial: 0.0, n_trials=1)
    with pytest.raises(ValueError, match="fuse"):
        ww.RayExecutor(n_hosts=1, num_gpus_per_host=0).optimize(
            optuna.create_study(), _squares, n_trials=1
        )
    assert not ray.is_initialized()


def test_study_stop_in_the_objective_asks_no_more_batches() -> None:
    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        trials[0].study.stop()
        return _squares(trials)

    study = optuna.create_study()
    _cpu(3).optimize(study, objective, n_trials=30)
    assert _states(study) == [TrialState.COMPLETE] * 3


def test_the_sampler_sees_the_batch_mates_running(storage: optuna.storages.BaseStorage) -> None:
    running_seen: list[int] = []

    @ww.batched
    def objective(trials: list[optuna.trial.Trial]) -> list[float]:
        study = trials[0].study
        running_seen.append(len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))))
        return _squares(trials)

    study = optuna.create_study(storage=storage)
    _cpu(4).optimize(study, objective, n_trials=8)
    assert running_seen == [4, 4]  # asked together: each sampler call saw the earlier ones
