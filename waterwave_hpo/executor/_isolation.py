"""Where the executor runs a device's trials: threads of the driver, or worker processes."""

from __future__ import annotations

import enum


class Isolation(str, enum.Enum):
    """How co-hosted trials are kept apart (``WaterwaveExecutor(isolation=...)``).

    ``THREADS``: each slot is a thread of the driver's process (the fast way: one stream-aware
    pool, memory flowing between trials, Waterwave's design); a crash in native code ends the
    whole study, and process-wide state (torch's random generator, ``os.environ``,
    frameworks' globals) is shared. ``PROCESS``: each slot runs its trials in a worker process
    of its own (spawned, reused, replaced after a crash): a crash fails its trial alone, and a
    seeded trial computes as it would alone; memory is leased per trial instead of flowing.
    """

    THREADS = "threads"
    PROCESS = "process"
