"""How an executor's worker processes are started: forked by its zygote, or spawned.

:class:`ZygoteStarter` (Linux, the default) gets the executor a zygote of its own, forked
from the driver process's zygote template (:mod:`waterwave_hpo.workers._zygote`: a fresh
interpreter that imports what workers need, started once per driver process, by the first
executor that needs workers), and asks it to fork each worker: milliseconds per worker instead
of seconds, and the pages the template imported shared by every worker.
:class:`SpawnStarter` starts each worker as a fresh interpreter of its own (``python -c``):
where fork cannot serve (not Linux), where the user asks for it
(``WATERWAVE_WORKER_START=spawn``), or where the template found CUDA loaded by an import (a
forked process could not use it); :func:`spawn_reason` says which, and
:func:`say_spawned_once` says so once.

Both are driven by the :class:`~waterwave_hpo.workers._manager.WorkerManager`'s thread only,
and report to it: a worker's pid once it runs (``started(worker, pid)``) and its end
(``exited(worker, returncode, ended, reason)``: ``Popen.returncode``'s convention, or ``None``
when unknown; the processes it left that were ended with it; a reason when the start itself
failed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
import contextlib
import itertools
import logging
import os
from pathlib import Path
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

from waterwave_hpo.workers._manager import WorkerManager
from waterwave_hpo.workers._zygote import MAX_MESSAGE_BYTES
from waterwave_hpo.workers._zygote import WORKER_MARK
from waterwave_hpo.workers._zygote import ZYGOTE_MARK

if TYPE_CHECKING:
    from waterwave_hpo.workers._pool import WorkerProcess

_logger = logging.getLogger("waterwave_hpo")
START_ENV_VAR = "WATERWAVE_WORKER_START"
"""``spawn``: start each worker process as a fresh interpreter instead of forking it from the
executor's zygote (seconds per worker and per crash instead of milliseconds)."""
EXIT_WAIT_S = 5.0
ZYGOTE_RESTARTS = 3
"""A zygote killed from outside is started again this many times per executor, then workers
are spawned."""
# The package's parent directory: the zygote (or a spawned worker) imports waterwave_hpo from
# there before it learns the driver's sys.path (an editable or a source checkout need not be on
# the default path).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# The zygote template. If the library itself cannot be imported, it answers each request with why.
_ZYGOTE_BOOT = """
import gc; gc.disable()
import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)
import sys; sys.path.insert(0, {root!r})
try:
    from waterwave_hpo.workers._zygote import zygote_main
except BaseException as error:
    import pickle, socket
    why = f"it could not import waterwave_hpo: {{type(error).__name__}}: {{error}}"
    answer = pickle.dumps(("failed", why, False))
    requests = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=int(sys.argv[1]))
    requests.setblocking(False)
    while True:  # each request waiting is answered on its own socket
        try:
            data, fds, _, _ = socket.recv_fds(requests, 1 << 20, 1)
        except OSError:
            break
        if not data:
            break
        for fd in fds:
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=fd).send(answer)
    raise
zygote_main(int(sys.argv[1]), int(sys.argv[2]))
"""
# A spawned worker (the fallback). If the library cannot be imported, it tells the driver why.
_SPAWN_BOOT = """
import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)
import sys; sys.path.insert(0, {root!r})
try:
    from waterwave_hpo.workers._worker import worker_main
except BaseException as error:
    import os, pickle
    from multiprocessing.connection import Connection
    conn = Connection(int(sys.argv[1]))
    conn.recv_bytes()
    why = RuntimeError(
        f"The worker process {{os.getpid()}} could not start: it could not import "
        f"waterwave_hpo: {{type(error).__name__}}: {{error}}"
    )
    conn.send_bytes(pickle.dumps(("setup_error", why, True)))
    raise
worker_main(int(sys.argv[1]), int(sys.argv[2]))
"""

