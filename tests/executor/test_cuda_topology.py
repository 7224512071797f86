"""A co-hosted study through the executor's CUDA paths on the CPU (issue 14 §2): a fake CUDA
device (it records initialisation and device-wide synchronizes), fake per-slot streams, a
simulated pool standing in as PyTorch's allocator (its guards on), and every backward on one
shared autograd worker under an empty contextvars context. Nothing the executor runs may call a
device-wide ``torch.cuda.synchronize`` or PyTorch's per-device stats APIs while the pool is
installed, and each trial's memory is its own pool account."""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import itertools
import threading
from typing import Any

from fakes.autograd_worker import SharedAutogradWorker
from fakes.cuda_init import FakeCuda
import optuna
from optuna.trial import TrialState
import pytest
import torch
from torch import nn

import waterwave_hpo as ww
from waterwave_hpo.executor import _streams
from waterwave_hpo.executor._attrs import ATTR_PEAK_BYTES
from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory._torch_api import install_guards
from waterwave_hpo.memory._torch_api import remove_guards

MIB = 1 << 20
_STATS_APIS = (
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "memory_summary",
    "memory_snapshot",
)


class _FakeStream:
    _handles = itertools.count(0x1000)

    def __init__(self, device: torch.device) -> None:
        self.cuda_stream = next(self._handles)
        self.device = device
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1  # this stream only: allowed


@pytest.fixture
def topology(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    pools: list[StreamAwarePool] = []

    def sim_pool(**kwargs: Any) -> StreamAwarePool:
        pools.append(StreamAwarePool(capacity_bytes=256 * MIB, backend="sim"))
        return pools[-1]

    cuda = FakeCuda(n=1, pool_factory=sim_pool).install(monkeypatch)
    real_use_pool = cuda._use_pool

    def use_pool(pool: StreamAwarePool) -> None:
        real_use_pool(pool)
        install_guards(lambda index: cuda.pools.get(index))  # as the real use_pool does

    import waterwave_hpo.memory as memory

    monkeypatch.setattr(memory, "use_pool", use_pool)
    monkeypatch.setattr(_streams, "acquire_stream", _FakeStream)
    monkeypatch.setattr(_streams, "release_stream", lambda stream: stream.synchronize())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    stats_calls: list[str] = []
    for name in _STATS_APIS:
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: stats_calls.append(_n))
    worker = SharedAutogradWorker(timeout_s=30)
    worker.install(monkeypatch)
    try:
        yield {"cuda": cuda, "pools": pools, "stats_calls": stats_calls, "worker": worker}
    finally:
        worker.close()
        remove_guards()
        for pool in pools:
            pool._pinned = False


def test_a_co_hosted_study_on_the_cuda_paths_keeps_the_rules(topology: dict[str, Any]) -> None:
    allocated: dict[int, int] = {}
    lock = threading.Lock()

    def objective(trial: optuna.trial.Trial) -> float:
        ctx = ww.current()
        pool = topology["pools"][0]
        nbytes = (trial.number + 1) * MIB
        # What PyTorch would do through the pool for this trial's tensors, on its stream:
        block = pool.allocate(nbytes, stream=ctx.stream)
        stats = ww.trial_memory_stats()
        with lock:
            allocated[trial.number] = stats.peak_allocated_bytes if stats else -1
        torch.manual_seed(trial.number)
        model = ww.pipeline(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)))
        loss = torch.zeros(())
        for _ in range(3):
            loss = model(torch.randn(16, 8)).square().mean()
            loss.backward()
        pool.free(block, stream=ctx.stream)
        return float(loss.detach())

    study = optuna.create_study()
    executor = ww.WaterwaveExecutor("cuda:0", 2)
    executor.optimize(study, objective, n_trials=4)
    cuda: FakeCuda = topology["cuda"]
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert cuda.events[0] == "pool 0"  # installed before CUDA initialised
    assert cuda.device_syncs == []  # no device-wide synchronize
    assert topology["stats_calls"] == []  # no per-device stats API
    assert topology["worker"].backwards == 12  # every backward on the shared worker
    for t in study.trials:  # each trial's peak is its own account, not its slot stream's
        assert allocated[t.number] == (t.number + 1) * MIB
        assert t.user_attrs[ATTR_PEAK_BYTES] == (t.number + 1) * MIB
