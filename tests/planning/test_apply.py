"""The swap path's stream-and-event logic without a GPU.

The CPU path runs the same ``_Swapped`` code with synchronous copies (``test_fit.py``). The first
tests use a fake transfer that reports an event that has not completed yet; the rest run the
real CUDA transfer on the late-completing fake device of ``tests/fakes/late_cuda.py`` (side-stream
copies land only when the test advances the device; frees are checked against queued copies).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fakes import late_cuda
import pytest
import torch
from torch import nn

import waterwave_hpo as ww
from waterwave_hpo.planning import StepLedger
from waterwave_hpo.planning import memory_ledger
from waterwave_hpo.planning import step_profile_of
from waterwave_hpo.planning._apply import _Swapped
from waterwave_hpo.planning._apply import _Transfer

KIB = 1 << 10


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
    """Copies like a side stream would: the copy is queued, its event completes later; the
    source's release cannot be ordered after the copy (the fallback), so it is held."""

    def __init__(self) -> None:
        self.compute = FakeStream()
        self.out_event = FakeEvent()
        self.in_event = FakeEvent()

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any, Any, Any]:
        return t.clone(), self.out_event, self.compute, t

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


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> late_cuda.FakeGpu:
    return late_cuda.install(monkeypatch)


def _activation(gpu: late_cuda.FakeGpu, n: int = 1024) -> torch.Tensor:
    with gpu.memory():
        return torch.arange(n, dtype=torch.float32)


def test_a_swapped_activation_is_let_go_once_its_copy_is_ordered_not_once_seen_landed(
    gpu: late_cuda.FakeGpu,
) -> None:
    """The host runs ahead of the GPU, so an activation held until its
    copy's event is *seen* complete is held through the forward and the swap saves nothing."""
    t = _activation(gpu)
    expected = t.clone()
    ledger = StepLedger()
    held = _Swapped(t, ledger, _Transfer(), ("device", "cuda:0", 1), 4 * KIB)
    del t
    assert not held.out_event.query()  # the copy has not landed: the host ran ahead
    assert gpu.allocated_bytes == 0  # let go at once...
    assert gpu.held_bytes == 4 * KIB  # ...its memory held by the allocator for the copy
    assert ledger.current_bytes == 0
    gpu.advance()
    assert (gpu.held_bytes, gpu.hazards) == (0, [])
    assert torch.equal(held.host, expected)
    assert torch.equal(held.fetch(), expected)  # back on the device, waited for on the GPU


def test_a_prefetched_buffer_dropped_before_its_unpack_is_released_after_its_copy(
    gpu: late_cuda.FakeGpu,
) -> None:
    """Backward raised after the swap-in was issued, before the unpack
    made the compute stream wait for it; the buffer is freed while the side stream writes."""
    ledger = StepLedger()
    held = _Swapped(_activation(gpu), ledger, _Transfer(), ("device", "cuda:0", 1), 4 * KIB)
    gpu.advance()  # the swap-out landed
    held.poll()
    held.prefetch()  # the swap-in is queued on the side stream, not landed
    assert gpu.allocated_bytes == 4 * KIB and not held.in_event.query()
    del held  # backward raised: autograd drops the saved tensors
    assert gpu.hazards == []
    assert gpu.held_bytes == 4 * KIB  # held for the copy, not handed to a neighbour
    gpu.advance()
    assert (gpu.allocated_bytes, gpu.held_bytes, ledger.current_bytes) == (0, 0, 0)


