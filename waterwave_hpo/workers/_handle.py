"""The driver's side of process isolation: a device host whose slots are worker processes.

:class:`ProcessHostHandle` is a :class:`~waterwave_hpo.executor._handle.HostHandle` like the thread
host: the run loop asks trials and hands them to its slots. Each slot owns one worker process
(``_worker.py``), started on the slot's first job (``multiprocessing``'s spawn context, so the
K workers import in parallel), reused for the slot's later jobs and replaced after it dies. A
thread per worker serves its pipe: the study's storage calls (checked by the run's
:class:`~waterwave_hpo.relay.StorageService`), memory-lease calls (the device's
:class:`~waterwave_hpo.memory.LeaseBook`), and the records of finished attempts, which it tells
the study from (``host/_runner.py``'s :func:`tell_record`) before it puts the outcome on the
run's queue.

A worker that dies (a segmentation fault, ``abort()``, ``os._exit``, SIGKILL from outside or
from the OOM killer) fails the trial it ran alone: the trial is told FAIL with the signal or
exit code in its ``waterwave:fail_reason`` attribute, and the slot's next job starts a new
worker; the study goes on. A trial whose CUDA error may have poisoned its worker's context
(anything but out of memory) ends as its exception says, and its worker retires: the slot's
next trial starts a new one.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from typing import Any

import torch

from waterwave_hpo import _optuna_compat
from waterwave_hpo.host import NoMemory
from waterwave_hpo.host import OutcomeKind
from waterwave_hpo.host import RunSettings
from waterwave_hpo.host import SlotTable
from waterwave_hpo.host import TrialJob
from waterwave_hpo.host import TrialOutcome
from waterwave_hpo.host import TrialRecord
from waterwave_hpo.host import fail_trial
from waterwave_hpo.host import tell_record
from waterwave_hpo.relay import StorageService
from waterwave_hpo.relay import sendable
from waterwave_hpo.workers._lease_service import LeaseServer
from waterwave_hpo.workers._worker import worker_main

_logger = logging.getLogger("waterwave_hpo")
_EXIT_WAIT_S = 5.0  # how long a worker whose pipe closed may take to be reaped
_DEATH_POLL_S = 1.0  # without a pidfd: how often a pipe thread checks that its worker lives


def exit_reason(exitcode: int | None, pid: int | None) -> str:
    """Why a worker process ended, for a trial's fail reason.

    >>> exit_reason(-11, 42)
    'its worker process (pid 42) died: killed by signal SIGSEGV (Segmentation fault)'
    >>> exit_reason(3, 42)
    'its worker process (pid 42) died: exit code 3'
    """
    where = f"its worker process (pid {pid}) died"
    if exitcode is None:
        return f"{where}: its pipe closed and it did not exit within {_EXIT_WAIT_S:g} s"
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


class _Worker:
    """One worker process and the driver thread that serves its pipe."""

    def __init__(self, slot: WorkerSlot) -> None:
        host = slot.host
        self.slot = slot
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=worker_main,
            args=(child_conn, host.payload, str(host.device), slot.index, host.torch_threads),
            name=f"waterwave-{host.device}-slot{slot.index}",
            daemon=True,
        )
        self.ready = False
        self.setup_error: BaseException | None = None
        self.driver_reason: str | None = None  # why the driver ended the worker, if it did
        self.job: TrialJob | None = None
        self.unrecorded: list[TrialJob] = []  # members of self.job whose record has not come
        self.interrupted = False
        self.dead = False
        self._queued: list[tuple[Any, ...]] = []
        self._neighbours: int | None = None  # the count to send (tell_neighbours)
        self._neighbours_changed = threading.Event()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self.process.start()
        child_conn.close()  # the worker holds it: EOF here once the worker is gone
        self.thread = threading.Thread(
            target=self._serve, name=f"waterwave-pipe-{self.process.pid}", daemon=True
        )
        self.thread.start()
        threading.Thread(
            target=self._send_neighbours,
            name=f"waterwave-neighbours-{self.process.pid}",
            daemon=True,
        ).start()

    # -- the run loop's thread ------------------------------------------------------------

    def run(self, job: TrialJob) -> None:
        """Send ``job`` to the worker (once it is ready)."""
        members = [(_optuna_compat.trial_id(m.trial), m.attempt, m.retry_of) for m in job.members()]
        cap = None if job.planning is None else job.planning.cap_bytes
        with self._lock:
            self.job = job
            self.unrecorded = list(job.members())
            self.interrupted = False
        self.send(("submit", members, bool(job.batch), cap))

    def send(self, message: tuple[Any, ...]) -> None:
        """Send ``message``, or queue it until the worker is ready; never raises."""
        import cloudpickle

        with self._lock:
            if not self.ready and message[0] != "answer":
                self._queued.append(message)
                return
        with contextlib.suppress(Exception), self._send_lock:  # a dead worker: _serve reports
            self.conn.send_bytes(cloudpickle.dumps(message))

    def tell_neighbours(self, n: int) -> None:
        """Have the worker learn that ``n`` other workers run trials; never blocks.

        Only a changed count is sent, from a thread of this worker's own: a worker that stops
        reading its pipe (stuck holding the GIL) blocks that thread, not the run loop's.
        """
        with self._lock:
            if n == self._neighbours:
                return
            self._neighbours = n
        self._neighbours_changed.set()

    def _send_neighbours(self) -> None:
        sent: int | None = None
        while True:
            self._neighbours_changed.wait()
            self._neighbours_changed.clear()
            with self._lock:
                if self.dead:
                    return
                n = self._neighbours
            if n is not None and n != sent:
                self.send(("neighbours", n))
                sent = n

    def kill(self) -> None:
        """End the worker now (SIGKILL); its running trial has been told FAIL."""
        with self._lock:
            self.interrupted = True
        with contextlib.suppress(Exception):
            self.process.kill()

    def stop(self, timeout_s: float) -> None:
        """Ask the worker to exit, wait up to ``timeout_s`` seconds, then kill it."""
        self.send(("stop",))
        self.process.join(timeout=timeout_s)
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.process.kill()
            self.process.join(timeout=_EXIT_WAIT_S)
        self.thread.join(timeout=_EXIT_WAIT_S)
        with contextlib.suppress(Exception):
            self.conn.close()

    # -- the pipe's thread ----------------------------------------------------------------

    def _serve(self) -> None:
        # The worker's death is noticed as its pid's end, not the pipe's EOF nor the process's
        # sentinel: a process it started (fork) inherits both and may hold them open long
        # after it died.
        import cloudpickle

        pidfd = _pidfd(self.process.pid)
        watched: list[Any] = [self.conn] if pidfd is None else [self.conn, pidfd]
        try:
            while True:
                ready = multiprocessing.connection.wait(watched, timeout=_DEATH_POLL_S)
                if self.conn in ready:
                    self._dispatch(cloudpickle.loads(self.conn.recv_bytes()))
                    continue
                if self.process.exitcode is None:  # reaps it once it has died
                    continue
                while self.conn.poll(0):  # what it sent before it died
                    self._dispatch(cloudpickle.loads(self.conn.recv_bytes()))
                break
        except (EOFError, OSError):
            pass
        except Exception as error:  # a message that cannot be read: the worker is unusable
            _logger.error(
                "Worker %s sent a message that cannot be read: %r", self.process.pid, error
            )
            self.driver_reason = (
                f"its worker process (pid {self.process.pid}) sent a message the driver "
                f"could not read: {type(error).__name__}: {error}; the driver ended the worker"
            )
            with contextlib.suppress(Exception):
                self.process.kill()
        finally:
            if pidfd is not None:
                os.close(pidfd)
        self._ended()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "call":
            _, call_id, target, method, args = message
            ok, payload = self.slot.host.serve_call(self, target, method, args)
            import cloudpickle

            self.send(("answer", call_id, *sendable(ok, payload, cloudpickle.dumps)))
        elif kind == "records":
            _, records, snapshot, retire = message
            if retire:  # before the outcomes: the slot's next job must go to a new worker
                with self._lock:
                    self.dead = True
            if snapshot.stop_requested:
                _optuna_compat.request_stop(self.slot.host.settings.study)
            for record in records:
                self._tell(record)
        elif kind == "ready":
            with self._lock:
                self.ready = True
                queued, self._queued = self._queued, []
            for queued_message in queued:
                self.send(queued_message)
        elif kind == "setup_error":
            self.setup_error = message[1]

    def _tell(self, record: TrialRecord) -> None:
        with self._lock:
            job = next((m for m in self.unrecorded if m.trial.number == record.number), None)
            if job is not None:
                self.unrecorded.remove(job)
        if job is None:
            _logger.error(
                "Worker %s reported trial %d, which it was not running.",
                self.process.pid,
                record.number,
            )
            return
        outcome = tell_record(self.slot.host.settings, job, record)
        self.slot.host.outcome(outcome)

    def _ended(self) -> None:
        """The pipe closed: the worker exited. Fail (or, after Ctrl+C, drop) what it ran."""
        self.process.join(timeout=_EXIT_WAIT_S)
        self.slot.host.leases.holder_died(self.process.pid)
        with self._lock:
            self.dead = True
            lost, self.unrecorded = self.unrecorded, []
            interrupted = self.interrupted
        self._neighbours_changed.set()  # its sender ends
        host = self.slot.host
        if not lost:
            return
        settings = host.settings
        if interrupted:
            for member in lost:
                host.outcome(TrialOutcome(member, OutcomeKind.INTERRUPTED, None))
            return
        error = self.setup_error
        if error is not None:
            reason = f"waterwave-hpo could not start the worker process for this trial: {error}"
        elif self.driver_reason is not None:
            reason = self.driver_reason
        else:
            reason = exit_reason(self.process.exitcode, self.process.pid)
        for member in lost:
            frozen = fail_trial(settings.study, member, reason)
            kind = OutcomeKind.FATAL if error is not None else OutcomeKind.FAILED
            host.outcome(TrialOutcome(member, kind, frozen, error, 0, None if error else reason))


class WorkerSlot:
    """One slot of a :class:`ProcessHostHandle`: a trial (or fused batch) at a time, in a worker."""

    def __init__(self, host: ProcessHostHandle, index: int) -> None:
        self.host = host
        self.index = index
        self.job: TrialJob | None = None  # owned by the run loop's thread
        self.worker: _Worker | None = None

    def interrupt(self) -> None:
        """End this slot's worker (Ctrl+C); the run loop has told its trial FAIL."""
        if self.worker is not None:
            self.worker.kill()


