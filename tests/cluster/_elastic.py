"""A real multi-node Ray cluster on one machine for the elastic tests
(``ray.cluster_utils.Cluster``: a head with no GPU, worker nodes with one logical GPU each),
shared by ``test_elastic_executor.py`` (RayExecutor) and ``test_elastic_tune.py`` (both Ray
Tune designs): each module starts its own, so that xdist runs the two on two workers at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Iterator
import json
import os
from pathlib import Path
import signal
import threading
import time
from typing import Any

import optuna
from optuna.trial import TrialState
import pytest
import ray
from ray import cluster_utils

from waterwave_hpo.host._attrs import ATTR_FAIL_REASON
from waterwave_hpo.host._attrs import ATTR_RETRY_OF

# The tests put little in the object store; Ray's default (30% of the memory) per node would
# be claimed by every node of every cluster xdist's workers run at once.
_OBJECT_STORE_BYTES = 128 * 2**20
_GPU_NODE = {"num_cpus": 1, "num_gpus": 1, "object_store_memory": _OBJECT_STORE_BYTES}
BACKSTOP_S = 300.0
"""The longest a wait for the cluster may take (nodes up, hosts started, trials at a point): a
backstop, never a timing. On a loaded 2-core machine a host actor took over 60 s to start."""


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
        wait_for(lambda: gpus_alive() == n, timeout_s=BACKSTOP_S)

    def add(self) -> Any:
        node = self.cluster.add_node(**_GPU_NODE)
        self.gpu_nodes.append(node)
        return node

    def remove(self, node: Any) -> None:
        self.gpu_nodes.remove(node)
        self.cluster.remove_node(node)

    def node_id(self, node: Any) -> str:
        return str(node.node_id)


def cluster_nodes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Nodes]:
    """The body of a module-scoped ``nodes`` fixture: a head node (2 CPUs, no GPU) and no GPU
    node yet; the requesting module and this one are pickled by value into Ray's workers."""
    import sys

    sigint = signal.getsignal(signal.SIGINT)
    if ray.is_initialized():
        ray.shutdown()
    cwd = os.getcwd()
    # Workers put the driver's working directory on sys.path: not the source tree.
    os.chdir(tmp_path_factory.mktemp("ray-cluster"))
    try:
        cluster = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "num_gpus": 0,
                "include_dashboard": False,
                "object_store_memory": _OBJECT_STORE_BYTES,
            },
        )
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    finally:
        os.chdir(cwd)
    ray.cloudpickle.register_pickle_by_value(request.module)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield Nodes(cluster)
    finally:
        ray.shutdown()
        cluster.shutdown()
        signal.signal(signal.SIGINT, sigint)


def figures() -> Iterator[dict[str, Any]]:
    """The body of a module-scoped ``results`` fixture: figures the tests measure, added to the
    JSON file $WATERWAVE_ELASTIC_RESULTS if set (see experiments/elastic.md)."""
    measured: dict[str, Any] = {}
    yield measured
    path = os.environ.get("WATERWAVE_ELASTIC_RESULTS")
    if path:
        written = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        written.update(measured)
        written["loadavg_at_end"] = os.getloadavg()
        Path(path).write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def record(results: dict[str, Any], name: str, study: optuna.Study, n_trials: int) -> None:
    trials = study.get_trials(deepcopy=False)
    counts = states(study)
    results[name] = {
        "trials_asked_for": n_trials,
        "complete": counts[TrialState.COMPLETE],
        "failed_lost_host": counts[TrialState.FAIL],
        "re_run": sum(1 for t in trials if ATTR_RETRY_OF in t.system_attrs),
        "left_running_or_waiting": counts[TrialState.RUNNING] + counts[TrialState.WAITING],
        "trials_lost": n_trials - counts[TrialState.COMPLETE],
    }


def gpus_alive() -> int:
    return sum(int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"])


def wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the cluster"
        time.sleep(0.1)


def in_background(action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=action, daemon=True)
    thread.start()
    return thread


def states(study: optuna.Study) -> Counter[TrialState]:
    return Counter(t.state for t in study.get_trials(deepcopy=False))


def assert_nothing_lost(study: optuna.Study, n_trials: int) -> None:
    """Every trial ended; each asked for completed; each FAIL was a lost host, run again."""
    trials = study.get_trials(deepcopy=False)
    counts = states(study)
    assert TrialState.RUNNING not in counts and TrialState.WAITING not in counts
    assert counts[TrialState.COMPLETE] == n_trials
    failed = [t for t in trials if t.state is TrialState.FAIL]
    assert all("was lost" in t.system_attrs[ATTR_FAIL_REASON] for t in failed)
    re_run = {t.system_attrs[ATTR_RETRY_OF] for t in trials if ATTR_RETRY_OF in t.system_attrs}
    assert {t.number for t in failed} <= re_run
