"""MemoryLedger: exact accounting against a hard budget."""

from __future__ import annotations

import pytest

from waterwave_hpo.scheduler import MemoryLedger
from waterwave_hpo.scheduler import Phase
from waterwave_hpo.scheduler import Reservation


def test_reserve_release_and_peak() -> None:
    ledger = MemoryLedger(100)
    a = Reservation(1, 0, 0, 60, Phase.FORWARD)
    b = Reservation(2, 1, -1, 40, Phase.RESIDENT)
    ledger.reserve(a)
    ledger.reserve(b)
    assert ledger.used_bytes == 100 and ledger.free_bytes == 0 and ledger.peak_bytes == 100
    assert ledger.held_bytes(1, Phase.RESIDENT) == 40 and ledger.held_bytes(1, Phase.FORWARD) == 0
    assert ledger.release(1) == a
    assert ledger.release(1) is None
    assert ledger.used_bytes == 40 and ledger.peak_bytes == 100
    assert ledger.release_trial(1) == 40
    assert ledger.used_bytes == 0 and ledger.reservations(1) == []


def test_refuses_what_does_not_fit() -> None:
    ledger = MemoryLedger(10)
    ledger.reserve(Reservation(1, 0, 0, 8, Phase.FORWARD))
    with pytest.raises(ValueError, match="does not fit"):
        ledger.reserve(Reservation(2, 0, 1, 3, Phase.FORWARD))
    assert ledger.used_bytes == 8


def test_zero_byte_reservations() -> None:
    ledger = MemoryLedger(10)
    zero = Reservation(1, 0, 0, 0, Phase.FORWARD)
    some = Reservation(2, 0, 1, 4, Phase.FORWARD)
    ledger.reserve(zero)
    ledger.reserve(some)
    assert ledger.release(2) == some
    assert ledger.release(1) == zero
    assert ledger.used_bytes == 0 and ledger.held_bytes(0, Phase.FORWARD) == 0
