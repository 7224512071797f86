"""Nodes lost and added mid-study on a real multi-node Ray cluster on one machine
(``ray.cluster_utils.Cluster``: a head with no GPU, worker nodes with one logical GPU each):
RayExecutor and both Ray Tune designs start with what comes up, use nodes that join, and lose
no trial to a node that leaves."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Iterator
from functools import partial
import json
import logging
import os
from pathlib import Path
import signal
import threading
import time
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

import waterwave_hpo as ww  # noqa: E402
from waterwave_hpo.cluster import ATTR_NODE  # noqa: E402
from waterwave_hpo.cluster import RayExecutor  # noqa: E402
from waterwave_hpo.host._attrs import ATTR_FAIL_REASON  # noqa: E402
from waterwave_hpo.host._attrs import ATTR_RETRY_OF  # noqa: E402

# Its own multi-node cluster; one xdist worker runs the Ray modules of its group in turn.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray-a")]

DRIVER_PID = os.getpid()  # pickled by value into the hosts: "am I in a host actor?"
_GPU_NODE = {"num_cpus": 1, "num_gpus": 1}
# The longest a wait for the cluster may take (nodes up, hosts started, trials at a point): a
# backstop, never a timing. On a loaded 2-core machine a host actor took over 60 s to start.
BACKSTOP_S = 300.0


class Nodes:
    """The module's cluster and its GPU worker nodes, reset to ``n`` nodes per test."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.gpu_nodes: list[Any] = []

    def reset(self, n: int) -> None:
        while len(self.gpu_nodes) > n:
            self.remove(self.gpu_nodes[-1])
        while len(self.gpu_nodes) < n:
            self.add()
        _wait_for(lambda: _gpus_alive() == n, timeout_s=BACKSTOP_S)

    def add(self) -> Any:
        node = self.cluster.add_node(**_GPU_NODE)
        self.gpu_nodes.append(node)
        return node

    def remove(self, node: Any) -> None:
        self.gpu_nodes.remove(node)
        self.cluster.remove_node(node)

    def node_id(self, node: Any) -> str:
        return str(node.node_id)


@pytest.fixture(scope="module")
def nodes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nodes]:
    sigint = signal.getsignal(signal.SIGINT)
    if ray.is_initialized():
        ray.shutdown()
    cwd = os.getcwd()
    # Workers put the driver's working directory on sys.path: not the source tree.
    os.chdir(tmp_path_factory.mktemp("ray-cluster"))
    try:
        cluster = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "num_gpus": 0, "include_dashboard": False},
        )
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    finally:
        os.chdir(cwd)
    ray.cloudpickle.register_pickle_by_value(request.module)
    result = Nodes(cluster)
    try:
        yield result
    finally:
        ray.shutdown()
        cluster.shutdown()
        signal.signal(signal.SIGINT, sigint)


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Any]]:
    """Figures the tests measure; written as JSON to $WATERWAVE_ELASTIC_RESULTS if set (see
    experiments/elastic.md)."""
    figures: dict[str, Any] = {}
    yield figures
    path = os.environ.get("WATERWAVE_ELASTIC_RESULTS")
    if path:
        figures["loadavg_at_end"] = os.getloadavg()
        Path(path).write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")


def _record(results: dict[str, Any], name: str, study: optuna.Study, n_trials: int) -> None:
    trials = study.get_trials(deepcopy=False)
    states = _states(study)
    results[name] = {
        "trials_asked_for": n_trials,
        "complete": states[TrialState.COMPLETE],
        "failed_lost_host": states[TrialState.FAIL],
        "re_run": sum(1 for t in trials if ATTR_RETRY_OF in t.system_attrs),
        "left_running_or_waiting": states[TrialState.RUNNING] + states[TrialState.WAITING],
        "trials_lost": n_trials - states[TrialState.COMPLETE],
    }


