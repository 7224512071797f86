"""A trial that forks while other trials run in threads of its process: said once, with the fix.

``fork()`` copies only the calling thread; every lock another thread held at that moment stays
locked in the child for ever. With trials co-hosted as threads, a trial's ``DataLoader(
num_workers=2)`` forks its workers while its neighbours hold torch's random generator's lock
(``torch.manual_seed``, a dropout), the allocator's, or a logger's; a worker that needs that lock
blocks, and the trial with it (seen with Optuna's own ``n_jobs=4`` as with the executor's threads).
Python itself says so only from 3.12, as a ``DeprecationWarning`` that is hidden by default.

The fix is the trial's, and costs little: ``DataLoader(..., multiprocessing_context=
"forkserver")`` (or ``"spawn"``; the dataset and its class must then be importable, not defined
in the script), or ``isolation="process"``, where each trial has its process to itself and its
DataLoader workers fork from it.
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
        "one for ever. Give the DataLoader multiprocessing_context='forkserver' (or 'spawn'), "
        "or run trials with isolation='process'. "
        "(Said once per process.)",
        number,
        len(running) - 1,
    )


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork)
