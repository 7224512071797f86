"""The swap path's stream-and-event logic, with a fake CUDA transfer (no GPU here).

The CPU path runs the same ``_Swapped`` code with synchronous copies (``test_fit.py``); here the
transfer reports an event that has not completed yet, as a side-stream copy on CUDA would.
"""

from __future__ import annotations

from typing import Any

import torch

from waterwave_hpo.planning import StepLedger
from waterwave_hpo.planning._apply import _Swapped


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class FakeCudaTransfer:
    """Copies like a side stream would: the copy is queued, its event completes later."""

    def __init__(self) -> None:
        self.compute = FakeStream()
        self.out_event = FakeEvent()
        self.in_event = FakeEvent()

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        return t.clone(), self.out_event, self.compute

    def to_device(self, host: torch.Tensor, device: torch.device, compute: Any) -> Any:
        assert compute is self.compute  # back on the stream the activation was made on
        return host.clone(), self.in_event


def test_device_bytes_stay_counted_until_the_swap_out_event_completes() -> None:
    ledger = StepLedger()
    transfer = FakeCudaTransfer()
    t = torch.arange(256, dtype=torch.float32)
    held = _Swapped(t, ledger, transfer, ("dev", 1), 1024)  # type: ignore[arg-type]
    assert ledger.current_bytes == 1024 and held.pending is t
    held.poll()
    assert ledger.current_bytes == 1024  # copy still queued: never waited on, still held
    transfer.out_event.done = True
    held.poll()
    assert ledger.current_bytes == 0 and held.pending is None


def test_prefetch_is_counted_and_unpack_waits_for_it_on_the_compute_stream() -> None:
    ledger = StepLedger()
    transfer = FakeCudaTransfer()
    transfer.out_event.done = True
    t = torch.arange(256, dtype=torch.float32)
    held = _Swapped(t, ledger, transfer, ("dev", 1), 1024)  # type: ignore[arg-type]
    held.prefetch()
    assert ledger.current_bytes == 1024
    out = held.fetch()
    assert transfer.compute.waited == [transfer.in_event]  # a GPU-side wait, no CPU block
    assert torch.equal(out, t)
    del held, out
    assert ledger.current_bytes == 0


def test_prefetch_before_the_swap_out_completed_reuses_the_device_tensor() -> None:
    ledger = StepLedger()
    transfer = FakeCudaTransfer()
    t = torch.ones(8)
    held = _Swapped(t, ledger, transfer, ("dev", 1), 32)  # type: ignore[arg-type]
    assert held.fetch() is t
    assert transfer.compute.waited == []
    del held
    assert ledger.current_bytes == 0
