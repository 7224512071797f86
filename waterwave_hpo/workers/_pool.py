"""Warm worker processes: started once per executor and device, kept across ``optimize`` calls.

A :class:`WorkerPool` holds one device's K worker processes (``_worker.py``), forked by the
executor's zygote (``_zygote.py``, ``_starters.py``: milliseconds per worker; fresh
interpreters where fork cannot serve). Each ``optimize`` call binds them to its
:class:`~waterwave_hpo.workers._handle.ProcessHostHandle` (a ``begin`` message: the run's
pickled objective and settings; the worker opens the study through the relay) and unbinds them
when it ends (``end``); the processes stay, so the next call, of the same study or another,
starts its first trial at once. One call holds them at a time (:meth:`WorkerPool.take`): a call
from a second thread waits for the first to end; nothing of a run (its ``study.stop()``)
reaches the next. A worker that dies is replaced at once by a new fork, ahead of the slot's
next trial. :class:`WorkerPools` (one per executor) ends them all on ``close()``, when the
executor is garbage-collected, or at interpreter exit.

One owner for each worker's life: the executor's
:class:`~waterwave_hpo.workers._manager.WorkerManager` thread creates, attaches, replaces and
ends the workers, serves their pipes and the zygote's socket from one selector, and never
blocks (sends wait in a worker's outbox until its pipe takes them). What may take long runs in
the slot's :class:`~waterwave_hpo.workers._manager.Lane`, in order: the study's storage calls
(through the bound run's :class:`~waterwave_hpo.relay.StorageService`), the writes a worker
posted, and telling the study how its trials ended. The run loop's thread hands a slot its job
(:meth:`WorkerPool.submit`, non-blocking) and waits for a run's start and end with deadlines.
The driver's side of one worker is a :class:`WorkerProcess`: its pipe, its outbox and what it
runs, changed under its pool's lock.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING
from typing import Any
import weakref

import torch

from waterwave_hpo.workers._lease_service import CONTEXT_RESERVE_BYTES
from waterwave_hpo.workers._lease_service import DeviceLeases
from waterwave_hpo.workers._manager import Lane
from waterwave_hpo.workers._manager import WorkerManager
from waterwave_hpo.workers._mps import detect_mps
from waterwave_hpo.workers._mps import pinned_memory_limit
from waterwave_hpo.workers._mps import say_how_workers_share
from waterwave_hpo.workers._starters import ZYGOTE_RESTARTS
from waterwave_hpo.workers._starters import SpawnStarter
from waterwave_hpo.workers._starters import Starter
from waterwave_hpo.workers._starters import ZygoteStarter
from waterwave_hpo.workers._starters import say_spawned_once
from waterwave_hpo.workers._starters import spawn_reason
from waterwave_hpo.workers._starters import worker_environment
from waterwave_hpo.workers._worker import dumps
from waterwave_hpo.workers._zygote import WORKER_MARK

if TYPE_CHECKING:
    from waterwave_hpo.host import TrialJob
    from waterwave_hpo.workers._handle import ProcessHostHandle

__all__ = ["EXIT_WAIT_S", "WORKER_MARK", "WorkerPool", "WorkerPools", "WorkerProcess"]

_logger = logging.getLogger("waterwave_hpo")
EXIT_WAIT_S = 5.0  # how long an ended or killed worker may take to be reaped
ANSWER_TIMEOUT_S = 600.0
"""How long a run waits for its workers to warm up and open the run (a fresh interpreter on a
loaded machine, a CUDA context, an objective whose module imports a framework): past it the run
raises instead of waiting for a hung worker."""
_READ_BYTES = 1 << 16  # read at once from a worker's pipe (whole messages are dispatched)
_READS_PER_EVENT = 16  # then the other workers' pipes get their turn
_STOP_WAIT_S = 5.0
_START_TRIES = 3  # a worker killed from outside while it warms up is started again, up to this
_CALL_WAIT_S = 60.0  # the most a thread waits for the manager to run its call


def exit_reason(exitcode: int | None, pid: int | None) -> str:
    """Why a worker process ended, for a trial's fail reason.

    >>> exit_reason(-11, 42)
    'its worker process (pid 42) died: killed by signal SIGSEGV (Segmentation fault)'
    >>> exit_reason(3, 42)
    'its worker process (pid 42) died: exit code 3'
    """
    where = f"its worker process (pid {pid}) died"
    if exitcode is None:
        return f"{where}: its exit status is unknown"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        description = signal.strsignal(-exitcode) or name
        hint = " (kill -9, or the kernel's OOM killer)" if -exitcode == signal.SIGKILL else ""
        return f"{where}: killed by signal {name} ({description}){hint}"
    return f"{where}: exit code {exitcode}"


def _frame(data: bytes) -> bytes:
    """``data`` with ``Connection.send_bytes``' header (the worker reads with ``recv_bytes``)."""
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!iQ", -1, len(data)) + data
    return struct.pack("!i", len(data)) + data


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


