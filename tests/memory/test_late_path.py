"""The late path: the user's script touched CUDA before the executor set the device up.

PyTorch swaps its allocator only before CUDA initialises; once it has (data or a model moved to
the GPU, a Hugging Face ``Trainer``'s ``__init__``, a device property read, an earlier study in
the same notebook), the executor runs the trials on PyTorch's own caching allocator and says
once, plainly, what that loses. Here CUDA is the fake topology of ``fakes.cuda_topology`` (a
study runs its CUDA branches on the CPU), and PyTorch's private pools are the fake of
``fakes.torch_private_pools``, which keeps the caching allocator's bookkeeping (use counts,
``captures_underway``, ``~MemPool`` -> ``emptyCache``) and records every ``std::terminate`` the
real allocator would raise: a design that routed each trial's stream to a private
``torch.cuda.MemPool`` aborted the process when the first of two co-hosted trials ended.
"""

from __future__ import annotations

from collections.abc import Iterator
import threading
import time
from typing import Any
import warnings

from fakes import cuda_topology
from fakes.torch_private_pools import FakePrivatePools
from fakes.torch_private_pools import TorchInternalAssert
import optuna
from optuna.trial import TrialState
import pytest
import torch

import waterwave_hpo as ww
from waterwave_hpo import _experimental
from waterwave_hpo.host._memory import MemoryPoolMode
from waterwave_hpo.host._memory import make_device_memory

# What the user's script did before the executor set the device up; each initialises CUDA.
LATE_STARTS = {
    "data moved to the GPU first": lambda: torch.cuda._lazy_init(),
    "a Hugging Face Trainer moved the model_init model": lambda: torch.cuda.set_device(0),
    "a process-isolation driver read the device's properties": (
        lambda: torch.cuda.get_device_properties(0)
    ),
    "a notebook ran a process study, then a threads study": lambda: torch.cuda.mem_get_info(0),
}


@pytest.fixture
def late(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[cuda_topology.Topology, Any]]:
    topology = cuda_topology.install(monkeypatch)
    pools = FakePrivatePools().install(monkeypatch)
    yield topology, pools
    cuda_topology.uninstall()


# -- the fake keeps PyTorch's invariants (so the study test below can fail) ----------------------


def test_the_fake_accepts_pytorchs_own_pattern_of_one_routed_pool(late: Any) -> None:
    _, pools = late
    # torch.cuda.use_mem_pool's pattern: begin, end, release; then the MemPool is dropped.
    pool = pools.MemPool()
    torch._C._cuda_beginAllocateCurrentStreamToPool(0, pool.id)
    assert pool.use_count() == 2
    torch._C._cuda_endAllocateToPool(0, pool.id)
    torch._C._cuda_releasePool(0, pool.id)
    del pool
    assert pools.terminations == [] and pools.captures_underway == {}
    torch.cuda.empty_cache()  # nothing routed: PyTorch's recovery may run


def test_the_fake_aborts_where_pytorch_aborts(late: Any) -> None:
    _, pools = late
    # Two trial streams, each routed to its own private pool; the first trial ends.
    first, second = pools.MemPool(), pools.MemPool()
    torch._C._cuda_beginAllocateCurrentStreamToPool(0, first.id)
    torch._C._cuda_beginAllocateCurrentStreamToPool(0, second.id)
    torch._C._cuda_endAllocateToPool(0, first.id)
    torch._C._cuda_releasePool(0, first.id)
    with pytest.raises(TorchInternalAssert, match="captures_underway"):
        torch.cuda.empty_cache()  # the caching allocator's OOM recovery cannot run either
    del first  # ~MemPool -> emptyCache(id) while the second pool is routed
    assert len(pools.terminations) == 1 and "std::terminate" in pools.terminations[0]
    with pytest.raises(TorchInternalAssert, match="already recording"):
        torch._C._cuda_beginAllocateCurrentStreamToPool(0, second.id)
    with pytest.raises(TorchInternalAssert, match="not currently recording"):
        torch._C._cuda_endAllocateToPool(0, (0, 99))


# -- the late path through the executor ------------------------------------------------------------


def _overlapping_objective(study: optuna.Study) -> Any:
    """Trial 0 ends while trial 1 still runs: what made a routed design abort at K=2."""
    both = threading.Barrier(2, timeout=60)

    def objective(trial: optuna.trial.Trial) -> float:
        device = ww.current().device
        x = torch.ones(4, 4).to(device)
        if trial.number < 2:
            both.wait()
        if trial.number == 1:  # hold on until trial 0 was told, i.e. its memory is closed
            deadline = time.monotonic() + 60
            while study.trials[0].state is TrialState.RUNNING:
                assert time.monotonic() < deadline, "trial 0 never ended"
                time.sleep(0.01)
        return float(x.sum())

    return objective


@pytest.mark.parametrize("start", list(LATE_STARTS), ids=list(LATE_STARTS))
def test_a_co_hosted_study_after_cuda_was_touched_first_completes_without_an_abort(
    late: Any, start: str
) -> None:
    topology, pools = late
    LATE_STARTS[start]()
    assert topology.cuda.events == ["cuda init"]
    study = optuna.create_study()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ww.WaterwaveExecutor("cuda:0", 2).optimize(study, _overlapping_objective(study), n_trials=4)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert pools.terminations == []  # the process would have aborted
    assert topology.cuda.pools == {}  # PyTorch's allocator could not be swapped, and was not
    late_warnings = [
        str(w.message) for w in caught if "PyTorch's own CUDA allocator" in str(w.message)
    ]
    assert len(late_warnings) == 1, late_warnings
    message = late_warnings[0]
    assert "initialised CUDA in this process before the executor" in message  # the cause
    assert "allocation fails" in message  # what is lost, said plainly
    assert "before the script's first CUDA call" in message  # the fix
    assert "memory_pool='off'" in message  # how to silence it


def test_memory_pool_on_refuses_the_late_path_with_the_cause_and_the_fix(late: Any) -> None:
    torch.cuda._lazy_init()
    with pytest.raises(RuntimeError, match=r"memory_pool='on'.*before the script's first CUDA"):
        make_device_memory(torch.device("cuda", 0), MemoryPoolMode.ON, None, "fifo", max_trials=2)


def test_memory_pool_off_runs_the_late_path_without_a_word(
    late: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, pools = late
    torch.cuda._lazy_init()
    # The CUDA path's ExperimentalWarning comes once per process: forget whether an earlier test
    # in this worker had it, so the test sees the same warnings whatever ran before it.
    monkeypatch.setattr(_experimental, "_warned", set())
    study = optuna.create_study()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ww.WaterwaveExecutor("cuda:0", 2, memory_pool="off").optimize(
            study, _overlapping_objective(study), n_trials=2
        )
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    assert pools.terminations == []
    # Nothing about the late path or the pool: only the CUDA path's one experimental notice.
    assert [(w.category, str(w.message).split(" is experimental")[0]) for w in caught] == [
        (_experimental.ExperimentalWarning, _experimental.ExperimentalPath.EXECUTOR_CUDA.value)
    ]


def test_before_cuda_starts_the_pool_still_replaces_pytorchs_allocator(late: Any) -> None:
    topology, pools = late
    memory = make_device_memory(
        torch.device("cuda", 0), MemoryPoolMode.AUTO, None, "fifo", max_trials=2
    )
    assert topology.cuda.events[0] == "pool 0" and memory.pool is topology.cuda.pools[0]
    assert pools.calls == []  # no private pool of PyTorch's was made
