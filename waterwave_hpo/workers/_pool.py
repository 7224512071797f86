"""Warm worker processes: started once per executor and device, kept across ``optimize`` calls.

A :class:`WorkerPool` holds one device's K worker processes (``_worker.py``). They start in
parallel, each a fresh interpreter (``python -c``: never the user's script, so a script without
``if __name__ == "__main__":`` works), and warm up once: torch, the library, on CUDA the
device's context and the stream-aware pool. Each ``optimize`` call then binds them to its
:class:`~waterwave_hpo.workers._handle.ProcessHostHandle` (a ``begin`` message: the run's
pickled objective and settings; the worker opens the study through the relay) and unbinds them
when it ends (``end``); the processes stay, so the next call, of the same study or another,
starts its first trial at once. One call holds them at a time (:meth:`WorkerPool.take`): a
call from a second thread waits for the first to end; nothing of a run (its ``study.stop()``)
reaches the next. A worker that dies is replaced at once, ahead of the slot's next trial.
:class:`WorkerPools` (one per executor) ends them all on ``close()``, when the executor is
garbage-collected, or at interpreter exit.

The driver's side of one worker is a :class:`WorkerProcess`: the process and its pipe. One
thread per pool, its :class:`PipeServer`, serves every worker's pipe from one selector (the
study's storage calls, through the bound run's :class:`~waterwave_hpo.relay.StorageService`;
memory-lease calls, through the device's
:class:`~waterwave_hpo.workers._lease_service.LeaseServer`; the records of finished attempts,
told to the study by the bound run) and notices each worker's death: one thread waking for
whichever worker wrote, instead of a thread per worker each taking the GIL in turn.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
import contextlib
import functools
import logging
import multiprocessing.connection
import os
from pathlib import Path
import pickle
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from typing import TYPE_CHECKING
from typing import Any
import weakref

import torch

from waterwave_hpo.relay import sendable
from waterwave_hpo.workers._lease_service import CONTEXT_RESERVE_BYTES
from waterwave_hpo.workers._lease_service import LeaseServer
from waterwave_hpo.workers._mps import detect_mps
from waterwave_hpo.workers._mps import pinned_memory_limit
from waterwave_hpo.workers._mps import say_how_workers_share
from waterwave_hpo.workers._worker import dumps

if TYPE_CHECKING:
    from waterwave_hpo.host import TrialJob
    from waterwave_hpo.workers._handle import ProcessHostHandle

_logger = logging.getLogger("waterwave_hpo")
EXIT_WAIT_S = 5.0  # how long a worker whose pipe closed may take to be reaped
_DEATH_POLL_S = 1.0  # without a pidfd: how often the pipe server checks that workers live
_READ_BYTES = 1 << 16  # read at once from a worker's pipe (whole messages are dispatched)
_STOP_WAIT_S = 5.0
_START_TRIES = 100  # a worker killed (SIGKILL) while it warms up is started again
# The package's parent directory: the worker imports waterwave_hpo from there before it learns
# the driver's sys.path (an editable or a source checkout need not be on the default path).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# If the library itself cannot be imported, the worker still tells the driver why.
_BOOT = """
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
WORKER_MARK = "waterwave_hpo.workers._worker"
"""A string in every worker process's command line (to find them, e.g. with psutil)."""


def _trial_id(job: TrialJob) -> int:
    from waterwave_hpo import _optuna_compat

    return _optuna_compat.trial_id(job.trial)


def exit_reason(exitcode: int | None, pid: int | None) -> str:
    """Why a worker process ended, for a trial's fail reason.

    >>> exit_reason(-11, 42)
    'its worker process (pid 42) died: killed by signal SIGSEGV (Segmentation fault)'
    >>> exit_reason(3, 42)
    'its worker process (pid 42) died: exit code 3'
    """
    where = f"its worker process (pid {pid}) died"
    if exitcode is None:
        return f"{where}: its pipe closed and it did not exit within {EXIT_WAIT_S:g} s"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        description = signal.strsignal(-exitcode) or name
        hint = " (kill -9, or the kernel's OOM killer)" if -exitcode == signal.SIGKILL else ""
        return f"{where}: killed by signal {name} ({description}){hint}"
    return f"{where}: exit code {exitcode}"


