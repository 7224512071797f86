"""DeviceMemory: admission by measured demand (trials_per_device="auto"), on a simulated pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from waterwave_hpo.executor import trial_scope
from waterwave_hpo.host._memory import DeviceMemory
from waterwave_hpo.memory import StreamAwarePool

MIB = 1 << 20


def _trial(number: int) -> SimpleNamespace:
    return SimpleNamespace(number=number)


def test_admission_follows_running_peaks_and_the_typical_finished_peak() -> None:
    pool = StreamAwarePool(capacity_bytes=64 * MIB, backend="sim")
    memory = DeviceMemory(torch.device("cpu"), pool=pool, budget_bytes=30 * MIB)

    # Nothing measured yet: only an empty device admits (the first trial measures).
    assert memory.has_room()
    memory.trial_admitted(_trial(0))
    account = memory.open_account(0, 1)  # stream 1
    assert not memory.has_room()
    ptr = pool.allocate(10 * MIB, stream=1)
    pool.free(ptr, stream=1)
    assert memory.close_account(0, account) >= 10 * MIB
    memory.trial_ended(0)

    # Typical peak 10 MiB: two running 10 MiB trials + a third fit in 30 MiB, a fourth not.
    for number, stream in ((1, 2), (2, 3)):
        memory.trial_admitted(_trial(number))
        memory.open_account(number, stream)
    assert memory.has_room()
    memory.trial_admitted(_trial(3))  # admitted, its thread has not opened its account yet
    assert not memory.has_room()
    memory.trial_ended(3)
    assert memory.has_room()

    # A running trial whose measured peak grows past the typical one takes the room.
    ptr = pool.allocate(15 * MIB, stream=2)
    assert not memory.has_room()
    pool.free(ptr, stream=2)


def test_without_a_pool_or_scheduler_nothing_is_measured() -> None:
    memory = DeviceMemory(torch.device("cpu"))
    assert memory.open_account(0, None) is None
    assert memory.close_account(0, None) is None
    assert not memory.has_room()  # the executor then runs trials one at a time


def test_the_default_cuda_budget_leaves_room_outside_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from waterwave_hpo.host._memory import MemoryPoolMode
    from waterwave_hpo.host._memory import make_device_memory

    total = 16 << 30
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total)
    )
    memory = make_device_memory(
        torch.device("cuda:0"), MemoryPoolMode.OFF, None, "fifo", max_trials=2
    )
    # The context and cuBLAS/cuDNN state live outside the pool: 5% of 16 GiB is kept back.
    assert memory.budget_bytes == total - int(total * 0.05)
    assert memory.scheduler is not None and memory.scheduler.budget_bytes == memory.budget_bytes


def test_trial_memory_stats_is_the_running_trials_own_account() -> None:
    import waterwave_hpo as ww

    pool = StreamAwarePool(capacity_bytes=1 << 26, backend="sim")
    memory = DeviceMemory(torch.device("cuda:0"), pool=pool)
    assert ww.trial_memory_stats() is None  # outside a trial
    with trial_scope(None, 3, device="cuda:0"):
        account = memory.open_account(3, 5)
        p = pool.allocate(1 << 20, stream=5)
        q = pool.allocate(1 << 20, stream=6)  # a neighbour's stream: not this trial's
        stats = ww.trial_memory_stats()
        assert stats is not None and stats.allocated_bytes == 1 << 20
        pool.free(p, stream=5)
        pool.free(q, stream=6)
        memory.close_account(3, account)
        assert ww.trial_memory_stats() is None
    pool.close()
