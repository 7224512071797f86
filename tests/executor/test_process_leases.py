"""Memory leases of process isolation's workers (``workers/_lease_service.py``), with the CUDA
fakes: the driver's book splits the device's budget, a worker waits for room, and a held lease
bounds the trial's pool account, PyTorch's memory fraction and CuPy's pool."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from fakes import fake_cupy
from fakes.cuda_init import FakeCuda
import pytest
import torch

from waterwave_hpo.host._memory import _TRIAL_ACCOUNT
from waterwave_hpo.workers._lease_service import LeaseServer
from waterwave_hpo.workers._lease_service import hold_lease

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


def test_a_dead_workers_leases_are_released_at_once_for_the_next_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeCuda().install(monkeypatch)
    server = LeaseServer(CUDA0, 2, budget_bytes=1000)
    call = _call(server)
    for holder in ("pid11-0", "pid12-0"):  # two workers hold the budget (leased()'s names)
        call("lease", "request", (holder, None))
        assert call("lease", "poll", (holder,))[1] is not None
    call("lease", "request", ("pid13-0", None))  # the replacement of worker 11
    assert call("lease", "poll", ("pid13-0",)) == (True, None)  # no room
    server.holder_died(11)  # worker 11 was SIGKILLed: it never releases nor renews
    ok, lease = call("lease", "poll", ("pid13-0",))
    assert ok and lease is not None and lease.nbytes == 500  # not after LEASE_TTL_S
    assert server.book is not None and sorted(server.book.holders()) == ["pid12-0", "pid13-0"]
    server.holder_died(None)  # a worker that never started: nothing to release
    server.holder_died(12)
    assert server.book.holders() == ["pid13-0"]


def test_without_a_budget_each_worker_plans_for_its_lease_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import queue

    import cloudpickle
    import optuna

    from waterwave_hpo.host._device_host import RunSettings
    from waterwave_hpo.host._memory import MemoryPoolMode
    from waterwave_hpo.host._memory import default_budget_bytes
    from waterwave_hpo.host._outcome import OnOOM
    from waterwave_hpo.host._planning import PlanSettings
    from waterwave_hpo.workers import _payload
    from waterwave_hpo.workers._lease_service import CONTEXT_RESERVE_BYTES
    from waterwave_hpo.workers._payload import process_hosts

    FakeCuda(total_memory=8 << 30).install(monkeypatch)
    settings = RunSettings(
        study=optuna.create_study(),
        func=lambda trial: 1.0,
        catch=(),
        on_oom=OnOOM.FAIL,
        max_oom_retries=0,
        gc_after_trial=False,
        outcomes=queue.SimpleQueue(),
    )

    class Handle:  # what process_hosts hands each device's host: its pool and payload
        def __init__(self, pool: Any, settings: Any, payload: bytes, service: Any) -> None:
            self.leases, self.payload = pool.leases, payload

    class Pools:  # the devices' pools, without worker processes (the CUDA here is fake)
        def pool(self, device: Any, n: int, budget: int | None, memory_pool: str) -> Any:
            return SimpleNamespace(device=device, leases=LeaseServer(device, n, budget))

    monkeypatch.setattr(_payload, "ProcessHostHandle", Handle)

    def worker_budgets(budget: int | None) -> list[tuple[int | None, int | None]]:
        hosts = process_hosts(
            Pools(),  # type: ignore[arg-type]
            [CUDA0, torch.device("cuda", 1)],
            4,
            settings,
            memory_pool=MemoryPoolMode.OFF,
            memory_budget_bytes=budget,
            policy="waterwave",
            memory_plan=PlanSettings(),
        )
        budgets = []
        for host in hosts:  # a worker's budget, and the lease its trial would hold
            host.leases.run("request", ("pid1-0", None))
            ok, lease = host.leases.run("poll", ("pid1-0",))
            assert ok
            budgets.append((cloudpickle.loads(host.payload)[0].memory_budget_bytes, lease.nbytes))
        return budgets

    # Not the whole device's budget; and each worker's own CUDA context is left out.
    share = (default_budget_bytes(8 << 30) - 4 * CONTEXT_RESERVE_BYTES) // 4
    assert worker_budgets(None) == [(share, share)] * 2
    assert worker_budgets(4000) == [(1000, 1000)] * 2
