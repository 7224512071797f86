"""The driver's side of a host actor.

The driver's side of a host actor: a :class:`RayHostHandle` that the executor drives like a
:class:`~waterwave_hpo.host._device_host.DeviceHost`, and a thread that tells the study.

The executor's loop (``OptimizeRun`` in ``executor/_optimize.py``) asks trials and hands them to
hosts; for a remote host, :meth:`RayHostHandle.submit` hands the trial's id to the host's poller
thread, which sends it with its next poll (one actor call per trial), or sends it at once when a
poll is under way. The poller collects how each attempt ended, tells the study in the driver's
process (so the user's sampler, pruner state and callbacks see it), and puts the outcome on the
executor's queue.
When the actor dies (killed, out of host memory, its node lost) the poller tells each of its
running trials FAIL and reports it :attr:`~OutcomeKind.HOST_LOST`, so the executor re-queues its
parameters on the remaining hosts: nothing is lost and nothing stays RUNNING.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import logging
import threading
from typing import Any

import optuna

from waterwave_hpo import _optuna_compat
from waterwave_hpo.cluster._actor import ATTR_HOST
from waterwave_hpo.cluster._actor import ATTR_NODE
from waterwave_hpo.cluster._actor import HostInfo
from waterwave_hpo.cluster._actor import TrialRecord
from waterwave_hpo.host import ATTR_BATCH
from waterwave_hpo.host import ATTR_DEVICE
from waterwave_hpo.host import ATTR_SLOT
from waterwave_hpo.host import NoMemory
from waterwave_hpo.host import OutcomeKind
from waterwave_hpo.host import RunSettings
from waterwave_hpo.host import SlotTable
from waterwave_hpo.host import TrialJob
from waterwave_hpo.host import TrialOutcome
from waterwave_hpo.host import fail_trial
from waterwave_hpo.host import tell_record
from waterwave_hpo.relay import StudyAccessPolicy
from waterwave_hpo.scheduler import PipelineScheduler

_logger = logging.getLogger("waterwave_hpo")
_POLL_S = 1.0
"""How long a poll waits on the actor for a trial to end: it returns as soon as one does, so this
bounds only an idle host's polls."""
_ROOM_POLL_S = 0.1
"""The same with ``trials_per_device="auto"``: the host's memory room changes without a trial
ending, and the driver admits the next trial only when a poll says there is room."""
_REFILL_WAIT_S = 0.05
"""How long the poller, having told trials that freed slots, waits for the executor's next jobs
to send them with its next poll (the executor asks and submits within ~1-3 ms in memory; a job
that comes later goes in a call of its own). Bounds how late another trial's end on the same
host is collected when no job follows (the study's last trials)."""
_UNAVAILABLE_RETRIES = 50  # ActorUnavailableError is transient (a network blip): ~5 s of retries


class RaySlot:
    """A slot of a remote host, as the executor sees it."""

    def __init__(self, host: RayHostHandle, index: int) -> None:
        self.host = host
        self.index = index
        self.job: TrialJob | None = None

    def interrupt(self) -> None:
        """Ask the actor to stop this slot's trial (Ctrl+C); never raises."""
        with contextlib.suppress(Exception):
            self.host.actor.interrupt.remote(self.index)