@pytest.mark.parametrize("route", ["record_stream", "pool", "no pool"])
def test_every_allocator_route_orders_the_swap_buffers_release_after_their_copies(
    gpu: late_cuda.FakeGpu, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """PyTorch's allocator (``Tensor.record_stream``); the waterwave pool behind a shim without
    the record_stream hook (``pool.record_stream``, as ``Tensor.record_stream`` is dropped
    there); and no pool to tell: the activation is then held until its copy is seen landed,
    and the compute stream waits for the swap-in on the GPU before anything can free it."""
    pool = late_cuda.FakePool(gpu)
    if route != "record_stream":
        info = dataclasses.replace(ww.memory.allocator_info(), swapped=True, record_stream=False)
        monkeypatch.setattr(ww.memory, "allocator_info", lambda: info)
        monkeypatch.setattr(
            ww.memory, "device_pool", lambda device=0: pool if route == "pool" else None
        )
    ledger = StepLedger()
    held = _Swapped(_activation(gpu), ledger, _Transfer(), ("device", "cuda:0", 1), 4 * KIB)
    held_until_landed = route == "no pool"
    assert gpu.allocated_bytes == (4 * KIB if held_until_landed else 0)
    gpu.advance()
    held.poll()
    assert gpu.allocated_bytes == 0
    held.prefetch()
    del held  # backward raised before the unpack
    gpu.advance()
    assert gpu.hazards == []
    assert (gpu.allocated_bytes, gpu.held_bytes, ledger.current_bytes) == (0, 0, 0)
    assert len(pool.recorded) == (2 if route == "pool" else 0)
    assert gpu.record_stream_calls == (2 if route == "record_stream" else 0)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)
    )


def test_a_swap_plan_keeps_its_predicted_peak_when_copies_land_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Planned peak vs measured: with every copy still queued when the
    host reaches the next pack, a swap-everything plan stays within its predicted peak, and
    trains as the bare model does (each swap-in waited for on the compute stream)."""
    x = torch.randn(32, 64)
    bare = _mlp()
    bare(x).square().mean().backward()
    model = _mlp()
    # Profile and plan on the plain CPU, then run on the fake device.
    ww.fit_memory(model, 1 << 40, example_input=x, planner="swap_all")
    gpu = late_cuda.install(monkeypatch)
    plan = ww.plan_of(model)
    ledger = memory_ledger(model)
    ledger.reset_peak()
    with gpu.memory():
        xd = x.clone()
        loss = model(xd).square().mean()
        forward_peak = ledger.peak_bytes
        assert gpu.side_streams and not all(s.query() for s in gpu.side_streams)  # still queued
        loss.backward()
    assert forward_peak + step_profile_of(model).static_bytes <= plan.predicted_peak_bytes
    gpu.advance()
    assert gpu.hazards == []
    for (name, p), q in zip(model.named_parameters(), bare.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class _OutOfMemoryInBackward(torch.autograd.Function):
    """Identity forward; when armed, its backward runs out of memory (expected here)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, armed: bool) -> torch.Tensor:
        ctx.armed = armed
        return x.clone()  # a new tensor: what comes after saves it, not the input

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.armed:
            raise torch.cuda.OutOfMemoryError("fake: out of memory in backward")
        return grad, None


class _Raises(nn.Module):
    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OutOfMemoryInBackward.apply(x, self.armed)  # type: ignore[no-any-return]


def test_backward_that_runs_out_of_memory_frees_swap_in_buffers_after_their_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a real step: the GPU catches up in mid-forward (the early
    swap-outs land), backward starts the swap-ins and raises before unpacking them; every
    swap-in buffer is freed only after its copy, none is handed out while being written."""
    torch.manual_seed(0)
    raises = _Raises()
    model = nn.Sequential(
        nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), raises, nn.Linear(256, 4)
    )
    x = torch.randn(32, 64)
    ww.fit_memory(model, 1 << 40, example_input=x, planner="swap_all")
    raises.armed = True
    gpu = late_cuda.install(monkeypatch)
    raises.register_forward_hook(lambda *_: gpu.advance())  # the GPU caught up here
    with gpu.memory():
        loss = model(x.clone()).square().mean()
        with pytest.raises(torch.cuda.OutOfMemoryError):
            loss.backward()
        assert any(not s.query() for s in gpu.side_streams)  # swap-ins still queued
        del loss  # the failed step's graph and its saved tensors go
    assert gpu.hazards == []
    gpu.advance()
    assert (gpu.held_bytes, memory_ledger(model).current_bytes) == (0, 0)
