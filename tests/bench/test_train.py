"""A trial's memory in the bench is its own pool account, not its slot stream's running max."""

from __future__ import annotations

import torch

from waterwave_hpo.bench._train import _trial_bytes
from waterwave_hpo.executor import trial_scope
from waterwave_hpo.host._memory import DeviceMemory
from waterwave_hpo.memory import StreamAwarePool

MIB = 1 << 20


def test_a_trials_peak_is_its_account_not_the_slot_streams_history() -> None:
    pool = StreamAwarePool(capacity_bytes=64 * MIB, backend="sim")
    memory = DeviceMemory(torch.device("cuda:0"), pool=pool)
    slot_stream = 7  # one slot's stream, reused by its next trial
    with trial_scope(None, 0, device="cuda:0"):
        account = memory.open_account(0, slot_stream)
        big = pool.allocate(8 * MIB, stream=slot_stream)
        assert _trial_bytes(peak=True) == 8 * MIB
        pool.free(big, stream=slot_stream)
        memory.close_account(0, account)
    with trial_scope(None, 1, device="cuda:0"):
        account = memory.open_account(1, slot_stream)
        small = pool.allocate(1 * MIB, stream=slot_stream)
        assert _trial_bytes() == 1 * MIB
        assert _trial_bytes(peak=True) == 1 * MIB  # not the slot's 8 MiB from trial 0
        pool.free(small, stream=slot_stream)
        memory.close_account(1, account)
        assert _trial_bytes() is None  # the account is closed: nothing to read
    pool.close()