def _pidfd(pid: int | None) -> int | None:
    """A file descriptor readable once process ``pid`` has ended (Linux 5.3+), or ``None``."""
    if pid is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        return int(os.pidfd_open(pid))
    except OSError:
        return None


class WorkerProcess:
    """One worker process and its pipe (served by its pool's :class:`PipeServer`).

    Its life: started (:meth:`__init__` returns at once), warm (``warm``), bound to one run at a
    time (:meth:`attach` ... :meth:`detach`), stopped by its pool or dead. Only the run loop's
    thread calls :meth:`attach`, :meth:`run` and :meth:`detach`.
    """

    def __init__(self, pool: WorkerPool, index: int) -> None:
        self.pool = pool
        self.index = index
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = pool.launch(theirs.fileno())
        self.conn = multiprocessing.connection.Connection(ours.detach())
        self.pid = self.process.pid
        self.host: ProcessHostHandle | None = None  # the run it is bound to
        self.warm = threading.Event()  # warmed up, or dead
        self.is_warm = False
        self.answered = threading.Event()  # the bound run's begin answered, or dead
        self.ready = False  # the bound run's study is open here
        self.setup_error: BaseException | None = None
        self.fatal_setup_error: BaseException | None = None  # it could not warm up
        self.ended_run = threading.Event()
        self.driver_reason: str | None = None  # why the driver ended the worker, if it did
        self.job: TrialJob | None = None
        self.unrecorded: list[TrialJob] = []  # members of self.job whose record has not come
        self.interrupted = False
        self.stopping = False
        self.dead = False
        # Errors the storage raised for the running job's posted writes, by trial id: the
        # trial fails with it when its record comes (as if the objective had raised it).
        self.write_errors: dict[int, tuple[str, BaseException]] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        """What crossed the pipe: messages by kind, both ways (``"to:submit"``,
        ``"from:records"``, ``"from:post"``: the messages inside a batch count too),
        ``"sent"`` and ``"received"`` (messages as sent, a batch once), ``"from:call"``
        (calls the worker waited on) and ``"from:flush"`` (batches of posted writes alone: the
        worker's periodic flush, every 0.1 s). Diagnostics (the tests count a trial's cost
        with it)."""
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        # Held across an attach's begin (never by the pipe server): a second attach to the run
        # returns only once the first one's begin is sent, so a submit never overtakes it.
        self._attach_lock = threading.Lock()
        # Read by the pool's PipeServer only: bytes of messages not whole yet, the pid's fd.
        self._received = bytearray()
        self._pidfd = _pidfd(self.pid)
        self._unreadable = False  # it sent a message the driver could not read: ignored now
        self._ending = False  # the server has seen it end
        self.served = threading.Event()  # the server is done with it (it ended, all reported)
        self.send(
            (
                "init",
                list(sys.path),
                str(pool.device),
                index,
                pool.torch_threads,
                pool.memory_pool,
            )
        )
        pool.server.add(self)

    # -- the run loop's thread ------------------------------------------------------------

    def attach(self, host: ProcessHostHandle) -> None:
        """Bind the worker to ``host``'s run: it opens the run's study (``begin``).

        Once per run: the slot's next submit and the death handler's replacement may both
        attach a new worker to the same run, and a second ``begin`` would open the run again in
        the worker (a second study and, on CUDA, a second stream, kept until the run ends).
        """
        with self._attach_lock:
            with self._lock:
                if self.host is host:
                    return
                self.host = host
                self.ready = False
                self.setup_error = None
                self.answered.clear()
                self.ended_run.clear()
                dead = self.dead
            if dead:
                self.answered.set()
                return
            self.send(("begin", host.payload))

    def detach(self) -> None:
        """Ask the worker to end the bound run (its host shuts down); it stays warm."""
        with self._lock:
            if self.dead or self.host is None:
                self.ended_run.set()
                return
        self.send(("end",))

    def run(self, job: TrialJob, frozen: list[Any]) -> bool:
        """Send ``job`` (its trials as the driver's storage holds them: ``frozen``).

        Returns:
            ``False`` if the worker has died (the driver has seen it end, and failed what it
            ran before): nothing was sent; the slot's next worker takes the job. A worker whose
            bound run could not begin fails the job at once with its error (it would drop it).
        """
        from waterwave_hpo import _optuna_compat

        members = [(_optuna_compat.trial_id(m.trial), m.attempt, m.retry_of) for m in job.members()]
        cap = None if job.planning is None else job.planning.cap_bytes
        with self._lock:
            # Checked with the job taken in one step: _ended (the death) and the setup_error
            # (the run's begin failed) take what is unrecorded under this lock; seen here
            # instead, no one else would end the job.
            if self.dead:
                return False
            setup_error, host = self.setup_error, self.host
            if setup_error is None:
                self.job = job
                self.unrecorded = list(job.members())
                self.interrupted = False
                self.write_errors.clear()
        if setup_error is not None:
            if host is not None:
                host.lost(list(job.members()), setup_error, None)
            return True
        self.send(("submit", members, bool(job.batch), cap, frozen))
        return True

    def send(self, message: tuple[Any, ...]) -> None:
        """Send ``message``; never raises (a dead worker: its pipe thread reports)."""
        with contextlib.suppress(Exception), self._send_lock:
            self.counts["to:" + message[0]] += 1
            self.counts["sent"] += 1
            self.conn.send_bytes(dumps(message))

    def kill(self) -> None:
        """End the worker now (SIGKILL); its running trial has been told FAIL."""
        with self._lock:
            self.interrupted = True
        with contextlib.suppress(Exception):
            self.process.kill()

    def stop(self) -> None:
        """Ask the worker to exit (it is idle); :meth:`join` waits for it."""
        with self._lock:
            self.stopping = True
        self.send(("stop",))

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the worker to exit, then kill it."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(Exception):
                self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=EXIT_WAIT_S)
        self.served.wait(timeout=EXIT_WAIT_S)
        with contextlib.suppress(Exception):
            self.conn.close()

    # -- the pool's pipe server's thread -------------------------------------------------

    def receive(self) -> bool:
        """Read what the pipe holds now; dispatch each whole message. ``False``: it has closed.

        Called when the pipe is readable (one read, which does not wait). A message that
        cannot be read makes the worker unusable: the driver ends it (its death is noticed as
        any other), and ignores what it sends meanwhile.
        """
        try:
            data = os.read(self.conn.fileno(), _READ_BYTES)
        except OSError:
            return False
        if not data:
            return False
        if self._unreadable:
            return True
        self._received += data
        try:
            frames = _whole_frames(self._received)
        except ValueError as error:  # a header no message has: the stream is lost
            self._cannot_read(error)
            return True
        for frame in frames:
            try:
                message = pickle.loads(frame)
                self.counts["received"] += 1
                self._dispatch(message)
            except Exception as error:  # a message that cannot be read or served
                self._cannot_read(error)
                return True
        return True

    def receive_rest(self) -> None:
        """Read and dispatch what it sent before it ended, without waiting.

        Nothing here waits for more: a process the worker forked may hold the pipe open long
        after the worker died.
        """
        poller = select.poll()
        poller.register(self.conn.fileno(), select.POLLIN)
        with contextlib.suppress(Exception):
            while poller.poll(0) and self.receive():
                pass

    def _cannot_read(self, error: BaseException) -> None:
        _logger.error("Worker %s sent a message that cannot be read: %r", self.pid, error)
        self._unreadable = True
        self._received.clear()
        self.driver_reason = (
            f"its worker process (pid {self.pid}) sent a message the driver "
            f"could not read: {type(error).__name__}: {error}; the driver ended the worker"
        )
        with contextlib.suppress(Exception):
            self.process.kill()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        self.counts["from:" + kind] += 1
        if kind == "batch":  # posted writes, then (maybe) the message that followed them
            inner = [pickle.loads(data) for data in message[1]]
            if inner and inner[-1][0] == "post":  # the worker's periodic flush
                self.counts["from:flush"] += 1
            for each in inner:
                self._dispatch(each)
        elif kind == "post":
            _, target, method, args = message
            ok, payload = self._serve_call(target, method, args)
            if not ok:
                self._write_failed(method, args, payload)
        elif kind == "call":
            _, call_id, target, method, args = message
            ok, payload = self._serve_call(target, method, args)
            self.send(("answer", call_id, *sendable(ok, payload, dumps)))
        elif kind == "records":
            _, records, snapshot, retire = message
            if retire:  # before the outcomes: the slot's next job must go to a new worker
                with self._lock:
                    self.dead = True
            host = self.host
            if host is not None:
                host.records(self, records, snapshot)
        elif kind == "warm":
            self.is_warm = True
            self.warm.set()
        elif kind == "ready":
            self.ready = True
            self.answered.set()
        elif kind == "setup_error":
            _, error, fatal = message
            if fatal:
                self.fatal_setup_error = error
            else:
                host = self.host
                with self._lock:  # with the job taken, as run() reads them (see there)
                    self.setup_error = error
                    lost, self.unrecorded = self.unrecorded, []
                if host is not None and lost:
                    host.lost(lost, error, None)
                self.answered.set()
        elif kind == "ended":
            self.ended_run.set()

    def _serve_call(self, target: str, method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        host = self.host
        if target == "lease":
            return self.pool.leases.run(method, args)
        if host is not None:
            return host.serve_call(self, target, method, args)
        return False, ConnectionError("The run this worker served has ended.")

    def _write_failed(self, method: str, args: tuple[Any, ...], error: BaseException) -> None:
        """A posted write failed: its trial fails with ``error`` when its record comes.

        Only the first error of a trial is kept (the objective would have stopped there).
        A write to a trial the worker no longer runs (the driver failed it: Ctrl+C) is dropped.
        """
        trial_id = args[0] if args else None
        with self._lock:
            if not isinstance(trial_id, int) or trial_id in self.write_errors:
                return
            if not any(_trial_id(m) == trial_id for m in self.unrecorded):
                return
            self.write_errors[trial_id] = (method, error)

    def take_write_error(self, trial_id: int) -> tuple[str, BaseException] | None:
        """The failed posted write of trial ``trial_id`` (its method and error), once."""
        with self._lock:
            return self.write_errors.pop(trial_id, None)

    def take_record(self, number: int) -> TrialJob | None:
        """The member of the running job numbered ``number`` (once), or ``None``."""
        with self._lock:
            job = next((m for m in self.unrecorded if m.trial.number == number), None)
            if job is not None:
                self.unrecorded.remove(job)
        return job

    def _ended(self) -> None:
        """The worker exited. Fail (or, after Ctrl+C, drop) what it ran; replace it."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=EXIT_WAIT_S)
        self.pool.leases.holder_died(self.pid)
        with self._lock:
            self.dead = True
            lost, self.unrecorded = self.unrecorded, []
            interrupted = self.interrupted
            host = self.host
        self.warm.set()
        self.answered.set()
        self.ended_run.set()
        self.served.set()
        if host is not None and lost:
            if interrupted:
                host.lost(lost, None, None)
            else:
                error = self.fatal_setup_error
                if error is not None:
                    reason = f"waterwave-hpo could not start the worker process: {error}"
                elif self.driver_reason is not None:
                    reason = self.driver_reason
                else:
                    reason = exit_reason(self.process.returncode, self.pid)
                host.lost(lost, error, reason)
        self.pool.replace(self)

    def exit_reason(self) -> str:
        """Why it could not serve: its start-up error, or how it died."""
        error = self.fatal_setup_error or self.setup_error
        if error is not None:
            return str(error)
        return self.driver_reason or exit_reason(self.process.returncode, self.pid)


def _whole_frames(buffer: bytearray) -> list[bytes]:
    r"""Take the whole messages off the front of ``buffer`` (``Connection.send_bytes`` framing).

    >>> buffer = bytearray(b"\x00\x00\x00\x02hi\x00\x00\x00\x03ab")
    >>> _whole_frames(buffer), bytes(buffer)
    ([b'hi'], b'\x00\x00\x00\x03ab')

    Raises:
        ValueError: If a header gives a negative size (not a message's: the bytes are not
            what ``send_bytes`` wrote).
    """
    frames = []
    start = 0
    end = len(buffer)
    while end - start >= 4:
        (size,) = struct.unpack_from("!i", buffer, start)
        header = 4
        if size == -1:  # over 2 GiB: an 8-byte size follows
            if end - start < 12:
                break
            (size,) = struct.unpack_from("!Q", buffer, start + 4)
            header = 12
        elif size < 0:
            raise ValueError(f"a frame header gives a size of {size} bytes")
        if end - start - header < size:
            break
        frames.append(bytes(buffer[start + header : start + header + size]))
        start += header + size
    del buffer[:start]
    return frames


class PipeServer:
    """One thread that serves the pipes of a pool's workers, all from one selector.

    It reads whatever a worker sent (a storage call, posted writes, records), serves it in
    order (:meth:`WorkerProcess.receive`) and notices each worker's end: its pid's file
    descriptor (Linux 5.3+), else a look every ``_DEATH_POLL_S`` seconds. What follows an end
    (failing the trial the worker ran, starting its successor, which may wait seconds to send
    it the run) happens in a thread of its own, so the other workers are not kept waiting.

    Args:
        name: The thread's name.
    """

    def __init__(self, name: str) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._added: list[WorkerProcess] = []
        self._stopping = False
        self._polled: list[WorkerProcess] = []  # served workers without a pid fd
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def add(self, worker: WorkerProcess) -> None:
        """Serve ``worker``'s pipe from now on (until it ends)."""
        with self._lock:
            self._added.append(worker)
        self._wake()

    def stop(self) -> None:
        """End the thread (every worker has ended). Idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake()
        self.thread.join(timeout=EXIT_WAIT_S)
        if not self.thread.is_alive():
            self._selector.close()
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"!")

    def _serve(self) -> None:
        while True:
            try:
                if not self._serve_ready():
                    return
            except Exception:  # the driver's own bug: say so, keep serving the others
                _logger.exception("The pipe server of the worker processes failed")

    def _serve_ready(self) -> bool:
        """Serve what is ready (waiting up to ``_DEATH_POLL_S`` s); ``False`` once stopped."""
        for key, _ in self._selector.select(timeout=_DEATH_POLL_S):
            if key.data is None:
                if not self._take_added():
                    return False
                continue
            worker, is_pidfd = key.data
            if worker._ending:
                continue  # ended already (its pipe and its pid were both ready)
            if is_pidfd or not worker.receive():
                self._end(worker)
        for worker in list(self._polled):
            if not worker._ending and worker.process.poll() is not None:
                self._end(worker)
        return True

    def _take_added(self) -> bool:
        """Register the workers added since; ``False`` when the server stops."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_read, 4096)
        with self._lock:
            added, self._added = self._added, []
            stopping = self._stopping
        for worker in added:
            self._selector.register(worker.conn.fileno(), selectors.EVENT_READ, (worker, False))
            if worker._pidfd is not None:
                self._selector.register(worker._pidfd, selectors.EVENT_READ, (worker, True))
            else:
                self._polled.append(worker)
        return not stopping

    def _end(self, worker: WorkerProcess) -> None:
        """``worker`` exited or closed its pipe: read the rest, forget it, report it."""
        worker._ending = True
        worker.receive_rest()
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(worker.conn.fileno())
        if worker._pidfd is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(worker._pidfd)
            os.close(worker._pidfd)
            worker._pidfd = None
        if worker in self._polled:
            self._polled.remove(worker)
        threading.Thread(
            target=worker._ended, name=f"waterwave-ended-{worker.pid}", daemon=True
        ).start()


class WorkerPool:
    """One device's worker processes, one per slot, warm across ``optimize`` calls.

    Args:
        device: The device their trials run on.
        n_workers: Worker processes (``trials_per_device``).
        leases: The device's memory leases, served to its workers.
        memory_pool: ``memory_pool=`` of the executor (``"auto"``, ``"on"``, ``"off"``): on
            CUDA the workers install the pool at warm-up, before anything allocates.
        launch: Starts one worker process given its socket's file descriptor
            (one thread of :class:`WorkerPools` starts every worker).
    """

    def __init__(
        self,
        device: torch.device,
        n_workers: int,
        leases: LeaseServer,
        memory_pool: str,
        launch: Any,
    ) -> None:
        self.device = device
        self.n_workers = n_workers
        self.leases = leases
        self.memory_pool = memory_pool
        self.launch = launch
        self.torch_threads = torch.get_num_threads()
        self.closed = False
        self._lock = threading.Lock()
        # One run at a time: a run binds every worker of the pool (attach), so a second
        # optimize call of the same executor (another thread) waits for the first to end.
        self._run_lock = threading.Lock()
        self._run_thread: int | None = None  # the thread whose run holds the workers
        self.server = PipeServer(f"waterwave-pipes-{device}")
        self.workers: list[WorkerProcess] = [WorkerProcess(self, i) for i in range(n_workers)]

    def take(self) -> None:
        """Hold the workers for one run; wait while another ``optimize`` call holds them.

        Every run binds all of the device's workers (:meth:`WorkerProcess.attach`): two
        ``optimize`` calls of one executor from two threads run one after the other, each
        with every slot, as the first call started them.

        Raises:
            RuntimeError: If this thread's own run holds them (``optimize`` called again from
                a callback of the running ``optimize``): it would wait for itself.
        """
        me = threading.get_ident()
        if not self._run_lock.acquire(blocking=False):
            if self._run_thread == me:
                raise RuntimeError(
                    f"optimize() of this executor (isolation='process') was called again while "
                    f"its run in the same thread holds the worker processes of {self.device} "
                    "(from a callback?); use a second WaterwaveExecutor for the inner run"
                )
            _logger.info(
                "The worker processes of %s run another optimize() call of this executor; "
                "this call waits for it to end.",
                self.device,
            )
            self._run_lock.acquire()
        self._run_thread = me

    def give_back(self) -> None:
        """Let the next run take the workers (its :meth:`take` returns)."""
        self._run_thread = None
        self._run_lock.release()

    def wait_warm(self) -> None:
        """Wait until every worker has warmed up or died (one killed meanwhile starts again).

        Raises:
            RuntimeError: If no worker warmed up (each died at start): with the first
                worker's error (an import that fails in a fresh interpreter, a CUDA error).
        """
        for index in range(self.n_workers):
            for _ in range(_START_TRIES):
                worker = self.workers[index]
                worker.warm.wait()
                if worker.is_warm or worker.fatal_setup_error is not None:
                    break
                if worker.process.returncode != -signal.SIGKILL:
                    break  # its own death (an exit code, a fault): it would die again
                # Killed from outside while it warmed up (kill -9, the OOM killer): again.
                self.worker(index)
        if not any(worker.is_warm and not worker.dead for worker in self.workers):
            first = self.workers[0]
            raise RuntimeError(
                f"Every worker process of {self.device} died at start "
                f"(isolation='process'); the first: {first.exit_reason()}"
            ) from first.fatal_setup_error

    def worker(self, index: int) -> WorkerProcess:
        """Slot ``index``'s live worker, started now if it has none (a crash, a retirement)."""
        with self._lock:
            worker = self.workers[index]
            if worker.dead:
                worker = self.workers[index] = WorkerProcess(self, index)
            return worker

    def replace(self, dead: WorkerProcess) -> None:
        """A worker died: start its successor now, ahead of the slot's next trial.

        A worker that never warmed up is not replaced here (its successor would fail the same
        way); the slot's next trial starts one.
        """
        with self._lock:
            if self.closed or dead.stopping or self.workers[dead.index] is not dead:
                return
            if not dead.is_warm:
                return
            worker = self.workers[dead.index] = WorkerProcess(self, dead.index)
            host = dead.host
        if host is not None and host.active:
            worker.attach(host)

    def pids(self) -> list[int]:
        """The pids of the live workers, slot by slot."""
        return [worker.pid for worker in self.workers if not worker.dead]

    def close(self) -> None:
        """Stop every worker; wait up to a few seconds each, then kill. Idempotent."""
        with self._lock:
            self.closed = True
            workers = list(self.workers)
        for worker in workers:
            worker.stop()
        for worker in workers:
            worker.join(_STOP_WAIT_S)
        self.server.stop()


class WorkerPools:
    """An executor's warm workers: one :class:`WorkerPool` per device, ended on :meth:`close`.

    A finalizer ends them when the owner is garbage-collected or at interpreter exit, whatever
    the user forgot. Every worker is started from one thread of this object's (Linux ties a
    worker's life to the thread that started it, ``PR_SET_PDEATHSIG``: a pipe thread that
    replaces a dead worker ends soon after).
    """

    def __init__(self) -> None:
        self.pools: dict[str, WorkerPool] = {}
        self._lock = threading.Lock()  # two threads' first calls start one pool per device
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="waterwave-launcher")
        self._finalizer = weakref.finalize(self, _close_pools, self.pools, self._launcher)

    def pool(
        self,
        device: torch.device,
        n_workers: int,
        budget_bytes: int | None,
        memory_pool: str,
    ) -> WorkerPool:
        """``device``'s pool, started (in parallel with the other devices') on first use."""
        key = str(device)
        with self._lock:
            pool = self.pools.get(key)
            if pool is not None:
                return pool
            leases = LeaseServer(device, n_workers, budget_bytes)
            env: dict[str, str] = {}
            if device.type == "cuda":
                _build_shim_once()
                status = detect_mps()
                say_how_workers_share(status, n_workers)
                share = leases.share_bytes
                if status.running and share is not None:
                    # The driver enforces it, the worker's context included.
                    env = pinned_memory_limit(device.index or 0, share + CONTEXT_RESERVE_BYTES)
            # The pools must not hold this object (its finalizer holds them).
            launch = functools.partial(_launch, self._launcher, env)
            pool = self.pools[key] = WorkerPool(device, n_workers, leases, memory_pool, launch)
            return pool

    def close(self) -> None:
        """Stop every worker process. Idempotent."""
        self._finalizer()


def _build_shim_once() -> None:
    """Build the pool's torch shim here, once, before K workers would each compile it."""
    with contextlib.suppress(Exception):  # a worker reports the build's error itself
        from waterwave_hpo.memory._internal import build_shim

        build_shim()


def _launch(launcher: ThreadPoolExecutor, env: dict[str, str], fd: int) -> subprocess.Popen[bytes]:
    """Start one worker process (a fresh interpreter) holding socket ``fd``, from ``launcher``."""
    return launcher.submit(_popen, fd, env).result()


def _popen(fd: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _BOOT.format(root=_PACKAGE_ROOT),
            str(fd),
            str(os.getpid()),
            WORKER_MARK,
        ],
        pass_fds=(fd,),
        stdin=subprocess.DEVNULL,
        env={**_worker_environment(), **env},
    )


def _worker_environment() -> dict[str, str]:
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


def _close_pools(pools: dict[str, WorkerPool], launcher: ThreadPoolExecutor) -> None:
    for pool in pools.values():
        pool.close()
    pools.clear()
    launcher.shutdown(wait=False)
