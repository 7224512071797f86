"""Shared test setup: quiet Optuna, the ``gpu`` marker skipped where CUDA is absent, the order
and grouping of tests for pytest-xdist, and a local Ray instance for the test modules that ask
for one, kept between modules that want the same one."""

from __future__ import annotations

import os

# One intra-op thread per process: pytest-xdist runs a worker per core (below), and each
# worker's torch would otherwise run one OpenMP thread per core, whose idle threads spin while
# they wait and take the cores from the other workers. Measured on the 2-core VM with nothing
# else running, the fusion tests on 4 workers (tests/fusion/test_zoo.py and test_fuse.py, 44
# tests, two runs each): 137-148 user CPU-seconds and 92-101 s with torch's default (a thread
# per core), 95-104 and 57-75 s with OMP_WAIT_POLICY=PASSIVE, 96-98 and 61 s with one thread.
# Read by torch as it is imported (this module imports it), and inherited by every process a
# test starts. A value set outside is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Iterator
import signal
import time
from typing import Any

import _xdist_scopes
import fakes
import optuna
import pytest
import torch

optuna.logging.set_verbosity(optuna.logging.WARNING)

# Ray starts its worker processes (every actor: Tune's trials, RayExecutor's hosts, the storage
# relay) at nice 15 (its `worker_niceness` setting). Beside the suite's other processes, at
# nice 0, they then get a few percent of a busy core: with two busy loops beside the suite, a
# host actor took over 120 s to import its modules and the tests waiting on it failed. At nice 0
# they share the cores as evenly as everything else. Ray reads the setting from the environment
# of the process that starts its node (ray.init, ray.cluster_utils.Cluster).
os.environ.setdefault("RAY_worker_niceness", "0")
# No worker processes started ahead of need: by default each node starts one per CPU when the
# first driver connects, and keeps idle ones up to its CPU count. In the suite most never ran
# anything (14 of 243 in the quick and slow runs on 2026-11-29), and an idle worker still takes
# about 1% of a core (0.45 CPU-s in 40 s on the 2-core VM): with an instance per xdist worker,
# booting and idling them cost more than the second a first actor now waits for its process.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("RAY_enable_worker_prestart", "0")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations",
        action="store_true",
        help="write each test's duration (setup + call + teardown, seconds) to "
        "tests/durations.json, which orders the next runs' units of work (longest first)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # A shell without job control starts background commands (`pytest &`, `nohup pytest &`)
    # with SIGINT ignored, and every process they start inherits that: the Ctrl+C tests' children
    # would never see their SIGINT. Give this process, its xdist workers and every child
    # Python's own handler, as in a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` (pyproject's addopts): an xdist worker per core, at least 2, at most 8.

    A test that waits (on worker processes, Ray actors, trials that sleep) leaves its core to
    the processes it waits on, which are busy: two workers a core were no faster and spent more
    CPU. On the 2-core VM with nothing else running (2026-11-29, one run each; repeats in
    docs/development.md), the quick loop took 4.6 minutes and 545 CPU-seconds on four workers,
    4.2 and 407 on two; the slow tests 8.3 minutes and 989 CPU-seconds on four, 8.1 and 865 on
    two (12.0 and 791 on none).
    Each worker holds its own torch, Ray and subprocesses, hence the cap.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides.
    """
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(8, cores or 1))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # The longest first (longest-processing-time scheduling): each unit of work (an
    # xdist_group, a module with module-scoped fixtures, else one test) is costed at its tests'
    # durations from the last `--store-durations` run (tests/durations.json; a test not there
    # counts as the typical slow or quick one), and xdist hands units out in that order, so
    # that the long ones start first and short ones fill the other workers at the end. A
    # unit's tests stay together, in file order.
    _xdist_scopes.sort_by_cost(items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _xdist_scopes.record_duration(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("--store-durations") and not hasattr(
        session.config, "workerinput"
    ):  # the controller (or a run without xdist), which sees every test's reports
        _xdist_scopes.store_durations()


def pytest_configure_node(node: Any) -> None:  # xdist's controller, per worker
    _xdist_scopes.configure_node(node)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reports its collection
def pytest_collection_finish(session: pytest.Session) -> None:
    _xdist_scopes.write_scopes(session)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None  # another --dist: xdist's own
    return _xdist_scopes.make_scheduler(config, log)


@pytest.fixture(autouse=True)
def _environment_kept() -> Iterator[None]:
    """Fails the test that leaves the process without a variable it had, and puts it back.

    A test that drops one (``PATH``, say) breaks the next tests of its xdist worker instead:
    in CI, accelerate's ``clear_environment`` raced in two co-hosted trials and a later test's
    g++ could not find ``ld``. ``monkeypatch`` has restored its own changes before this runs.
    """
    before = dict(os.environ)
    yield
    lost = sorted(set(before) - set(os.environ))
    if lost:
        os.environ.update({key: before[key] for key in lost})
        pytest.fail(
            f"the test removed {', '.join(lost)} from the process environment (os.environ) "
            "and left it so; put back here for the tests after it"
        )


_OBJECT_STORE_BYTES = 256 * 2**20

# The local Ray instance this pytest process started for ray_cluster, kept for the next module
# that wants the same one: (num_cpus, num_gpus) and the GCS address it runs at.
_ray_instance: dict[str, Any] = {}


def _start_ray(ray: Any, config: tuple[int, int], workdir: str) -> None:
    if ray.is_initialized():
        ray.shutdown()
    # Ray puts the driver's working directory first on its workers' sys.path; from the repo
    # root that would shadow the installed package with the source tree.
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        ray.init(
            # "local": a new instance, never another user's cluster (or another xdist
            # worker's) found on this machine: ray.init() without an address joins one it
            # finds in /tmp/ray, then fails here.
            address="local",
            num_cpus=config[0],
            num_gpus=config[1],
            # The tests put little in the object store; Ray's default (30% of the memory)
            # would be claimed by each of the instances xdist's workers run at once.
            object_store_memory=_OBJECT_STORE_BYTES,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    finally:
        os.chdir(cwd)
    _ray_instance.update(config=config, gcs=ray.get_runtime_context().gcs_address)


def _ray_left_as_new(ray: Any, timeout_s: float = 60.0) -> bool:
    """Whether the kept instance can serve the next module as if new: its named actors (lease
    brokers and hosts are detached: they outlive the module that made them) are killed, then
    every CPU and GPU must come back free within ``timeout_s``."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        try:
            ray.kill(ray.get_actor(entry["name"], namespace=entry["namespace"]))
        except ValueError:  # gone meanwhile
            pass
    deadline = time.monotonic() + timeout_s
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        if all(free.get(key, 0.0) >= total.get(key, 0.0) - 1e-6 for key in ("CPU", "GPU")):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="session")
def _ray_session() -> Iterator[None]:
    yield
    if _ray_instance:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        _ray_instance.clear()


