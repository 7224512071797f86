"""Memory leases of process isolation's workers (``workers/_lease_service.py``), with the CUDA
fakes: the device's budget is split over the workers once, a worker's lease bounds each of its
trials (the trial's pool account, PyTorch's memory fraction, CuPy's pool) without a call to the
driver, and a trial over its lease fails at once, never re-run with fewer neighbours."""

from __future__ import annotations

from collections.abc import Iterator
import inspect
from types import SimpleNamespace
from typing import Any

from fakes import fake_cupy
from fakes.cuda_init import FakeCuda
import optuna
import pytest
import torch

from waterwave_hpo.host._memory import _TRIAL_ACCOUNT
from waterwave_hpo.workers._lease_service import DeviceLeases
from waterwave_hpo.workers._lease_service import leased

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


@pytest.fixture(autouse=True)
def _no_trial_account() -> Iterator[None]:
    """Each test starts as a worker's trial thread without the pool: no account in its context
    (an earlier test of this process may have left one in the context variable)."""
    token = _TRIAL_ACCOUNT.set(None)
    yield
    _TRIAL_ACCOUNT.reset(token)


def _no_real_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, Any]]:
    fractions: list[tuple[float, Any]] = []
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: fractions.append((f, d))
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 900)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return fractions


def test_on_the_cpu_no_lease_is_taken() -> None:
    leases = DeviceLeases(torch.device("cpu"), 4, None)
    assert not leases.enabled
    assert leases.share_bytes is None


def test_the_budget_is_split_over_the_workers_once(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda().install(monkeypatch)
    assert DeviceLeases(CUDA0, 2, budget_bytes=1000).share_bytes == 500
    assert DeviceLeases(CUDA0, 3, budget_bytes=1000).share_bytes == 333
    # A lease is the worker's, not asked per trial: the bound takes no transport to the driver.
    assert "call" not in inspect.signature(leased).parameters


def test_a_lease_bounds_each_trial_account_and_cupys_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeCuda().install(monkeypatch)
    _no_real_cuda(monkeypatch)
    cupy = fake_cupy.install(monkeypatch)
    seen: list[tuple[int | None, int]] = []

    def objective(trial: object) -> float:
        seen.append((account.quota, cupy.get_default_memory_pool().get_limit()))
        return 1.0

    run = leased(objective, CUDA0, 1000)
    for _ in range(2):  # each trial has an account of its own: each gets the quota
        account = _Account()
        token = _TRIAL_ACCOUNT.set(account)
        try:
            assert run(None) == 1.0
        finally:
            _TRIAL_ACCOUNT.reset(token)
    assert seen == [(1000, 1000), (1000, 1000)]


def test_the_default_budget_leaves_torchs_cuda_uninitialised_for_a_later_threads_study(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from waterwave_hpo import memory
    from waterwave_hpo.host._memory import default_budget_bytes
    from waterwave_hpo.workers._lease_service import CONTEXT_RESERVE_BYTES

    total = 8 << 30
    fake = FakeCuda(total_memory=total).install(monkeypatch)
    leases = DeviceLeases(CUDA0, 2, budget_bytes=None)
    assert leases.budget_bytes == default_budget_bytes(total) - 2 * CONTEXT_RESERVE_BYTES
    # The device's size came from the driver, not torch.cuda: torch's allocator is untouched,
    # so a threads study later in this process (a notebook) still installs the pool.
    assert fake.events == []
    memory.use_pool(memory.StreamAwarePool(device=0))
    assert fake.events == ["pool 0"]


def test_without_the_pool_the_lease_is_pytorchs_memory_fraction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCuda(total_memory=8000).install(monkeypatch)
    fractions = _no_real_cuda(monkeypatch)
    leases = DeviceLeases(CUDA0, 2, budget_bytes=None)  # the device's total less a reserve
    assert leases.budget_bytes is not None and leases.budget_bytes <= fake.total_memory
    share = leases.share_bytes
    assert share is not None
    leased(lambda trial: 0.0, CUDA0, share)(None)
    assert fractions == [(share / 8000, CUDA0)]


def test_a_trial_over_its_lease_fails_at_once_naming_the_lease_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from waterwave_hpo.host import OnOOM
    from waterwave_hpo.host import OutcomeKind
    from waterwave_hpo.host import TrialJob
    from waterwave_hpo.host import is_out_of_memory
    from waterwave_hpo.host._attempt import cannot_fit
    from waterwave_hpo.host._attempt import classify

    FakeCuda().install(monkeypatch)
    _no_real_cuda(monkeypatch)

    def greedy(trial: object) -> float:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")

    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        leased(greedy, CUDA0, 64 << 20)(None)
    error = raised.value
    assert is_out_of_memory(error)  # still an OOM for on_oom
    assert "lease of 64.0 MiB" in str(error)
    assert "peak: 900" in str(error)
    assert "a larger memory_budget_bytes or a smaller trials_per_device" in str(error)
    # Its neighbours do not change its lease: never re-run "with fewer neighbours", however
    # many ran beside it, while the other slots would be held idle for the re-run.
    context = SimpleNamespace(batch=(), planning=None)
    memory = SimpleNamespace(budget_bytes=None, pool=None)
    reason = cannot_fit(error, None, context, memory)  # type: ignore[arg-type]
    assert reason is not None and "lease of 64.0 MiB" in reason
    settings = SimpleNamespace(on_oom=OnOOM.RETRY, max_oom_retries=2, catch=())
    job = TrialJob(optuna.trial.FixedTrial({}), 0, None, None)  # type: ignore[arg-type]
    kind = classify(settings, job, error, 3, True, cannot_fit=reason)  # type: ignore[arg-type]
    assert kind is OutcomeKind.OOM_FAILED


def test_a_plain_oom_beside_neighbours_is_still_re_run() -> None:
    from waterwave_hpo.host import OnOOM
    from waterwave_hpo.host import OutcomeKind
    from waterwave_hpo.host import TrialJob
    from waterwave_hpo.host._attempt import cannot_fit
    from waterwave_hpo.host._attempt import classify

    error = torch.cuda.OutOfMemoryError("CUDA out of memory.")
    context = SimpleNamespace(batch=(), planning=None)
    memory = SimpleNamespace(budget_bytes=None, pool=None)
    assert cannot_fit(error, None, context, memory) is None  # type: ignore[arg-type]
    settings = SimpleNamespace(on_oom=OnOOM.RETRY, max_oom_retries=2, catch=())
    job = TrialJob(optuna.trial.FixedTrial({}), 0, None, None)  # type: ignore[arg-type]
    assert classify(settings, job, error, 3, True) is OutcomeKind.OOM_RETRY  # type: ignore[arg-type]


def test_without_a_budget_each_worker_plans_for_its_lease_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import queue

    import cloudpickle

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
            return SimpleNamespace(device=device, leases=DeviceLeases(device, n, budget))

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
        # A worker's budget (its lease: the worker bounds its trials by it), and its share.
        return [
            (cloudpickle.loads(host.payload)[0].memory_budget_bytes, host.leases.share_bytes)
            for host in hosts
        ]

    # Not the whole device's budget; and each worker's own CUDA context is left out.
    share = (default_budget_bytes(8 << 30) - 4 * CONTEXT_RESERVE_BYTES) // 4
    assert worker_budgets(None) == [(share, share)] * 2
    assert worker_budgets(4000) == [(1000, 1000)] * 2
