"""What a trial leaves running: its child processes, ended before the worker's next trial.

A warm worker runs one job (a trial, or a fused batch) at a time, so every process it has
started when its job ends was started by that job: a ``multiprocessing.Process`` never joined,
a ``subprocess.Popen`` never waited for, the workers of a ``DataLoader(persistent_workers=True)``
still referenced (a cycle, a global). Left alone they hold the trial's memory (on a GPU: a CUDA
context and whatever they allocated) and CPU for the rest of the study, and they outlive the
worker. Ray ends a worker's children when the worker exits (``RAY_kill_child_processes_on_
worker_exit``); a warm worker outlives many trials, so it ends them at each trial's end, with a
warning naming the trial and the pids, before its record goes back to the driver (and so before
the driver can send the next trial).

Not the trial's, so left running: the helpers a library starts once per process and reuses for
every later caller (``multiprocessing``'s resource tracker and forkserver, PyTorch Inductor's
compile-worker pool). The processes the forkserver forked for the trial are the trial's.

A worker is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process a trial detaches
(``setsid cmd &``, a daemon's double fork) becomes the worker's child when its parent exits,
instead of init's, and is ended here with the others.

A non-daemon thread a trial leaves running would keep an interpreter alive at its exit; a
worker does not wait for it (its end, at ``close()`` or a crash, ends the thread), so the
worker names it in a warning when the trial ends (:func:`warn_of_threads_left`).
"""

from __future__ import annotations

from collections.abc import Sequence
import contextlib
import logging
import multiprocessing
import os
import sys
import threading
import time

import psutil

_logger = logging.getLogger("waterwave_hpo")

#: Seconds a stray has to exit after SIGTERM before it is sent SIGKILL.
TERMINATE_GRACE_S = 1.0
#: Seconds to wait, at most, for the strays to be gone after SIGKILL.
KILL_WAIT_S = 30.0
# How PyTorch Inductor's compile-worker pool is started (``python -m`` of this module).
_COMPILE_POOL_MODULE = "torch._inductor.compile_worker"


def end_stray_children(trial_numbers: Sequence[int]) -> list[int]:
    """End this process's children (and theirs) left by the job of ``trial_numbers``.

    Call it only when no trial runs in this process: every child then belongs to the job that
    just ended, or is a per-process helper (left running). Each stray gets SIGTERM, then
    SIGKILL after :data:`TERMINATE_GRACE_S` seconds; ``multiprocessing`` children are ended and
    joined through their own objects, so ``multiprocessing.active_children()`` stays true.
    A warning on the ``waterwave_hpo`` logger names the trial(s) and the pids.

    Args:
        trial_numbers: The numbers of the trials of the job that ended (one, or a fused
            batch's), for the warning.

    Returns:
        The pids that were ended, in ascending order (empty when there were none).
    """
    if not _has_children():
        return []
    me = psutil.Process()
    try:
        children = me.children(recursive=True)
    except psutil.Error:
        return []
    if not children:
        return []
    keep = _helpers(children)
    # A zombie has exited: its owner (a Popen object, multiprocessing) reaps it.
    strays = [p for p in children if p.pid not in keep and not _zombie(p)]
    if not strays:
        return []
    described = ", ".join(f"{p.pid} ({_name(p)})" for p in sorted(strays, key=lambda p: p.pid))
    _end(strays)
    trials = ", ".join(str(n) for n in trial_numbers)
    _logger.warning(
        "%s %s ended with %d child process(es) still running: %s. The worker ended them "
        "(SIGTERM, then SIGKILL after %.0f s) before its next trial. End the processes a trial "
        "starts before it returns: join a multiprocessing.Process, wait for a subprocess, let "
        "a DataLoader with persistent_workers=True go (del it) or shut its iterator down.",
        "Trial" if len(trial_numbers) == 1 else "Trials",
        trials,
        len(strays),
        described,
        TERMINATE_GRACE_S,
    )
    return sorted(p.pid for p in strays)