@pytest.fixture(scope="module")
def ray_cluster(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    _ray_session: None,
) -> Iterator[None]:
    """A local Ray instance for the requesting test module: 2 CPUs and ``RAY_GPUS`` (a module
    global, default 1) logical GPUs, so Ray's placement is real while the work runs on the CPU.

    Use it with ``pytestmark = pytest.mark.usefixtures("ray_cluster")`` in a module that has
    already done ``pytest.importorskip("ray")``. Starting Ray takes seconds (tens on a loaded
    2-core machine), so the instance the previous module used is kept when it has the same
    resources and is left as new (no named actor, every CPU and GPU free); otherwise a new one
    starts (each module is a unit of xdist's work of its own, so several instances may run at
    once, each in its own xdist worker).
    """
    import ray

    sigint = signal.getsignal(signal.SIGINT)  # Tune's driver installs its own and keeps it
    config = (2, int(getattr(request.module, "RAY_GPUS", 1)))
    kept = (
        ray.is_initialized()
        and _ray_instance.get("config") == config
        and _ray_instance.get("gcs") == ray.get_runtime_context().gcs_address
        and _ray_left_as_new(ray)
    )
    if not kept:
        _start_ray(ray, config, str(tmp_path_factory.mktemp("ray")))
    # The trainables and objectives live in the test module, and shared test doubles in
    # tests/fakes, neither of which Ray's workers can import.
    ray.cloudpickle.register_pickle_by_value(request.module)
    ray.cloudpickle.register_pickle_by_value(fakes)
    yield
    signal.signal(signal.SIGINT, sigint)
