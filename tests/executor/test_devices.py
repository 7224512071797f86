"""resolve_devices: what ``WaterwaveExecutor(devices=...)`` accepts and refuses."""

from __future__ import annotations

import pytest
import torch

from waterwave_hpo.host._devices import resolve_devices


def test_cpu_spellings() -> None:
    cpu = [torch.device("cpu")]
    assert resolve_devices("cpu") == cpu
    assert resolve_devices(torch.device("cpu")) == cpu
    assert resolve_devices(["cpu", "cpu"]) == cpu


def test_auto_is_every_gpu_else_the_cpu() -> None:
    expected = (
        [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [torch.device("cpu")]
    )
    assert resolve_devices("auto") == expected


def test_a_device_past_the_last_one_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"cuda:99") as info:
        resolve_devices("cuda:99")
    assert "devices='cpu'" in str(info.value) or "indices 0.." in str(info.value)
    with pytest.raises(ValueError, match="99"):
        resolve_devices(99)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message on a machine without CUDA"
)
def test_cuda_without_cuda_says_so() -> None:
    with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False"):
        resolve_devices("cuda")


@pytest.mark.parametrize("spec", ["tpu", "meta", "gpu:0", "auto-ish"])
def test_unknown_devices_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=repr(spec)):
        resolve_devices(spec)


def test_auto_cannot_be_mixed() -> None:
    with pytest.raises(ValueError, match="cannot be mixed"):
        resolve_devices(["auto", "cpu"])


@pytest.mark.parametrize("spec", [None, 1.0, True, {"cpu"}])
def test_wrong_types_are_refused(spec: object) -> None:
    with pytest.raises(TypeError):
        resolve_devices(spec)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_cuda_means_every_visible_gpu() -> None:
    count = torch.cuda.device_count()
    assert resolve_devices("cuda") == [torch.device("cuda", i) for i in range(count)]
    assert resolve_devices(0) == [torch.device("cuda", 0)]