def _trial_id(job: TrialJob) -> int:
    from waterwave_hpo import _optuna_compat

    return _optuna_compat.trial_id(job.trial)


class WorkerProcess:
    """The driver's side of one worker process: its pipe, its outbox, what it runs.

    Its life: started (by the pool's manager; ``pid`` once it runs), warm, bound to one run at
    a time (``host``: ``begin`` ... ``end``), dead. Its fields change under its pool's lock
    (the pool's condition is notified); :meth:`send` may be called from any thread and never
    blocks.
    """

    def __init__(self, pool: WorkerPool, index: int, starter: Starter) -> None:
        self.pool = pool
        self.index = index
        self.starter = starter
        self.sock, theirs = socket.socketpair()
        self._theirs: socket.socket | None = theirs
        self.sock.setblocking(False)
        self.pid: int | None = None
        self.tag: Any = None  # the starter's
        self.host: ProcessHostHandle | None = None  # the run it is bound to
        self.is_warm = False
        self.answered = False  # the bound run's begin was answered
        self.ready = False  # the bound run's study is open here
        self.ended_run = False  # the bound run's end was answered
        self.setup_error: BaseException | None = None  # the bound run could not begin here
        self.fatal_setup_error: BaseException | None = None  # it could not warm up
        self.start_failure: str | None = None  # the starter could not start it
        self.driver_reason: str | None = None  # why the driver ended the worker, if it did
        self.returncode: int | None = None
        self.dead = False
        self.retiring = False  # it exits after its record (its CUDA context may be poisoned)
        self.stopping = False
        self.interrupted = False
        self.doomed = False  # the driver killed it (or will, once it runs)
        self.job: TrialJob | None = None
        self.unrecorded: list[TrialJob] = []  # members of self.job whose record has not come
        # Errors the storage raised for the running job's posted writes, by trial id: the
        # trial fails with it when its record comes (as if the objective had raised it).
        # The slot's lane alone reads and writes it.
        self.write_errors: dict[int, tuple[str, BaseException]] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        """What crossed the pipe: messages by kind, both ways (``"to:submit"``,
        ``"from:records"``, ``"from:post"``: the messages inside a batch count too),
        ``"sent"`` and ``"received"`` (messages as sent, a batch once), ``"from:call"``
        (calls the worker waited on) and ``"from:flush"`` (batches of posted writes alone: the
        worker's periodic flush, every 0.1 s). Diagnostics (the tests count a trial's cost
        with it)."""
        self.served = threading.Event()  # its end is handled: what it ran is failed or dropped
        self._outbox = bytearray()
        self._out_lock = threading.Lock()
        self._closed = False
        self._received = bytearray()  # the manager's: bytes of messages not whole yet
        self._unreadable = False  # it sent a message the driver could not read: ignored now

    def take_theirs(self) -> socket.socket:
        """The worker's end of the pipe, for its starter (once)."""
        theirs, self._theirs = self._theirs, None
        assert theirs is not None
        return theirs

    def exit_reason(self) -> str:
        """Why it could not serve: its start-up error, or how it died."""
        error = self.fatal_setup_error or self.setup_error
        if error is not None:
            return str(error)
        if self.start_failure is not None:
            return f"its worker process could not start: {self.start_failure}"
        return self.driver_reason or exit_reason(self.returncode, self.pid)

    # -- any thread ---------------------------------------------------------------------------

    def send(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` without blocking; never raises (a dead worker: its end reports).

        What the pipe cannot take now waits in the outbox; the manager sends it when the pipe
        is writable, in order.
        """
        data = _frame(dumps(message))
        with self._out_lock:
            self.counts["to:" + message[0]] += 1
            self.counts["sent"] += 1
            if self._closed:
                return
            if not self._outbox:
                try:
                    sent = self.sock.send(data)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    return
                if sent == len(data):
                    return
                data = data[sent:]
            self._outbox += data
        manager = self.pool.manager
        if manager.in_thread():
            manager.want_write(self.sock, True)
        else:
            manager.call(lambda: manager.want_write(self.sock, True))

    # -- the manager's thread -----------------------------------------------------------------

    def on_events(self, readable: bool, writable: bool) -> None:
        """The selector's events of its pipe."""
        if writable:
            self._flush()
        if readable:
            for _ in range(_READS_PER_EVENT):
                if not self._receive_once():
                    break

    def _flush(self) -> None:
        with self._out_lock:
            while self._outbox and not self._closed:
                try:
                    sent = self.sock.send(self._outbox)
                except BlockingIOError:
                    return
                except OSError:
                    self._outbox.clear()
                    break
                del self._outbox[:sent]
        self.pool.manager.want_write(self.sock, False)

    def _receive_once(self) -> bool:
        """Read what the pipe holds now, dispatch each whole message; ``False``: nothing more."""
        try:
            data = self.sock.recv(_READ_BYTES)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:  # it closed its end: its death comes from its starter
            self.pool.manager.unregister(self.sock)
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
                self.pool.dispatch(self, message)
            except Exception as error:  # a message that cannot be read or served
                self._cannot_read(error)
                return True
        return True

    def receive_rest(self) -> None:
        """Read and dispatch what it sent before it ended, without waiting."""
        with contextlib.suppress(Exception):
            while self._receive_once():
                pass

    def close(self) -> None:
        """Close the driver's end of the pipe (the worker has ended)."""
        with self._out_lock:
            self._closed = True
            self._outbox.clear()
        self.pool.manager.unregister(self.sock)
        with contextlib.suppress(OSError):
            self.sock.close()
        if self._theirs is not None:
            self._theirs.close()
            self._theirs = None

    def _cannot_read(self, error: BaseException) -> None:
        _logger.error("Worker %s sent a message that cannot be read: %r", self.pid, error)
        self._unreadable = True
        self._received.clear()
        self.driver_reason = (
            f"its worker process (pid {self.pid}) sent a message the driver "
            f"could not read: {type(error).__name__}: {error}; the driver ended the worker"
        )
        self.pool.kill(self)

    # -- under the pool's lock ----------------------------------------------------------------

    def take_record(self, number: int) -> TrialJob | None:
        """The member of the running job numbered ``number`` (once), or ``None``."""
        job = next((m for m in self.unrecorded if m.trial.number == number), None)
        if job is not None:
            self.unrecorded.remove(job)
        return job

    def take_members(self, trial_ids: list[int]) -> list[TrialJob]:
        """The members of the running job with these trial ids (once each)."""
        taken = [m for m in self.unrecorded if _trial_id(m) in trial_ids]
        self.unrecorded = [m for m in self.unrecorded if m not in taken]
        return taken

    def take_write_error(self, trial_id: int) -> tuple[str, BaseException] | None:
        """The failed posted write of trial ``trial_id`` (its method and error), once.

        The slot's lane only.
        """
        return self.write_errors.pop(trial_id, None)


class WorkerPool:
    """One device's worker processes, one per slot, warm across ``optimize`` calls.

    Args:
        workers: The executor's :class:`WorkerPools` state (its manager, its starter).
        device: The device their trials run on.
        n_workers: Worker processes (``trials_per_device``).
        leases: How the device's memory is split over them.
        memory_pool: ``memory_pool=`` of the executor (``"auto"``, ``"on"``, ``"off"``): on
            CUDA the workers install the pool at warm-up, before anything allocates.
        env: Environment variables of this device's workers (under MPS, their limit).
    """

    def __init__(
        self,
        workers: _Supervisor,
        device: torch.device,
        n_workers: int,
        leases: DeviceLeases,
        memory_pool: str,
        env: dict[str, str],
    ) -> None:
        self.supervisor = workers
        self.manager = workers.manager
        self.device = device
        self.n_workers = n_workers
        self.leases = leases
        self.memory_pool = memory_pool
        self.env = env
        self.torch_threads = torch.get_num_threads()
        self.closed = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # One run at a time: a run binds every worker of the pool, so a second optimize call of
        # the same executor (another thread) waits for the first to end.
        self._run_lock = threading.Lock()
        self._run_thread: int | None = None  # the thread whose run holds the workers
        self.lanes = [Lane(f"waterwave-lane-{device}-{i}") for i in range(n_workers)]
        self.workers: list[WorkerProcess | None] = [None] * n_workers
        self.bound: ProcessHostHandle | None = None  # the run holding the workers
        # Jobs for a slot whose worker is being replaced: (host, job, frozen).
        self._pending: dict[int, tuple[ProcessHostHandle, TrialJob, bytes]] = {}
        self._broken: dict[int, WorkerProcess] = {}  # slots whose worker cannot start
        self._start_failures = [0] * n_workers
        self.manager.call(self._start_all)

    # -- the run loop's thread ----------------------------------------------------------------

    def take(self) -> None:
        """Hold the workers for one run; wait while another ``optimize`` call holds them.

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

    def bind(self, host: ProcessHostHandle, timeout_s: float) -> None:
        """Bind every worker to ``host``'s run and wait (up to ``timeout_s``) until each answered.

        A slot whose worker could not start is retried once here (a new run, a new chance).

        Raises:
            RuntimeError: If no worker could start the run (each died at start, or could not
                load the objective): the first worker's error; or if a worker neither answered
                nor died within ``timeout_s`` seconds (a hung warm-up or start).
        """
        self._in_manager(lambda: self._attach_all(host))
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                waiting = [i for i in range(self.n_workers) if not self._settled(i, host)]
                if not waiting:
                    break
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    raise RuntimeError(
                        f"The worker process(es) of {self.device} for slot(s) "
                        f"{', '.join(map(str, waiting))} did not answer within {timeout_s:g} s "
                        "(isolation='process'): their warm-up (on CUDA, the device's context) "
                        "or the run's start (loading the objective) hung. The run is refused "
                        "and those workers are ended."
                    )
                self._changed.wait(left_s)
            ready = [w for w in self.workers if w is not None and w.ready and not w.dead]
            if ready:
                return
            first = self._broken.get(0) or self.workers[0]
            assert first is not None
            everyone_broken = len(self._broken) == self.n_workers
        if everyone_broken:
            raise RuntimeError(
                f"Every worker process of {self.device} died at start "
                f"(isolation='process'); the first: {first.exit_reason()}"
            ) from first.fatal_setup_error
        error = first.setup_error or first.fatal_setup_error
        raise RuntimeError(
            f"No worker process of {self.device} could start this run "
            f"(isolation='process'): {first.exit_reason()}"
        ) from error

    def _fail_unstarted(
        self, index: int, host: ProcessHostHandle, job: TrialJob, worker: Any
    ) -> None:
        """Fail ``job`` in slot ``index``'s lane: its worker process could not start."""
        self.lanes[index].put(
            lambda: host.lost(
                list(job.members()),
                worker.fatal_setup_error,
                f"its worker process could not start: {worker.exit_reason()}",
            )
        )

    def submit(self, index: int, host: ProcessHostHandle, job: TrialJob, frozen: bytes) -> None:
        """Hand ``job`` (its trials pickled: ``frozen``) to slot ``index``'s worker; never waits.

        A worker that is being replaced (it died, or retires) gets it once its successor opened
        the run; a slot whose worker cannot start fails it with the reason.
        """
        with self._lock:
            worker = self.workers[index]
            if index in self._broken:
                self._fail_unstarted(index, host, job, self._broken[index])
                return
            if worker is None or worker.dead or worker.retiring or worker.host is not host:
                self._pending[index] = (host, job, frozen)
                return
            self._send_job(worker, host, job, frozen)

    def interrupt(self, index: int) -> None:
        """End slot ``index``'s worker (Ctrl+C); the run loop has told its trial FAIL."""
        with self._lock:
            pending = self._pending.pop(index, None)
            worker = self.workers[index]
            if worker is not None:
                worker.interrupted = True
        if pending is not None:
            host, job, _ = pending
            self.lanes[index].put(lambda: host.lost(list(job.members()), None, None))
        if worker is not None:
            self.kill(worker)

    def unbind(self, host: ProcessHostHandle, timeout_s: float) -> None:
        """Unbind the workers from ``host``'s run; kill those that do not end it in time."""
        ending = self._in_manager(lambda: self._end_run(host))
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                late = [w for w in ending if not (w.ended_run or w.dead)]
                left_s = deadline - time.monotonic()
                if not late or left_s <= 0:
                    break
                self._changed.wait(left_s)
        for worker in late:
            worker.driver_reason = (
                f"its worker process (pid {worker.pid}) did not end the run within "
                f"{timeout_s:g} s; the driver ended the worker"
            )
            self.kill(worker)
        with self._lock:
            for worker in ending:
                if worker.host is host:
                    worker.host = None

    def pids(self) -> list[int]:
        """The pids of the live workers, slot by slot."""
        with self._lock:
            return [
                w.pid for w in self.workers if w is not None and not w.dead and w.pid is not None
            ]

    def close(self) -> None:
        """Stop every worker; wait a few seconds, then kill. Idempotent."""
        stopping = self._in_manager(self._stop_all)
        self._wait_dead(stopping, _STOP_WAIT_S)
        for worker in stopping:
            if not worker.dead:
                self.kill(worker)
        self._wait_dead(stopping, EXIT_WAIT_S)
        for lane in self.lanes:
            lane.stop(EXIT_WAIT_S)

    # -- the manager's thread (and the lanes) ------------------------------------------------

    def kill(self, worker: WorkerProcess) -> None:
        """SIGKILL ``worker`` and its process group (any thread; done by the manager).

        A worker not started yet is killed as soon as it is.
        """
        with self._lock:
            worker.doomed = True
        self.manager.call(lambda: worker.starter.kill(worker))

    def _in_manager(self, function: Any) -> Any:
        """Run ``function`` in the manager's thread; its result. Waits up to a minute."""
        if self.manager.in_thread():
            return function()
        done = threading.Event()
        result: list[Any] = []
        failed: list[BaseException] = []

        def run() -> None:
            try:
                result.append(function())
            except BaseException as error:
                failed.append(error)
            finally:
                done.set()

        self.manager.call(run)
        if not done.wait(_CALL_WAIT_S):
            raise RuntimeError(
                f"The manager thread of the worker processes did not answer within "
                f"{_CALL_WAIT_S:g} s (isolation='process')"
            )
        if failed:
            raise failed[0]
        return result[0] if result else None

    def _start_all(self) -> None:
        for index in range(self.n_workers):
            if self.workers[index] is None:
                self._start(index)

    def _start(self, index: int) -> WorkerProcess:
        starter = self.supervisor.current_starter()
        worker = WorkerProcess(self, index, starter)
        with self._lock:
            self.workers[index] = worker
            self._changed.notify_all()
        self.manager.register(worker.sock, worker.on_events)
        worker.send(
            (
                "init",
                list(sys.path),
                str(self.device),
                index,
                self.torch_threads,
                self.memory_pool,
            )
        )
        starter.start(worker, worker.take_theirs(), {**worker_environment(), **self.env})
        return worker

    def started(self, worker: WorkerProcess, pid: int) -> None:
        with self._lock:
            worker.pid = pid
            doomed = worker.doomed
            self._changed.notify_all()
        if doomed:  # killed before it ran
            worker.starter.kill(worker)

    def _attach_all(self, host: ProcessHostHandle) -> None:
        with self._lock:
            self.bound = host
            broken, self._broken = self._broken, {}
            self._start_failures = [0] * self.n_workers
        for index in range(self.n_workers):
            worker = self.workers[index]
            if worker is None or worker.dead or index in broken:
                worker = self._start(index)
            self._attach(worker, host)

    def _attach(self, worker: WorkerProcess, host: ProcessHostHandle) -> None:
        """Send ``worker`` the run's ``begin`` (once per run)."""
        with self._lock:
            if worker.host is host:
                return
            worker.host = host
            worker.answered = worker.ready = worker.ended_run = False
            worker.setup_error = None
            self._changed.notify_all()
        worker.send(("begin", host.payload))

    def _settled(self, index: int, host: ProcessHostHandle) -> bool:
        """Whether slot ``index`` has answered ``host``'s begin, or cannot (pool's lock held)."""
        if self.bound is not host:
            return False
        if index in self._broken:
            return True
        worker = self.workers[index]
        return worker is not None and not worker.dead and worker.host is host and worker.answered

    def _send_job(
        self, worker: WorkerProcess, host: ProcessHostHandle, job: TrialJob, frozen: bytes
    ) -> None:
        """Send ``job`` to ``worker`` (pool's lock held), or fail it: the run did not begin."""
        from waterwave_hpo import _optuna_compat

        if worker.setup_error is not None:
            error = worker.setup_error
            self.lanes[worker.index].put(lambda: host.lost(list(job.members()), error, None))
            return
        members = [(_optuna_compat.trial_id(m.trial), m.attempt, m.retry_of) for m in job.members()]
        cap = None if job.planning is None else job.planning.cap_bytes
        worker.job = job
        worker.unrecorded = list(job.members())
        worker.interrupted = False
        worker.send(("submit", members, bool(job.batch), cap, frozen))

    def _end_run(self, host: ProcessHostHandle) -> list[WorkerProcess]:
        with self._lock:
            if self.bound is host:
                self.bound = None
            for index, (pending_host, _, _) in list(self._pending.items()):
                if pending_host is host:
                    del self._pending[index]
            ending = [w for w in self.workers if w is not None and w.host is host and not w.dead]
        for worker in ending:
            worker.send(("end",))
        return ending

    def _stop_all(self) -> list[WorkerProcess]:
        with self._lock:
            self.closed = True
            stopping = [w for w in self.workers if w is not None and not w.dead]
            for worker in stopping:
                worker.stopping = True
        for worker in stopping:
            worker.send(("stop",))
        return stopping

    def _wait_dead(self, workers: list[WorkerProcess], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while any(not w.dead for w in workers):
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    return
                self._changed.wait(left_s)

    def dispatch(self, worker: WorkerProcess, message: tuple[Any, ...]) -> None:
        """Serve one message of ``worker`` (the manager's thread; slow work to the lane)."""
        kind = message[0]
        worker.counts["from:" + kind] += 1
        lane = self.lanes[worker.index]
        host = worker.host
        if kind == "batch":  # posted writes, then (maybe) the message that followed them
            inner = [pickle.loads(data) for data in message[1]]
            if inner and inner[-1][0] == "post":  # the worker's periodic flush
                worker.counts["from:flush"] += 1
            for each in inner:
                self.dispatch(worker, each)
        elif kind == "post":
            _, target, method, args = message
            trial_id = args[0] if args else None
            with self._lock:  # whether the trial still runs, as the write arrives
                running = any(_trial_id(m) == trial_id for m in worker.unrecorded)
            lane.put(lambda: self._post(worker, host, running, target, method, args))
        elif kind == "call":
            _, call_id, target, method, args = message
            lane.put(lambda: self._answer(worker, host, call_id, target, method, args))
        elif kind == "records":
            _, records, snapshot, retire = message
            with self._lock:
                if retire:  # the slot's next job must go to a new worker
                    worker.retiring = True
                pairs = [(worker.take_record(record.number), record) for record in records]
            if host is not None:
                lane.put(lambda: host.records(worker, pairs, snapshot))
        elif kind == "refused":
            _, trial_ids, reason = message
            with self._lock:
                members = worker.take_members(list(trial_ids))
            if host is not None and members:
                lane.put(lambda: host.lost(members, None, reason))
        elif kind == "warm":
            with self._lock:
                worker.is_warm = True
                self._changed.notify_all()
        elif kind == "ready":
            with self._lock:
                worker.ready = worker.answered = True
                self._changed.notify_all()
        elif kind == "setup_error":
            _, error, fatal = message
            with self._lock:
                if fatal:
                    worker.fatal_setup_error = error
                    lost: list[TrialJob] = []
                else:
                    worker.setup_error = error
                    worker.answered = True
                    lost, worker.unrecorded = worker.unrecorded, []
                self._changed.notify_all()
            if host is not None and lost:
                lane.put(lambda: host.lost(lost, error, None))
        elif kind == "ended":
            with self._lock:
                worker.ended_run = True
                self._changed.notify_all()

    def _post(
        self,
        worker: WorkerProcess,
        host: ProcessHostHandle | None,
        running: bool,
        target: str,
        method: str,
        args: tuple[Any, ...],
    ) -> None:
        """Run a posted write (the lane). A refused one fails its trial when its record comes.

        Only the first error of a trial is kept (the objective would have stopped there). A
        write to a trial the worker no longer runs (the driver failed it: Ctrl+C) is dropped.
        """
        ok, payload = self._serve_call(worker, host, target, method, args)
        trial_id = args[0] if args else None
        if ok or not running or not isinstance(trial_id, int):
            return
        worker.write_errors.setdefault(trial_id, (method, payload))

    def _answer(
        self,
        worker: WorkerProcess,
        host: ProcessHostHandle | None,
        call_id: int,
        target: str,
        method: str,
        args: tuple[Any, ...],
    ) -> None:
        ok, payload = self._serve_call(worker, host, target, method, args)
        # The payload apart: a value the worker cannot load fails this call there, not the worker.
        try:
            data = dumps(payload)
        except Exception as error:
            ok, data = False, dumps(RuntimeError(f"The storage's answer cannot be sent: {error!r}"))
        worker.send(("answer", call_id, ok, data))

    def _serve_call(
        self,
        worker: WorkerProcess,
        host: ProcessHostHandle | None,
        target: str,
        method: str,
        args: tuple[Any, ...],
    ) -> tuple[bool, Any]:
        if host is not None:
            return host.serve_call(worker, target, method, args)
        return False, ConnectionError("The run this worker served has ended.")

    def worker_exited(
        self,
        worker: WorkerProcess,
        returncode: int | None,
        ended: list[tuple[int, str]],
        start_failure: str | None,
    ) -> None:
        """``worker`` ended: fail (or, after Ctrl+C, drop) what it ran; replace it."""
        worker.receive_rest()
        worker.close()
        with self._lock:
            worker.dead = True
            worker.returncode = returncode
            worker.start_failure = start_failure
            lost, worker.unrecorded = worker.unrecorded, []
            interrupted = worker.interrupted
            host = worker.host
            error = worker.fatal_setup_error
            if error is not None:
                reason = f"waterwave-hpo could not start the worker process: {error}"
            else:
                reason = worker.exit_reason()
            self._changed.notify_all()
        lane = self.lanes[worker.index]
        if host is not None and lost:
            if interrupted:
                lane.put(lambda: host.lost(lost, None, None))
            else:
                lane.put(lambda: host.lost(lost, error, reason))
        lane.put(worker.served.set)
        if ended:
            _logger.warning(
                "Worker process %s ended (%s) leaving %d process(es) it started: %s. They "
                "were ended with it.",
                worker.pid,
                reason,
                len(ended),
                ", ".join(f"{pid} ({name})" for pid, name in ended),
            )
        self._replace(worker)

    def _replace(self, dead: WorkerProcess) -> None:
        """Start ``dead``'s successor now, ahead of the slot's next trial, if it may serve.

        A worker that died before it warmed up is started again only when it was killed from
        outside (kill -9, the OOM killer), up to ``_START_TRIES`` times; one that failed on
        its own (its error, a start the starter could not make) would fail again: the slot is
        broken until the next run, and its jobs fail with the reason.
        """
        index = dead.index
        with self._lock:
            if self.closed or dead.stopping or self.workers[index] is not dead:
                return
            # Never started because its starter gave way (to spawned workers, a new zygote):
            # not its failure.
            moved = dead.pid is None and dead.starter is not self.supervisor.starter
            if not dead.is_warm and not moved:
                self._start_failures[index] += 1
                killed = dead.returncode == -signal.SIGKILL and dead.fatal_setup_error is None
                if not killed or self._start_failures[index] >= _START_TRIES:
                    self._broken[index] = dead
                    pending = self._pending.pop(index, None)
                    self._changed.notify_all()
                    if pending is not None:
                        host, job, _ = pending
                        self._fail_unstarted(index, host, job, dead)
                    return
        worker = self._start(index)
        bound = self.bound
        if bound is None:
            return
        self._attach(worker, bound)
        with self._lock:
            waiting = self._pending.pop(index, None)
            if waiting is not None:
                pending_host, pending_job, frozen = waiting
                if pending_host is bound:
                    self._send_job(worker, bound, pending_job, frozen)


class _Supervisor:
    """What an executor's worker processes share: the manager's thread, the starter, the pools.

    Held by :class:`WorkerPools` and by its finalizer (never the other way round).
    """

    def __init__(self) -> None:
        self.manager = WorkerManager("waterwave-workers")
        self.pools: dict[str, WorkerPool] = {}
        self._starter: Starter | None = None
        self._zygote_starts = 0
        self._closed = False

    @property
    def starter(self) -> Starter | None:
        """The starter new workers get now (``None`` before the first)."""
        return self._starter

    def current_starter(self) -> Starter:
        """The starter new workers get (the manager's thread): made on first use."""
        starter = self._starter
        if starter is None or (isinstance(starter, ZygoteStarter) and starter.failure):
            # None yet, or one that could not start (its workers were told why): a new one.
            starter = self._starter = self._new_starter()
        return starter

    def _new_starter(self) -> Starter:
        reason = spawn_reason()
        if reason is None and self._zygote_starts > ZYGOTE_RESTARTS:
            reason = f"the executor's zygote ended {self._zygote_starts} times"
        if reason is not None:
            say_spawned_once(reason)
            return SpawnStarter(self.manager, self._started, self._exited)
        self._zygote_starts += 1
        return ZygoteStarter(self.manager, self._started, self._exited, self._zygote_lost)

    def _zygote_lost(self, fallback: bool) -> None:
        """The zygote ended unasked: new workers get a new one (or spawned workers)."""
        if self._closed:
            return
        if fallback:
            failure = getattr(self._starter, "failure", None) or "CUDA was loaded at import"
            say_spawned_once(failure)
            self._starter = SpawnStarter(self.manager, self._started, self._exited)
            return
        _logger.warning(
            "%s; its worker processes died with it (their trials fail). A new zygote forks "
            "their successors.",
            getattr(self._starter, "failure", "the executor's zygote ended"),
        )
        self._starter = self._new_starter()

    def _started(self, worker: WorkerProcess, pid: int) -> None:
        worker.pool.started(worker, pid)

    def _exited(
        self,
        worker: WorkerProcess,
        returncode: int | None,
        ended: list[tuple[int, str]],
        start_failure: str | None,
    ) -> None:
        worker.pool.worker_exited(worker, returncode, ended, start_failure)

    def close(self) -> None:
        """End every worker, then the starter, then the manager's thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for pool in list(self.pools.values()):
            pool.close()
        self.pools.clear()
        starter = self._starter
        if starter is not None:
            done = threading.Event()

            def stop() -> None:
                try:
                    starter.stop(EXIT_WAIT_S)
                finally:
                    done.set()

            self.manager.call(stop)
            done.wait(EXIT_WAIT_S * 2)
        self.manager.stop(EXIT_WAIT_S)


class WorkerPools:
    """An executor's warm workers: one :class:`WorkerPool` per device, ended on :meth:`close`.

    A finalizer ends them when the owner is garbage-collected or at interpreter exit (after
    Python has joined the program's threads, so an ``optimize`` still running in one of them
    finishes first), whatever the user forgot.
    """

    def __init__(self) -> None:
        self._supervisor = _Supervisor()
        self._lock = threading.Lock()  # two threads' first calls start one pool per device
        self._finalizer = weakref.finalize(self, _close, self._supervisor)

    @property
    def pools(self) -> dict[str, WorkerPool]:
        """The devices' pools, by device name."""
        return self._supervisor.pools

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
            leases = DeviceLeases(device, n_workers, budget_bytes)
            env: dict[str, str] = {}
            if device.type == "cuda":
                _build_shim_once()
                status = detect_mps()
                say_how_workers_share(status, n_workers)
                share = leases.share_bytes
                if status.running and share is not None:
                    # The driver enforces it, the worker's context included.
                    env = pinned_memory_limit(device.index or 0, share + CONTEXT_RESERVE_BYTES)
            pool = WorkerPool(self._supervisor, device, n_workers, leases, memory_pool, env)
            self.pools[key] = pool
            return pool

    def close(self) -> None:
        """Stop every worker process. Idempotent."""
        self._finalizer()


def _close(supervisor: _Supervisor) -> None:
    own = supervisor.manager.in_thread() or any(
        threading.current_thread() is lane.thread
        for pool in supervisor.pools.values()
        for lane in pool.lanes
    )
    if own:  # collected in a thread that the close waits for: close from another one
        threading.Thread(target=supervisor.close, name="waterwave-close", daemon=True).start()
        return
    supervisor.close()


def _build_shim_once() -> None:
    """Build the pool's torch shim here, once, before K workers would each compile it."""
    with contextlib.suppress(Exception):  # a worker reports the build's error itself
        from waterwave_hpo.memory._internal import build_shim

        build_shim()