Started = Callable[["WorkerProcess", int], None]
Exited = Callable[["WorkerProcess", "int | None", "list[tuple[int, str]]", "str | None"], None]


class Starter(Protocol):
    """Starts worker processes and reports their ends (the manager's thread only)."""

    name: str
    """``"zygote"`` or ``"spawn"``."""

    def start(self, worker: WorkerProcess, theirs: socket.socket, env: dict[str, str]) -> None:
        """Start ``worker`` holding socket ``theirs`` (closed here), with environment ``env``."""

    def kill(self, worker: WorkerProcess) -> None:
        """SIGKILL ``worker`` and its process group, if it has not been reaped."""

    def stop(self, timeout_s: float) -> None:
        """Let go: every worker has ended (a zygote exits). Idempotent."""


def worker_environment() -> dict[str, str]:
    """The driver's environment, with OpenMP's threads told to sleep when idle.

    K workers each run ``torch.get_num_threads()`` intra-op threads on the same cores; OpenMP
    threads that spin while they wait then take the cores from the other workers' busy ones
    (measured on the 2-core VM, K=4, 8 short training trials: 20 s with spinning, 0.2 s with
    ``OMP_WAIT_POLICY=PASSIVE``). Threads of one process (``isolation="threads"``) share one
    OpenMP pool and never meet this. A value the user set is kept.
    """
    environment = dict(os.environ)
    environment.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return environment


