"""The bench's waterwave method through its CUDA paths on the CPU, under the fake CUDA topology of
``tests/fakes/cuda_topology.py``: the pool is installed before CUDA initialises, the results say it
ran on the pool, and nothing the bench runs calls a device-wide ``torch.cuda.synchronize`` or
PyTorch's per-device stats APIs."""

from __future__ import annotations

from collections.abc import Iterator

from fakes import cuda_topology
import pytest
import torch

from waterwave_hpo.bench import Allocator
from waterwave_hpo.bench import Method
from waterwave_hpo.bench import Setting
from waterwave_hpo.bench import Workload
from waterwave_hpo.bench import WorkloadSpec
from waterwave_hpo.bench import draw_params
from waterwave_hpo.bench import run_method


@pytest.fixture
def topology(monkeypatch: pytest.MonkeyPatch) -> Iterator[cuda_topology.Topology]:
    yield cuda_topology.install(monkeypatch)
    cuda_topology.uninstall()


@pytest.mark.slow
def test_the_waterwave_method_on_cuda_measures_the_pool_without_device_waits(
    topology: cuda_topology.Topology,
) -> None:
    spec = WorkloadSpec(Workload.DIGITS, Setting.LIGHT, batch_size=16, steps=2)
    params = draw_params(Workload.DIGITS, 2, seed=0)
    run = run_method(
        Method.WATERWAVE,
        spec,
        params,
        torch.device("cuda:0"),
        k=2,
        seed=0,
        capacity_bytes=64 << 20,
        isolate=False,
    )
    assert run.available, run.note
    assert run.completed == {0, 1}
    assert topology.cuda.events[0] == "pool 0"  # before CUDA initialised
    assert run.allocator is Allocator.STREAM_AWARE_POOL
    assert topology.device_syncs == []
    assert topology.stats_calls == []
    assert all(r.device_s_per_step is not None for r in run.records)  # timed with events
    assert topology.worker.backwards > 0
