"""A device host: slots (threads, each with its own CUDA stream) that run trials on one device.

Waterwave (IEEE TC 2023, Sec. 3) co-hosts training jobs in one process, each on its own stream.
A host has ``trials_per_device`` slots; a slot is a long-lived thread that owns one stream for its
whole life and runs one trial at a time, so at most ``trials_per_device`` trials run on the device
at once. Every attempt ends with the study told COMPLETE, PRUNED or FAIL from the slot's thread,
and a :class:`TrialOutcome` put on the executor's queue.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import ctypes
from dataclasses import dataclass
from dataclasses import field
import gc
import queue
import threading
import traceback
from typing import Any

import optuna
from optuna.trial import TrialState
import torch

from waterwave_hpo import _optuna_compat
from waterwave_hpo.executor import _streams
from waterwave_hpo.executor._attrs import ATTR_DEVICE
from waterwave_hpo.executor._attrs import ATTR_FAIL_REASON
from waterwave_hpo.executor._attrs import ATTR_PEAK_BYTES
from waterwave_hpo.executor._attrs import ATTR_SLOT
from waterwave_hpo.executor._batch import run_batch
from waterwave_hpo.executor._memory import DeviceMemory
from waterwave_hpo.executor._oom import is_out_of_memory
from waterwave_hpo.executor._outcome import OnOOM
from waterwave_hpo.executor._outcome import OutcomeKind
from waterwave_hpo.executor._outcome import TrialJob
from waterwave_hpo.executor._outcome import TrialOutcome
from waterwave_hpo.executor._planning import MemoryPlanMode
from waterwave_hpo.executor._planning import PlanSettings
from waterwave_hpo.executor._planning import find_no_plan_fits
from waterwave_hpo.sim import PLAN_SHRINK
from waterwave_hpo.trial import TrialContext
from waterwave_hpo.trial._internal import CURRENT_CONTEXT as _CURRENT

_REASON_MAX_CHARS = 500


class TrialInterrupted(BaseException):
    """Raised inside a trial's thread when the executor stops it (Ctrl+C on the main thread).

    A ``BaseException``, like ``KeyboardInterrupt``, so that ``except Exception`` in an objective
    does not swallow it.
    """


@dataclass(frozen=True)
class RunSettings:
    """What every slot of one ``optimize`` call needs to run and tell trials."""

    study: optuna.Study
    func: Callable[[Any], Any]
    """The objective: it takes a trial, or a list of trials when batched (``fuse=K``)."""
    catch: tuple[type[BaseException], ...]
    on_oom: OnOOM
    max_oom_retries: int
    gc_after_trial: bool
    outcomes: queue.SimpleQueue[TrialOutcome]
    record_trial_attrs: bool = True
    """Record the trial's device, slot, peak bytes and failure reason as ``waterwave:*``
    system attributes (``WaterwaveExecutor(record_trial_attrs=...)``)."""
    memory_plan: PlanSettings = field(default_factory=PlanSettings)
    """Whether and how trials that do not fit get memory plans (``memory_plan=``)."""


class DeviceHost:
    """The slots of one device for one ``optimize`` call.

    Only the executor's thread calls :meth:`submit`, :meth:`idle_slot`, :meth:`mark_idle`
    and :meth:`shutdown`; slot threads only run trials and report outcomes.

    Args:
        device: The device its trials run on.
        n_slots: How many trials may run at once (``trials_per_device``).
        settings: The ``optimize`` call's settings.
        memory: The device's pool and pipeline scheduler (handed to trials through
            :class:`TrialContext`); ``None`` for neither.
        admit_by_memory: ``trials_per_device="auto"``: start another trial only while
            :meth:`DeviceMemory.has_room` says so.
    """

    def __init__(
        self,
        device: torch.device,
        n_slots: int,
        settings: RunSettings,
        memory: DeviceMemory | None = None,
        admit_by_memory: bool = False,
    ) -> None:
        self.device = device
        self.settings = settings
        self.memory = memory if memory is not None else DeviceMemory(device)
        self.scheduler = self.memory.scheduler
        self.admit_by_memory = admit_by_memory
        self.slots = [_Slot(self, index) for index in range(n_slots)]

    @property
    def n_running(self) -> int:
        """Trials handed to this host whose outcome the executor has not handled yet."""
        return sum(1 for slot in self.slots if slot.job is not None)

    def idle_slot(self) -> _Slot | None:
        """A slot that may take a trial now, or ``None``.

        All slots may be taken; or, with ``admit_by_memory``, the device's measured memory
        demand leaves no room. A host with no trial running always admits one, so that a study
        never stalls (a trial too big for the device then fails alone).
        """
        if self.admit_by_memory and self.n_running > 0 and not self.memory.has_room():
            return None
        for slot in self.slots:
            if slot.job is None:
                return slot
        return None

    def submit(self, slot: _Slot, job: TrialJob) -> None:
        """Hand ``job`` to the idle ``slot``; starts the slot's thread on first use."""
        assert slot.job is None, "submit() to a busy slot"
        for member in job.members():
            self.memory.trial_admitted(member.trial)
        slot.job = job
        slot.start()
        slot.inbox.put(job)

    def running_jobs(self) -> list[tuple[_Slot, TrialJob]]:
        """The (slot, job) pairs running now."""
        return [(slot, slot.job) for slot in self.slots if slot.job is not None]

    def shutdown(self, timeout_s: float) -> None:
        """Stop the slot threads; wait up to ``timeout_s`` seconds in all for them to end."""
        for slot in self.slots:
            if slot.thread is not None:
                slot.inbox.put(None)
        deadline = timeout_s
        for slot in self.slots:
            if slot.thread is not None:
                slot.thread.join(timeout=max(0.0, deadline))


