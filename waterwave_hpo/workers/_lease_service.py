"""Memory leases for the worker processes of one device (process isolation).

Threads of one process share one stream-aware pool, so memory flows between co-hosted trials;
worker processes cannot share it. Their peaks are kept from colliding by leases, as Ray's
packed trials are (``shared_gpu()``): each worker holds a lease of device memory, and its
trials are bounded by it (Waterwave's admission, IEEE TC 2023, Sec. 4, across processes).

An executor's worker processes are a fixed set, one per slot, so a lease never changes: it is
the device's budget split over ``trials_per_device`` (:attr:`DeviceLeases.share_bytes`), set
once per worker when a run begins, and no trial asks the driver for it (no round trip, no renew
thread). On the CPU there is no device memory to share and no lease.

While a trial runs, its process is bounded by the lease: the trial's pool account gets it as
its quota (the worker's ``StreamAwarePool``, which CuPy allocates from when it uses the pool's
allocator); without the pool, PyTorch's per-process memory fraction; and CuPy's own default
pool, when CuPy is installed, gets it as its limit. The quota bounds the bytes the trial's
tensors hold (allocated), not what the worker's pool keeps reserved beside them (segments,
rounded up and cached until the trial ends): a trial of 60 MiB under a 64 MiB lease may hold
more reserved. The worker gives its cached memory back between trials.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import sys
from typing import Any

import torch

from waterwave_hpo import _checks
from waterwave_hpo import _experimental
from waterwave_hpo.host import TRIAL_ACCOUNT as _TRIAL_ACCOUNT
from waterwave_hpo.host import default_budget_bytes
from waterwave_hpo.host import device_total_bytes
from waterwave_hpo.host import is_out_of_memory
from waterwave_hpo.host import mark_never_fits

CONTEXT_RESERVE_BYTES = 512 << 20
"""Device memory each worker holds outside any pool: its CUDA context, cuBLAS and cuDNN handles
(hundreds of MiB per process on recent GPUs); the default lease budget leaves it out per worker.
A ``gpu`` test measures a worker's real context on the GPU at hand against it
(``tests/executor/test_process_cuda_context.py``)."""


class DeviceLeases:
    """The driver's side: how one device's budget is split over its worker processes.

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
        self.budget_bytes: int | None = None
        self.n_slots = n_slots
        if self.enabled:
            if budget_bytes is None:
                # From the driver: torch.cuda here would initialise torch's allocator in the
                # driver process, and a threads study run after this one would lose the pool.
                total = device_total_bytes(device)
                budget_bytes = max(
                    default_budget_bytes(total) - n_slots * CONTEXT_RESERVE_BYTES, total // 4
                )
            self.budget_bytes = budget_bytes

    @property
    def share_bytes(self) -> int | None:
        """A worker's lease (``budget // n_slots`` bytes); ``None`` when there are no leases."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes // self.n_slots


def leased(func: Any, device: torch.device, lease_bytes: int) -> Any:
    """``func`` bounded by the worker's lease of ``lease_bytes`` on ``device`` while it runs.

    No call to the driver: the lease is the worker's for the run. An out-of-memory error
    inside it becomes :func:`over_lease_error` (no re-run can fit), and the worker's cached
    device memory is given back after each call.
    """

    @functools.wraps(func)
    def run(arg: Any) -> Any:
        _experimental.warn_experimental(_experimental.ExperimentalPath.EXECUTOR_CUDA)
        bound_process(device, lease_bytes, _TRIAL_ACCOUNT.get())
        try:
            return func(arg)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            raise over_lease_error(error, lease_bytes, _peak_bytes(device)) from error
        finally:
            with contextlib.suppress(Exception):
                _release_cache(device)

    return run


def _release_cache(device: torch.device) -> None:
    """Give the worker's cached device memory back between trials.

    A lease bounds what a trial allocates; what its worker keeps cached after the trial would
    otherwise stay reserved beside the other workers' trials.
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


def over_lease_error(error: BaseException, lease_bytes: int, peak_bytes: int | None) -> Exception:
    """The out-of-memory error of a trial that needed more than its worker's lease.

    Still PyTorch's out-of-memory type (the executor's classification and ``on_oom`` see an
    OOM), its message naming the lease, the trial's peak and the fix, and marked as one no
    re-run can cure (:func:`~waterwave_hpo.host.mark_never_fits`): the lease is the same
    whatever the trial's neighbours do, so the trial fails at once, never re-run with fewer
    neighbours while other slots wait.
    """
    lease = _checks.format_bytes(lease_bytes)
    peak = "unknown" if peak_bytes is None else _checks.format_bytes(peak_bytes)
    why = (
        f"its worker's lease of {lease} is the most it could ever get (its peak: {peak}): the "
        "lease is the device's budget split over trials_per_device, whatever its neighbours "
        "do; pass a larger memory_budget_bytes or a smaller trials_per_device"
    )
    message = (
        f"the trial needed more device memory than its worker's lease: {why}. "
        f"({type(error).__name__}: {error})"
    )
    oom_type = getattr(torch.cuda, "OutOfMemoryError", MemoryError)
    try:
        made: Exception = oom_type(message)
    except Exception:
        made = MemoryError(message)
    mark_never_fits(made, why)
    return made


def _peak_bytes(device: torch.device) -> int | None:
    with contextlib.suppress(Exception):
        account = _TRIAL_ACCOUNT.get()
        if account is not None and not account.closed:
            return int(account.stats().peak_allocated_bytes)
        return int(torch.cuda.max_memory_allocated(device))
    return None