def _has_children() -> bool:
    """Whether this process has a child, running or exited, without reaping one.

    One system call (5 us here) where listing the children reads every process's ``/proc``
    entry (4 ms per trial on the 2-core VM at 95 processes): a trial that starts no process
    pays only this. A grandchild can only be left behind a child (an orphan goes to init).
    """
    if not hasattr(os, "waitid"):  # not Linux or a BSD: list them
        return True
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _end(strays: list[psutil.Process]) -> None:
    """SIGTERM, up to :data:`TERMINATE_GRACE_S` seconds, then SIGKILL; each one waited for.

    A ``multiprocessing`` child is ended and joined through its own object (reaped behind its
    back, ``multiprocessing.active_children()`` would list it for ever).
    """
    own = {p.pid: p for p in multiprocessing.active_children()}
    mp_strays = [own[p.pid] for p in strays if p.pid in own]
    others = [p for p in strays if p.pid not in own]
    for child in mp_strays:
        child.terminate()
    for process in others:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _wait(mp_strays, others, TERMINATE_GRACE_S)
    for child in mp_strays:
        if child.is_alive():
            child.kill()
    for process in others:
        with contextlib.suppress(psutil.Error):
            if not _zombie(process):
                process.kill()
    # SIGKILL cannot be refused, but a loaded machine may take seconds to tear a large process
    # down: wait, so that the next trial never meets it.
    _wait(mp_strays, others, KILL_WAIT_S)


def _wait(
    mp_strays: list[multiprocessing.process.BaseProcess],
    others: list[psutil.Process],
    timeout_s: float,
) -> None:
    """Wait up to ``timeout_s`` seconds in all for the strays to exit (and reap own children)."""
    deadline = time.monotonic() + timeout_s
    for child in mp_strays:
        child.join(max(0.0, deadline - time.monotonic()))
    # Own children are reaped here; a grandchild whose parent was ended is reaped by init (or
    # not, in a container without one): it is gone once it is a zombie.
    me = os.getpid()
    running = [p for p in others if _parent(p) == me or not _zombie(p)]
    psutil.wait_procs(running, timeout=max(0.0, deadline - time.monotonic()))


def _parent(process: psutil.Process) -> int | None:
    try:
        return int(process.ppid())
    except psutil.Error:
        return None


def _zombie(process: psutil.Process) -> bool:
    try:
        return bool(process.status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return True


def _helpers(children: list[psutil.Process]) -> set[int]:
    """The pids among ``children`` that are per-process helpers of a library, not a trial's."""
    keep: set[int] = set()
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    tracker_pid = getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)
    forkserver = sys.modules.get("multiprocessing.forkserver")
    forkserver_pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    keep.update(pid for pid in (tracker_pid, forkserver_pid) if isinstance(pid, int))
    for process in children:
        try:
            cmdline = process.cmdline()
        except psutil.Error:
            continue
        if _COMPILE_POOL_MODULE in " ".join(cmdline):
            keep.add(process.pid)
            with contextlib.suppress(psutil.Error):
                keep.update(p.pid for p in process.children(recursive=True))
    return keep


def _name(process: psutil.Process) -> str:
    try:
        return str(process.name())
    except psutil.Error:
        return "gone"


_warned_threads: set[int] = set()  # idents of the threads already named (a warm worker lives on)


def warn_of_threads_left(trial_numbers: Sequence[int], own: Sequence[int] = ()) -> list[str]:
    """Warn of the non-daemon threads running when the job of ``trial_numbers`` ended.

    Call it only when no trial runs in this process: besides the main thread and ``own``
    (the worker's slot thread, whose daemon flag a trial's threads inherit as a script's
    threads inherit the main thread's), a worker's threads are daemons, so every other
    non-daemon thread was started by a trial (this one, or one before it, whose threads were
    named then). Each thread is named once.

    Args:
        trial_numbers: The numbers of the trials of the job that ended.
        own: Idents of the worker's own non-daemon threads.

    Returns:
        The names of the threads warned of now.
    """
    left = [
        thread
        for thread in threading.enumerate()
        if not thread.daemon
        and thread is not threading.main_thread()
        and thread.ident not in own
        and thread.ident not in _warned_threads
    ]
    if not left:
        return []
    _warned_threads.update(thread.ident for thread in left if thread.ident is not None)
    names = [thread.name for thread in left]
    _logger.warning(
        "%s %s ended with %d non-daemon thread(s) still running: %s. A worker process "
        "(isolation='process') does not wait for them as an interpreter does at its exit: "
        "they end with the worker (at close(), or when it dies). Join the threads a trial "
        "starts before it returns.",
        "Trial" if len(trial_numbers) == 1 else "Trials",
        ", ".join(str(n) for n in trial_numbers),
        len(left),
        ", ".join(repr(name) for name in names),
    )
    return names
