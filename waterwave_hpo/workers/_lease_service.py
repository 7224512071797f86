"""Memory leases for the worker processes of one device (process isolation).

Threads of one process share one stream-aware pool, so memory flows between co-hosted trials;
worker processes cannot share it. Their peaks are kept from colliding as Ray's packed trials
are (``shared_gpu()``): each trial holds a lease of device memory from the device's
:class:`~waterwave_hpo.memory._leases.LeaseBook` (first come, first served while the leases fit
the budget; Waterwave's admission, IEEE TC 2023, Sec. 4, across processes). Here the book lives
in the driver, one per CUDA device, and the workers reach it over their pipes; on the CPU there
is no device memory to share and no lease is taken.

While a trial holds its lease, its process is bounded by it: the trial's pool account gets the
lease as its quota (the worker's ``StreamAwarePool``, which CuPy allocates from when it uses the
pool's allocator); without the pool, PyTorch's per-process memory fraction; and CuPy's own
default pool, when CuPy is installed, gets the lease as its limit.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import functools
import importlib
import importlib.util
import sys
import threading
import time
from typing import Any

import torch

from waterwave_hpo import _experimental
from waterwave_hpo.host import TRIAL_ACCOUNT as _TRIAL_ACCOUNT
from waterwave_hpo.host import default_budget_bytes
from waterwave_hpo.host import is_out_of_memory
from waterwave_hpo.memory._internal import LeaseBook

CONTEXT_RESERVE_BYTES = 512 << 20
"""Device memory each worker holds outside any pool: its CUDA context, cuBLAS and cuDNN handles
(hundreds of MiB per process on recent GPUs); the default lease budget leaves it out per worker."""
LEASE_TTL_S = 10.0
"""A lease its worker stops renewing (the worker died) expires after this many seconds."""
_POLL_S = 0.05


class LeaseServer:
    """The driver's side: one device's :class:`LeaseBook`, called from the workers' pipes.

    Args:
        device: The device.
        n_slots: Its workers; a lease is ``budget // n_slots`` bytes.
        budget_bytes: The bytes the leases share (``memory_budget_bytes``); ``None``: on CUDA,
            the device's default budget (its total less the driver's reserve) less
            :data:`CONTEXT_RESERVE_BYTES` per worker (each worker has a context of its own);
            on the CPU, no leases.
    """

    def __init__(self, device: torch.device, n_slots: int, budget_bytes: int | None) -> None:
        self.enabled = device.type == "cuda"
        self.book: LeaseBook | None = None
        if self.enabled:
            if budget_bytes is None:
                total = int(torch.cuda.get_device_properties(device).total_memory)
                budget_bytes = max(
                    default_budget_bytes(total) - n_slots * CONTEXT_RESERVE_BYTES, total // 4
                )
            self.book = LeaseBook(budget_bytes, n_slots, LEASE_TTL_S)
        self._lock = threading.Lock()

    @property
    def share_bytes(self) -> int | None:
        """A worker's lease (``budget // n_slots`` bytes); ``None`` when there are no leases."""
        if self.book is None or self.book.budget_bytes is None or self.book.trials_per_gpu is None:
            return None
        return self.book.budget_bytes // self.book.trials_per_gpu

    def holder_died(self, pid: int | None) -> None:
        """Release every lease and request of worker ``pid`` (it died: it never will).

        Its holders are named ``pid<pid>-<n>`` (:func:`leased`); the next worker's request
        is granted at once instead of after the lease's :data:`LEASE_TTL_S`.
        """
        if self.book is None or pid is None:
            return
        prefix = f"pid{pid}-"
        with self._lock:
            for holder in self.book.holders():
                if holder.startswith(prefix):
                    self.book.release(holder)

    def run(self, method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        """One call of a worker: ``(True, result)`` or ``(False, exception)``. Never raises."""
        if self.book is None or method not in ("request", "poll", "renew", "release"):
            return False, PermissionError(f"No lease call {method!r} on this device.")
        try:
            with self._lock:
                return True, getattr(self.book, method)(*args)
        except Exception as error:
            return False, error


Call = Callable[[str, str, tuple[Any, ...]], tuple[bool, Any]]


def _checked(call: Call, method: str, *args: Any) -> Any:
    ok, payload = call("lease", method, args)
    if not ok:
        raise payload
    return payload


@contextlib.contextmanager
def hold_lease(call: Call, holder: str, device: torch.device) -> Iterator[int | None]:
    """Hold a memory lease of ``device`` for the block, bounding this process by it.

    Waits (first come, first served) until the driver's book grants it; renews it from a
    thread; releases it with the measured peak on the way out.

    Args:
        call: The worker's call to the driver (``PipeLink.call``).
        holder: A name unique to this attempt.
        device: The trial's CUDA device.

    Yields:
        The lease's bytes, or ``None`` when the book has no budget.
    """
    _checked(call, "request", holder, None)
    while (lease := _checked(call, "poll", holder)) is None:
        time.sleep(_POLL_S)
    nbytes: int | None = lease.nbytes
    stop = threading.Event()
    renewer = threading.Thread(
        target=_renew, args=(call, holder, stop), name=f"waterwave-lease-{holder}", daemon=True
    )
    renewer.start()
    peak: int | None = None
    try:
        account = _TRIAL_ACCOUNT.get()
        if nbytes is not None:
            _experimental.warn_experimental(_experimental.ExperimentalPath.EXECUTOR_CUDA)
            bound_process(device, nbytes, account)
        yield nbytes
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            account = _TRIAL_ACCOUNT.get()
            peak = (
                int(account.stats().peak_allocated_bytes)
                if account is not None and not account.closed
                else int(torch.cuda.max_memory_reserved(device))
            )
        with contextlib.suppress(Exception):
            _release_cache(device)
        with contextlib.suppress(Exception):
            _checked(call, "release", holder, peak)


def _release_cache(device: torch.device) -> None:
    """Give the worker's cached device memory back between trials.

    A lease bounds what a trial allocates; what its worker keeps cached after the trial would
    otherwise stay reserved beside the next lease holder's bytes.
    """
    from waterwave_hpo.memory import installed_pool

    pool = installed_pool(device.index if device.index is not None else 0)
    if pool is not None:
        pool.release_cached_when_idle()
    else:
        torch.cuda.empty_cache()


def bound_process(device: torch.device, nbytes: int, account: Any) -> None:
    """Bound this process's device memory by a lease of ``nbytes``.

    With the pool, the trial's account (``account``) gets ``nbytes`` as its quota; without it,
    PyTorch's per-process memory fraction of ``device`` is set to the lease; CuPy's default
    pool, if CuPy is installed, gets it as its limit.
    """
    if account is not None:
        account.set_quota(nbytes)
    else:
        total = int(torch.cuda.get_device_properties(device).total_memory)
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), device)
        torch.cuda.reset_peak_memory_stats(device)
    cupy = _cupy_if_installed()
    if cupy is not None:
        with cupy.cuda.Device(device.index if device.index is not None else 0):
            cupy.get_default_memory_pool().set_limit(size=nbytes)