class _Slot:
    """One trial at a time, in its own thread, on its own stream."""

    def __init__(self, host: DeviceHost, index: int) -> None:
        self.host = host
        self.index = index
        self.inbox: queue.SimpleQueue[TrialJob | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.job: TrialJob | None = None  # owned by the executor's thread
        self.busy = False  # owned by the slot's thread: inside an objective now

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._loop,
                name=f"waterwave-{self.host.device}-slot{self.index}",
                daemon=True,
            )
            self.thread.start()

    def interrupt(self) -> None:
        """Raise :class:`TrialInterrupted` in this slot's thread if it is inside an objective.

        The exception arrives at the thread's next Python bytecode; a long native call (a CUDA
        kernel launch, a big matmul on the CPU) finishes first.
        """
        if self.thread is not None and self.thread.ident is not None and self.busy:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.thread.ident), ctypes.py_object(TrialInterrupted)
            )

    def neighbours(self) -> int:
        """How many other slots of this host are inside an objective now."""
        return sum(1 for slot in self.host.slots if slot is not self and slot.busy)

    def _loop(self) -> None:
        device = self.host.device
        stream: torch.cuda.Stream | None = None
        setup_error: BaseException | None = None
        if device.type == "cuda":
            try:
                torch.cuda.set_device(device)
                stream = _streams.acquire_stream(device)
            except BaseException as error:  # reported with the first job, then the slot exits
                setup_error = error
        try:
            while True:
                job = self.inbox.get()
                if job is None:
                    return
                settings = self.host.settings
                if setup_error is not None:
                    outcomes = [
                        _fail_without_running(settings, member, setup_error)
                        for member in job.members()
                    ]
                else:
                    try:
                        if job.batch:
                            outcomes = run_batch(self, job, stream)
                        else:
                            outcomes = [_run_trial(self, job, stream)]
                    except TrialInterrupted as interrupted:  # inside the executor's own calls
                        _release_interrupted(interrupted)
                        with contextlib.suppress(Exception):
                            _optuna_compat.release_thread_session(settings.study)
                        outcomes = [
                            TrialOutcome(member, OutcomeKind.INTERRUPTED, None)
                            for member in job.members()
                        ]
                    except BaseException as error:  # the study's storage failed, not the trial
                        outcomes = [
                            _fail_without_running(settings, member, error)
                            for member in job.members()
                        ]
                for outcome in outcomes:
                    settings.outcomes.put(outcome)
                if setup_error is not None:
                    return
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    _streams.release_stream(stream)


