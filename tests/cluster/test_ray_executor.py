"""RayExecutor on a local Ray cluster with logical GPUs: the trials run on the CPU, placement is
Ray's (one host actor per declared GPU)."""

from __future__ import annotations

from collections import Counter
import os
from pathlib import Path
import time
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest
import torch

ray = pytest.importorskip("ray")

from fakes.samplers import ReseedCountingSampler  # noqa: E402

import waterwave_hpo as ww  # noqa: E402
from waterwave_hpo.cluster import ATTR_HOST  # noqa: E402
from waterwave_hpo.cluster import AllHostsLostError  # noqa: E402
from waterwave_hpo.cluster import RayExecutor  # noqa: E402
from waterwave_hpo.host._attrs import ATTR_ATTEMPT  # noqa: E402
from waterwave_hpo.host._attrs import ATTR_FAIL_REASON  # noqa: E402
from waterwave_hpo.host._attrs import ATTR_RETRY_OF  # noqa: E402
from waterwave_hpo.report import max_concurrent_trials  # noqa: E402

N_GPUS = 2


RAY_GPUS = N_GPUS  # logical GPUs of the module's local Ray instance (tests/conftest.py)
pytestmark = [
    pytest.mark.usefixtures("ray_cluster"),
]  # tests/conftest.py


def _states(study: optuna.Study) -> Counter[TrialState]:
    return Counter(t.state for t in study.get_trials(deepcopy=False))


def _objective(trial: optuna.trial.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    if trial.number % 5 == 3:
        raise optuna.TrialPruned()
    if trial.number % 5 == 4:
        raise ValueError("a failing trial")
    for step in range(3):
        trial.report(x * step, step)
        time.sleep(0.02)
    assert ww.current().trial_number == trial.number
    return x * x


def test_the_suites_ray_workers_run_at_the_suites_priority() -> None:
    # tests/conftest.py: at Ray's default worker niceness (15), hosts starved beside busy
    # processes and missed their start-up deadline; the suite's Ray workers run at nice 0.
    assert ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote(), timeout=120) == 0


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_finishes_a_study_with_the_right_counts_and_states() -> None:
    study = ww.create_study()  # in-memory, on the driver
    executor = RayExecutor(trials_per_device=3)
    study.optimize(_objective, n_trials=20, catch=(ValueError,), executor=executor)
    states = _states(study)
    assert states == {TrialState.COMPLETE: 12, TrialState.PRUNED: 4, TrialState.FAIL: 4}
    trials = study.trials
    assert len({t.params["x"] for t in trials}) == 20  # the hosts' samplers were reseeded
    hosts = {t.system_attrs[ATTR_HOST] for t in trials}
    # One host actor per logical GPU; trials start on the first one up and the other joins
    # when it is up, which on a loaded machine can be after the last of these short trials.
    assert 1 <= len(hosts) <= N_GPUS
    assert all(t.intermediate_values for t in trials if t.state is TrialState.COMPLETE)
    for t in trials:
        if t.state is TrialState.FAIL:
            assert "a failing trial" in t.system_attrs[ATTR_FAIL_REASON]
    per_host = [[t for t in trials if t.system_attrs[ATTR_HOST] == h] for h in hosts]
    assert max(max_concurrent_trials(ts) for ts in per_host) >= 2  # co-hosted on a host


