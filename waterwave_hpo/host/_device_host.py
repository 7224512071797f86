"""A device host: slots (threads, each with its own CUDA stream) that run trials on one device.

Waterwave (IEEE TC 2023, Sec. 3) co-hosts training jobs in one process, each on its own stream.
A host has ``trials_per_device`` slots; a slot is a long-lived thread that owns one stream for its
whole life and runs one trial at a time, so at most ``trials_per_device`` trials run on the device
at once. Every attempt ends with the study told COMPLETE, PRUNED or FAIL from the slot's thread,
and a :class:`TrialOutcome` put on the executor's queue; the run itself is
``host/_attempt.py``'s, shared with the cluster's hosts.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import ctypes
from dataclasses import dataclass
from dataclasses import field
import queue
import threading
import time
from typing import Any

import optuna
import torch

from waterwave_hpo import _optuna_compat
from waterwave_hpo.host import _streams
from waterwave_hpo.host._attempt import TrialInterrupted
from waterwave_hpo.host._attempt import fail_without_running
from waterwave_hpo.host._attempt import release_interrupted
from waterwave_hpo.host._attempt import run_job
from waterwave_hpo.host._memory import DeviceMemory
from waterwave_hpo.host._memory import MemoryPoolMode
from waterwave_hpo.host._memory import make_device_memory
from waterwave_hpo.host._outcome import OnOOM
from waterwave_hpo.host._outcome import OutcomeKind
from waterwave_hpo.host._outcome import TrialJob
from waterwave_hpo.host._outcome import TrialOutcome
from waterwave_hpo.host._planning import MemoryPlanMode
from waterwave_hpo.host._planning import PlanSettings
from waterwave_hpo.host._slots import SlotTable


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


class DeviceHost(SlotTable["_Slot"]):
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
        slot_indices: The indices its slots carry (default ``0 .. n_slots - 1``): a worker
            process of process isolation runs one slot of the driver's host.
    """

    def __init__(
        self,
        device: torch.device,
        n_slots: int,
        settings: RunSettings,
        memory: DeviceMemory | None = None,
        admit_by_memory: bool = False,
        slot_indices: list[int] | None = None,
    ) -> None:
        self.device = device
        self.settings = settings
        self.memory = memory if memory is not None else DeviceMemory(device)
        self.scheduler = self.memory.scheduler
        self.admit_by_memory = admit_by_memory
        indices = list(range(n_slots)) if slot_indices is None else list(slot_indices)
        self.slots = [_Slot(self, index) for index in indices]
        self.count_outside: Callable[[], int] | None = None
        """How many trials run on the device outside this host (the other worker processes of
        the driver's host, under process isolation), or ``None`` for none: asked only when an
        attempt ran out of memory (they count as its neighbours for the re-run's decision), so
        a trial that ends otherwise costs no question to the driver."""

    @classmethod
    def build(
        cls,
        device: torch.device,
        n_slots: int,
        settings: RunSettings,
        *,
        memory_pool: MemoryPoolMode,
        memory_budget_bytes: int | None,
        policy: Any,
        admit_by_memory: bool = False,
        slot_indices: list[int] | None = None,
    ) -> DeviceHost:
        """A host with its device's memory machinery, as every runner of trials builds it.

        The driver (threads), a worker process and a Ray host actor all build their host here:
        the device's pool and scheduler (:func:`make_device_memory`, sized for ``n_slots``
        trials, with plans when ``settings.memory_plan`` asks for them), then the slots.

        Args:
            device: The device the trials run on.
            n_slots: Trials at once (slots made; threads start on first use).
            settings: The run's settings (``settings.memory_plan`` decides plans).
            memory_pool: ``WaterwaveExecutor(memory_pool=...)``.
            memory_budget_bytes: The device's memory budget in bytes, or ``None``.
            policy: The scheduler's policy (a name or a ``Policy``).
            admit_by_memory: ``trials_per_device="auto"``: admit by measured memory.
            slot_indices: The slots' indices (a worker's one slot keeps its driver's index).
        """
        memory = make_device_memory(
            device,
            memory_pool,
            memory_budget_bytes,
            policy,
            max_trials=n_slots,
            plans=settings.memory_plan.mode is not MemoryPlanMode.OFF,
        )
        return cls(
            device,
            n_slots,
            settings,
            memory=memory,
            admit_by_memory=admit_by_memory,
            slot_indices=slot_indices,
        )

    def idle_slot(self) -> _Slot | None:
        """A slot that may take a trial now, or ``None``.

        All slots may be taken; or, with ``admit_by_memory``, the device's measured memory
        demand leaves no room. A host with no trial running always admits one, so that a study
        never stalls (a trial too big for the device then fails alone).
        """
        if self.admit_by_memory and self.n_running > 0 and not self.memory.has_room():
            return None
        return self.first_idle()

    def submit(self, slot: _Slot, job: TrialJob) -> None:
        """Hand ``job`` to the idle ``slot``; starts the slot's thread on first use."""
        assert slot.job is None, "submit() to a busy slot"
        for i, member in enumerate(job.members()):
            # A fused batch reserves under its first trial only (the one call's context).
            self.memory.trial_admitted(member.trial, scheduled=i == 0)
        slot.job = job
        slot.start()
        slot.inbox.put(job)

    def run_here(self, slot: _Slot, job: TrialJob) -> None:
        """Run ``job`` in ``slot`` in the calling thread, which then is the slot's thread.

        For a host whose caller waits for each job anyway: a worker process of process
        isolation runs its one slot's trials in the thread that reads its pipe, with no
        hand-off to a slot thread. The outcomes go to the outcome queue as from a slot thread,
        before this returns. The caller must be the same thread for every job of the slot
        (its CUDA stream is acquired in it once, and released by :meth:`shutdown`).
        """
        assert slot.job is None, "run_here() in a busy slot"
        assert slot.thread is None, "run_here() in a slot that has a thread of its own"
        for i, member in enumerate(job.members()):
            self.memory.trial_admitted(member.trial, scheduled=i == 0)
        slot.job = job
        slot.run_here(job)

    def running_jobs(self) -> list[tuple[_Slot, TrialJob]]:
        """The (slot, job) pairs running now."""
        return [(slot, slot.job) for slot in self.slots if slot.job is not None]

    def shutdown(self, timeout_s: float) -> None:
        """Stop the slot threads; wait up to ``timeout_s`` seconds in all for them to end."""
        for slot in self.slots:
            if slot.thread is not None:
                slot.inbox.put(None)
        deadline = time.monotonic() + timeout_s
        for slot in self.slots:
            if slot.thread is not None:
                slot.thread.join(timeout=max(0.0, deadline - time.monotonic()))
            slot.release_caller_stream()


