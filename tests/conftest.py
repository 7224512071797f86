"""Shared test setup: quiet Optuna, the ``gpu`` marker skipped where CUDA is absent, and one
local Ray instance per test module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator
import os
import signal

import fakes
import optuna
import pytest
import torch

optuna.logging.set_verbosity(optuna.logging.WARNING)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ray_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """One local Ray instance for the requesting test module: 2 CPUs and ``RAY_GPUS`` (a module
    global, default 1) logical GPUs, so Ray's placement is real while the work runs on the CPU.

    Use it with ``pytestmark = pytest.mark.usefixtures("ray_cluster")`` in a module that has
    already done ``pytest.importorskip("ray")``.
    """
    import ray

    sigint = signal.getsignal(signal.SIGINT)  # Tune's driver installs its own and keeps it
    if ray.is_initialized():
        ray.shutdown()
    # Ray puts the driver's working directory first on its workers' sys.path; from the repo
    # root that would shadow the installed package with the source tree.
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray"))
    try:
        ray.init(
            # "local": a new instance, never another user's cluster found on this machine
            # (ray.init() without an address joins one it finds in /tmp/ray, then fails here).
            address="local",
            num_cpus=2,
            num_gpus=getattr(request.module, "RAY_GPUS", 1),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    finally:
        os.chdir(cwd)
    # The trainables and objectives live in the test module, and shared test doubles in
    # tests/fakes, neither of which Ray's workers can import.
    ray.cloudpickle.register_pickle_by_value(request.module)
    ray.cloudpickle.register_pickle_by_value(fakes)
    yield
    ray.shutdown()
    signal.signal(signal.SIGINT, sigint)
