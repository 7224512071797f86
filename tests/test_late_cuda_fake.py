"""The late-completing fake CUDA device itself (``tests/fakes/late_cuda.py``): what it promises
the tests that use it, so code that assumes a copy landed when issued fails under it."""

from __future__ import annotations

from fakes import late_cuda
import pytest
import torch


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> late_cuda.FakeGpu:
    return late_cuda.install(monkeypatch)


def test_a_side_stream_copy_lands_only_when_the_device_gets_there(gpu: late_cuda.FakeGpu) -> None:
    with gpu.memory():
        src = torch.full((4,), 7.0)
    host = torch.zeros(4)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    assert src.is_cuda and src.device == torch.device("cuda", 0) and not host.is_cuda
    assert not event.query() and torch.equal(host, torch.zeros(4))  # the host ran ahead
    event.synchronize()
    assert event.query() and torch.equal(host, torch.full((4,), 7.0))


def test_an_eager_stream_waiting_on_an_event_runs_the_work_before_it(
    gpu: late_cuda.FakeGpu,
) -> None:
    host = torch.ones(3)
    with gpu.memory():
        dev = torch.empty_like(host, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dev.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    torch.cuda.current_stream().wait_event(event)  # the compute stream (the host) waits
    assert event.query() and torch.equal(dev, host)


def test_freeing_device_memory_a_queued_copy_uses_is_a_hazard_unless_recorded(
    gpu: late_cuda.FakeGpu,
) -> None:
    side = torch.cuda.Stream()
    with gpu.memory():
        a, b = torch.ones(256), torch.ones(256)
    for t, record in ((a, False), (b, True)):
        with torch.cuda.stream(side):
            torch.zeros(256).copy_(t, non_blocking=True)
        if record:
            t.record_stream(side)
    del a
    assert len(gpu.hazards) == 1 and gpu.hazards[0].nbytes == 1024
    del b, t
    assert len(gpu.hazards) == 1 and gpu.held_bytes == 1024  # held for the copy, not handed out
    gpu.advance()
    assert (gpu.held_bytes, gpu.allocated_bytes) == (0, 0)