def test_journal_storage_and_callbacks_in_the_driver(tmp_path: Path) -> None:
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.log"))
    )
    study = optuna.create_study(storage=storage, direction="maximize")
    seen: list[tuple[int, int]] = []

    def callback(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> None:
        seen.append((os.getpid(), frozen.number))

    RayExecutor(n_hosts=1, trials_per_device=2).optimize(
        study, lambda t: t.suggest_int("k", 0, 9), n_trials=6, callbacks=[callback]
    )
    assert _states(study) == {TrialState.COMPLETE: 6}
    assert sorted(n for _, n in seen) == list(range(6))
    assert {pid for pid, _ in seen} == {os.getpid()}
    reloaded = optuna.load_study(study_name=study.study_name, storage=storage)
    assert len(reloaded.trials) == 6


def _slow(trial: optuna.trial.Trial) -> float:
    time.sleep(0.4)
    return float(trial.number)


def _meets_three_others(directory: str) -> Any:
    """An objective whose trials wait (up to 60 s) until four trials have started: the study
    starts on the first host up, so four run at once only once the second has joined."""

    def objective(trial: optuna.trial.Trial) -> float:
        Path(directory, str(trial.number)).touch()
        deadline = time.monotonic() + 60.0
        while len(os.listdir(directory)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        return float(trial.number)

    return objective


def test_packs_trials_onto_the_host_with_the_most_room(tmp_path: Path) -> None:
    study = optuna.create_study()
    RayExecutor(trials_per_device=2).optimize(study, _meets_three_others(str(tmp_path)), n_trials=4)
    per_host = Counter(t.system_attrs[ATTR_HOST] for t in study.trials)
    assert sorted(per_host.values()) == [2, 2]
    assert max_concurrent_trials(study.trials) == 4


def _two_objectives(trial: optuna.trial.Trial) -> tuple[float, float]:
    x = trial.suggest_float("x", 0.0, 1.0)
    return x, 1.0 - x


def test_multi_objective_values_reach_the_driver() -> None:
    study = optuna.create_study(directions=["minimize", "maximize"])
    RayExecutor(n_hosts=1, trials_per_device=2).optimize(study, _two_objectives, n_trials=4)
    assert _states(study) == {TrialState.COMPLETE: 4}
    for t in study.trials:
        assert t.values == pytest.approx([t.params["x"], 1.0 - t.params["x"]])


def _oom_once(trial: optuna.trial.Trial) -> float:
    x = trial.suggest_float("x", 0.0, 1.0)
    if trial.number == 1 and ww.current().attempt == 0:
        time.sleep(0.1)  # trial 0, its neighbour, is still running
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    time.sleep(0.6)
    return x


def test_out_of_memory_on_a_host_re_queues_the_parameters() -> None:
    study = optuna.create_study()
    RayExecutor(n_hosts=1, trials_per_device=2).optimize(study, _oom_once, n_trials=4)
    first = study.trials[1]
    assert first.state is TrialState.FAIL
    assert "out of device memory" in first.system_attrs[ATTR_FAIL_REASON]
    (rerun,) = [t for t in study.trials if t.system_attrs.get(ATTR_RETRY_OF) == 1]
    assert rerun.state is TrialState.COMPLETE and rerun.params == first.params
    assert _states(study) == {TrialState.COMPLETE: 4, TrialState.FAIL: 1}


def test_auto_trials_per_device_runs_on_remote_hosts() -> None:
    study = optuna.create_study()
    executor = RayExecutor(trials_per_device="auto", memory_budget_bytes=1 << 30)
    executor.optimize(study, _objective, n_trials=6, catch=(ValueError,))
    assert sum(_states(study).values()) == 6
    assert TrialState.RUNNING not in _states(study)


def _dies_once(trial: optuna.trial.Trial) -> float:
    x = trial.suggest_float("x", 0.0, 1.0)
    time.sleep(0.2)
    if trial.number == 2:  # the first attempt of trial 2 takes its whole host actor down
        os._exit(1)
    return x


def test_a_killed_host_loses_no_trial() -> None:
    study = optuna.create_study()
    RayExecutor(trials_per_device=2).optimize(study, _dies_once, n_trials=8)
    trials = study.trials
    states = _states(study)
    assert set(states) <= {TrialState.COMPLETE, TrialState.FAIL}
    assert states[TrialState.COMPLETE] == 8  # every asked-for trial finished, on the other host
    lost = [t for t in trials if t.state is TrialState.FAIL]
    assert 1 <= len(lost) <= 2  # trial 2 and the neighbour on its host
    assert all("was lost" in t.system_attrs[ATTR_FAIL_REASON] for t in lost)
    reruns = {t.system_attrs[ATTR_RETRY_OF]: t for t in trials if ATTR_RETRY_OF in t.system_attrs}
    assert sorted(reruns) == sorted(t.number for t in lost)
    for t in lost:
        # What the lost attempt had sampled is run again (a neighbour killed before it sampled
        # anything has nothing to carry over, and its re-run samples afresh).
        assert reruns[t.number].params.items() >= t.params.items()
        assert reruns[t.number].system_attrs[ATTR_ATTEMPT] == 1
        assert reruns[t.number].state is TrialState.COMPLETE


def _always_dies(trial: optuna.trial.Trial) -> float:
    time.sleep(0.1)
    os._exit(1)


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_all_hosts_lost_raises_and_leaves_nothing_running() -> None:
    study = optuna.create_study()
    with pytest.raises(AllHostsLostError, match="were lost"):
        RayExecutor(n_hosts=1, trials_per_device=2).optimize(study, _always_dies, n_trials=10)
    states = _states(study)
    assert states[TrialState.FAIL] >= 1
    assert set(states) == {TrialState.FAIL}


def _sleeps(trial: optuna.trial.Trial) -> float:
    time.sleep(1.5)
    return 0.0


def test_ctrl_c_tells_every_running_trial_fail_and_stops_the_hosts() -> None:
    import _thread
    import threading

    study = optuna.create_study()

    def interrupt_when_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if len(running) >= 2:
                _thread.interrupt_main()
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_when_running, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        RayExecutor(trials_per_device=2).optimize(study, _sleeps, n_trials=20)
    states = _states(study)
    assert TrialState.RUNNING not in states and TrialState.WAITING not in states
    assert states[TrialState.FAIL] >= 2
    assert all(
        "interrupted" in t.system_attrs[ATTR_FAIL_REASON]
        for t in study.trials
        if t.state is TrialState.FAIL
    )
    # The host actors are gone: their GPUs are free again for the next optimize().
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU", 0) < N_GPUS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("GPU", 0) == N_GPUS


def _raises_key_error(trial: optuna.trial.Trial) -> float:
    if trial.number == 1:
        raise KeyError("boom")
    time.sleep(0.05)
    return 0.0


def test_an_exception_not_in_catch_propagates_after_the_others_are_told() -> None:
    study = optuna.create_study()
    with pytest.raises(KeyError, match="boom"):
        RayExecutor(n_hosts=1, trials_per_device=2).optimize(study, _raises_key_error, n_trials=10)
    states = _states(study)
    assert TrialState.RUNNING not in states and TrialState.WAITING not in states
    assert study.trials[1].state is TrialState.FAIL
    assert len(study.trials) < 10


def _stops(trial: optuna.trial.Trial) -> float:
    if trial.number == 2:
        trial.study.stop()
    time.sleep(0.05)
    return 0.0


def test_study_stop_in_a_remote_objective_stops_the_search() -> None:
    study = optuna.create_study()
    RayExecutor(n_hosts=1, trials_per_device=1).optimize(study, _stops, n_trials=50)
    assert 3 <= len(study.trials) < 50
    assert set(_states(study)) == {TrialState.COMPLETE}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n_hosts": 0}, ValueError, "n_hosts=0: must be >= 1"),
        ({"n_hosts": "many"}, TypeError, "n_hosts='many'"),
        ({"num_gpus_per_host": 2}, ValueError, "num_gpus_per_host=2: must be 1"),
        ({"num_gpus_per_host": 0}, ValueError, "n_hosts='auto' counts the cluster's GPUs"),
        ({"host_resources": {"GPU": 1}}, ValueError, "num_gpus_per_host"),
        ({"num_cpus_per_host": 0}, ValueError, "num_cpus_per_host=0: must be > 0"),
        ({"trials_per_device": 0}, ValueError, "trials_per_device=0"),
        ({"max_host_retries": -1}, ValueError, "max_host_retries=-1"),
        ({"max_devices": 0}, ValueError, "max_devices=0: must be >= 1"),
        ({"n_hosts": 2, "max_devices": 1}, ValueError, "max_devices=1 is below n_hosts=2"),
    ],
)
def test_bad_arguments_name_the_argument(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        RayExecutor(**kwargs)  # type: ignore[arg-type]


def test_more_hosts_than_gpus_fails_before_any_trial() -> None:
    study = optuna.create_study()
    with pytest.raises(RuntimeError, match="need 3 GPU"):
        RayExecutor(n_hosts=3).optimize(study, _slow, n_trials=2)
    assert study.trials == []


def test_cpu_hosts_that_cannot_be_placed_time_out_with_the_reason() -> None:
    study = optuna.create_study()
    executor = RayExecutor(
        n_hosts=1, num_gpus_per_host=0, num_cpus_per_host=64, startup_timeout_s=2
    )
    with pytest.raises(RuntimeError, match="not up within startup_timeout_s=2"):
        executor.optimize(study, _slow, n_trials=2)
    assert study.trials == []


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_max_devices_asks_the_autoscaler_for_host_bundles_while_hosts_are_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A local Ray has no autoscaler: record what would be asked of it.
    requests: list[list[dict[str, float]]] = []

    def request_resources(num_cpus: int | None = None, bundles: Any = None) -> None:
        requests.append(list(bundles))

    monkeypatch.setattr("ray.autoscaler.sdk.request_resources", request_resources)
    study = optuna.create_study()
    executor = RayExecutor(
        n_hosts=1,
        trials_per_device=1,
        max_devices=3,
        num_cpus_per_host=0.5,
        host_resources={"waterwave_test": 0.001},
    )
    with pytest.raises(RuntimeError, match="No device host started"):
        executor.optimize(study, _slow, n_trials=1)  # no node has the custom resource
    assert requests == [] and study.trials == []
    executor = RayExecutor(n_hosts=1, trials_per_device=1, max_devices=3, num_cpus_per_host=0.5)
    executor.optimize(study, _sleeps, n_trials=6)
    assert _states(study) == {TrialState.COMPLETE: 6}
    bundle = {"CPU": 0.5, "GPU": 1.0}
    assert requests[0] == [bundle] * 3  # room for max_devices hosts, asked once
    assert requests[-1] == []  # withdrawn when optimize returned
    assert len(requests) == 2
    stats = executor.cluster_stats
    assert stats is not None and stats.autoscaler_requests == 1
    assert stats.hosts_started == 2  # n_hosts, then the cluster's other GPU, up to max_devices


WIDTH = 128
BATCH = 1024


def _two_mlps() -> torch.nn.Module:
    """Two MLPs run as one (a stand-in for a fused model): the batch's model."""

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(
            *[m for _ in range(4) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())],
            torch.nn.Linear(WIDTH, 4),
        )

    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.models = torch.nn.ModuleList([mlp(), mlp()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([m(x) for m in self.models])

    return Fused()


def _fused_plain_and_smallest_bytes() -> tuple[int, int]:
    from waterwave_hpo.planning import PLANNERS
    from waterwave_hpo.planning import remove_memory_plan
    from waterwave_hpo.planning import step_profile_of

    model = _two_mlps()
    ww.fit_memory(model, 1 << 40, example_input=torch.randn(BATCH, WIDTH), planner="none")
    profile = step_profile_of(model)
    remove_memory_plan(model)
    bw = ww.planning.DEFAULT_BANDWIDTH_BYTES_PER_S
    plain = PLANNERS["none"](profile, 0, bandwidth_bytes_per_s=bw, seed=0).prediction.peak_bytes
    smallest = PLANNERS["swap_all"](profile, 0, bandwidth_bytes_per_s=bw, seed=0)
    return plain, smallest.prediction.peak_bytes


@ww.batched
def _fused_planned(trials: list[optuna.trial.Trial]) -> list[float]:
    xs = [t.suggest_float("x", -1.0, 1.0) for t in trials]
    model = _two_mlps() if len(trials) == 2 else None
    if model is not None:
        model = ww.fit_trial_memory(model, example_input=torch.randn(BATCH, WIDTH))
        model(torch.randn(BATCH, WIDTH)).sum().backward()
    return [x * x for x in xs]


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_fused_batches_with_memory_plans_run_on_ray_hosts() -> None:
    # fuse=2 and memory_plan="home" on RayExecutor: each host runs whole batches
    # in one call, plans the batch's model as one when it does not fit, and the driver tells
    # each trial its own outcome.
    from waterwave_hpo.executor import trial_memory_plan

    plain, smallest = _fused_plain_and_smallest_bytes()
    assert smallest < plain * 6 // 10
    budget = (plain + smallest) // 2
    study = optuna.create_study()
    executor = RayExecutor(
        n_hosts=2, trials_per_device=1, fuse=2, memory_plan="home", memory_budget_bytes=budget
    )
    executor.optimize(study, _fused_planned, n_trials=8)
    trials = study.trials
    assert _states(study) == {TrialState.COMPLETE: 8}
    batches = {tuple(t.system_attrs["waterwave:batch"]) for t in trials}
    assert all(len(b) == 2 for b in batches) and len(batches) == 4
    for batch in batches:
        hosts = {trials[n].system_attrs[ATTR_HOST] for n in batch}
        assert len(hosts) == 1  # a batch runs in one slot of one host
        plans = [trial_memory_plan(trials[n]) for n in batch]
        assert plans[0] is not None and plans[0] == plans[1]  # one plan for the batch
        assert plans[0].predicted_peak_bytes <= budget
    assert len({t.system_attrs[ATTR_HOST] for t in trials}) == 2


@ww.batched
def _fused_gated_planned(trials: list[optuna.trial.Trial]) -> list[float]:
    from waterwave_hpo.nodegroup._internal import has_pipeline

    xs = [t.suggest_float("x", -1.0, 1.0) for t in trials]
    if len(trials) == 2:
        model = ww.fit_trial_memory(
            ww.pipeline(_two_mlps()), example_input=torch.randn(BATCH, WIDTH)
        )
        model(torch.randn(BATCH, WIDTH)).sum().backward()
        for t in trials:
            t.set_user_attr("gated", has_pipeline(model))
    return [x * x for x in xs]


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_fused_gated_batches_short_of_memory_run_with_plans_on_ray_hosts() -> None:
    # fuse=2 + ww.pipeline gates + memory_plan="home" on RayExecutor: the batch's
    # gated model does not fit under its gates' claim, so each host plans it as one instead.
    from waterwave_hpo.executor import trial_memory_plan
    from waterwave_hpo.nodegroup import trial_profile

    claim = trial_profile(
        ww.pipeline(_two_mlps(), example_input=torch.randn(BATCH, WIDTH))
    ).peak_bytes
    _, smallest = _fused_plain_and_smallest_bytes()
    assert smallest < claim
    budget = (claim + smallest) // 2
    study = optuna.create_study()
    executor = RayExecutor(
        n_hosts=2, trials_per_device=1, fuse=2, memory_plan="home", memory_budget_bytes=budget
    )
    executor.optimize(study, _fused_gated_planned, n_trials=4)
    trials = study.trials
    assert _states(study) == {TrialState.COMPLETE: 4}
    fused = [t for t in trials if len(t.system_attrs["waterwave:batch"]) == 2]
    assert fused
    for t in fused:
        plan = trial_memory_plan(t)
        assert plan is not None and plan.predicted_peak_bytes <= budget
        assert t.user_attrs["gated"] is False  # the plan replaced the gates


@ww.batched
def _fused_gated(trials: list[optuna.trial.Trial]) -> list[float]:
    model = ww.pipeline(_two_mlps())
    for _ in range(2):  # the first step profiles the groups, the second is gated
        model(torch.randn(BATCH, WIDTH)).sum().backward()
    scheduler = ww.current().scheduler
    assert scheduler is not None
    stats = scheduler.stats()
    for t in trials:
        t.set_user_attr("ledger_peak_bytes", stats.peak_bytes)
        t.set_user_attr("scheduler_trials", [s.trial_number for s in stats.trials])
    return [0.0] * len(trials)


def test_fused_batches_run_under_their_gates_on_ray_hosts() -> None:
    # fuse=2 + ww.pipeline gates on RayExecutor: each batch's gates reserve in its
    # host's scheduler under the batch's first trial alone.
    study = optuna.create_study()
    executor = RayExecutor(n_hosts=1, trials_per_device=1, fuse=2, memory_budget_bytes=1 << 30)
    executor.optimize(study, _fused_gated, n_trials=2)
    assert _states(study) == {TrialState.COMPLETE: 2}
    first = study.trials[0]
    assert first.system_attrs["waterwave:batch"] == [0, 1]
    assert first.user_attrs["ledger_peak_bytes"] > 0
    assert first.user_attrs["scheduler_trials"] == [0]  # not the batch-mate


def test_trials_start_on_the_first_host_without_waiting_for_hosts_that_cannot_be_placed() -> None:
    # Two logical GPUs but CPUs for one host of 2 CPUs: the study must run on
    # the host that is up, not wait startup_timeout_s (here 600 s) for the other. The bound
    # below is a liveness check with a wide margin, not a speed figure.
    import threading

    study = optuna.create_study()
    executor = RayExecutor(
        n_hosts=2, trials_per_device=2, num_cpus_per_host=2.0, startup_timeout_s=600.0
    )
    run = threading.Thread(
        target=executor.optimize,
        args=(study, _objective, 10),
        kwargs={"catch": (ValueError,)},
        daemon=True,
    )
    run.start()
    run.join(timeout=240.0)
    assert not run.is_alive(), "optimize waited for the host that cannot be placed"
    assert set(_states(study)) <= {TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL}
    assert len(study.trials) == 10
    assert len({t.system_attrs[ATTR_HOST] for t in study.trials}) == 1
    stats = executor.cluster_stats
    assert stats is not None and stats.hosts_started == 1


class _RecordingSampler(optuna.samplers.RandomSampler):
    """A sampler that records, in the process it lives in, each trial it was told about."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.told: list[tuple[int, TrialState]] = []

    def after_trial(
        self,
        study: optuna.Study,
        trial: optuna.trial.FrozenTrial,
        state: TrialState,
        values: Any,
    ) -> None:
        self.told.append((trial.number, state))


def test_the_driver_tells_each_hosted_trial_so_its_sampler_sees_every_end() -> None:
    # The driver's study tells each trial from its host's record (Study.optimize's after_trial
    # in the driver's process), with the value, the pruned value and the failure as on a host.
    sampler = _RecordingSampler()
    study = ww.create_study(sampler=sampler)
    executor = RayExecutor(n_hosts=1, trials_per_device=2)
    study.optimize(_objective, n_trials=10, catch=(ValueError,), executor=executor)
    assert sorted(sampler.told) == sorted((t.number, t.state) for t in study.trials)
    assert _states(study) == {TrialState.COMPLETE: 6, TrialState.PRUNED: 2, TrialState.FAIL: 2}
    for t in study.trials:
        if t.state is TrialState.COMPLETE:
            assert t.value == pytest.approx(t.params["x"] ** 2)
        if t.state is TrialState.PRUNED:  # Optuna's pruned value: the last report, if any
            assert t.values is None or t.value == t.intermediate_values[max(t.intermediate_values)]


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_the_driver_reseeds_its_sampler_once_per_run_as_the_hosts_sample() -> None:
    # The trials sample in the host actors (each reseeds its copy as it opens the run); the
    # driver's sampler only sees before_trial and after_trial: one reseed per optimize call.
    sampler = ReseedCountingSampler()
    study = ww.create_study(sampler=sampler)
    executor = RayExecutor(trials_per_device=2)
    study.optimize(_objective, n_trials=8, catch=(ValueError,), executor=executor)
    assert sampler.reseeds == 1
    study.optimize(_objective, n_trials=4, catch=(ValueError,), executor=executor)
    assert sampler.reseeds == 2
    assert len({t.params["x"] for t in study.get_trials(deepcopy=False)}) == 12


class _RefusesOnHosts(optuna.samplers.RandomSampler):
    """A sampler that cannot open a trial in a host actor (its ``before_trial`` raises there)."""

    def __init__(self, driver_pid: int) -> None:
        super().__init__(seed=0)
        self.driver_pid = driver_pid

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if os.getpid() != self.driver_pid:
            raise RuntimeError("this sampler cannot open a trial on a host")


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_a_host_that_cannot_take_a_trial_is_lost_and_nothing_stays_running() -> None:
    # The driver does not wait for a host to take a trial; the host's poller finds the failure.
    study = optuna.create_study(sampler=_RefusesOnHosts(os.getpid()))
    executor = RayExecutor(n_hosts=1, trials_per_device=2, max_host_retries=0)
    with pytest.raises(AllHostsLostError, match="cannot open a trial"):
        executor.optimize(study, lambda t: 0.0, n_trials=4)
    assert set(_states(study)) == {TrialState.FAIL}


class _RefusesOnTheFirstHost(optuna.samplers.RandomSampler):
    """A sampler that cannot open trials in the first host process (a live actor refusing)."""

    def __init__(self, driver_pid: int, marker: str) -> None:
        super().__init__()
        self.driver_pid = driver_pid
        self.marker = marker

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if os.getpid() == self.driver_pid:
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        if Path(self.marker).read_text() == str(os.getpid()):
            raise RuntimeError("the first host cannot open a trial")


def _first_host_gone(marker: str) -> Any:
    def objective(trial: optuna.trial.Trial) -> float:
        first = int(Path(marker).read_text())
        deadline = time.monotonic() + 30.0
        alive = True
        while alive and time.monotonic() < deadline:
            try:
                os.kill(first, 0)
            except ProcessLookupError:
                alive = False
            else:
                time.sleep(0.1)
        trial.set_user_attr("first_host_alive", alive)
        return 0.0

    return objective


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_a_live_host_that_is_lost_is_ended_before_its_replacement_runs(tmp_path: Path) -> None:
    # A host lost while its actor lives (it refused a trial) must not keep its process (its GPU
    # share, its memory) beside the host that replaces it.
    marker = str(tmp_path / "first_host")
    study = optuna.create_study(sampler=_RefusesOnTheFirstHost(os.getpid(), marker))
    RayExecutor(n_hosts=1, trials_per_device=1, max_host_retries=2).optimize(
        study, _first_host_gone(marker), n_trials=2
    )
    done = [t for t in study.trials if t.state is TrialState.COMPLETE]
    assert done, _states(study)
    assert all(t.user_attrs["first_host_alive"] is False for t in done)


def test_the_next_trial_goes_to_its_host_with_the_poll_that_brought_the_last_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One actor call per trial, not two: the poller sends the trials the
    # executor asked since its last poll with the next poll, so a trial needs no submit call.
    from ray.actor import ActorMethod

    calls: Counter[str] = Counter()
    remote = ActorMethod.remote

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[self._method_name] += 1
        return remote(self, *args, **kwargs)

    monkeypatch.setattr(ActorMethod, "remote", counted)
    study = ww.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    executor = RayExecutor(n_hosts=1, trials_per_device=1)
    study.optimize(lambda t: t.suggest_float("x", -1.0, 1.0) ** 2, n_trials=20, executor=executor)
    assert _states(study) == {TrialState.COMPLETE: 20}
    # The first trial may go on its own (the first poll may be under way); later ones are sent
    # with the poll unless the driver took longer than the poller waits for them (a loaded
    # machine): most are.
    assert calls["submit"] <= 5, calls
    assert calls["poll"] >= 20, calls