@contextlib.contextmanager
def on_trial_stream(
    device: torch.device, stream: torch.cuda.Stream | None, pool: Any
) -> Iterator[None]:
    """Make ``stream`` current on ``device`` for the block, in PyTorch and CuPy.

    Make ``stream`` current on ``device`` for the block, in PyTorch and CuPy (nothing on the
    CPU); with the pool installed, turn its exhaustion into ``torch.cuda.OutOfMemoryError``.
    """
    if stream is None:
        yield
        return
    from waterwave_hpo.memory._internal import cupy_on_stream

    index = device.index if device.index is not None else 0
    # CuPy's current stream too, so a trial's CuPy work is ordered with its PyTorch work.
    with (
        torch.cuda.device(device),
        torch.cuda.stream(stream),
        cupy_on_stream(stream.cuda_stream, index, pool),
    ):
        if pool is None:
            yield
            return
        from waterwave_hpo.memory import translate_oom

        # A pluggable allocator's exhaustion reaches Python as a plain RuntimeError; make it the
        # torch.cuda.OutOfMemoryError that OOM isolation and users' own handlers expect.
        with translate_oom():
            yield


def _run_trial(slot: _Slot, job: TrialJob, stream: torch.cuda.Stream | None) -> TrialOutcome:
    settings = slot.host.settings
    study, trial = settings.study, job.trial
    device = slot.host.device
    context = TrialContext(
        trial=trial,
        trial_number=trial.number,
        device=device,
        stream=stream,
        slot=slot.index,
        attempt=job.attempt,
        scheduler=slot.host.scheduler,
        retry_of=None if job.retry_of is None else int(job.retry_of),
        planning=job.planning,
    )
    if job.planning is not None:
        job.planning.device_plans = slot.host.memory.plans
    _optuna_compat.set_in_optimize_loop(study, True)
    token = _CURRENT.set(context)
    memory = slot.host.memory
    account: Any = None
    peak_bytes: int | None = None
    value: Any = None
    pruned = False
    error: BaseException | None = None
    slot.busy = True
    try:
        _set_attr(settings, trial, ATTR_DEVICE, str(device))
        _set_attr(settings, trial, ATTR_SLOT, slot.index)
        account = memory.open_account(trial.number, stream)
        with on_trial_stream(device, stream, memory.pool):
            value = settings.func(trial)
    except optuna.TrialPruned:
        pruned = True
    except BaseException as caught:  # classified below; KeyboardInterrupt included
        error = caught
    finally:
        neighbours = slot.neighbours()
        slot.busy = False
        _CURRENT.reset(token)
        no_plan_fits = find_no_plan_fits(error)
        out_of_memory = isinstance(error, Exception) and (
            no_plan_fits is not None or is_out_of_memory(error)
        )
        if out_of_memory:
            # Free the failed trial's tensors (held by the traceback's frames) before its
            # scheduler share is released and before anyone retries.
            _release_memory(error, device)  # type: ignore[arg-type]
        with contextlib.suppress(Exception):
            peak_bytes = memory.close_account(trial.number, account)
        with contextlib.suppress(Exception):
            memory.trial_ended(trial.number)  # a pruned or finished trial frees its share at once

    if isinstance(error, TrialInterrupted):
        # The executor has told the study FAIL already; make sure, without raising. The
        # interrupt may have landed inside a storage call, leaving a database connection in a
        # transaction (SQLite: holding the file's write lock) referenced only by the
        # traceback's frames: free them, and this thread's session, before anyone writes.
        _release_interrupted(error)
        error = None
        with contextlib.suppress(Exception):
            _optuna_compat.release_thread_session(study)
        with contextlib.suppress(Exception):
            settings.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        return TrialOutcome(job, OutcomeKind.INTERRUPTED, None)

    if peak_bytes is not None:
        with contextlib.suppress(Exception):
            _set_attr(settings, trial, ATTR_PEAK_BYTES, peak_bytes)
    fail_message: str | None = None
    if pruned:
        frozen, _ = _tell(settings.study, trial, state=TrialState.PRUNED)
        kind = OutcomeKind.PRUNED
    elif error is None:
        frozen, fail_message = _tell(settings.study, trial, values=value)
        kind = OutcomeKind.COMPLETE
    else:
        kind = _classify(settings, job, error, neighbours, out_of_memory)
        if no_plan_fits is not None:
            reason = f"out of device memory: {no_plan_fits}"
        elif out_of_memory:
            reason = f"out of device memory with {neighbours} neighbour(s): {error}"
        else:
            reason = "".join(traceback.format_exception_only(type(error), error)).strip()
        with contextlib.suppress(Exception):
            _set_attr(settings, trial, ATTR_FAIL_REASON, reason[:_REASON_MAX_CHARS])
        frozen, _ = _tell(settings.study, trial, state=TrialState.FAIL)
    if fail_message is not None:
        with contextlib.suppress(Exception):
            _set_attr(settings, trial, ATTR_FAIL_REASON, fail_message[:_REASON_MAX_CHARS])
    if settings.gc_after_trial:
        gc.collect()
    return TrialOutcome(job, kind, frozen, error, neighbours, fail_message, value)


