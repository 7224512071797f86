"""The driver's side of process isolation: a device host whose slots are worker processes.

:class:`ProcessHostHandle` is a :class:`~waterwave_hpo.executor._handle.HostHandle` like the thread
host: the run loop asks trials and hands them to its slots. Slot ``i`` runs its trials in the
``i``-th warm worker of the device's :class:`~waterwave_hpo.workers._pool.WorkerPool` (started
once per executor, kept across ``optimize`` calls); the handle binds the workers to its run
when it is made (each opens the study through the relay, in parallel) and unbinds them at its
shutdown. Each worker's pipe thread serves the study's storage calls (checked by the run's
:class:`~waterwave_hpo.relay.StorageService`), runs the writes the worker posted (in order,
without answering: one the storage refuses fails its trial with that error when the record
comes) and hands back the records of finished attempts, which it tells the study from
(``host/_runner.py``'s :func:`tell_record`) before it puts the outcome on the run's queue.

A worker that dies (a segmentation fault, ``abort()``, ``os._exit``, SIGKILL from outside or
from the OOM killer) fails the trial it ran alone: the trial is told FAIL with the signal or
exit code in its ``waterwave:fail_reason`` attribute, and a new worker takes the slot at once;
the study goes on. A trial whose CUDA error poisoned its worker's context ends as its
exception says, and its worker retires: a new one takes the slot.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
import logging
from typing import Any

from optuna.trial import TrialState

from waterwave_hpo import _optuna_compat
from waterwave_hpo.host import ATTR_BATCH
from waterwave_hpo.host import ATTR_DEVICE
from waterwave_hpo.host import ATTR_FAIL_REASON
from waterwave_hpo.host import ATTR_SLOT
from waterwave_hpo.host import HostSnapshot
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
from waterwave_hpo.workers import _pool
from waterwave_hpo.workers._pool import EXIT_WAIT_S
from waterwave_hpo.workers._pool import WorkerPool
from waterwave_hpo.workers._pool import WorkerProcess
from waterwave_hpo.workers._worker import dumps

_logger = logging.getLogger("waterwave_hpo")
_REASON_MAX_CHARS = 500


class WorkerSlot:
    """One slot of a :class:`ProcessHostHandle`: a trial (or fused batch) at a time, in a worker."""

    def __init__(self, host: ProcessHostHandle, index: int) -> None:
        self.host = host
        self.index = index
        self.job: TrialJob | None = None  # owned by the run loop's thread

    @property
    def worker(self) -> WorkerProcess | None:
        """The slot's worker now (a new one after a crash)."""
        return self.host.pool.workers[self.index]

    def interrupt(self) -> None:
        """End this slot's worker (Ctrl+C); the run loop has told its trial FAIL."""
        self.host.pool.interrupt(self.index)


