"""Per-slot CUDA streams from the driver (``host/_streams.py``), against a fake driver."""

from __future__ import annotations

from fakes.cuda_driver import FakeDriver
from fakes.cuda_driver import FakeExternalStream
from fakes.cuda_driver import FakeTorchStreamPool
import pytest
import torch

from waterwave_hpo.host import _driver
from waterwave_hpo.host import _streams


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_streams, "_free", {})
    monkeypatch.setattr(_streams, "_in_use", set())
    monkeypatch.setattr(_driver, "_driver", None)
    monkeypatch.setattr(torch.cuda, "ExternalStream", FakeExternalStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _use_driver(monkeypatch: pytest.MonkeyPatch, driver: FakeDriver) -> None:
    monkeypatch.setattr(_streams.ctypes, "CDLL", lambda name: driver)


@pytest.mark.usefixtures("fresh")
def test_slots_get_distinct_non_blocking_driver_streams_and_reuse_released_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = FakeDriver()
    _use_driver(monkeypatch, driver)
    a = _streams.acquire_stream(torch.device("cuda:0"))
    b = _streams.acquire_stream(torch.device("cuda"))  # no index: the current device
    assert a.cuda_stream != b.cuda_stream
    assert driver.stream_flags == [0x1, 0x1]  # CU_STREAM_NON_BLOCKING, as torch's own streams
    assert driver.retained == [0xC000]  # the primary context retained once, then current
    assert _streams.streams_in_use() == {a.cuda_stream, b.cuda_stream}
    _streams.release_stream(a)
    assert a.synchronized == 1  # its queued work waited for before anyone reuses it
    assert _streams.streams_in_use() == {b.cuda_stream}
    assert _streams.acquire_stream(torch.device("cuda:0")) is a  # reused, never destroyed
    assert driver.calls.count("cuStreamCreate") == 2


@pytest.mark.usefixtures("fresh")
def test_without_the_driver_torch_pooled_streams_held_by_a_slot_are_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _use_driver(monkeypatch, FakeDriver(fail={"cuInit": 100}))  # CUDA_ERROR_NO_DEVICE
    monkeypatch.setattr(torch.cuda, "Stream", FakeTorchStreamPool())
    held = {_streams.acquire_stream(torch.device("cuda:0")).cuda_stream for _ in range(40)}
    assert len(held) == 40  # more than one priority's 32: none shared


@pytest.mark.usefixtures("fresh")
def test_when_every_pooled_stream_is_held_the_error_says_what_to_lower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_streams.ctypes, "CDLL", _raise_os_error)
    monkeypatch.setattr(torch.cuda, "Stream", FakeTorchStreamPool())
    for _ in range(64):
        _streams.acquire_stream(torch.device("cuda:0"))
    with pytest.raises(RuntimeError, match="Lower trials_per_device"):
        _streams.acquire_stream(torch.device("cuda:0"))


def _raise_os_error(name: str) -> None:
    raise OSError(f"{name}: cannot open shared object file")
