"""PyTorch's memory API while the pool is its allocator: given back, or refused clearly.

PyTorch's ``CUDAPluggableAllocator`` (``torch/csrc/cuda/CUDAPluggableAllocator.cpp``, read for
torch 2.9 to 2.15) raises ``"does not yet support getDeviceStats"`` (and ``resetPeakStats``,
``resetAccumulatedStats``, ``cacheInfo``, ``snapshot``); its ``emptyCache`` calls a reset
function the Python class never sets (a no-op); and its ``beginAllocateToPool`` is a no-op, so
memory a CUDA graph captured is not private and a neighbour trial may be handed it. For each:

* ``torch.cuda.memory_stats`` and everything built on it (``memory_allocated``,
  ``max_memory_allocated``, ``memory_reserved``, ``max_memory_reserved``): answered from the
  pool's counters for the device (all co-hosted trials, as PyTorch's figures are per device).
  A trial's own figures: :func:`waterwave_hpo.trial_memory_stats`.
* ``torch.cuda.reset_peak_memory_stats`` / ``reset_accumulated_memory_stats``: a one-time
  warning, nothing reset (resetting the device's peaks would erase co-hosted trials' peaks).
* ``torch.cuda.empty_cache``: releases the pool's wholly free segments, at once when no trial
  runs on the pool, else when the last running trial's account closes
  (:meth:`StreamAwarePool.release_cached_when_idle`): ``cuMemFree`` synchronises the whole
  device, so releasing inside a running study (the OOM retry calls it) would wait for every
  neighbour's stream.
* ``torch.backends.cudnn.benchmark = True``: cuDNN's benchmark mode asks the allocator for
  ``cacheInfo``, so every convolution would fail; a one-time warning and benchmark mode stays
  off. Convolutions then use cuDNN's heuristics: the refusal sets
  ``TORCH_CUDNN_USE_HEURISTIC_MODE_B=1`` (unless the user set it), which torch reads once, at
  the first cuDNN convolution (``ATen/native/ConvUtils.h``, torch 2.9 to 2.15), and which makes
  cuDNN's v8 API pick plans with its heuristic mode B (a per-GPU model, slower to query once
  per shape, then cached) instead of the instant mode: closer to what benchmark mode picks for
  the grouped convolutions of fused trials.
* CUDA graph capture (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``):
  ``RuntimeError`` naming the fix.

All of this goes through ``torch._C`` entry points that ``torch.cuda.memory`` looks up at call
time, so ``from torch.cuda import memory_allocated`` done earlier is covered too.
"""

from __future__ import annotations

from collections.abc import Callable
import os
import threading
from typing import TYPE_CHECKING
from typing import Any
import warnings

if TYPE_CHECKING:
    from waterwave_hpo.memory._pool import StreamAwarePool

#: The pools installed, by device index (read at call time; :mod:`_torch` owns the dict).
PoolLookup = Callable[[int], "StreamAwarePool | None"]

_lock = threading.Lock()
_guarded = False
#: Read by torch at the first cuDNN convolution of the process (ATen/native/ConvUtils.h).
HEURISTIC_MODE_B = "TORCH_CUDNN_USE_HEURISTIC_MODE_B"
_warned: set[str] = set()
_originals: dict[str, Any] = {}
_MISSING = object()
#: The ``torch._C`` entry points replaced while the guards are on.
_PATCHED = (
    "_cuda_memoryStats",
    "_cuda_resetPeakMemoryStats",
    "_cuda_resetAccumulatedMemoryStats",
    "_cuda_emptyCache",
    "_set_cudnn_benchmark",
)

GRAPH_CAPTURE_MESSAGE = (
    "CUDA graph capture (torch.cuda.graph, torch.cuda.make_graphed_callables, "
    "torch.compile(mode='reduce-overhead')) is not supported while waterwave's stream-aware pool "
    "is PyTorch's allocator: PyTorch's pluggable allocator cannot keep a graph's memory private, "
    "so a co-hosted trial could be handed memory the graph replays into. Use "
    "torch.compile(mode='default') or mode='max-autotune-no-cudagraphs', or run without the pool "
    "(WaterwaveExecutor(memory_pool='off'))."
)


