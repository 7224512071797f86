"""Nodes lost and added mid-run on a real multi-node Ray cluster on one machine
(``_elastic.py``): both Ray Tune designs, ``tune_hosts()`` and ``shared_gpu()``, use nodes that
join and lose no trial to a node that leaves (RayExecutor: ``test_elastic_executor.py``)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from functools import partial
from pathlib import Path
import time
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.cluster_utils")

from cluster._elastic import BACKSTOP_S  # noqa: E402
from cluster._elastic import Nodes  # noqa: E402
from cluster._elastic import cluster_nodes  # noqa: E402
from cluster._elastic import figures  # noqa: E402
import waterwave_hpo as ww  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nodes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nodes]:
    yield from cluster_nodes(request, tmp_path_factory)


@pytest.fixture(scope="module")
def results() -> Iterator[dict[str, Any]]:
    yield from figures()


N_STEPS = 4


def _meet_the_doomed_node(config: dict[str, Any], node: str) -> None:
    """Each trial marks its node in ``config["meet_in"]``; one elsewhere waits (a backstop
    long at most) until a trial has started on the node a test removes (``config["hold_on"]``):
    on a loaded machine that node's host can start after the other's has run every trial, and
    then no trial would be there to lose."""
    doomed = config.get("hold_on")
    if doomed is None:
        return
    Path(config["meet_in"], node).touch()
    deadline = time.monotonic() + BACKSTOP_S
    while not Path(config["meet_in"], doomed).exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _hold_if_doomed(config: dict[str, Any], node: str, step: int) -> None:
    """On the node a test removes (``config["hold_on"]``), a trial that reported its second
    checkpoint goes no further: the removal ends it mid-run however late it comes, so a loaded
    machine cannot let the trial finish first (the re-run from a checkpoint is what is tested)."""
    if node == config.get("hold_on") and step > 2:
        deadline = time.monotonic() + BACKSTOP_S
        while time.monotonic() < deadline:
            time.sleep(0.1)


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
    _meet_the_doomed_node(config, node)
    for step in range(start + 1, N_STEPS + 1):
        _hold_if_doomed(config, node, step)
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
    tmp_path: Path,
    trainable: Any,
    resources: Any,
    n_trials: int,
    callback: Any,
    hold_on: str | None = None,
    **kwargs: Any,
) -> Any:
    """``tune.run`` of ``n_trials``; with ``hold_on``, a trial runs on that node before any
    goes on elsewhere (``_meet_the_doomed_node``), and trials there stop after their second
    checkpoint until the node is removed (``_hold_if_doomed``)."""
    from ray import tune

    meet_in = tmp_path / "nodes-with-a-trial"
    meet_in.mkdir()
    return tune.run(
        trainable,
        config={
            "sleep_s": 0.3,
            "hold_on": hold_on,
            "meet_in": str(meet_in),
            "i": tune.grid_search(list(range(n_trials))),
        },
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
            hold_on=doomed_id,
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

    # The callback above holds Tune's driver loop (up to 120 s), and with it the trials'
    # reports: a hosted trial not polled for heartbeat_ttl_s (30 s by default) is
    # stopped as if its Tune process had died (it did in CI, after a 32 s hold).
    with ww.tune_hosts(trials_per_gpu=2, cpus_per_trial=0.25, heartbeat_ttl_s=BACKSTOP_S) as hosts:
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
        hold_on=doomed_id,
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
    if len(trials) == 2:
        _meet_the_doomed_node(trials[0].config, node)
    for step in range(min(starts) + 1, N_STEPS + 1):
        if len(trials) == 2:
            _hold_if_doomed(trials[0].config, node, step)
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
    seen: list[tuple[str, str, int, int]] = []  # (trial, node, batch size, step): for a failure

    def batch_mid_run_on_the_doomed_node(result: dict[str, Any]) -> bool:
        node = "doomed" if result["node"] == doomed_id else "other"
        seen.append((result["trial_id"], node, result["batch"], result["step"]))
        return node == "doomed" and result["step"] >= 2 and result["batch"] == 2

    # A batch starts once it is full; fuse_wait_s only bounds the wait for a late batch-mate.
    # On a loaded machine Tune starts the trials' processes over tens of seconds, and a mate
    # later than fuse_wait_s would leave the doomed node's trials in batches of one.
    with ww.tune_hosts(trials_per_gpu=1, cpus_per_trial=0.25, fuse=2, fuse_wait_s=60.0) as hosts:
        assert hosts.n_hosts == 2 and hosts.max_concurrent_trials == 4
        analysis = _run_tune(
            tmp_path,
            hosts.wrap(_fused_train_with_checkpoints),
            hosts.resources,
            4,
            _on_result(batch_mid_run_on_the_doomed_node, partial(nodes.remove, doomed)),
            hold_on=doomed_id,
            max_concurrent_trials=hosts.max_concurrent_trials,
        )
        stats = hosts.stats()
    _assert_all_finished(analysis, 4)
    resumed = [t for t in analysis.trials if t.last_result["resumed_from"] > 0]
    assert len(resumed) >= 2, (
        "the lost batch's trials were not run again from checkpoints; the results, as "
        f"(trial, node, batch size, step): {seen}"
    )
    assert all(t.last_result["node"] != doomed_id for t in resumed)
    assert len(stats) == 1 and stats[0].running == 0
    results["tune_hosts_node_lost_mid_fused_batch"] = {
        "trials": 4,
        "terminated": 4,
        "re_run_from_checkpoint": len(resumed),
        "trials_lost": 0,
    }