def _classify(
    settings: RunSettings,
    job: TrialJob,
    error: BaseException,
    neighbours: int,
    out_of_memory: bool,
) -> OutcomeKind:
    if out_of_memory:
        if find_no_plan_fits(error) is not None:
            return OutcomeKind.OOM_FAILED  # no neighbour leaving and no smaller plan can help
        retry = settings.on_oom is OnOOM.RETRY and job.attempt < settings.max_oom_retries
        if retry and planned_rerun_cap(job) is not None:
            return OutcomeKind.OOM_RETRY  # re-run with a smaller plan, even alone
        if retry and neighbours > 0:
            return OutcomeKind.OOM_RETRY
        return OutcomeKind.OOM_FAILED
    if isinstance(error, settings.catch):
        return OutcomeKind.FAILED
    return OutcomeKind.FATAL


def planned_rerun_cap(job: TrialJob) -> int | None:
    """The plan cap of ``job``'s re-run after it ran out of memory, or ``None`` for no plan.

    With ``memory_plan="home"`` and a model registered with ``fit_trial_memory``: a re-run
    plans for at most ``PLAN_SHRINK`` of the footprint that failed, if the model can be planned
    that small.
    """
    planning = job.planning
    if planning is None or planning.settings.mode is MemoryPlanMode.OFF:
        return None
    return planning.rerun_cap_bytes(PLAN_SHRINK)


def _release_interrupted(error: BaseException) -> None:
    # Frames of an interrupted storage call may hold an open database transaction.
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)
    error.__traceback__ = None
    gc.collect()


def _release_memory(error: BaseException, device: torch.device) -> None:
    # The traceback's frames hold the failed trial's tensors; free them before anyone retries.
    tb = error.__traceback__
    if tb is not None:
        traceback.clear_frames(tb)
    for linked in (error.__cause__, error.__context__):
        if linked is not None and linked.__traceback__ is not None:
            traceback.clear_frames(linked.__traceback__)
    gc.collect()
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def _set_attr(settings: RunSettings, trial: optuna.trial.Trial, key: str, value: object) -> None:
    # The executor's bookkeeping is a system attribute, and only on request: the user's
    # attributes stay the user's, and trials_dataframe() shows Optuna's columns.
    if settings.record_trial_attrs:
        _optuna_compat.set_system_attr(settings.study, _optuna_compat.trial_id(trial), key, value)


def _tell(
    study: optuna.Study,
    trial: optuna.trial.Trial,
    values: Any = None,
    state: TrialState | None = None,
) -> tuple[optuna.trial.FrozenTrial, str | None]:
    # As Study.optimize tells: an invalid return value is logged as the trial's failure, not
    # warned; skip_if_finished: the executor may have told FAIL already (Ctrl+C) or the
    # objective may have told the study itself.
    return _optuna_compat.tell_as_optimize(study, trial, values, state)


def _fail_without_running(
    settings: RunSettings, job: TrialJob, error: BaseException
) -> TrialOutcome:
    """Tell FAIL for a trial the executor itself could not run or tell; never raises."""
    reason = f"waterwave-hpo could not run or tell this trial: {error!r}"
    frozen = None
    with contextlib.suppress(Exception):
        _set_attr(settings, job.trial, ATTR_FAIL_REASON, reason[:_REASON_MAX_CHARS])
    with contextlib.suppress(Exception):
        frozen, _ = _tell(settings.study, job.trial, state=TrialState.FAIL)
    return TrialOutcome(job, OutcomeKind.FATAL, frozen, error)
