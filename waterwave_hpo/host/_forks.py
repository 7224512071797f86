"""A trial that forks while other trials run in threads of its process: said once, with the fix.

``fork()`` copies only the calling thread; every lock another thread held at that moment stays
locked in the child for ever. With trials co-hosted as threads, a trial's ``DataLoader(
num_workers=2)`` forks its workers while its neighbours hold torch's random generator's lock
(``torch.manual_seed``, a dropout), the allocator's, or a logger's; a worker that needs that lock
blocks, and the trial with it (seen with Optuna's own ``n_jobs=4`` as with the executor's threads).
Python itself says so only from 3.12, as a ``DeprecationWarning`` that is hidden by default.

The fast fix is ``isolation="process"``: each trial has its process to itself and its
DataLoader workers fork from it, at fork's speed (the DataLoader's seconds of a 2-epoch trial:
1.60 in a worker process against 1.93 with threads, ``experiments/results/2026-11-27-process-
semantics/``). ``DataLoader(..., multiprocessing_context="forkserver")`` (or ``"spawn"``) also
avoids the hang, but then each DataLoader worker is a new process that imports torch and
unpickles the dataset, every epoch unless ``persistent_workers=True`` (``spawn``: 119.8 s in the
same run), and the dataset and its class must be importable, not defined in the script.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import logging
import os
import threading

_logger = logging.getLogger("waterwave_hpo")
_lock = threading.Lock()
_running: dict[int, int] = {}  # thread ident -> trial number, for trials running in a thread
_warned = False


@contextlib.contextmanager
def running_trial(number: int) -> Iterator[None]:
    """Mark the calling thread as running trial ``number`` (a fork from it is checked)."""
    ident = threading.get_ident()
    with _lock:
        _running[ident] = number
    try:
        yield
    finally:
        with _lock:
            _running.pop(ident, None)


def _before_fork() -> None:
    global _warned
    ident = threading.get_ident()
    # No lock here: a fork may come from a thread that holds it; a stale read only delays the
    # warning to the next fork.
    running = dict(_running)
    number = running.get(ident)
    if _warned or number is None or len(running) < 2:
        return
    _warned = True
    _logger.warning(
        "Trial %d forked a process (a DataLoader with num_workers > 0 forks its workers) while "
        "%d other trial(s) ran in threads of this process: the child inherits every lock those "
        "threads held at that moment (torch's random generator's, a logger's) and may block on "
        "one for ever. Run trials with WaterwaveExecutor(isolation='process'): each trial's "
        "DataLoader workers then fork from a process of its own, at fork's speed. "
        "multiprocessing_context='forkserver' (or 'spawn') on the DataLoader also avoids the "
        "hang but starts each worker as a new interpreter (seconds per epoch unless "
        "persistent_workers=True). (Said once per process.)",
        number,
        len(running) - 1,
    )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)