def _gpus_alive() -> int:
    return sum(int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"])


def _wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the cluster"
        time.sleep(0.1)


def _in_background(action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def _states(study: optuna.Study) -> Counter[TrialState]:
    return Counter(t.state for t in study.get_trials(deepcopy=False))


def _assert_nothing_lost(study: optuna.Study, n_trials: int) -> None:
    """Every trial ended; each asked for completed; each FAIL was a lost host, run again."""
    trials = study.get_trials(deepcopy=False)
    states = _states(study)
    assert TrialState.RUNNING not in states and TrialState.WAITING not in states
    assert states[TrialState.COMPLETE] == n_trials
    failed = [t for t in trials if t.state is TrialState.FAIL]
    assert all("was lost" in t.system_attrs[ATTR_FAIL_REASON] for t in failed)
    re_run = {t.system_attrs[ATTR_RETRY_OF] for t in trials if ATTR_RETRY_OF in t.system_attrs}
    assert {t.number for t in failed} <= re_run


class _SlowToStartSampler(optuna.samplers.RandomSampler):
    """Reseeded (once) in every host actor as it starts: make that take a while, so that a
    node can be removed while its host is starting."""

    def reseed_rng(self) -> None:
        if os.getpid() != DRIVER_PID:
            time.sleep(4.0)
        super().reseed_rng()


def _sleeps(trial: optuna.trial.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    time.sleep(0.3)
    return x * x


def _reports(trial: optuna.trial.Trial) -> float:
    x = trial.suggest_float("x", -1.0, 1.0)
    for step in range(8):
        trial.report(x * step, step)  # intermediate values: Optuna's checkpoint of a trial
        time.sleep(0.15)
    return x * x


def test_a_node_lost_while_the_hosts_start_leaves_the_study_to_the_others(
    nodes: Nodes, caplog: pytest.LogCaptureFixture
) -> None:
    nodes.reset(2)
    doomed = nodes.gpu_nodes[1]
    doomed_id = nodes.node_id(doomed)
    study = optuna.create_study(sampler=_SlowToStartSampler())
    executor = RayExecutor(trials_per_device=2, startup_timeout_s=BACKSTOP_S)
    remover = threading.Timer(1.0, nodes.remove, args=(doomed,))
    remover.start()
    with caplog.at_level(logging.WARNING, logger="waterwave_hpo"):
        executor.optimize(study, _sleeps, n_trials=6)
    remover.join()
    assert _states(study) == {TrialState.COMPLETE: 6}
    assert {t.system_attrs[ATTR_NODE] for t in study.trials} == {nodes.node_id(nodes.gpu_nodes[0])}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("did not start" in m and doomed_id[:8] in m for m in warnings), warnings
    assert executor.cluster_stats is not None and executor.cluster_stats.hosts_started == 1


def test_a_node_lost_mid_study_loses_no_trial(nodes: Nodes, results: dict[str, Any]) -> None:
    nodes.reset(2)
    doomed = nodes.gpu_nodes[1]
    doomed_id = nodes.node_id(doomed)
    study = optuna.create_study()

    def mid_study_on_doomed() -> bool:
        # Four done, and a trial running on the doomed node's host: on a loaded machine that
        # host may start after the other one has run several trials.
        trials = study.get_trials(deepcopy=False)
        return sum(t.state is TrialState.COMPLETE for t in trials) >= 4 and any(
            t.state is TrialState.RUNNING and t.system_attrs.get(ATTR_NODE) == doomed_id
            for t in trials
        )

    def remove_after_four() -> None:
        _wait_for(mid_study_on_doomed, timeout_s=BACKSTOP_S)
        nodes.remove(doomed)

    remover = _in_background(remove_after_four)
    executor = RayExecutor(trials_per_device=2)
    executor.optimize(study, _sleeps, n_trials=16)
    remover.join()
    _assert_nothing_lost(study, 16)
    _record(results, "ray_executor_node_lost_mid_study", study, 16)
    stats = executor.cluster_stats
    assert stats is not None and (stats.hosts_lost, stats.nodes_lost) == (1, 1)


def test_a_node_lost_while_its_trials_report_re_runs_them_whole(
    nodes: Nodes, results: dict[str, Any]
) -> None:
    nodes.reset(2)
    doomed = nodes.gpu_nodes[1]
    doomed_id = nodes.node_id(doomed)
    study = optuna.create_study()

    def reporting_on_doomed() -> bool:
        return any(
            t.state is TrialState.RUNNING
            and t.system_attrs.get(ATTR_NODE) == doomed_id
            and len(t.intermediate_values) >= 2
            for t in study.get_trials(deepcopy=False)
        )

    def remove_while_reporting() -> None:
        _wait_for(reporting_on_doomed, timeout_s=BACKSTOP_S)
        nodes.remove(doomed)

    remover = _in_background(remove_while_reporting)
    RayExecutor(trials_per_device=2).optimize(study, _reports, n_trials=8)
    remover.join()
    _assert_nothing_lost(study, 8)
    _record(results, "ray_executor_node_lost_while_reporting", study, 8)
    failed = [t for t in study.trials if t.state is TrialState.FAIL]
    assert failed and all(t.system_attrs[ATTR_NODE] == doomed_id for t in failed)
    complete = [t for t in study.trials if t.state is TrialState.COMPLETE]
    assert all(len(t.intermediate_values) == 8 for t in complete)


def _waits_for_a_second_node(flag: Path, first_node_id: str) -> Callable[..., float]:
    """An objective whose trials on the first node wait (up to 60 s) until a trial has run on
    another node: the study cannot end before a node that joins had its chance."""

    def objective(trial: optuna.trial.Trial) -> float:
        x = trial.suggest_float("x", -1.0, 1.0)
        if ray.get_runtime_context().get_node_id() != first_node_id:
            flag.touch()
        deadline = time.monotonic() + BACKSTOP_S
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.2)
        return x * x

    return objective


def test_a_gpu_node_that_joins_mid_study_gets_trials(
    nodes: Nodes, tmp_path: Path, results: dict[str, Any]
) -> None:
    nodes.reset(1)
    first_id = nodes.node_id(nodes.gpu_nodes[0])
    study = optuna.create_study()
    executor = RayExecutor(trials_per_device=2)
    objective = _waits_for_a_second_node(tmp_path / "second-node-used", first_id)
    # Ray adds nodes from the main thread only: the study runs in another.
    running = _in_background(lambda: executor.optimize(study, objective, n_trials=8))
    _wait_for(lambda: _states(study)[TrialState.RUNNING] >= 2, timeout_s=BACKSTOP_S)
    joined = {"id": nodes.node_id(nodes.add()), "at_s": time.time()}
    running.join(timeout=180)
    assert not running.is_alive()
    assert _states(study) == {TrialState.COMPLETE: 8}
    on_new = [t for t in study.trials if t.system_attrs[ATTR_NODE] == joined["id"]]
    assert on_new, "no trial ran on the node that joined"
    assert {t.system_attrs[ATTR_NODE] for t in study.trials} == {first_id, joined["id"]}
    stats = executor.cluster_stats
    assert stats is not None and (stats.hosts_started, stats.nodes_joined) == (2, 1)
    first_start = min(t.datetime_start.timestamp() for t in on_new)  # type: ignore[union-attr]
    results["ray_executor_time_to_use_new_node_s"] = round(first_start - joined["at_s"], 2)
    results["ray_executor_trials_on_new_node"] = len(on_new)


# -- Ray Tune: tune_hosts() and shared_gpu() ---------------------------------------------------

N_STEPS = 4


def _train_with_checkpoints(config: dict[str, Any]) -> None:
    """Counts steps; checkpoints every step; resumes from its checkpoint when re-run."""
    import tempfile

    from ray import tune

    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            start = int(Path(directory, "step.txt").read_text())
    node = ray.get_runtime_context().get_node_id()
    for step in range(start + 1, N_STEPS + 1):
        time.sleep(config["sleep_s"])
        with tempfile.TemporaryDirectory() as directory:
            Path(directory, "step.txt").write_text(str(step))
            tune.report(
                {"step": step, "resumed_from": start, "node": node},
                checkpoint=tune.Checkpoint.from_directory(directory),
            )


def _on_result(when: Callable[[dict[str, Any]], bool], action: Callable[[], None]) -> Any:
    """A Tune callback (it runs in the driver's main thread, where Ray can add nodes) that
    calls ``action()`` once, on the first result for which ``when(result)`` holds."""
    from ray import tune

    class OnResult(tune.Callback):  # type: ignore[misc]
        done = False

        def on_trial_result(self, iteration: int, trials: Any, trial: Any, result: Any) -> None:
            if not self.done and when(result):
                self.done = True
                action()

    return OnResult()


def _remove_once_it_checkpointed(nodes: Nodes, doomed: Any) -> Any:
    """Remove ``doomed`` once a trial there has reported its second checkpoint."""
    doomed_id = nodes.node_id(doomed)
    return _on_result(
        lambda r: r["node"] == doomed_id and r["step"] >= 2, partial(nodes.remove, doomed)
    )


def _run_tune(
    tmp_path: Path, trainable: Any, resources: Any, n_trials: int, callback: Any, **kwargs: Any
) -> Any:
    from ray import tune

    return tune.run(
        trainable,
        config={"sleep_s": 0.3, "i": tune.grid_search(list(range(n_trials)))},
        resources_per_trial=resources,
        storage_path=str(tmp_path),
        max_failures=3,
        callbacks=[callback],
        raise_on_failed_trial=False,
        verbose=0,
        **kwargs,
    )


def _assert_all_finished(analysis: Any, n_trials: int) -> None:
    trials = analysis.trials
    assert [t.status for t in trials] == ["TERMINATED"] * n_trials, [t.error_file for t in trials]
    assert all(t.last_result["step"] == N_STEPS for t in trials)


def test_tune_hosts_a_node_lost_while_trials_checkpoint_loses_no_trial(
    nodes: Nodes, tmp_path: Path, results: dict[str, Any]
) -> None:
    import waterwave_hpo as ww

    nodes.reset(2)
    doomed = nodes.gpu_nodes[1]
    doomed_id = nodes.node_id(doomed)
    with ww.tune_hosts(trials_per_gpu=2, cpus_per_trial=0.25) as hosts:
        assert hosts.n_hosts == 2
        analysis = _run_tune(
            tmp_path,
            hosts.wrap(_train_with_checkpoints),
            hosts.resources,
            4,
            _remove_once_it_checkpointed(nodes, doomed),
            max_concurrent_trials=hosts.max_concurrent_trials,
        )
    _assert_all_finished(analysis, 4)
    resumed = [t for t in analysis.trials if t.last_result["resumed_from"] > 0]
    assert resumed, "no trial was run again from its checkpoint"
    assert all(t.last_result["node"] != doomed_id for t in resumed)
    results["tune_hosts_node_lost_while_checkpointing"] = {
        "trials": 4,
        "terminated": 4,
        "re_run_from_checkpoint": len(resumed),
        "trials_lost": 0,
    }


def test_tune_hosts_a_gpu_node_that_joins_gets_trials(
    nodes: Nodes, tmp_path: Path, results: dict[str, Any]
) -> None:
    import waterwave_hpo as ww

    nodes.reset(1)
    joined: dict[str, Any] = {}

    def add_node() -> None:
        joined["id"] = nodes.node_id(nodes.add())
        joined["at_s"] = time.time()
        # Hold Tune's driver loop (this callback runs in it) until the joined node's host
        # answers, so trials Tune starts next have it to choose; on a loaded machine the host
        # can take longer to start than the first node's hosts take to finish every trial.
        deadline = time.monotonic() + 120.0
        while len(hosts.stats()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)

    with ww.tune_hosts(trials_per_gpu=2, cpus_per_trial=0.25) as hosts:
        analysis = _run_tune(
            tmp_path,
            hosts.wrap(_train_with_checkpoints),
            hosts.resources,
            8,
            _on_result(lambda r: r["step"] >= 1, add_node),
            max_concurrent_trials=4,  # room for the node that joins
        )
    _assert_all_finished(analysis, 8)
    on_new = [t for t in analysis.trials if t.last_result["node"] == joined["id"]]
    assert on_new, "no trial ran in a host on the node that joined"
    first = min(t.last_result["timestamp"] - t.last_result["time_total_s"] for t in on_new)
    results["tune_hosts_time_to_use_new_node_s"] = round(first - joined["at_s"], 2)
    results["tune_hosts_trials_on_new_node"] = len(on_new)


def test_shared_gpu_a_node_lost_while_trials_checkpoint_loses_no_trial_nor_lease(
    nodes: Nodes, tmp_path: Path, results: dict[str, Any]
) -> None:
    from waterwave_hpo.integrations import ray_tune as ww_tune

    import waterwave_hpo as ww

    nodes.reset(2)
    keeper, doomed = nodes.gpu_nodes
    doomed_id = nodes.node_id(doomed)
    resources = ww.shared_gpu(trials_per_gpu=2, cpus_per_trial=0.25, memory_budget_bytes=100)
    analysis = _run_tune(
        tmp_path,
        resources.wrap(_train_with_checkpoints),
        resources,
        4,
        _remove_once_it_checkpointed(nodes, doomed),
    )
    _assert_all_finished(analysis, 4)
    resumed = [t for t in analysis.trials if t.last_result["resumed_from"] > 0]
    assert resumed and all(t.last_result["node"] != doomed_id for t in resumed)
    stats = ww_tune.lease_stats(gpu_id=0, node_id=nodes.node_id(keeper))
    assert (stats.n_held, stats.n_waiting) == (0, 0)  # every lease given back
    results["shared_gpu_node_lost_while_checkpointing"] = {
        "trials": 4,
        "terminated": 4,
        "re_run_from_checkpoint": len(resumed),
        "trials_lost": 0,
    }


def test_shared_gpu_a_gpu_node_that_joins_gets_trials(nodes: Nodes, tmp_path: Path) -> None:
    import waterwave_hpo as ww

    nodes.reset(1)
    joined: dict[str, Any] = {}

    def add_node() -> None:
        joined["id"] = nodes.node_id(nodes.add())

    resources = ww.shared_gpu(trials_per_gpu=2, cpus_per_trial=0.25, memory_budget_bytes=100)
    analysis = _run_tune(
        tmp_path,
        resources.wrap(_train_with_checkpoints),
        resources,
        8,
        _on_result(lambda r: r["step"] >= 1, add_node),
    )
    _assert_all_finished(analysis, 8)
    assert any(t.last_result["node"] == joined["id"] for t in analysis.trials)


@ww.batched
def _fused_sleeps(trials: list[optuna.trial.Trial]) -> list[float]:
    xs = [t.suggest_float("x", -1.0, 1.0) for t in trials]
    for step in range(4):
        for t, x in zip(trials, xs, strict=True):
            t.report(x * step, step)
        time.sleep(0.1)
    return [x * x for x in xs]


def test_a_node_lost_mid_fused_batch_loses_no_trial(nodes: Nodes, results: dict[str, Any]) -> None:
    # RayExecutor(fuse=2) on a cluster_utils cluster: the node of a running fused
    # batch is removed; each of its trials is told FAIL and re-run, nothing is left RUNNING.
    nodes.reset(2)
    doomed = nodes.gpu_nodes[1]
    doomed_id = nodes.node_id(doomed)
    study = optuna.create_study()

    def batch_running_on_doomed() -> bool:
        return any(
            t.state is TrialState.RUNNING
            and t.system_attrs.get(ATTR_NODE) == doomed_id
            and len(t.intermediate_values) >= 1
            for t in study.get_trials(deepcopy=False)
        )

    def remove_mid_batch() -> None:
        _wait_for(batch_running_on_doomed, timeout_s=BACKSTOP_S)
        nodes.remove(doomed)

    remover = _in_background(remove_mid_batch)
    executor = RayExecutor(trials_per_device=1, fuse=2)
    executor.optimize(study, _fused_sleeps, n_trials=10)
    remover.join()
    _assert_nothing_lost(study, 10)
    _record(results, "ray_executor_node_lost_mid_fused_batch", study, 10)
    failed = [t for t in study.trials if t.state is TrialState.FAIL]
    assert failed and all(t.system_attrs[ATTR_NODE] == doomed_id for t in failed)
    batches = [t.system_attrs.get("waterwave:batch") for t in study.trials]
    assert any(b is not None and len(b) == 2 for b in batches)  # fused batches ran


@ww.batched
def _fused_train_with_checkpoints(trials: list[Any]) -> None:
    """A batched trainable: each trial counts its own steps, checkpoints every step and resumes
    from its own checkpoint when re-run (batch-mates may resume from different steps)."""
    import tempfile

    from ray import tune

    starts = []
    for t in trials:
        start = 0
        checkpoint = t.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:
                start = int(Path(directory, "step.txt").read_text())
        starts.append(start)
    node = ray.get_runtime_context().get_node_id()
    for step in range(min(starts) + 1, N_STEPS + 1):
        time.sleep(trials[0].config["sleep_s"])
        for t, start in zip(trials, starts, strict=True):
            if step <= start:
                continue
            with tempfile.TemporaryDirectory() as directory:
                Path(directory, "step.txt").write_text(str(step))
                t.report(
                    {"step": step, "resumed_from": start, "node": node, "batch": len(trials)},
                    checkpoint=tune.Checkpoint.from_directory(directory),
                )


def test_tune_hosts_a_node_lost_mid_fused_batch_loses_no_trial(
    nodes: Nodes, tmp_path: Path, results: dict[str, Any]
) -> None:
    # tune_hosts(fuse=2) on a cluster_utils cluster: the node of a running fused
    # batch is removed; each of its Tune trials fails alone and Tune runs it again, from its
    # own last checkpoint, on the other node's host. Nothing lost, nothing left RUNNING.
    nodes.reset(2)
    doomed = nodes.gpu_nodes[1]
    doomed_id = nodes.node_id(doomed)
    with ww.tune_hosts(trials_per_gpu=1, cpus_per_trial=0.25, fuse=2, fuse_wait_s=10.0) as hosts:
        assert hosts.n_hosts == 2 and hosts.max_concurrent_trials == 4
        analysis = _run_tune(
            tmp_path,
            hosts.wrap(_fused_train_with_checkpoints),
            hosts.resources,
            4,
            _on_result(
                lambda r: r["node"] == doomed_id and r["step"] >= 2 and r["batch"] == 2,
                partial(nodes.remove, doomed),
            ),
            max_concurrent_trials=hosts.max_concurrent_trials,
        )
        stats = hosts.stats()
    _assert_all_finished(analysis, 4)
    resumed = [t for t in analysis.trials if t.last_result["resumed_from"] > 0]
    assert len(resumed) >= 2, "the lost batch's trials were not run again from checkpoints"
    assert all(t.last_result["node"] != doomed_id for t in resumed)
    assert len(stats) == 1 and stats[0].running == 0
    results["tune_hosts_node_lost_mid_fused_batch"] = {
        "trials": 4,
        "terminated": 4,
        "re_run_from_checkpoint": len(resumed),
        "trials_lost": 0,
    }
