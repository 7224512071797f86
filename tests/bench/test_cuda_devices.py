"""The bench's device handling on CUDA (``--device``, the GPU's name, the pool install), against
the fake CUDA of ``tests/fakes/cuda_init.py``."""

from __future__ import annotations

from fakes.cuda_init import FakeCuda
import pytest
import torch

from waterwave_hpo.bench._machine import device_name
from waterwave_hpo.bench._machine import machine
from waterwave_hpo.bench._machine import resolve_device
from waterwave_hpo.bench._runners import PoolNotInstalledError
from waterwave_hpo.bench._runners import _install_pool


def test_cuda_devices_resolve_to_an_existing_gpu_or_name_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeCuda(n=2).install(monkeypatch)
    assert resolve_device("auto") == torch.device("cuda:0")
    assert resolve_device("cuda") == torch.device("cuda:0")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"device='cuda:2' does not exist here \(2 CUDA"):
        resolve_device("cuda:2")


def test_results_name_the_gpu_and_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(n=1, total_memory=80 << 30).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    device = torch.device("cuda:0")
    assert device_name(device) == "nvidia-h100-80gb-hbm3"
    info = machine(device)
    assert (info["gpu"], info["gpu_total_memory_bytes"]) == ("fake GPU", 80 << 30)


def test_a_pool_that_cannot_be_installed_stops_the_method_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = FakeCuda(n=1).install(monkeypatch)
    torch.cuda.init()  # something initialised CUDA first: the allocator can no longer be swapped
    with pytest.raises(PoolNotInstalledError, match="this method measures the pool, so it did"):
        _install_pool(torch.device("cuda:0"))
    assert cuda.events == ["cuda init"]
