"""A co-hosted study through the executor's CUDA paths on the CPU, under the fake
CUDA topology of ``tests/fakes/cuda_topology.py``: nothing the executor runs may call a
device-wide ``torch.cuda.synchronize`` or PyTorch's per-device stats APIs while the pool is
installed, every backward runs on one shared worker, and each trial's memory is its own pool
account."""

from __future__ import annotations

from collections.abc import Iterator
import threading

from fakes import cuda_topology
import optuna
from optuna.trial import TrialState
import pytest
import torch
from torch import nn

import waterwave_hpo as ww
from waterwave_hpo.host._attrs import ATTR_PEAK_BYTES

MIB = 1 << 20


@pytest.fixture
def topology(monkeypatch: pytest.MonkeyPatch) -> Iterator[cuda_topology.Topology]:
    yield cuda_topology.install(monkeypatch)
    cuda_topology.uninstall()


def test_a_co_hosted_study_on_the_cuda_paths_keeps_the_rules(
    topology: cuda_topology.Topology,
) -> None:
    allocated: dict[int, int] = {}
    lock = threading.Lock()

    def objective(trial: optuna.trial.Trial) -> float:
        ctx = ww.current()
        pool = topology.pools[0]
        nbytes = (trial.number + 1) * MIB
        # What PyTorch would do through the pool for this trial's tensors, on its stream:
        block = pool.allocate(nbytes, stream=ctx.stream)
        stats = ww.trial_memory_stats()
        with lock:
            allocated[trial.number] = stats.peak_allocated_bytes if stats else -1
        torch.manual_seed(trial.number)
        model = ww.pipeline(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2)))
        model = model.to(ctx.device)
        loss = torch.zeros(())
        for _ in range(3):
            loss = model(torch.randn(16, 8).to(ctx.device)).square().mean()
            loss.backward()
        pool.free(block, stream=ctx.stream)
        return float(loss.detach())

    study = optuna.create_study()
    executor = ww.WaterwaveExecutor("cuda:0", 2, record_trial_attrs=True)
    executor.optimize(study, objective, n_trials=4)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert topology.cuda.events[0] == "pool 0"  # installed before CUDA initialised
    assert topology.device_syncs == []  # no device-wide synchronize
    assert topology.stats_calls == []  # no per-device stats API
    # Every backward ran in its trial's thread, none on the shared worker.
    assert (topology.worker.backwards, topology.worker.inline_backwards) == (0, 12)
    for t in study.trials:  # each trial's peak is its own account, not its slot stream's
        assert allocated[t.number] == (t.number + 1) * MIB
        assert t.system_attrs[ATTR_PEAK_BYTES] == (t.number + 1) * MIB


def test_a_trials_backward_runs_in_its_own_thread_with_its_context(
    topology: cuda_topology.Topology,
) -> None:
    """On CUDA autograd runs every backward on one device thread unless the
    calling thread turned multithreading off; then hooks see the trial's thread and its
    ``current()``, and K trials' backwards overlap instead of queueing on one thread."""
    k = 2
    barrier = threading.Barrier(k, timeout=30)  # both trials inside a backward hook at once
    seen: dict[int, tuple[bool, int]] = {}

    def objective(trial: optuna.trial.Trial) -> float:
        trial_thread = threading.current_thread()
        x = torch.randn(4, 8, requires_grad=True)
        y = (x * 2.0).sum()

        def hook(grad: torch.Tensor) -> None:
            barrier.wait()  # on one shared worker this times out: the hooks are serialised
            seen[trial.number] = (
                threading.current_thread() is trial_thread,
                ww.current().trial_number,
            )

        x.register_hook(hook)
        y.backward()
        return 0.0

    study = optuna.create_study()
    ww.WaterwaveExecutor("cuda:0", k).optimize(study, objective, n_trials=k)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * k, [
        t.system_attrs for t in study.trials
    ]
    assert seen == {n: (True, n) for n in range(k)}
    assert topology.worker.backwards == 0


def test_a_slot_that_cannot_get_a_cuda_stream_fails_its_trial_with_the_reason(
    topology: cuda_topology.Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    from waterwave_hpo.host import _streams

    def no_stream(device: torch.device) -> None:
        raise RuntimeError("cuStreamCreate failed with CUresult 2")

    monkeypatch.setattr(_streams, "acquire_stream", no_stream)
    ran: list[int] = []
    study = optuna.create_study()
    executor = ww.WaterwaveExecutor("cuda:0", 1, record_trial_attrs=True)
    with pytest.raises(RuntimeError, match="cuStreamCreate failed"):
        executor.optimize(study, lambda trial: ran.append(trial.number) or 0.0, n_trials=2)
    assert ran == []  # no objective ran without its stream
    assert [t.state for t in study.trials] == [TrialState.FAIL]
    assert "cuStreamCreate failed" in study.trials[0].system_attrs["waterwave:fail_reason"]


def test_a_cuda_out_of_memory_fails_that_trial_alone_and_the_study_goes_on(
    topology: cuda_topology.Topology,
) -> None:
    def objective(trial: optuna.trial.Trial) -> float:
        if trial.number == 0:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return 1.0

    study = optuna.create_study()
    executor = ww.WaterwaveExecutor("cuda:0", 1, record_trial_attrs=True)
    executor.optimize(study, objective, n_trials=2)  # alone on the device: failed, not retried
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.COMPLETE]
    assert "out of device memory" in study.trials[0].system_attrs["waterwave:fail_reason"]
    assert topology.device_syncs == []


def test_the_oom_retry_releases_no_segment_while_a_neighbour_runs(
    topology: cuda_topology.Topology, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OOM path's torch.cuda.empty_cache() would give the pool's free
    segments back to the driver (cuMemFree synchronises the whole device, neighbours included);
    under running trials it is deferred to the last one's end."""
    # torch.cuda.empty_cache() acts only once CUDA is initialised (torch.cuda.memory's own name)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    both = threading.Barrier(2, timeout=60)
    seen: dict[str, int] = {}

    def objective(trial: optuna.trial.Trial) -> float:
        ctx = ww.current()
        pool = topology.pools[0]
        x = trial.suggest_float("x", 0, 1)
        if trial.number < 2:
            both.wait()
        if trial.number == 0:
            pool.free(pool.allocate(4 * MIB, stream=ctx.stream), stream=ctx.stream)
            pool.sim.finish_all()  # the block's last use completed: its segment is releasable
            seen["cached"] = pool.stats().reserved_bytes
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        if trial.number == 1:  # the neighbour, still running when trial 0 is told FAIL
            while study.trials[0].state is not TrialState.FAIL:
                threading.Event().wait(0.01)
            seen["after_retry_path"] = pool.stats().reserved_bytes
        return x

    study = optuna.create_study()
    ww.WaterwaveExecutor("cuda:0", 2, record_trial_attrs=True).optimize(
        study, objective, n_trials=2
    )
    assert [t.state for t in study.trials] == [TrialState.FAIL] + [TrialState.COMPLETE] * 2
    assert seen["cached"] > 0
    assert seen["after_retry_path"] == seen["cached"]  # nothing released under the neighbour
    assert topology.pools[0].stats().reserved_bytes == 0  # released once no trial runs
