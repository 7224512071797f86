"""The pool is PyTorch's allocator before CUDA initialises, on every entry point that installs
it (the executor's device hosts, the Ray/Tune trial hosts, the bench), checked on the CPU with a
fake CUDA that records the order."""

from __future__ import annotations

import queue

from fakes.cuda_init import FakeCuda
import optuna
import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo.host._device_host import RunSettings
from waterwave_hpo.host._outcome import OnOOM


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda(n=2).install(monkeypatch)


def test_the_executor_installs_every_devices_pool_before_cuda_initialises(
    cuda: FakeCuda,
) -> None:
    executor = ww.WaterwaveExecutor("auto", 2)
    assert cuda.events == []  # resolving "auto" counted devices without initialising CUDA
    settings = RunSettings(
        study=optuna.create_study(),
        func=lambda trial: 0.0,
        catch=(),
        on_oom=OnOOM.RETRY,
        max_oom_retries=0,
        gc_after_trial=False,
        outcomes=queue.SimpleQueue(),
    )
    hosts = executor._make_hosts(settings)
    assert [str(h.device) for h in hosts] == ["cuda:0", "cuda:1"]
    assert cuda.events[0] == "pool 0", cuda.events  # first, before any initialisation
    assert "pool 1" in cuda.events
    assert all(h.memory.pool is cuda.pools[h.device.index] for h in hosts)


def test_tune_trial_hosts_install_the_pool_before_cuda_initialises(cuda: FakeCuda) -> None:
    pytest.importorskip("ray")
    from waterwave_hpo.cluster._hosted import TrialHost

    host = TrialHost(torch.device("cuda", 1), 2)
    try:
        assert cuda.events[0] == "pool 1", cuda.events
        assert host.memory.pool is cuda.pools[1]
        assert host.memory.budget_bytes is not None
        assert host.memory.budget_bytes < cuda.total_memory  # the reserve outside the pool
    finally:
        host.shutdown()  # its Tune session hook must not outlive the test


def test_the_fake_refuses_a_pool_after_cuda_initialised(cuda: FakeCuda) -> None:
    # The check above can fail: an install after any CUDA call is refused, as PyTorch does;
    # the executor then runs the trials on PyTorch's own allocator and says so.
    torch.cuda.get_device_properties(0)
    with pytest.raises(RuntimeError, match="before CUDA's first allocation"):
        ww.memory.use_pool(ww.memory.StreamAwarePool(backend="cuda", device=0))
    with pytest.warns(RuntimeWarning, match="PyTorch's own CUDA allocator"):
        hosts = ww.WaterwaveExecutor("cuda:0", 1)._make_hosts(
            RunSettings(
                study=optuna.create_study(),
                func=lambda trial: 0.0,
                catch=(),
                on_oom=OnOOM.RETRY,
                max_oom_retries=0,
                gc_after_trial=False,
                outcomes=queue.SimpleQueue(),
            )
        )
    assert cuda.events == ["cuda init"] and cuda.pools == {}
    assert hosts[0].memory.pool is None
