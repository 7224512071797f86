"""Memory leases of process isolation's workers (``executor/_process/_leases.py``), with the CUDA
fakes: the driver's book splits the device's budget, a worker waits for room, and a held lease
bounds the trial's pool account, PyTorch's memory fraction and CuPy's pool (issue 28)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from fakes import fake_cupy
from fakes.cuda_init import FakeCuda
import pytest
import torch

from waterwave_hpo.executor._memory import _TRIAL_ACCOUNT
from waterwave_hpo.executor._process._leases import LeaseServer
from waterwave_hpo.executor._process._leases import hold_lease

pytestmark = pytest.mark.filterwarnings("ignore::waterwave_hpo.ExperimentalWarning")
CUDA0 = torch.device("cuda", 0)


class _Account:
    closed = False

    def __init__(self) -> None:
        self.quota: int | None = None

    def set_quota(self, quota_bytes: int | None) -> None:
        self.quota = quota_bytes

    def stats(self) -> Any:
        return SimpleNamespace(peak_allocated_bytes=321)


def _no_real_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, Any]]:
    fractions: list[tuple[float, Any]] = []
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: fractions.append((f, d))
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 777)
    return fractions


def _call(server: LeaseServer) -> Any:
    return lambda target, method, args: server.run(method, args)


def test_on_the_cpu_no_lease_is_taken() -> None:
    server = LeaseServer(torch.device("cpu"), 4, None)
    assert not server.enabled
    ok, error = server.run("request", ("w", None))
    assert not ok and isinstance(error, PermissionError)


def test_leases_split_the_budget_and_a_third_worker_waits_for_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeCuda().install(monkeypatch)
    _no_real_cuda(monkeypatch)
    server = LeaseServer(CUDA0, 2, budget_bytes=1000)
    call = _call(server)
    release_first = threading.Event()
    held: dict[str, int | None] = {}

    def hold(name: str, until: threading.Event) -> None:
        with hold_lease(call, name, CUDA0) as nbytes:
            held[name] = nbytes
            until.wait(timeout=30)

    first = threading.Thread(target=hold, args=("a", release_first))
    first.start()
    while "a" not in held:
        time.sleep(0.01)
    second = threading.Event()
    threading.Thread(target=hold, args=("b", second)).start()
    while "b" not in held:
        time.sleep(0.01)
    assert held == {"a": 500, "b": 500}  # budget // trials_per_device
    third_done = threading.Event()
    third = threading.Thread(target=hold, args=("c", third_done))
    third.start()
    assert server.book is not None
    while server.book.n_waiting == 0:  # its request is in
        time.sleep(0.01)
    time.sleep(0.2)  # a few of its polls
    assert "c" not in held  # the two leases fill the budget: it waits
    release_first.set()
    first.join(timeout=30)
    third_done.set()
    third.join(timeout=30)
    second.set()
    assert held["c"] == 500


def test_a_held_lease_bounds_the_trial_account_and_cupys_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeCuda().install(monkeypatch)
    cupy = fake_cupy.install(monkeypatch)
    server = LeaseServer(CUDA0, 4, budget_bytes=4000)
    account = _Account()
    token = _TRIAL_ACCOUNT.set(account)
    try:
        with hold_lease(_call(server), "w", CUDA0) as nbytes:
            assert nbytes == 1000
            assert account.quota == 1000
            assert cupy.get_default_memory_pool().get_limit() == 1000
            assert server.book is not None and server.book.n_held == 1
    finally:
        _TRIAL_ACCOUNT.reset(token)
    assert server.book.n_held == 0
    assert list(server.book._peaks) == [321]  # released with the account's measured peak


def test_without_the_pool_the_lease_is_pytorchs_memory_fraction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCuda(total_memory=8000).install(monkeypatch)
    fractions = _no_real_cuda(monkeypatch)
    server = LeaseServer(CUDA0, 2, budget_bytes=None)  # the device's total less a reserve
    assert server.book is not None and server.book.budget_bytes is not None
    assert server.book.budget_bytes <= fake.total_memory
    with hold_lease(_call(server), "w", CUDA0) as nbytes:
        assert nbytes == server.book.budget_bytes // 2
    assert fractions == [(nbytes / 8000, CUDA0)]
    assert list(server.book._peaks) == [777]
