"""A trial's stream is current for PyTorch and for CuPy, checked on the CPU
with a fake CuPy module and torch's stream context stubbed out."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from fakes import fake_cupy
from fakes.autograd_worker import SharedAutogradWorker
import pytest
import torch

from waterwave_hpo.host._attempt import on_trial_stream


class _Stream:
    """Stands for a trial's ``torch.cuda.Stream``: its raw handle is all CuPy is given."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


@pytest.fixture
def no_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


@pytest.mark.usefixtures("no_torch_cuda")
def test_cupy_work_in_a_trial_goes_to_the_trials_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = fake_cupy.install(monkeypatch)
    with on_trial_stream(torch.device("cuda:0"), _Stream(0xBEEF), None):  # type: ignore[arg-type]
        inside = cupy.empty(64)
    outside = cupy.empty(64)
    assert inside.stream_ptr == 0xBEEF  # not CuPy's default stream
    assert outside.stream_ptr == 0  # restored after the trial


@pytest.mark.usefixtures("no_torch_cuda")
def test_each_trial_thread_sees_its_own_stream_in_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = fake_cupy.install(monkeypatch)
    barrier = threading.Barrier(2, timeout=10)
    seen: dict[int, Any] = {}

    def trial(handle: int) -> None:
        with on_trial_stream(torch.device("cuda:0"), _Stream(handle), None):  # type: ignore[arg-type]
            barrier.wait()  # both trials inside at once
            seen[handle] = cupy.empty(8).stream_ptr

    threads = [threading.Thread(target=trial, args=(h,)) for h in (101, 202)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {101: 101, 202: 202}


@pytest.mark.usefixtures("no_torch_cuda")
def test_cupy_work_in_a_trials_backward_goes_to_the_trials_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CuPy code in a backward hook ran on autograd's device thread, where
    CuPy's (thread-local) current stream is its null stream, unordered with the trial's."""
    cupy = fake_cupy.install(monkeypatch)
    worker = SharedAutogradWorker(timeout_s=30)
    worker.install(monkeypatch)
    seen: list[int] = []
    try:
        with on_trial_stream(torch.device("cuda:0"), _Stream(0xBEEF), None):  # type: ignore[arg-type]
            x = torch.ones(3, requires_grad=True)
            x.register_hook(lambda g: seen.append(cupy.empty(8).stream_ptr))  # type: ignore[no-untyped-call]
            (x * 2).sum().backward()
        (x * 3).sum().backward()  # outside a trial: the default again, on the shared worker
    finally:
        worker.close()
    assert seen == [0xBEEF, 0]
    assert (worker.inline_backwards, worker.backwards) == (1, 1)


def test_without_cupy_the_trial_stream_needs_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    with on_trial_stream(torch.device("cuda:0"), _Stream(7), None):  # type: ignore[arg-type]
        pass


@pytest.mark.usefixtures("no_torch_cuda")
def test_a_cupy_that_cannot_reach_cuda_does_not_fail_the_trial(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cupy = fake_cupy.install(monkeypatch)

    def broken(ptr: int, device_id: int = -1) -> Any:
        raise RuntimeError("cudaErrorInsufficientDriver")

    monkeypatch.setattr(cupy.cuda, "ExternalStream", broken)
    ran = False
    with on_trial_stream(torch.device("cuda:0"), _Stream(5), None):  # type: ignore[arg-type]
        ran = True
    assert ran
    assert "could not be set to the trial's" in caplog.text
