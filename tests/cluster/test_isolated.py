"""RayExecutor(isolation="process") on a local Ray cluster with logical GPUs: one single-slot
host actor per trial slot, its memory leased from the GPU's broker; a crash fails its trial
alone."""

from __future__ import annotations

from collections import Counter
import ctypes
import itertools
import os
import signal
import time
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest

ray = pytest.importorskip("ray")

import waterwave_hpo as ww  # noqa: E402
from waterwave_hpo.cluster import ATTR_HOST  # noqa: E402
from waterwave_hpo.cluster import RayExecutor  # noqa: E402
from waterwave_hpo.cluster._broker import find_broker  # noqa: E402
from waterwave_hpo.cluster._isolated import summarize_crash_report  # noqa: E402
from waterwave_hpo.host._attrs import ATTR_FAIL_REASON  # noqa: E402
from waterwave_hpo.host._attrs import ATTR_RETRY_OF  # noqa: E402
from waterwave_hpo.report import max_concurrent_trials  # noqa: E402

RAY_GPUS = 1  # one logical GPU: K host actors share it (tests/conftest.py)
pytestmark = [pytest.mark.usefixtures("ray_cluster")]

CRASHING = {2, 5}


def _states(study: optuna.Study) -> Counter[TrialState]:
    return Counter(t.state for t in study.get_trials(deepcopy=False))


def _segfaults_on_some(trial: optuna.trial.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(0.1)
    if trial.number in CRASHING:
        ctypes.string_at(0)  # a segmentation fault in native code
    assert ww.current().trial_number == trial.number
    trial.set_user_attr("pid", os.getpid())
    return x * x


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_a_segfaulting_trial_fails_alone_and_its_slot_gets_a_new_process() -> None:
    study = optuna.create_study()
    executor = RayExecutor(
        n_hosts=1, trials_per_device=2, isolation="process", memory_budget_bytes=1 << 30
    )
    executor.optimize(study, _segfaults_on_some, n_trials=8)
    states = _states(study)
    assert states == {TrialState.COMPLETE: 6, TrialState.FAIL: 2}
    for t in study.trials:
        if t.number in CRASHING:
            assert t.state is TrialState.FAIL
            reason = t.system_attrs[ATTR_FAIL_REASON]
            assert "SIGSEGV" in reason and "crashed" in reason, reason
            assert "_segfaults_on_some" in reason  # where, from faulthandler's stack
        else:
            assert t.state is TrialState.COMPLETE
    assert not any(ATTR_RETRY_OF in t.system_attrs for t in study.trials)  # not re-run
    assert executor.cluster_stats is not None
    assert executor.cluster_stats.hosts_lost == 2
    assert executor.cluster_stats.hosts_started >= 3  # the first two and a replacement
    # Each trial ran in a process of its own slot: at most two at once (both hosts up: trials
    # start on the first one, so under load they may never overlap), never two in one process.
    assert max_concurrent_trials(study.trials) <= 2
    done = [t for t in study.trials if t.state is TrialState.COMPLETE]
    for a, b in itertools.combinations(done, 2):
        assert a.datetime_complete is not None and b.datetime_complete is not None
        overlap = a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete
        assert not (overlap and a.user_attrs["pid"] == b.user_attrs["pid"])
    assert len({t.system_attrs[ATTR_HOST] for t in study.trials}) >= 3
    assert len({t.user_attrs["pid"] for t in done}) >= 2


@pytest.mark.slow  # over 20 s in the suite (tests/durations.json)
def test_cpu_hosts_replace_a_crashed_process_too() -> None:
    study = optuna.create_study()
    executor = RayExecutor(n_hosts=1, num_gpus_per_host=0, trials_per_device=2, isolation="process")
    executor.optimize(study, _segfaults_on_some, n_trials=8)
    assert _states(study) == {TrialState.COMPLETE: 6, TrialState.FAIL: 2}
    assert all("SIGSEGV" in study.trials[n].system_attrs[ATTR_FAIL_REASON] for n in CRASHING)
    assert executor.cluster_stats is not None and executor.cluster_stats.hosts_started >= 3


def _lease_of_this_process(trial: optuna.trial.Trial) -> float:
    gpu = str(ray.get_gpu_ids()[0])
    broker = find_broker(ray.get_runtime_context().get_node_id(), gpu)
    # Trials start on the first host process that is up; wait (bounded) for the second one,
    # which holds its lease from its start, so the figures below are the two processes'.
    deadline = time.monotonic() + 60.0
    stats = ray.get(broker.stats.remote())
    while stats.n_held < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = ray.get(broker.stats.remote())
    trial.set_user_attr("held", stats.n_held)
    trial.set_user_attr("granted", stats.granted_bytes)
    return 0.0


def test_each_host_process_holds_its_share_of_the_gpu_budget() -> None:
    study = optuna.create_study()
    budget = 1 << 30
    RayExecutor(
        n_hosts=1, trials_per_device=2, isolation="process", memory_budget_bytes=budget
    ).optimize(study, _lease_of_this_process, n_trials=4)
    assert _states(study) == {TrialState.COMPLETE: 4}
    for t in study.trials:
        # Both host processes of the GPU hold budget // 2 each, while the trials run.
        assert t.user_attrs["held"] == 2
        assert t.user_attrs["granted"] == budget


def _exits(trial: optuna.trial.Trial) -> float:
    time.sleep(0.1)
    if trial.number == 1:
        os._exit(3)
    return 1.0


def _sigkilled(trial: optuna.trial.Trial) -> float:
    time.sleep(0.1)
    if trial.number == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or `kill -9` would
        time.sleep(10)
    return 1.0


@pytest.mark.parametrize("objective", [_exits, _sigkilled], ids=["os._exit", "SIGKILL"])
def test_a_process_that_exits_fails_its_trial_with_the_reason_and_nothing_stays_running(
    objective: Any,
) -> None:
    study = optuna.create_study()
    RayExecutor(n_hosts=1, trials_per_device=2, isolation="process").optimize(
        study, objective, n_trials=5
    )
    assert _states(study) == {TrialState.COMPLETE: 4, TrialState.FAIL: 1}
    reason = study.trials[1].system_attrs[ATTR_FAIL_REASON]
    assert "died without a fatal-error report" in reason, reason


def test_isolation_arguments_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"isolation=.forks.: is not one of"):
        RayExecutor(isolation="forks")
    with pytest.raises(ValueError, match=r"trials_per_device='auto'.*pass an int"):
        RayExecutor(trials_per_device="auto", isolation="process")