class RayHostHandle(SlotTable[RaySlot]):
    """A host actor, driven by the executor's thread like a ``DeviceHost``.

    A host actor, driven by the executor's thread through the
    :class:`~waterwave_hpo.executor._handle.HostHandle` interface (as a ``DeviceHost`` is).

    Args:
        actor: The started :class:`~waterwave_hpo.cluster._actor.HostActor` handle.
        info: Where it runs.
        n_slots: Its ``trials_per_device``.
        admit_by_memory: ``trials_per_device="auto"``: admit another trial only while the
            actor's last poll said its memory has room.
        settings: The ``optimize`` call's settings (the driver's study and outcome queue).
        max_host_retries: How many times one set of parameters is re-queued after its host was
            lost (>= 0); past that, the trial is told FAIL and the search goes on.
        on_lost: Called (in the poller thread) once this host is lost.
        describe_loss: Called (in the poller thread) when this host is lost, before its
            trials are told FAIL: ``(reason, re_queue)``, the fail reason and whether their
            parameters are re-queued (``RayExecutor(isolation="process")``: a process that
            crashed on an alive node fails its one trial, with the signal). ``None``: "its
            device host was lost", re-queued.
        access: The run's storage policy: the trials handed to this host are allowed at once.
    """

    samples_in_driver = False
    """Its trials sample in the actor, with the actor's copy of the sampler (reseeded once as
    the actor opens the run: ``HostSpec.reseed_sampler_rng``): the run loop reseeds the
    driver's sampler once per run, not before every ask."""

    def __init__(
        self,
        actor: Any,
        info: HostInfo,
        n_slots: int,
        admit_by_memory: bool,
        settings: RunSettings,
        max_host_retries: int,
        on_lost: Callable[[RayHostHandle, BaseException], None],
        describe_loss: Callable[[RayHostHandle, BaseException], tuple[str, bool]] | None = None,
        access: StudyAccessPolicy | None = None,
    ) -> None:
        self.actor = actor
        self.access = access
        self.info = info
        self.device: str = info.label
        self.scheduler: PipelineScheduler | None = None  # the actor's own; none in the driver
        self.memory = NoMemory()
        self.settings = settings
        self.admit_by_memory = admit_by_memory
        self.max_host_retries = max_host_retries
        self.slots = [RaySlot(self, index) for index in range(n_slots)]
        self.lost = False
        self._shut_down = False
        self._on_lost = on_lost
        self._describe_loss = describe_loss
        self._lock = threading.Lock()
        self._reported: set[int] = set()
        """Trial numbers whose outcome is claimed: told from a record, or failed as lost. The
        poller (records) and the executor's thread (a submit that finds the actor dead) may both
        reach a job; the first claim reports it, so no trial is told twice or re-run after it
        finished."""
        self._has_room = True
        self._submitted: list[Any] = []  # submits the poller has not seen succeed yet
        self._wake = threading.Condition(self._lock)
        self._outbox: list[tuple[Any, ...]] = []
        """Jobs to send with the next poll (``HostActor.submit``'s arguments)."""
        self._polling = False
        """Whether a poll is under way: a job submitted meanwhile goes in a call of its own."""
        self._freed = 0
        """Slots the last poll's records freed: the poller waits (a little) for their jobs."""
        self._stop = threading.Event()
        self._poller = threading.Thread(
            target=self._poll_loop, name=f"waterwave-ray-{info.label}", daemon=True
        )
        self._poller.start()

    # -- the executor's thread --------------------------------------------------------------

    def idle_slot(self) -> RaySlot | None:
        """A slot that may take a trial now, or ``None`` (all busy, no memory room, or lost)."""
        if self.lost:
            return None
        if self.admit_by_memory and self.n_running > 0 and not self._has_room:
            return None
        return self.first_idle()

    def submit(self, slot: RaySlot, job: TrialJob) -> None:
        """Send ``job`` to the actor's slot; a host lost meanwhile reports it HOST_LOST."""
        with self._lock:
            slot.job = job
            lost = self.lost
            if self.admit_by_memory:
                self._has_room = False  # until the actor measures again
        if lost:
            for member in job.members():
                self._report_lost(member, "its host was lost before the trial started")
            return
        try:
            members = [
                (_optuna_compat.trial_id(m.trial), m.attempt, m.retry_of) for m in job.members()
            ]
            frozen = self._bookkeeping(slot, job)
            cap = None if job.planning is None else job.planning.cap_bytes
            args = (slot.index, members, bool(job.batch), cap, frozen)
            with self._lock:
                if self.lost:  # _mark_lost reported the job (its slot was set above)
                    return
                if not self._polling:  # the poller sends it with its next poll
                    self._outbox.append(args)
                    self._wake.notify()
                    return
            # A poll is under way: a call of its own, not waited for here (a round trip less
            # for the driver): the poller checks it, and a dead actor fails the poll anyway.
            submitted = self.actor.submit.remote(*args)
            with self._lock:
                self._submitted.append(submitted)
        except Exception as error:  # the actor died; the poller reports the others
            self._mark_lost(error)

    def _bookkeeping(self, slot: RaySlot, job: TrialJob) -> list[optuna.trial.FrozenTrial]:
        """Write where the job runs (as the host's run path would) and read its trials.

        The host then starts from these copies: no storage round trip to open a trial or
        record its host, node, device and slot (the host's writes of the same values are
        skipped by its storage, :class:`~waterwave_hpo.relay.RelayedStorage`).
        """
        study = self.settings.study
        storage = _optuna_compat.storage_of(study)
        members = job.members()
        frozen = []
        for member in members:
            trial_id = _optuna_compat.trial_id(member.trial)
            attrs: dict[str, Any] = {
                ATTR_HOST: self.info.label,
                ATTR_NODE: self.info.node_id,
                ATTR_DEVICE: self.info.device,
                ATTR_SLOT: slot.index,
            }
            if job.batch:
                attrs[ATTR_BATCH] = [m.trial.number for m in members]
            _optuna_compat.set_system_attrs(study, trial_id, attrs)
            if self.access is not None:  # the host may use it: no lookup when it does
                self.access.allow_trial(trial_id)
            frozen.append(storage.get_trial(trial_id))
        return frozen

    def running_jobs(self) -> list[tuple[RaySlot, TrialJob]]:
        """The (slot, job) pairs running now."""
        return [(slot, slot.job) for slot in self.slots if slot.job is not None]

    def shutdown(self, timeout_s: float) -> None:
        """Stop the poller and the actor; kill the actor (its GPU goes back to Ray).

        Idempotent.
        """
        import ray

        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        self._stop.set()
        with self._lock:
            self._wake.notify_all()
        if not self.lost:
            with contextlib.suppress(Exception):
                ray.get(self.actor.shutdown.remote(timeout_s), timeout=timeout_s + 5.0)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        self._poller.join(timeout=timeout_s)

    # -- the poller thread ----------------------------------------------------------------

    def _poll_loop(self) -> None:
        import ray

        # Transient (Ray >= 2.2x); older Rays report only deaths.
        transient: Any = getattr(ray.exceptions, "ActorUnavailableError", ())
        unavailable = 0
        wait_s = _ROOM_POLL_S if self.admit_by_memory else _POLL_S
        while not self._stop.is_set() and not self.lost:
            submits = self._take_outbox()
            try:
                try:
                    records, snapshot = ray.get(self.actor.poll.remote(wait_s, submits))
                finally:
                    with self._lock:
                        self._polling = False
            except transient as error:
                unavailable += 1
                # Whether the jobs it carried started is unknown: lose the host (as a failed
                # submit does); a poll alone is tried again.
                if submits or unavailable > _UNAVAILABLE_RETRIES:
                    self._mark_lost(error)
                continue
            except Exception as error:  # RayActorError: killed, crashed, a job could not start
                if not self._stop.is_set():
                    self._mark_lost(error)
                return
            unavailable = 0
            if not self._submits_ok(ray):
                return
            self._has_room = snapshot.has_room
            if snapshot.stop_requested:
                # An objective on the host called study.stop(): stop the driver's loop too
                # (the flag _optuna_compat.stop_requested reads).
                _optuna_compat.request_stop(self.settings.study)
            for record in records:
                self._tell(record)
            with self._lock:
                self._freed = min(len(records), len(self.slots))

    def _take_outbox(self) -> list[tuple[Any, ...]]:
        """The jobs to send with the next poll, waiting a little for those of freed slots."""
        with self._lock:
            if self._freed:
                self._wake.wait_for(
                    lambda: len(self._outbox) >= self._freed or self._stop.is_set() or self.lost,
                    timeout=_REFILL_WAIT_S,
                )
            submits, self._outbox = self._outbox, []
            self._freed = 0
            self._polling = True
            return submits

    def _submits_ok(self, ray: Any) -> bool:
        """Check the submits that have ended; a failed one loses the host (returns False)."""
        with self._lock:
            submitted, self._submitted = self._submitted, []
        if not submitted:
            return True
        ended, waiting = ray.wait(submitted, num_returns=len(submitted), timeout=0)
        with self._lock:
            self._submitted[:0] = waiting
        for ref in ended:
            try:
                ray.get(ref)
            except Exception as error:  # the actor could not take the trial: as if it died
                self._mark_lost(error)
                return False
        return True

    def _tell(self, record: TrialRecord) -> None:
        slot_job = self.slots[record.slot].job if 0 <= record.slot < len(self.slots) else None
        job = next(
            (
                m
                for m in (slot_job.members() if slot_job else ())
                if m.trial.number == record.number
            ),
            None,
        )
        if slot_job is None or job is None:
            _logger.error(
                "Host %s reported trial %d, which it was not running.", self.device, record.number
            )
            return
        if not self._claim(job):
            return  # already failed as lost (a submit found the actor dead meanwhile)
        if job.planning is not None and record.footprint_bytes is not None:
            # The host planned the attempt; the driver plans its re-run from the same bytes.
            job.planning.footprint_bytes = record.footprint_bytes
            job.planning.smallest_peak_bytes = record.smallest_peak_bytes
        outcome = tell_record(self.settings, job, record)  # as process isolation's workers
        if not slot_job.batch:  # a fused batch's slot is freed by the executor once all end
            with self._lock:
                self.slots[record.slot].job = None
        self.settings.outcomes.put(outcome)

    def _mark_lost(self, error: BaseException) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = True
            jobs = [m for slot in self.slots if slot.job is not None for m in slot.job.members()]
        _logger.warning("Device host %s was lost: %s", self.device, error)
        # It may still be alive (a submit it refused, a network partition past the retries):
        # end it before it is replaced, so it frees its GPU share and runs nothing more.
        with contextlib.suppress(Exception):
            import ray

            ray.kill(self.actor, no_restart=True)
        reason, re_queue = f"its device host {self.device} was lost: {error!r}", True
        if self._describe_loss is not None:
            reason, re_queue = self._describe_loss(self, error)
        for job in jobs:
            self._report_lost(job, reason, re_queue)
        self._on_lost(self, error)

    def _claim(self, job: TrialJob) -> bool:
        with self._lock:
            if job.trial.number in self._reported:
                return False
            self._reported.add(job.trial.number)
            return True

    def _report_lost(self, job: TrialJob, reason: str, re_queue: bool = True) -> None:
        if not self._claim(job):
            return  # its record was told first: it finished, nothing to fail or re-run
        frozen = fail_trial(self.settings.study, job, reason)
        kind = (
            OutcomeKind.HOST_LOST
            if re_queue and job.attempt < self.max_host_retries
            else OutcomeKind.FAILED
        )
        with self._lock:
            for slot in self.slots:
                if slot.job is job:  # one trial; a fused batch's slot is freed by the executor
                    slot.job = None
        self.settings.outcomes.put(TrialOutcome(job, kind, frozen, None, 0, reason))