class ProcessHostHandle(SlotTable[WorkerSlot]):
    """A device host whose slots run their trials in worker processes (process isolation).

    Only the run loop's thread calls :meth:`idle_slot`, :meth:`submit`, :meth:`running_jobs`
    and :meth:`shutdown`; each worker's pipe thread tells the study and reports outcomes.

    Args:
        device: The device its trials run on.
        n_slots: Worker processes (trials at once, ``trials_per_device``).
        settings: The ``optimize`` call's settings (the driver's study and outcome queue).
        payload: The cloudpickled ``(HostSpec, heartbeat, WorkerEnvironment)`` each worker
            starts from.
        service: The run's storage service (one per ``optimize`` call, shared by all hosts).
        leases: The device's memory leases, served to its workers.
    """

    def __init__(
        self,
        device: torch.device,
        n_slots: int,
        settings: RunSettings,
        payload: bytes,
        service: StorageService,
        leases: LeaseServer,
    ) -> None:
        self.device = device
        self.settings = settings
        self.payload = payload
        self.service = service
        self.leases = leases
        self.scheduler = None
        self.memory = NoMemory()
        self.torch_threads = torch.get_num_threads()
        self.slots = [WorkerSlot(self, index) for index in range(n_slots)]
        self._shut_down = False

    def idle_slot(self) -> WorkerSlot | None:
        """A slot whose last job has been handled, or ``None``."""
        return self.first_idle()

    def submit(self, slot: WorkerSlot, job: TrialJob) -> None:
        """Hand ``job`` to ``slot``'s worker, starting a new worker if it has none alive."""
        assert slot.job is None, "submit() to a busy slot"
        slot.job = job
        worker = slot.worker
        if worker is None or worker.dead or not worker.process.is_alive():
            # A dead worker's pipe thread reports what it ran and ends on its own.
            worker = slot.worker = _Worker(slot)
        worker.run(job)
        self._tell_neighbours()

    def running_jobs(self) -> list[tuple[WorkerSlot, TrialJob]]:
        """The (slot, job) pairs running now."""
        return [(slot, slot.job) for slot in self.slots if slot.job is not None]

    def shutdown(self, timeout_s: float) -> None:
        """Stop every worker, waiting up to ``timeout_s`` seconds for each. Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        workers = [slot.worker for slot in self.slots if slot.worker is not None]
        for worker in workers:
            worker.send(("stop",))
        for worker in workers:
            worker.stop(timeout_s)

    # -- the pipes' threads ---------------------------------------------------------------

    def outcome(self, outcome: TrialOutcome) -> None:
        """Report ``outcome`` to the run loop; the neighbours' counts follow."""
        self.settings.outcomes.put(outcome)
        self._tell_neighbours()

    def serve_call(
        self, worker: _Worker, target: str, method: str, args: tuple[Any, ...]
    ) -> tuple[bool, Any]:
        """Run one call a worker made: ``(True, result)`` or ``(False, exception)``."""
        if target == "storage":
            return self.service.run(method, args)
        if target == "lease":
            return self.leases.run(method, args)
        return False, PermissionError(f"A worker may not call {target}.{method}.")

    def _tell_neighbours(self) -> None:
        # Each worker's trials count the other workers' running trials as neighbours (the
        # executor's OOM retry needs them), as threads of one host count each other.
        running = [
            worker
            for slot in self.slots
            if (worker := slot.worker) is not None and not worker.dead and worker.unrecorded
        ]
        for worker in running:
            worker.tell_neighbours(len(running) - 1)
