"""PyTorch's memory API while the pool is its allocator: answered from the pool or refused.

On the CPU build torch has no CUDA, so these tests install the guards around a ``sim`` pool and
make ``torch.cuda`` report an initialized device 0; what they call is torch's own public API.
"""

from __future__ import annotations

from collections.abc import Iterator
import os
import warnings

import pytest
import torch

from waterwave_hpo.memory import StreamAwarePool
from waterwave_hpo.memory._torch_api import install_guards
from waterwave_hpo.memory._torch_api import remove_guards


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[StreamAwarePool]:
    pool = StreamAwarePool(capacity_bytes=1 << 24, backend="sim")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    install_guards(lambda index: pool if index == 0 else None)
    try:
        yield pool
    finally:
        remove_guards()
        torch.backends.cudnn.benchmark = False
        pool.close()


def test_memory_allocated_and_its_peak_come_from_the_pool(pool: StreamAwarePool) -> None:
    p = pool.allocate(1 << 20, stream=1)
    q = pool.allocate(1 << 20, stream=2)
    assert torch.cuda.memory_allocated() == pool.stats().allocated_bytes >= 2 << 20
    pool.free(q, stream=2)
    assert torch.cuda.memory_allocated(0) == pool.stats().allocated_bytes
    assert torch.cuda.max_memory_allocated(0) == pool.stats().peak_allocated_bytes >= 2 << 20
    assert torch.cuda.memory_reserved(0) == pool.stats().reserved_bytes
    stats = torch.cuda.memory_stats(0)
    assert stats["allocated_bytes.all.current"] == pool.stats().allocated_bytes
    assert stats["num_ooms"] == 0
    assert "PyTorch CUDA memory summary" in torch.cuda.memory_summary(0)  # every key it reads
    pool.free(p, stream=1)


def test_a_device_without_a_pool_is_its_own_error(pool: StreamAwarePool) -> None:
    with pytest.raises(RuntimeError, match="No waterwave pool serves device 1"):
        torch.cuda.memory_allocated(1)


def test_reset_peak_memory_stats_warns_once_and_keeps_every_peak(pool: StreamAwarePool) -> None:
    p = pool.allocate(1 << 20, stream=1)
    pool.free(p, stream=1)
    peak = pool.stats().peak_allocated_bytes
    with pytest.warns(UserWarning, match="trial_memory_stats"):
        torch.cuda.reset_peak_memory_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == peak > 0


def test_empty_cache_releases_the_pools_free_segments(pool: StreamAwarePool) -> None:
    p = pool.allocate(1 << 20, stream=1)
    pool.free(p, stream=1)
    pool.sim.finish_all()
    assert pool.stats().reserved_bytes > 0
    torch.cuda.empty_cache()
    assert pool.stats().reserved_bytes == 0


def test_cudnn_benchmark_mode_is_refused_with_a_warning(pool: StreamAwarePool) -> None:
    with pytest.warns(UserWarning, match="cacheInfo"):
        torch.backends.cudnn.benchmark = True
    assert torch.backends.cudnn.benchmark is False


def test_cuda_graph_capture_raises_naming_the_fix(pool: StreamAwarePool) -> None:
    # torch.cuda.graph(...) and torch.compile's CUDA-graph trees call CUDAGraph.capture_begin;
    # the CPU build cannot instantiate a graph, so the unbound method is called.
    with pytest.raises(RuntimeError, match="reduce-overhead"):
        torch.cuda.CUDAGraph.capture_begin(object())  # type: ignore[arg-type]


def test_guards_come_off_cleanly() -> None:
    before = torch.cuda.graphs.CUDAGraph.capture_begin
    install_guards(lambda index: None)
    remove_guards()
    assert torch.cuda.graphs.CUDAGraph.capture_begin is before
    torch.backends.cudnn.benchmark = True
    assert torch.backends.cudnn.benchmark is True
    torch.backends.cudnn.benchmark = False


def test_empty_cache_waits_for_the_running_trials_before_releasing(pool: StreamAwarePool) -> None:
    """cuMemFree synchronises the whole device, so torch.cuda.empty_cache()
    (the OOM retry calls it) releases nothing while trials run on the pool; the release happens
    when the last running trial's account closes."""
    first = pool.open_account("0", streams=(1,))
    second = pool.open_account("1", streams=(2,))
    p = pool.allocate(1 << 20, stream=1)
    pool.free(p, stream=1)
    pool.sim.finish_all()
    reserved = pool.stats().reserved_bytes
    assert reserved > 0
    torch.cuda.empty_cache()  # from inside trial 0, say, beside trial 1
    assert pool.stats().reserved_bytes == reserved
    first.close()
    assert pool.stats().reserved_bytes == reserved  # trial 1 still runs
    second.close()
    assert pool.stats().reserved_bytes == 0


@pytest.mark.parametrize("user_value", [None, "0"])
def test_cudnn_heuristic_mode_b_replaces_benchmark_mode_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch, user_value: str | None
) -> None:
    """Benchmark mode asked and refused under the pool: cuDNN picks plans with its
    heuristic mode B (TORCH_CUDNN_USE_HEURISTIC_MODE_B, read by torch at the first cuDNN
    convolution); a value the user set is kept. Not asked: cuDNN's default, as under
    PyTorch's own allocator."""
    import torch

    from waterwave_hpo.memory._torch_api import HEURISTIC_MODE_B

    if user_value is None:
        monkeypatch.delenv(HEURISTIC_MODE_B, raising=False)
    else:
        monkeypatch.setenv(HEURISTIC_MODE_B, user_value)
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    install_guards(lambda index: None)
    try:
        assert os.environ.get(HEURISTIC_MODE_B) == user_value  # nothing asked, nothing forced
        with pytest.warns(UserWarning, match="benchmark"):
            torch.backends.cudnn.benchmark = True
        assert torch.backends.cudnn.benchmark is False
        assert os.environ[HEURISTIC_MODE_B] == (user_value or "1")
    finally:
        remove_guards()
        torch.backends.cudnn.benchmark = saved
    assert os.environ.get(HEURISTIC_MODE_B) == user_value
