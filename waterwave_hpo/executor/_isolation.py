"""Where the executor runs a device's trials: threads of the driver, or worker processes."""

from __future__ import annotations

import enum

from waterwave_hpo import _checks


class Isolation(str, enum.Enum):
    """How co-hosted trials are kept apart (``WaterwaveExecutor(isolation=...)``).

    ``THREADS``: each slot is a thread of the driver's process (the fast way: one stream-aware
    pool, memory flowing between trials, Waterwave's design); a crash in native code ends the
    whole study, and process-wide state (torch's random generator, ``os.environ``,
    frameworks' globals) is shared. ``PROCESS``: each slot runs its trials in a worker process
    of its own (forked from the executor's zygote, reused, replaced after a crash): a crash
    fails its trial alone, and a seeded trial computes as it would alone; memory is leased per
    worker instead of flowing.
    """

    THREADS = "threads"
    PROCESS = "process"


WORKER_HOST_BYTES = 550 * 2**20
"""Host memory of one worker process (``isolation="process"``): about 545 MiB RSS measured on
torch 2.15 (a 2-core VM, CPU), rounded up. Each slot of each device has one."""


def check_process_slots(
    trials_per_device: int,
    n_devices: int,
    memory_budget_bytes: int | None,
    available_bytes: int | None = None,
) -> None:
    """Refuse process slots that cannot all exist: host memory for the workers, a budget share.

    Args:
        trials_per_device: Slots per device (one worker process each).
        n_devices: Devices.
        memory_budget_bytes: The budget split over a device's slots, or ``None``.
        available_bytes: Host memory available now; ``None``: ``psutil.virtual_memory()``.

    Raises:
        ValueError: The workers would need more host memory than is available now (naming the
            most that fit), or ``memory_budget_bytes`` leaves a slot less than one byte.
    """
    if memory_budget_bytes is not None and memory_budget_bytes // trials_per_device < 1:
        raise _checks.value_error(
            "memory_budget_bytes",
            memory_budget_bytes,
            f"is less than one byte for each of trials_per_device={trials_per_device} worker "
            "processes (each trial's lease and its worker's scheduler get "
            "memory_budget_bytes // trials_per_device)",
            "pass the device memory the trials may use together, in bytes, e.g. "
            f"memory_budget_bytes={trials_per_device * 2**30} for 1 GiB each",
        )
    if available_bytes is None:
        import psutil

        available_bytes = int(psutil.virtual_memory().available)
    workers = trials_per_device * n_devices
    if workers > 1 and workers * WORKER_HOST_BYTES > available_bytes:
        most = max(1, available_bytes // (WORKER_HOST_BYTES * n_devices))
        raise _checks.value_error(
            "trials_per_device",
            trials_per_device,
            f"{workers} worker processes ({n_devices} device(s)) need about "
            f"{_checks.format_bytes(workers * WORKER_HOST_BYTES)} of host memory (a worker is "
            f"about {_checks.format_bytes(WORKER_HOST_BYTES)}), but "
            f"{_checks.format_bytes(available_bytes)} is available now",
            f"pass trials_per_device <= {most}, or isolation='threads' (trials share this "
            "process's memory)",
        )