class _ZygoteTemplate:
    """The driver process's zygote template: started on first use, again if it ended.

    A process that forks (the user's ``os.fork()``, a ``multiprocessing`` fork) starts its own
    on its first use: the template serves the process that started it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self._process: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None

    def fork_zygote(self, fd: int) -> None:
        """Ask for a zygote answering on socket ``fd`` (a ``SOCK_SEQPACKET`` end); never waits.

        Raises:
            OSError: If no template can be reached (it cannot be started).
        """
        with self._lock:
            if self._owner != os.getpid():  # a forked copy of the driver: not its template
                self._owner, self._process, self._sock = os.getpid(), None, None
            for _ in range(2):
                if self._process is None or self._process.poll() is not None:
                    self._start()
                assert self._sock is not None
                try:
                    socket.send_fds(self._sock, [pickle.dumps(("zygote",))], [fd])
                    return
                except OSError:  # it ended since: once more, with a new one
                    self._process = None
            raise OSError("the zygote template could not be reached")

    def _start(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _ZYGOTE_BOOT.format(root=_PACKAGE_ROOT),
                    str(theirs.fileno()),
                    str(os.getpid()),
                    ZYGOTE_MARK,
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=worker_environment(),
            )
        ours.settimeout(30.0)  # its requests wait in its socket while it imports
        self._sock = ours


_TEMPLATE = _ZygoteTemplate()


class ZygoteStarter:
    """Workers forked by the executor's own zygote, asked for at once (not waited for).

    Fork requests made while the zygote (or its template) still starts wait in its socket. If
    it cannot start, every worker it was to fork ends with the reason (``zygote_lost`` is
    called first when a spawned worker could still serve: CUDA loaded at import).

    Args:
        manager: The thread that drives it.
        started: Called with a worker and its pid once forked.
        exited: Called with a worker when it ended.
        zygote_lost: Called (before the workers' ends are reported) when the zygote itself
            ended unasked, with ``True`` when spawned workers should be used from now on.
    """

    name = "zygote"

    def __init__(
        self,
        manager: WorkerManager,
        started: Started,
        exited: Exited,
        zygote_lost: Callable[[bool], None],
    ) -> None:
        self._manager = manager
        self._started = started
        self._exited = exited
        self._zygote_lost = zygote_lost
        self._tags = itertools.count()
        self._pending: dict[int, WorkerProcess] = {}  # asked to fork, no pid yet
        self._workers: dict[int, WorkerProcess] = {}  # pid -> worker, not reaped yet
        self._outbox: deque[tuple[bytes, list[int]]] = deque()
        self._stopping = False
        self._gone = False
        self.failure: str | None = None
        self.pid: int | None = None  # the zygote's, once it is ready
        self._pidfd: int | None = None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            _TEMPLATE.fork_zygote(theirs.fileno())
        except OSError as error:
            self.failure = f"The worker processes' zygote could not be started: {error}"
        finally:
            theirs.close()  # the template's request holds its own reference
        ours.setblocking(False)
        self._sock = ours
        manager.register(ours, self._serve)

    def start(self, worker: WorkerProcess, theirs: socket.socket, env: dict[str, str]) -> None:
        if self._gone or (self.failure is not None and self.pid is None):
            theirs.close()  # it cannot serve: the worker ends with the reason
            self._manager.call(lambda: self._exited(worker, None, [], self.failure))
            return
        tag = next(self._tags)
        self._pending[tag] = worker
        worker.tag = tag
        self._send(("fork", tag, env, os.getcwd()), [theirs.fileno()])
        theirs.close()  # the message holds its own reference while in flight

    def kill(self, worker: WorkerProcess) -> None:
        if worker.pid is not None and worker.pid in self._workers:
            self._send(("kill", worker.pid), [])

    def stop(self, timeout_s: float) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._send(("stop",), [])
        deadline = time.monotonic() + timeout_s
        while not self._gone and time.monotonic() < deadline:  # its socket closes as it exits
            select.select([self._sock], [], [], max(0.0, deadline - time.monotonic()))
            self._serve(True, False)
        if not self._gone and self._pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        self._manager.unregister(self._sock)
        with contextlib.suppress(OSError):
            self._sock.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _send(self, message: tuple[Any, ...], fds: list[int]) -> None:
        data = pickle.dumps(message)
        if self._outbox:
            self._outbox.append((data, [os.dup(fd) for fd in fds]))
            return
        try:
            socket.send_fds(self._sock, [data], fds)
        except BlockingIOError:
            self._outbox.append((data, [os.dup(fd) for fd in fds]))
            self._manager.want_write(self._sock, True)
        except OSError:
            pass  # the zygote is gone: its end is reported by the reader

    def _flush(self) -> None:
        while self._outbox:
            data, fds = self._outbox[0]
            try:
                socket.send_fds(self._sock, [data], fds)
            except BlockingIOError:
                return
            except OSError:
                pass
            self._outbox.popleft()
            for fd in fds:
                os.close(fd)
        self._manager.want_write(self._sock, False)

    def _serve(self, readable: bool, writable: bool) -> None:
        if writable:
            self._flush()
        if not readable:
            return
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            self._receive(pickle.loads(data))

    def _receive(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "ready":
            self.pid = message[1]
            if hasattr(os, "pidfd_open"):
                with contextlib.suppress(OSError):
                    self._pidfd = os.pidfd_open(message[1])
        elif kind == "forked":
            _, tag, pid = message
            worker = self._pending.pop(tag, None)
            if worker is not None:
                self._workers[pid] = worker
                self._started(worker, pid)
        elif kind == "fork_failed":
            _, tag, reason = message
            worker = self._pending.pop(tag, None)
            if worker is not None:
                self._exited(worker, None, [], f"the executor's zygote could not fork it: {reason}")
        elif kind == "exited":
            _, _, pid, returncode, ended = message
            worker = self._workers.pop(pid, None)
            if worker is not None:
                self._exited(worker, returncode, ended, None)
        elif kind == "failed":
            _, reason, fallback = message
            self.failure = f"The worker processes' zygote could not start: {reason}"
            if fallback:
                self._zygote_lost(True)

    def _lost(self) -> None:
        """The zygote's socket closed: it exited. Every worker it had dies with it."""
        self._manager.unregister(self._sock)
        if self._gone:
            return
        self._gone = True
        if self._stopping:
            return
        if self.failure is None:
            self.failure = (
                f"the executor's zygote (pid {self.pid}), which forks the worker processes, ended"
            )
            self._zygote_lost(False)
        lost = list(self._workers.values()) + list(self._pending.values())
        self._workers.clear()
        self._pending.clear()
        for worker in lost:
            self._exited(worker, None, [], self.failure)


class SpawnStarter:
    """Each worker a fresh interpreter (``python -c``), as before the zygote: the fallback.

    Each is started by the manager's thread, which lives as long as the workers: Linux ties a
    worker's parent-death signal to the thread that started it. A worker has a session (and so
    a process group) of its own; its end is seen on its pid's file descriptor (Linux 5.3+),
    else polled every second.

    Args:
        manager: The thread that drives it.
        started: Called with a worker and its pid once started.
        exited: Called with a worker when it ended.
    """

    name = "spawn"

    def __init__(self, manager: WorkerManager, started: Started, exited: Exited) -> None:
        self._manager = manager
        self._started = started
        self._exited = exited
        self._processes: dict[int, tuple[WorkerProcess, subprocess.Popen[bytes], int | None]] = {}
        manager.every_tick(self._poll)

    def command(self, fd: int) -> list[str]:
        """The command line of a worker holding socket ``fd``."""
        return [
            sys.executable,
            "-c",
            _SPAWN_BOOT.format(root=_PACKAGE_ROOT),
            str(fd),
            str(os.getpid()),
            WORKER_MARK,
        ]

    def start(self, worker: WorkerProcess, theirs: socket.socket, env: dict[str, str]) -> None:
        try:
            with theirs:
                process = subprocess.Popen(
                    self.command(theirs.fileno()),
                    pass_fds=(theirs.fileno(),),
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
        except OSError as error:
            why = f"it could not be started: {error}"
            self._manager.call(lambda: self._exited(worker, None, [], why))
            return
        pidfd = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(process.pid)
        self._processes[process.pid] = (worker, process, pidfd)
        if pidfd is not None:
            pid = process.pid
            self._manager.register(pidfd, lambda readable, writable: self._ended(pid))
        self._started(worker, process.pid)

    def kill(self, worker: WorkerProcess) -> None:
        entry = self._processes.get(worker.pid) if worker.pid is not None else None
        if entry is None or entry[1].returncode is not None:
            return
        with contextlib.suppress(OSError):
            os.killpg(entry[1].pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            entry[1].kill()

    def stop(self, timeout_s: float) -> None:
        pass

    def _poll(self) -> None:
        for pid, (_, process, pidfd) in list(self._processes.items()):
            if pidfd is None and process.poll() is not None:
                self._ended(pid)

    def _ended(self, pid: int) -> None:
        entry = self._processes.pop(pid, None)
        if entry is None:
            return
        worker, process, pidfd = entry
        if pidfd is not None:
            self._manager.unregister(pidfd)
            os.close(pidfd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=EXIT_WAIT_S)
        with contextlib.suppress(OSError):  # what is left of its process group
            os.killpg(pid, signal.SIGKILL)
        self._exited(worker, process.returncode, [], None)


_said = threading.Event()


def spawn_reason() -> str | None:
    """Why workers must be spawned here (fresh interpreters), or ``None``: the zygote serves."""
    if os.environ.get(START_ENV_VAR, "").strip().lower() == "spawn":
        return f"{START_ENV_VAR}=spawn asks for it"
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"the executor's zygote needs Linux's fork (this is {sys.platform})"
    if not hasattr(socket, "send_fds"):
        return "this Python has no socket.send_fds"
    return None


def say_spawned_once(reason: str) -> None:
    """Log, once per process, that workers start as fresh interpreters, and why."""
    if _said.is_set():
        return
    _said.set()
    _logger.warning(
        "isolation='process': worker processes start as fresh interpreters (%s): each takes "
        "seconds to start, and again after a crash, and holds its own copy of torch.",
        reason,
    )
