"""Profiling times a step with CUDA events on the trial's stream, never a device-wide
``torch.cuda.synchronize``, checked on the CPU with fake events."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from waterwave_hpo.nodegroup._profile import Profiler
from waterwave_hpo.nodegroup._profile import StepClock

TRIAL_STREAM = object()
_ticks = itertools.count()


class _FakeEvent:
    """A timing event: each record is 1 ms after the previous one."""

    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.stream: object = None
        self.tick = -1

    def record(self, stream: object = None) -> None:
        self.stream = stream
        self.tick = next(_ticks)

    def synchronize(self) -> None:
        _FakeEvent.waits += 1

    def elapsed_time(self, end: _FakeEvent) -> float:
        return float(end.tick - self.tick)


def test_profiling_marks_the_trials_stream_and_never_waits_for_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[_FakeEvent] = []

    def make_event(enable_timing: bool = False) -> _FakeEvent:
        events.append(_FakeEvent(enable_timing))
        return events[-1]

    def device_wide(device: object = None) -> None:
        raise AssertionError("torch.cuda.synchronize() waits for every co-hosted trial")

    monkeypatch.setattr(torch.cuda, "Event", make_event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: TRIAL_STREAM)
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2)
    )
    profiler = Profiler(model, clock=StepClock(torch.device("cuda:0")))
    profiler.install()
    model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    profiler.remove()
    assert profiler.ready
    atoms = profiler.atoms()
    assert len(atoms) > 1 and all(a.forward_s > 0 for a in atoms)  # from the events, in ms/1e3
    assert sum(profiler.backward_s()) > 0
    assert events and all(e.stream is TRIAL_STREAM for e in events)
    assert _FakeEvent.waits > 0  # durations read by waiting on events, not on the device


def test_on_the_cpu_the_clock_is_host_time() -> None:
    clock = StepClock(torch.device("cpu"))
    a = clock.mark()
    b = clock.mark()
    assert isinstance(a, float) and clock.seconds(a, b) >= 0
