"""LeaseBook: the per-GPU broker's memory leases, without Ray (a fake clock)."""

from __future__ import annotations

import pytest

from waterwave_hpo.memory._internal import LeaseBook
from waterwave_hpo.memory._internal import LeaseStats


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_leases_are_granted_while_they_fit_the_budget() -> None:
    book = LeaseBook(100, trials_per_gpu=None, clock=_Clock())
    for holder in "abc":
        book.request(holder, 40)
    assert book.poll("a") is not None
    assert book.poll("b") is not None
    assert book.poll("c") is None  # 40 + 40 + 40 > 100
    assert book.granted_bytes == 80
    assert book.stats() == LeaseStats(n_held=2, n_waiting=1, granted_bytes=80, budget_bytes=100)
    book.release("a")
    lease = book.poll("c")
    assert lease is not None and lease.nbytes == 40 and lease.budget_bytes == 100


def test_first_come_first_served_a_big_request_is_not_overtaken() -> None:
    book = LeaseBook(100, trials_per_gpu=None, clock=_Clock())
    book.request("a", 60)
    book.request("big", 70)
    book.request("small", 10)
    assert book.poll("a") is not None
    assert book.poll("small") is None  # it would fit, but "big" is ahead of it
    book.release("a")
    assert book.poll("big") is not None
    assert book.poll("small") is not None


def test_a_request_alone_is_granted_even_when_larger_than_the_budget() -> None:
    book = LeaseBook(100, trials_per_gpu=None, clock=_Clock())
    book.request("huge", 500)
    lease = book.poll("huge")
    assert lease is not None and lease.nbytes == 100  # capped at the budget


def test_unrenewed_leases_expire_and_free_their_bytes() -> None:
    clock = _Clock()
    book = LeaseBook(100, trials_per_gpu=None, ttl_s=5.0, clock=clock)
    book.request("dead", 80)
    assert book.poll("dead") is not None
    book.request("next", 80)
    clock.now = 3.0
    assert book.poll("next") is None
    clock.now = 6.0  # "dead" last seen at 0 s, "next" at 3 s
    assert book.poll("next") is not None
    assert book.renew("dead") is None
    assert book.renew("next") == 5.0
    book.configure(100, None, ttl_s=1.0)  # a later run on the same GPU asks for another TTL
    assert book.renew("next") == 1.0  # the holder learns it on its next renewal
    with pytest.raises(KeyError, match="expired"):
        book.poll("dead")


def test_sizes_without_nbytes_from_trials_per_gpu_or_measured_peaks() -> None:
    fixed = LeaseBook(100, trials_per_gpu=4, clock=_Clock())
    fixed.request("a", None)
    lease = fixed.poll("a")
    assert lease is not None and lease.nbytes == 25

    auto = LeaseBook(100, trials_per_gpu=None, clock=_Clock())
    auto.request("first", None)
    first = auto.poll("first")
    assert first is not None and first.nbytes == 100  # nothing measured: runs alone
    auto.request("second", None)
    assert auto.poll("second") is None
    auto.release("first", peak_bytes=30)
    second = auto.poll("second")
    assert second is not None and second.nbytes == 33  # median peak + 10 %


def test_no_budget_grants_everything_at_once() -> None:
    book = LeaseBook(None, trials_per_gpu=None, clock=_Clock())
    for holder in "abcdef":
        book.request(holder, None)
    assert all(book.poll(holder) is not None for holder in "abcdef")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="budget_bytes=0"):
        LeaseBook(0, None)
    with pytest.raises(ValueError, match="trials_per_gpu=0"):
        LeaseBook(10, 0)
    with pytest.raises(ValueError, match="ttl_s=0"):
        LeaseBook(10, None, ttl_s=0)
    with pytest.raises(ValueError, match="nbytes=-1"):
        LeaseBook(10, None).request("a", -1)
