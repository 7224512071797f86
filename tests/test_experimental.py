"""The never-run CUDA paths say so, once per process each.

Each path is driven on the CPU with the project's fakes far enough to reach its first use.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import types
from typing import Any
import warnings

from fakes import fake_cupy
import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo import _experimental
from waterwave_hpo.bench import Method
from waterwave_hpo.bench import Setting
from waterwave_hpo.bench import Workload
from waterwave_hpo.bench import WorkloadSpec
from waterwave_hpo.bench import _runners
from waterwave_hpo.cluster import _tune
from waterwave_hpo.executor import MemoryPoolMode
from waterwave_hpo.host import make_device_memory
from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory._internal import MemoryLease


@pytest.fixture(autouse=True)
def fresh_process_state() -> Iterator[None]:
    _experimental.reset_warnings()
    yield
    _experimental.reset_warnings()


def _experimental_warnings(call: Any, times: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(times):
            call()
    return [str(w.message) for w in caught if issubclass(w.category, ww.ExperimentalWarning)]


def test_the_warning_is_optunas_kind_and_public() -> None:
    import optuna

    assert issubclass(ww.ExperimentalWarning, optuna.exceptions.ExperimentalWarning)
    assert "ExperimentalWarning" in ww.__all__


def test_the_cupy_pool_warns_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)

    def make() -> None:
        with contextlib.suppress(RuntimeError):  # events still need libcuda.so.1
            StreamAwarePool(backend="cupy").close()

    messages = _experimental_warnings(make, 3)
    assert len(messages) == 1
    assert "backend='cupy'" in messages[0] and "H200 run of 2026-11-27" in messages[0]
    assert "speed has not been measured on a GPU" in messages[0]


def test_each_warning_says_what_has_and_has_not_run_on_a_gpu() -> None:
    from waterwave_hpo import _experimental

    assert set(_experimental.GPU_STATUS) == set(_experimental.ExperimentalPath)
    assert (
        "not yet run on a GPU"
        in _experimental.GPU_STATUS[_experimental.ExperimentalPath.LEASES_CUDA]
    )
    assert "11-67%" in _experimental.GPU_STATUS[_experimental.ExperimentalPath.POOL_CUDA]


def test_the_sim_pool_does_not_warn() -> None:
    assert _experimental_warnings(lambda: StreamAwarePool(backend="sim").close(), 2) == []


def test_the_cuda_pool_warns_before_it_reaches_the_driver() -> None:
    def make() -> None:
        with contextlib.suppress(Exception):  # no libcuda.so.1 on this machine
            StreamAwarePool(backend="cuda").close()

    messages = _experimental_warnings(make, 2)
    assert len(messages) == 1 and "backend='cuda'" in messages[0]


def test_the_executors_cuda_path_warns_once() -> None:
    def make() -> None:
        make_device_memory(
            torch.device("cuda", 0), MemoryPoolMode.OFF, 1 << 30, "fifo", max_trials=2
        )

    messages = _experimental_warnings(make, 3)
    assert len(messages) == 1 and "executor's CUDA path" in messages[0]
    cpu = _experimental_warnings(
        lambda: make_device_memory(
            torch.device("cpu"), MemoryPoolMode.OFF, None, "fifo", max_trials=2
        ),
        1,
    )
    assert cpu == []


def test_the_bench_warns_once_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runners, "_run_isolated", lambda *args: "ran")
    spec = WorkloadSpec(Workload.RESNET, Setting.LIGHT, batch_size=2, steps=1)

    def run() -> None:
        _runners.run_method(
            Method.TEMPORAL, spec, [{}], torch.device("cuda", 0), 1, seed=0, capacity_bytes=1
        )

    messages = _experimental_warnings(run, 2)
    assert len(messages) == 1 and "bench" in messages[0]


def test_gpu_leases_warn_once_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda = types.SimpleNamespace(
        get_device_properties=lambda device: types.SimpleNamespace(total_memory=1 << 30),
        set_per_process_memory_fraction=lambda fraction, device: None,
        reset_peak_memory_stats=lambda device: None,
    )
    monkeypatch.setattr(torch, "cuda", fake_cuda)
    lease = MemoryLease("t0", 1 << 20, 1 << 30, 0.0)
    messages = _experimental_warnings(lambda: _tune._cap_cuda(torch.device("cuda", 0), lease), 2)
    assert len(messages) == 1 and "shared_gpu()" in messages[0]