class _Slot:
    """One trial at a time, in its own thread, on its own stream."""

    def __init__(self, host: DeviceHost, index: int) -> None:
        self.host = host
        self.index = index
        self.inbox: queue.SimpleQueue[TrialJob | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.job: TrialJob | None = None  # owned by the executor's thread
        self.busy = False  # owned by the slot's thread: inside an objective now
        self.ident: int | None = None  # the thread running its jobs (its own, or run_here's)
        # run_here's: the caller's stream, made on its first job (None: not on CUDA), or
        # the error that kept it from being made.
        self._caller_stream: torch.cuda.Stream | None = None
        self._caller_setup: BaseException | None = None
        self._caller_ready = False

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
        ident = self.ident
        if ident is not None and self.busy:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(TrialInterrupted)
            )

    def neighbours(self) -> int:
        """How many other slots of this host are inside an objective now.

        Trials outside the host (:meth:`outside`) are added by the run path only when the
        attempt ran out of memory.
        """
        return sum(1 for slot in self.host.slots if slot is not self and slot.busy)

    def outside(self) -> int:
        """Trials running on the device outside this host now (``DeviceHost.count_outside``).

        0 when the host has no count (threads, a Ray host) or the count fails; never raises.
        """
        count = self.host.count_outside
        if count is None:
            return 0
        try:
            return int(count())
        except Exception:
            return 0

    def enter(self) -> None:
        """The slot's objective starts: from now on :meth:`interrupt` reaches it."""
        self.busy = True

    def leave(self) -> int:
        """The slot's objective has ended; return how many other slots were inside one."""
        neighbours = self.neighbours()
        self.busy = False
        return neighbours

    def run_here(self, job: TrialJob) -> None:
        """Run ``job`` in the calling thread (see :meth:`DeviceHost.run_here`)."""
        self.ident = threading.get_ident()
        if not self._caller_ready:
            self._caller_ready = True
            try:
                self._caller_stream = self._stream()
            except BaseException as error:  # every job fails with it, as a slot thread's first
                self._caller_setup = error
        self._run(job, self._caller_stream, self._caller_setup)

    def release_caller_stream(self) -> None:
        """Give back the stream :meth:`run_here` acquired, if any (the host shuts down)."""
        stream, self._caller_stream = self._caller_stream, None
        if stream is not None:
            with contextlib.suppress(Exception):
                _streams.release_stream(stream)

    def _stream(self) -> torch.cuda.Stream | None:
        """The calling thread's device set and its own stream on it (``None`` off CUDA)."""
        device = self.host.device
        if device.type != "cuda":
            return None
        torch.cuda.set_device(device)
        return _streams.acquire_stream(device)

    def _run(
        self, job: TrialJob, stream: torch.cuda.Stream | None, setup_error: BaseException | None
    ) -> None:
        """Run ``job`` in this thread; put each member's outcome on the outcome queue."""
        settings = self.host.settings
        if setup_error is not None:
            outcomes = [
                fail_without_running(settings, member, setup_error) for member in job.members()
            ]
        else:
            try:
                outcomes = run_job(self, job, stream)
            except TrialInterrupted as interrupted:  # inside the executor's own calls
                release_interrupted(interrupted)
                with contextlib.suppress(Exception):
                    _optuna_compat.release_thread_session(settings.study)
                outcomes = [
                    TrialOutcome(member, OutcomeKind.INTERRUPTED, None) for member in job.members()
                ]
            except BaseException as error:  # the study's storage failed, not the trial
                outcomes = [
                    fail_without_running(settings, member, error) for member in job.members()
                ]
        for outcome in outcomes:
            settings.outcomes.put(outcome)

    def _loop(self) -> None:
        self.ident = threading.get_ident()
        stream: torch.cuda.Stream | None = None
        setup_error: BaseException | None = None
        try:
            stream = self._stream()
        except BaseException as error:  # reported with the first job, then the slot exits
            setup_error = error
        try:
            while True:
                job = self.inbox.get()
                if job is None:
                    return
                self._run(job, stream, setup_error)
                if setup_error is not None:
                    return
        finally:
            if stream is not None:
                with contextlib.suppress(Exception):
                    _streams.release_stream(stream)