def _cupy_if_installed() -> Any:
    """CuPy's module if it is imported or installed (a trial may import it after its lease)."""
    if "cupy" in sys.modules:
        return sys.modules["cupy"]
    if importlib.util.find_spec("cupy") is None:
        return None
    try:
        return importlib.import_module("cupy")
    except Exception:  # installed for another CUDA version: the trial cannot use it either
        return None


def _renew(call: Call, holder: str, stop: threading.Event) -> None:
    every_s = LEASE_TTL_S / 4
    while not stop.wait(every_s):
        try:
            ttl_s = _checked(call, "renew", holder)
        except Exception:
            return
        if ttl_s is None:
            return
        every_s = float(ttl_s) / 4


def leased(func: Any, call: Call, device: torch.device, pid: int) -> Any:
    """``func`` that holds a lease of ``device`` while it runs (the objective of worker ``pid``)."""
    counter = iter(range(sys.maxsize))

    @functools.wraps(func)
    def run(arg: Any) -> Any:
        with hold_lease(call, f"pid{pid}-{next(counter)}", device) as nbytes:
            try:
                return func(arg)
            except Exception as error:
                if nbytes is None or not is_out_of_memory(error):
                    raise
                raise over_lease_error(error, nbytes, _peak_bytes(device)) from error

    return run


def over_lease_error(error: BaseException, lease_bytes: int, peak_bytes: int | None) -> Exception:
    """The out-of-memory error of a trial that needed more than its own lease.

    Still PyTorch's out-of-memory type (the executor's classification and ``on_oom`` see an
    OOM), its message naming the lease and the trial's peak. A worker's trials run alone in
    their lease, so no neighbour leaving can help: the trial fails once, never re-run with
    fewer neighbours.
    """
    peak = "unknown" if peak_bytes is None else f"{peak_bytes} bytes"
    message = (
        f"the trial needed more device memory than its worker's lease of {lease_bytes} bytes "
        f"(its peak: {peak}); a re-run cannot help (the lease is the device's budget split "
        "over trials_per_device): raise memory_budget_bytes, lower trials_per_device, or "
        f"shrink the trial. ({type(error).__name__}: {error})"
    )
    oom_type = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    try:
        return oom_type(message)
    except Exception:
        return MemoryError(message)


def _peak_bytes(device: torch.device) -> int | None:
    with contextlib.suppress(Exception):
        account = _TRIAL_ACCOUNT.get()
        if account is not None and not account.closed:
            return int(account.stats().peak_allocated_bytes)
        return int(torch.cuda.max_memory_allocated(device))
    return None
