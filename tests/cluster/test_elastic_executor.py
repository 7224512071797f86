"""Nodes lost and added mid-study on a real multi-node Ray cluster on one machine
(``_elastic.py``): RayExecutor starts with what comes up, uses nodes that join, and loses no
trial to a node that leaves (Ray Tune's designs: ``test_elastic_tune.py``)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import logging
import os
from pathlib import Path
import threading
import time
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.cluster_utils")

from cluster._elastic import BACKSTOP_S  # noqa: E402
from cluster._elastic import Nodes  # noqa: E402
from cluster._elastic import assert_nothing_lost  # noqa: E402
from cluster._elastic import cluster_nodes  # noqa: E402
from cluster._elastic import figures  # noqa: E402
from cluster._elastic import in_background  # noqa: E402
from cluster._elastic import record  # noqa: E402
from cluster._elastic import states  # noqa: E402
from cluster._elastic import wait_for  # noqa: E402
import waterwave_hpo as ww  # noqa: E402
from waterwave_hpo.cluster import ATTR_NODE  # noqa: E402
from waterwave_hpo.cluster import RayExecutor  # noqa: E402

pytestmark = pytest.mark.slow

DRIVER_PID = os.getpid()  # pickled by value into the hosts: "am I in a host actor?"


@pytest.fixture(scope="module")
def nodes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nodes]:
    yield from cluster_nodes(request, tmp_path_factory)


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Any]]:
    yield from figures()


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
    assert states(study) == {TrialState.COMPLETE: 6}
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
        wait_for(mid_study_on_doomed, timeout_s=BACKSTOP_S)
        nodes.remove(doomed)

    remover = in_background(remove_after_four)
    executor = RayExecutor(trials_per_device=2)
    executor.optimize(study, _sleeps, n_trials=16)
    remover.join()
    assert_nothing_lost(study, 16)
    record(results, "ray_executor_node_lost_mid_study", study, 16)
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
        wait_for(reporting_on_doomed, timeout_s=BACKSTOP_S)
        nodes.remove(doomed)

    remover = in_background(remove_while_reporting)
    RayExecutor(trials_per_device=2).optimize(study, _reports, n_trials=8)
    remover.join()
    assert_nothing_lost(study, 8)
    record(results, "ray_executor_node_lost_while_reporting", study, 8)
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
    running = in_background(lambda: executor.optimize(study, objective, n_trials=8))
    wait_for(lambda: states(study)[TrialState.RUNNING] >= 2, timeout_s=BACKSTOP_S)
    joined = {"id": nodes.node_id(nodes.add()), "at_s": time.time()}
    running.join(timeout=180)
    assert not running.is_alive()
    assert states(study) == {TrialState.COMPLETE: 8}
    on_new = [t for t in study.trials if t.system_attrs[ATTR_NODE] == joined["id"]]
    assert on_new, "no trial ran on the node that joined"
    assert {t.system_attrs[ATTR_NODE] for t in study.trials} == {first_id, joined["id"]}
    stats = executor.cluster_stats
    assert stats is not None and (stats.hosts_started, stats.nodes_joined) == (2, 1)
    first_start = min(t.datetime_start.timestamp() for t in on_new)  # type: ignore[union-attr]
    results["ray_executor_time_to_use_new_node_s"] = round(first_start - joined["at_s"], 2)
    results["ray_executor_trials_on_new_node"] = len(on_new)


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
        wait_for(batch_running_on_doomed, timeout_s=BACKSTOP_S)
        nodes.remove(doomed)

    remover = in_background(remove_mid_batch)
    executor = RayExecutor(trials_per_device=1, fuse=2)
    executor.optimize(study, _fused_sleeps, n_trials=10)
    remover.join()
    assert_nothing_lost(study, 10)
    record(results, "ray_executor_node_lost_mid_fused_batch", study, 10)
    failed = [t for t in study.trials if t.state is TrialState.FAIL]
    assert failed and all(t.system_attrs[ATTR_NODE] == doomed_id for t in failed)
    batches = [t.system_attrs.get("waterwave:batch") for t in study.trials]
    assert any(b is not None and len(b) == 2 for b in batches)  # fused batches ran