class ProcessHostHandle(SlotTable[WorkerSlot]):
    """A device host whose slots run their trials in warm worker processes (process isolation).

    Only the run loop's thread calls :meth:`idle_slot`, :meth:`submit`, :meth:`running_jobs`
    and :meth:`shutdown`; each slot's lane tells the study and reports outcomes.

    Args:
        pool: The device's warm workers (one per slot).
        settings: The ``optimize`` call's settings (the driver's study and outcome queue).
        payload: The cloudpickled ``(HostSpec, heartbeat, WorkerEnvironment)`` each worker
            starts the run from.
        service: The run's storage service (one per ``optimize`` call, shared by all hosts).

    Raises:
        RuntimeError: If no worker could start the run (each died, or could not load the
            objective): the first worker's error, before any trial is asked; if a worker
            neither answered nor died within ``_pool.ANSWER_TIMEOUT_S`` seconds; or if this
            thread's own run holds the pool's workers already (:meth:`WorkerPool.take`).

    Another ``optimize`` call holding the pool's workers (another thread) is waited for.
    """

    samples_in_driver = False
    """Its trials sample with the worker's copy of the sampler (reseeded once per run there):
    the run loop reseeds the driver's sampler once per run, not before every ask."""

    def __init__(
        self,
        pool: WorkerPool,
        settings: RunSettings,
        payload: bytes,
        service: StorageService,
    ) -> None:
        self.pool = pool
        self.device = pool.device
        self.settings = settings
        self.payload = payload
        self.service = service
        self.leases = pool.leases
        self.scheduler = None
        self.memory = NoMemory()
        self.slots = [WorkerSlot(self, index) for index in range(pool.n_workers)]
        self.active = True
        self._shut_down = False
        pool.take()  # given back by shutdown()
        try:
            pool.bind(self, _pool.ANSWER_TIMEOUT_S)
        except BaseException:
            self.shutdown(EXIT_WAIT_S)
            raise

    def idle_slot(self) -> WorkerSlot | None:
        """A slot whose last job has been handled, or ``None``."""
        return self.first_idle()

    def submit(self, slot: WorkerSlot, job: TrialJob) -> None:
        """Hand ``job`` to ``slot``'s worker (its successor, if it is being replaced)."""
        assert slot.job is None, "submit() to a busy slot"
        slot.job = job
        frozen = self._bookkeeping(slot, job)
        # The trials apart from the message: a value the worker cannot load fails them there.
        self.pool.submit(slot.index, self, job, dumps(frozen))

    def _bookkeeping(self, slot: WorkerSlot, job: TrialJob) -> list[Any]:
        """Write where the job runs (as the worker's run path would) and read its trials.

        The worker starts from these copies: no storage round trip to open a trial or record
        its device and slot (the worker's writes of the same values are skipped by its
        storage, :class:`~waterwave_hpo.relay.RelayedStorage`).
        """
        study = self.settings.study
        storage = _optuna_compat.storage_of(study)
        members = job.members()
        frozen = []
        for member in members:
            trial_id = _optuna_compat.trial_id(member.trial)
            if self.settings.record_trial_attrs:
                attrs: dict[str, Any] = {ATTR_DEVICE: str(self.device), ATTR_SLOT: slot.index}
                if job.batch:
                    attrs[ATTR_BATCH] = [m.trial.number for m in members]
                _optuna_compat.set_system_attrs(study, trial_id, attrs)
            self.service.policy.allow_trial(trial_id)  # the worker may use it: no lookup
            frozen.append(storage.get_trial(trial_id))
        return frozen

    def running_jobs(self) -> list[tuple[WorkerSlot, TrialJob]]:
        """The (slot, job) pairs running now."""
        return [(slot, slot.job) for slot in self.slots if slot.job is not None]

    def shutdown(self, timeout_s: float) -> None:
        """Unbind the workers from this run (they stay warm for the next). Idempotent.

        A worker that does not end the run within ``timeout_s`` seconds is killed (and
        replaced).
        """
        if self._shut_down:
            return
        self._shut_down = True
        self.active = False
        try:
            self.pool.unbind(self, timeout_s)
        finally:
            self.pool.give_back()  # the next optimize call may take the workers

    # -- the slots' lanes -----------------------------------------------------------------

    def records(
        self,
        worker: WorkerProcess,
        records: list[tuple[TrialJob | None, TrialRecord]],
        snapshot: HostSnapshot,
    ) -> None:
        """Tell the study how the worker's attempts ended; report their outcomes.

        Args:
            worker: The worker that ran them.
            records: Each record with the member of the worker's job it is of (``None``: the
                worker reported a trial it was not running).
            snapshot: The worker's host as the records left it.
        """
        if snapshot.stop_requested:
            _optuna_compat.request_stop(self.settings.study)
        for job, record in records:
            if job is None:
                _logger.error(
                    "Worker %s reported trial %d, which it was not running.",
                    worker.pid,
                    record.number,
                )
                continue
            failed_write = worker.take_write_error(_optuna_compat.trial_id(job.trial))
            if failed_write is not None:
                record = self._failed_by_write(job, record, *failed_write)
            self.outcome(tell_record(self.settings, job, record))

    def _failed_by_write(
        self, job: TrialJob, record: TrialRecord, method: str, error: BaseException
    ) -> TrialRecord:
        """``record`` of a trial whose posted write ``method`` the storage refused: FAIL.

        The worker sent the write without waiting (its trial's parameters, attributes and
        intermediate values are posted), so the objective went on; the trial ends as if the
        objective had raised ``error`` at that call, as under ``Study.optimize``: FAIL with
        ``error`` as its reason, and ``error`` raised by ``optimize`` unless ``catch`` lists it.
        """
        settings = self.settings
        kind = OutcomeKind.FAILED if isinstance(error, settings.catch) else OutcomeKind.FATAL
        reason = (
            f"{type(error).__name__}: {error} (the study's storage refused the trial's "
            f"{method}, which its worker process sent without waiting)"
        )
        if settings.record_trial_attrs:
            with contextlib.suppress(Exception):
                _optuna_compat.set_system_attr(
                    settings.study,
                    _optuna_compat.trial_id(job.trial),
                    ATTR_FAIL_REASON,
                    reason[:_REASON_MAX_CHARS],
                )
        return replace(
            record,
            kind=kind,
            state=TrialState.FAIL,
            values=None,
            error=error,
            error_traceback=None,
            fail_message=None,
        )

    def lost(
        self, members: list[TrialJob], error: BaseException | None, reason: str | None
    ) -> None:
        """Fail ``members`` (their worker died or could not start the run).

        ``reason`` ``None`` with no ``error``: the driver interrupted them (Ctrl+C), told
        already. With ``error`` (the worker could not start the run): FATAL, as an
        objective's uncaught exception.
        """
        settings = self.settings
        if error is None and reason is None:
            for member in members:
                self.outcome(TrialOutcome(member, OutcomeKind.INTERRUPTED, None))
            return
        why = (
            reason if reason is not None else f"its worker process could not start the run: {error}"
        )
        for member in members:
            frozen = fail_trial(settings.study, member, why)
            kind = OutcomeKind.FATAL if error is not None else OutcomeKind.FAILED
            self.outcome(TrialOutcome(member, kind, frozen, error, 0, None if error else why))

    def outcome(self, outcome: TrialOutcome) -> None:
        """Report ``outcome`` to the run loop."""
        self.settings.outcomes.put(outcome)

    def serve_call(
        self, worker: WorkerProcess, target: str, method: str, args: tuple[Any, ...]
    ) -> tuple[bool, Any]:
        """Run one call a worker made: ``(True, result)`` or ``(False, exception)``."""
        if target == "storage":
            return self.service.run(method, args)
        if target == "neighbours":
            return True, self.running_beside(worker)
        return False, PermissionError(f"A worker may not call {target}.{method}.")

    def running_beside(self, worker: WorkerProcess) -> int:
        """How many other workers of this host run a trial now.

        A worker whose trial ran out of memory asks (the executor's OOM re-run counts them as
        the trial's neighbours, as threads of one host count each other).
        """
        return sum(
            1
            for other in self.pool.workers
            if other is not None
            and other is not worker
            and other.host is self
            and not other.dead
            and other.unrecorded
        )