def warn_once(key: str, message: str) -> None:
    """Emits ``message`` as a ``UserWarning`` the first time ``key`` is seen in the process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=3)


def _device_index(device: Any) -> int:
    if device is None:
        import torch

        return int(torch.cuda.current_device())
    return int(getattr(device, "index", device) or 0)


def _stat(current: int, peak: int, allocated: int = 0, freed: int = 0) -> dict[str, int]:
    return {"current": current, "peak": peak, "allocated": allocated, "freed": freed}


def nested_memory_stats(pool: StreamAwarePool) -> dict[str, Any]:
    """The pool's counters in the shape of ``torch.cuda.memory_stats_as_nested_dict``.

    Every key ``torch.cuda.memory_summary`` reads is there. From the pool: ``allocated_bytes``,
    ``active_bytes``, ``reserved_bytes``, ``requested_bytes`` (its peak is its current value:
    the pool keeps no requested peak), ``segment``, ``allocation``, ``active`` (each
    ``{all,large_pool,small_pool}.{current,peak,allocated,freed}``; the pool has no small/large
    split, so ``large_pool`` repeats ``all`` and ``small_pool`` is zero), ``num_ooms``,
    ``num_device_alloc`` (segments taken). Zero: the inactive-split and oversize counters,
    retries. Sizes in bytes.
    """
    s = pool.stats()
    zero = _stat(0, 0)

    def pools(stat: dict[str, int]) -> dict[str, dict[str, int]]:
        return {"all": stat, "large_pool": dict(stat), "small_pool": dict(zero)}

    allocations = s.num_allocs - s.num_frees
    return {
        "allocated_bytes": pools(_stat(s.allocated_bytes, s.peak_allocated_bytes)),
        "reserved_bytes": pools(_stat(s.reserved_bytes, s.peak_reserved_bytes)),
        "requested_bytes": pools(_stat(s.requested_bytes, s.requested_bytes)),
        "active_bytes": pools(_stat(s.allocated_bytes, s.peak_allocated_bytes)),
        "segment": pools(_stat(s.num_segments, s.num_segments)),
        "allocation": pools(_stat(allocations, allocations, s.num_allocs, s.num_frees)),
        "active": pools(_stat(allocations, allocations, s.num_allocs, s.num_frees)),
        # The pool coalesces on free; nothing it caches is pinned by a live neighbour block.
        "inactive_split": pools(dict(zero)),
        "inactive_split_bytes": pools(dict(zero)),
        "oversize_allocations": dict(zero),
        "oversize_segments": dict(zero),
        "num_ooms": s.ooms,
        "num_alloc_retries": 0,
        "num_sync_all_streams": 0,
        "num_device_alloc": s.new_segment,
        "num_device_free": 0,
        "max_split_size": -1,
    }


def install_guards(lookup: PoolLookup) -> None:
    """Routes PyTorch's memory API to the pool and refuses what cannot work (idempotent).

    Args:
        lookup: Returns the pool installed for a device index, or ``None``.
    """
    global _guarded
    import torch

    with _lock:
        if _guarded:
            return
        _guarded = True
    c = torch._C

    def memory_stats(device: Any = None) -> dict[str, Any]:
        pool = lookup(_device_index(device))
        if pool is None:
            raise RuntimeError(
                f"No waterwave pool serves device {device}; every device PyTorch allocates on "
                "needs one while the pool is PyTorch's allocator."
            )
        return nested_memory_stats(pool)

    def reset_stats(device: Any = None) -> None:
        warn_once(
            "reset_peak",
            "torch.cuda.reset_peak_memory_stats/reset_accumulated_memory_stats do nothing while "
            "waterwave's pool is PyTorch's allocator (resetting the device's peaks would erase "
            "the co-hosted trials' peaks). Read a trial's own peak with "
            "waterwave_hpo.trial_memory_stats().peak_allocated_bytes.",
        )

    def empty_cache() -> None:
        original = _originals.get("_cuda_emptyCache", _MISSING)
        if original is not _MISSING:
            original()
        for index in range(max(torch.cuda.device_count(), 1)):
            pool = lookup(index)
            if pool is not None:
                pool.release_cached_when_idle()  # no device-wide sync under running trials

    def set_benchmark(flag: bool) -> None:
        setter = _originals["_set_cudnn_benchmark"]
        if flag:
            # Asked for benchmark mode: the closest the pool allows. Not set otherwise, so a
            # study that never asks gets cuDNN's default (instant) heuristics, as under
            # PyTorch's own allocator: forcing mode B on every convolution changed the plans
            # against the baseline the pool is measured with.
            os.environ.setdefault(HEURISTIC_MODE_B, "1")  # the user's own choice wins
            warn_once(
                "cudnn_benchmark",
                "torch.backends.cudnn.benchmark = True is ignored while waterwave's pool is "
                "PyTorch's allocator: cuDNN's benchmark mode asks the allocator for cacheInfo, "
                "which PyTorch's pluggable allocator does not support, and every convolution "
                "would fail. Convolutions run with cuDNN's heuristics instead (mode B: "
                f"{HEURISTIC_MODE_B}={os.environ.get(HEURISTIC_MODE_B, '')}).",
            )
            flag = False
        setter(flag)

    for name in _PATCHED:
        _originals[name] = getattr(c, name, _MISSING)
    _originals[HEURISTIC_MODE_B] = os.environ.get(HEURISTIC_MODE_B)
    c._cuda_memoryStats = memory_stats
    c._cuda_resetPeakMemoryStats = reset_stats
    c._cuda_resetAccumulatedMemoryStats = reset_stats
    c._cuda_emptyCache = empty_cache
    c._set_cudnn_benchmark = set_benchmark  # type: ignore[assignment]  # cudnn.flags()
    prop = vars(type(torch.backends.cudnn)).get("benchmark")
    if prop is not None and hasattr(prop, "setter"):
        prop.setter = set_benchmark  # torch.backends.cudnn.benchmark = ...
    if torch.backends.cudnn.benchmark:
        set_benchmark(True)

    graph_class = torch.cuda.graphs.CUDAGraph
    original_capture_begin = graph_class.capture_begin
    _originals["capture_begin"] = original_capture_begin

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(GRAPH_CAPTURE_MESSAGE)

    graph_class.capture_begin = capture_begin  # type: ignore[method-assign]


def remove_guards() -> None:
    """Restores PyTorch's own entry points (for tests; the pool itself stays installed)."""
    global _guarded
    import torch

    with _lock:
        if not _guarded:
            return
        _guarded = False
        _warned.clear()
    c = torch._C
    for name in _PATCHED:
        original = _originals[name]
        if original is _MISSING:
            delattr(c, name)
        else:
            setattr(c, name, original)
    prop = vars(type(torch.backends.cudnn)).get("benchmark")
    if prop is not None and hasattr(prop, "setter"):
        prop.setter = _originals["_set_cudnn_benchmark"]
    torch.cuda.graphs.CUDAGraph.capture_begin = _originals["capture_begin"]  # type: ignore[method-assign]
    mode_b = _originals.get(HEURISTIC_MODE_B)
    if mode_b is None:
        os.environ.pop(HEURISTIC_MODE_B, None)
    else:
        os.environ[HEURISTIC_MODE_B] = mode_b
    _originals.clear()
