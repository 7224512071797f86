"""The pool under PyTorch's caching allocator, one trial stream at a time, after CUDA started.

PyTorch swaps its process-wide allocator only before CUDA initialises, and a user's script
usually touches CUDA first: data or a model moved to the GPU, a Hugging Face ``Trainer`` whose
``__init__`` moved the ``model_init`` model, a device property read by a process-isolation
driver, an earlier study in the same notebook. From then on :func:`use_pool` is refused. What
still works (read in ``torch/cuda/memory.py`` and ``torch/csrc/cuda/Module.cpp`` of torch 2.15;
the same entry points exist since torch 2.1 for CUDA graphs):

* ``torch.cuda.MemPool(allocator)``: a private pool of PyTorch's caching allocator whose
  segments come from a pluggable allocator (here the pool's torch shim);
* ``torch._C._cuda_beginAllocateCurrentStreamToPool(device, pool_id)``: every allocation made
  on the current stream, from any thread, goes to that private pool until
  ``_cuda_endAllocateToPool`` (``_cuda_endAllocateCurrentStreamToPool`` before torch 2.6).
  Routing by stream, not by thread, matters: autograd runs a CUDA backward on its own device
  thread, which ``torch.cuda.use_mem_pool`` (thread-local) would leave on the default pool.

A trial then gets one private pool routed from its stream (:class:`StreamRoute`). What that
keeps and loses, against the pool as PyTorch's process-wide allocator (:func:`use_pool`):

* kept: PyTorch's own block-level caching (its cost per allocation), ``memory_stats``,
  snapshots, ``record_stream``, cuDNN's benchmark mode (its ``cacheInfo``); the trial's pool
  account sees the segments (reserved bytes), its quota and the pool's capacity hold;
* lost: memory flows between running trials at segment granularity only: a trial's cached
  blocks return to the pool when its private pool is released (the trial's end) or emptied,
  not while a neighbour's backward frees what this trial's forward needs (Waterwave's
  block-level flow);
* changed: while any stream is routed, PyTorch's caching allocator processes no
  ``record_stream`` events (it treats routing like a graph capture): blocks a side stream
  used are recycled only once routing ends.
"""

from __future__ import annotations

import threading
from typing import Any

from waterwave_hpo.memory._lib import library_path
from waterwave_hpo.memory._lib import load_library
from waterwave_hpo.memory._pool import StreamAwarePool
from waterwave_hpo.memory._shim import SHIM_FREE
from waterwave_hpo.memory._shim import SHIM_MALLOC
from waterwave_hpo.memory._shim import shim_for_pool

_lock = threading.Lock()
_routed: dict[int, tuple[StreamAwarePool, Any]] = {}  # device -> (pool, pluggable allocator)

#: The ``torch._C`` entry points a stream route needs; the end has two names across versions.
_BEGIN = "_cuda_beginAllocateCurrentStreamToPool"
_ENDS = ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")
_RELEASE = "_cuda_releasePool"


def stream_routing_unavailable() -> str | None:
    """Why this torch cannot route a stream's allocations to a private pool; None if it can."""
    import torch

    missing = [
        name
        for name, present in (
            ("torch.cuda.MemPool", hasattr(torch.cuda, "MemPool")),
            (f"torch._C.{_BEGIN}", hasattr(torch._C, _BEGIN)),
            (f"torch._C.{_ENDS[0]}", any(hasattr(torch._C, n) for n in _ENDS)),
            (f"torch._C.{_RELEASE}", hasattr(torch._C, _RELEASE)),
        )
        if not present
    ]
    if missing:
        return f"torch {torch.__version__} has no {', '.join(missing)}"
    return None


def routed_pool(device: int = 0) -> StreamAwarePool | None:
    """The pool :func:`enable_stream_routing` set up for ``device``, or None."""
    with _lock:
        entry = _routed.get(device)
    return None if entry is None else entry[0]


def enable_stream_routing(pool: StreamAwarePool) -> None:
    """Lets :class:`StreamRoute` put ``pool`` under trial streams of ``pool.device``.

    The pool then serves the segments of PyTorch's private pools (one per routed stream)
    through its torch shim (or the pool library's plain entry points, see :func:`use_pool`);
    PyTorch's own allocator stays the process's. The pool stays alive for the process.

    Raises:
        RuntimeError: This torch lacks the entry points (:func:`stream_routing_unavailable`
            says which), or another pool is routed on the device.
    """
    import torch

    from waterwave_hpo import _experimental

    reason = stream_routing_unavailable()
    if reason is not None:
        raise RuntimeError(f"cannot route trial streams to the stream-aware pool: {reason}")
    with _lock:
        current = _routed.get(pool.device)
        if current is not None:
            if current[0] is pool:
                return
            raise RuntimeError(
                f"Another pool ({current[0]!r}) is already routed on device {pool.device}; a "
                "process has one pool per device."
            )
        _experimental.warn_experimental(_experimental.ExperimentalPath.POOL_ROUTED)
        shim, _ = shim_for_pool(required=False)
        path, malloc, free = (
            (str(shim.path), SHIM_MALLOC, SHIM_FREE)
            if shim is not None
            else (str(library_path()), "waterwave_torch_malloc", "waterwave_torch_free")
        )
        allocator = torch.cuda.memory.CUDAPluggableAllocator(path, malloc, free)
        load_library().ww_torch_set_pool(pool.device, pool._handle())
        pool._pinned = True  # PyTorch's private pools may free into it until the process ends
        _routed[pool.device] = (pool, allocator)


class StreamRoute:
    """One trial stream's allocations, from any thread, in a private pool backed by the pool.

    Args:
        device: The CUDA device index; :func:`enable_stream_routing` was called for it.
        stream: The trial's stream (a ``torch.cuda.Stream``).

    Raises:
        RuntimeError: No pool is routed on ``device``.
    """

    def __init__(self, device: int, stream: Any) -> None:
        import torch

        with _lock:
            entry = _routed.get(device)
        if entry is None:
            raise RuntimeError(
                f"device {device} has no routed stream-aware pool; call enable_stream_routing"
            )
        self.device = device
        self.stream = stream
        self.mem_pool: Any = torch.cuda.MemPool(entry[1].allocator())
        with torch.cuda.stream(stream):
            getattr(torch._C, _BEGIN)(device, self.mem_pool.id)
        self._open = True

    def close(self) -> None:
        """Ends the routing and releases the private pool. Idempotent.

        Its free segments go back to the pool once PyTorch empties it; live tensors keep theirs.
        """
        import torch

        if not self._open:
            return
        self._open = False
        end = next(getattr(torch._C, n) for n in _ENDS if hasattr(torch._C, n))
        end(self.device, self.mem_pool.id)
        getattr(torch._C, _RELEASE)(self.device, self.mem_pool.id)
        self.mem_pool = None