def test_summary_names_the_signal_and_where() -> None:
    report = (
        "Fatal Python error: Aborted\n\nThread 0x01 (most recent call first):\n"
        '  File "a.py", line 1 in wait\n\nCurrent thread 0x02 (most recent call first):\n'
        '  File "b.py", line 2 in objective\n  File "c.py", line 3 in run\n\n'
        "Extension modules: numpy (total: 1)"
    )
    assert summarize_crash_report(report) == (
        'SIGABRT (Aborted) at File "b.py", line 2 in objective; File "c.py", line 3 in run'
    )


def test_on_cuda_each_trial_is_bounded_by_its_process_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CUDA path (never run on a GPU here): each trial of an isolated host bounds its
    # process by the lease before the objective runs, with the trial's pool account.
    from waterwave_hpo.cluster import _isolated
    from waterwave_hpo.host import TRIAL_ACCOUNT

    calls: list[tuple[object, int, object]] = []
    monkeypatch.setattr(
        _isolated,
        "bound_process",
        lambda device, nbytes, account: calls.append((device, nbytes, account)),
    )
    seen: list[int] = []

    def objective(trial: object) -> float:
        seen.append(len(calls))  # bounded before the objective starts
        return 1.0

    run = _isolated.bounded(objective, "cuda:0", 1 << 28)
    account = object()
    token = TRIAL_ACCOUNT.set(account)
    try:
        assert run(None) == 1.0
    finally:
        TRIAL_ACCOUNT.reset(token)
    assert calls == [("cuda:0", 1 << 28, account)] and seen == [1]
    assert run.__name__ == "objective"


class _FakeRay:
    """``ray.nodes()`` and ``ray.get`` for :func:`describe_loss`, without a cluster."""

    def __init__(self, alive: list[str], report: str | None) -> None:
        self.alive = alive
        self.report = report

    def nodes(self) -> list[dict[str, object]]:
        return [{"NodeID": node, "Alive": True} for node in self.alive]

    def get(self, ref: object, timeout: float | None = None) -> object:
        return self.report


class _FakeBroker:
    class holder_died:  # Ray's actor-method shape: broker.holder_died.remote(...)
        @staticmethod
        def remote(holder: str, pid: int) -> object:
            return (holder, pid)


@pytest.mark.parametrize(
    ("alive", "report", "message", "re_queue", "words"),
    [
        (["n1"], "Fatal Python error: Aborted\n", "died", False, "crashed: SIGABRT (Aborted)"),
        (["n1"], None, "died", False, "died without a fatal-error report"),
        ([], None, "died", True, "was lost with its node"),
        (["n1"], None, "The actor died because its node has died.", True, "with its node"),
    ],
)
def test_a_crash_on_an_alive_node_fails_its_trial_and_a_lost_node_re_queues_it(
    monkeypatch: pytest.MonkeyPatch,
    alive: list[str],
    report: str | None,
    message: str,
    re_queue: bool,
    words: str,
) -> None:
    from types import SimpleNamespace

    from waterwave_hpo.cluster import _isolated

    monkeypatch.setattr(_isolated, "find_broker", lambda node, gpu: _FakeBroker)
    info = _isolated.LeasedHostInfo("10.0.0.2/pid7/cpu", "cpu", "n1", 7, "0", "host/n1/pid7")
    host = SimpleNamespace(info=info, device=info.label)
    reason, again = _isolated.describe_loss(
        _FakeRay(alive, report),
        host,
        RuntimeError(message),  # type: ignore[arg-type]
    )
    assert again is re_queue
    assert words in reason and "pid 7" in reason
