"""A device host in another process, whatever carries its messages (Ray, or a pipe).

The run of a trial outside the driver is one thing, wherever it happens: the host process opens
the study through a relay of the driver's storage (``waterwave_hpo.relay``) with the driver's
pickled sampler and pruner, runs the jobs the driver hands it on a
:class:`~waterwave_hpo.host._device_host.DeviceHost` (the one run path, ``host/_attempt.py``), and
reports how each attempt ended as a :class:`TrialRecord`; the driver then tells the study from
the record (:func:`tell_record`), so the user's callbacks, logs and the run loop see every
outcome in the driver's process. Two transports use it: a Ray host actor
(``cluster/_actor.py``) and a worker process of process isolation (``workers/``).
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
from dataclasses import dataclass
from dataclasses import field
import queue
import threading
import traceback
from typing import Any
from typing import Protocol

import optuna
from optuna.trial import TrialState
import torch

from waterwave_hpo import _optuna_compat
from waterwave_hpo.host._attrs import ATTR_FAIL_REASON
from waterwave_hpo.host._device_host import DeviceHost
from waterwave_hpo.host._device_host import RunSettings
from waterwave_hpo.host._memory import MemoryPoolMode
from waterwave_hpo.host._outcome import OnOOM
from waterwave_hpo.host._outcome import OutcomeKind
from waterwave_hpo.host._outcome import TrialJob
from waterwave_hpo.host._outcome import TrialOutcome
from waterwave_hpo.host._planning import MemoryPlanMode
from waterwave_hpo.host._planning import PlanSettings
from waterwave_hpo.host._planning import TrialPlanning
from waterwave_hpo.relay import RelayedStorage

_REASON_MAX_CHARS = 500


class StorageConnector(Protocol):
    """How a host process reaches the run's study (e.g. ``cluster``'s ``StorageChannel``)."""

    def connect(self, defer_finish: bool = False) -> optuna.storages.BaseStorage:
        """The host's ``BaseStorage`` for the run's study.

        Args:
            defer_finish: Keep the final states of the trials the host runs for the driver to
                tell (:class:`~waterwave_hpo.relay.RelayedStorage`).
        """


@dataclass(frozen=True)
class HostSpec:
    """Everything a host process needs to build its device host (sent once, at its start).

    Attributes:
        storage: How the host reaches the study (a Ray relay's channel), or ``None`` when the
            host's transport brings its own (a worker process's pipe).
        study_name: The study to open.
        sampler: The driver's sampler (pickled; see ``reseed_sampler_rng``).
        pruner: The driver's pruner (pickled).
        func: The objective.
        n_slots: Slots of the host (trials at once).
    """

    storage: StorageConnector | None
    study_name: str
    sampler: optuna.samplers.BaseSampler
    pruner: optuna.pruners.BasePruner
    func: Any
    catch: tuple[type[BaseException], ...]
    on_oom: OnOOM
    max_oom_retries: int
    gc_after_trial: bool
    n_slots: int
    admit_by_memory: bool
    memory_pool: MemoryPoolMode
    memory_budget_bytes: int | None
    policy: Any
    memory_plan: PlanSettings = field(default_factory=PlanSettings)
    """``memory_plan=`` of the executor: each attempt's planning is made on the host."""
    record_trial_attrs: bool = True
    """``record_trial_attrs=`` of the executor (device, slot, peak bytes, fail reason)."""
    reseed_sampler_rng: bool = True
    """Reseed the host's copy of the sampler once, as the host opens the run: trials of the run
    may run at once (more than one slot in all, or fused batches), and hosts that got the same
    pickled sampler would otherwise draw the same parameters. Once is enough: from a seed of its
    own, each host's generator then runs its own sequence, as one sampler shared by the threads
    of ``Study.optimize(n_jobs > 1)`` does (a reseed costs 0.1-0.4 ms with NumPy's
    ``RandomState``, more than the rest of a trivial trial's sampling). ``False`` (one trial at
    a time): never reseeded, so a seeded sampler draws the sequence it draws under
    ``Study.optimize``."""

    @classmethod
    def of_run(
        cls, settings: RunSettings, storage: StorageConnector | None, **host: Any
    ) -> HostSpec:
        """The spec of a run: its study, objective and outcome rules from ``settings``.

        Args:
            settings: The ``optimize`` call's settings (the driver's study and objective).
            storage: How the host reaches the study, or ``None`` (a worker's pipe).
            host: The host's own fields (``n_slots``, ``memory_pool``, ...).
        """
        study = settings.study
        return cls(
            storage=storage,
            study_name=study.study_name,
            sampler=study.sampler,
            pruner=study.pruner,
            func=settings.func,
            catch=settings.catch,
            on_oom=settings.on_oom,
            max_oom_retries=settings.max_oom_retries,
            gc_after_trial=settings.gc_after_trial,
            **host,
        )


@dataclass(frozen=True)
class TrialRecord:
    """How one trial attempt ended on a host, for the driver to tell the study.

    Attributes:
        slot: The slot that ran it.
        number: The trial's number.
        kind: How it ended (the slot's classification).
        state: The state the host would have told (``None``: COMPLETE with ``values``).
        values: The objective's value(s) as floats, or its ``repr`` when they are not numbers
            (the driver's ``study.tell`` then fails the trial, as Optuna does).
        error: The exception (or a ``RuntimeError`` describing it when it cannot be pickled).
        error_traceback: ``error``'s traceback in the host's process, as text (pickling drops
            it); the driver shows it as the cause of the error it logs and raises.
        neighbours: Trials running beside it on the host when it ended.
        footprint_bytes: With ``memory_plan="home"``: the footprint its registered model ran
            with (the driver plans a re-run from it), else ``None``.
        smallest_peak_bytes: The registered model's smallest planned peak, else ``None``.
        fail_message: Why the study marked a returned value FAIL, else ``None``.
    """

    slot: int
    number: int
    kind: OutcomeKind
    state: TrialState | None
    values: float | list[float] | str | None
    error: BaseException | None
    neighbours: int
    footprint_bytes: int | None = None
    smallest_peak_bytes: int | None = None
    fail_message: str | None = None
    error_traceback: str | None = None


@dataclass(frozen=True)
class HostSnapshot:
    """A host's state after a poll: admission room and stop requests."""

    has_room: bool
    """Whether the host's measured memory demand leaves room for one more trial."""
    stop_requested: bool
    """Whether an objective on this host called ``study.stop()``."""


class _HostStudy(optuna.Study):
    """The host's view of the study: ``tell`` is recorded for the driver, then read back."""

    _told: dict[int, tuple[TrialState | None, Any]]
    _told_lock: threading.Lock

    def tell(
        self,
        trial: optuna.trial.Trial | int,
        values: Any = None,
        state: TrialState | None = None,
        skip_if_finished: bool = False,
    ) -> optuna.trial.FrozenTrial:
        number = trial if isinstance(trial, int) else trial.number
        with self._told_lock:
            self._told.setdefault(number, (state, values))
        storage = _optuna_compat.storage_of(self)
        trial_id = (
            storage.get_trial_id_from_study_id_trial_number(_optuna_compat.study_id(self), number)
            if isinstance(trial, int)
            else _optuna_compat.trial_id(trial)
        )
        return storage.get_trial(trial_id)


class HostRunner:
    """The host side: a study opened through a relay, a device host, records for the driver.

    Only the transport's threads call it: :meth:`submit`, :meth:`interrupt` and
    :meth:`shutdown` from the one that takes the driver's requests, :meth:`poll` from the one
    that sends records (they may be the same). With ``report``, no one polls: each attempt's
    record is handed to ``report`` by the slot thread that ran it, as soon as it ends (no
    thread hand-off between the trial's end and its record's send).

    Args:
        spec: The study, the objective and the executor's settings.
        storage: The relayed storage of the run's study.
        device: The device its trials run on.
        slot_indices: The indices its slots carry (default ``range(spec.n_slots)``): a worker
            process runs one slot of the driver's host, and its trials record that slot's index.
        report: ``report(records, snapshot)``, called in the slot's thread for each ended
            attempt, or ``None``: the records wait for :meth:`poll`.

    Raises:
        StoragePermissionError: If the study is not the one the driver's relay serves.
    """

    def __init__(
        self,
        spec: HostSpec,
        storage: optuna.storages.BaseStorage,
        device: torch.device,
        slot_indices: list[int] | None = None,
        report: Callable[[list[TrialRecord], HostSnapshot], None] | None = None,
    ) -> None:
        study = optuna.load_study(
            study_name=spec.study_name, storage=storage, sampler=spec.sampler, pruner=spec.pruner
        )
        if spec.reseed_sampler_rng:  # before any trial's sampling; see HostSpec
            study.sampler.reseed_rng()
        study.__class__ = _HostStudy
        assert isinstance(study, _HostStudy)
        study._told = {}
        study._told_lock = threading.Lock()
        self.study: optuna.Study = study
        self._study = study
        # A relayed storage keeps the trials this host runs (fewer round trips).
        self._relayed = storage if isinstance(storage, RelayedStorage) else None
        settings = RunSettings(
            study=study,
            func=spec.func,
            catch=spec.catch,
            on_oom=spec.on_oom,
            max_oom_retries=spec.max_oom_retries,
            gc_after_trial=spec.gc_after_trial,
            outcomes=queue.SimpleQueue() if report is None else _ReportAtOnce(self._report_now),
            record_trial_attrs=spec.record_trial_attrs,
            memory_plan=spec.memory_plan,
        )
        self._memory_plan = spec.memory_plan
        self.host = DeviceHost.build(
            device,
            spec.n_slots,
            settings,
            memory_pool=spec.memory_pool,
            memory_budget_bytes=spec.memory_budget_bytes,
            policy=spec.policy,
            admit_by_memory=spec.admit_by_memory,
            slot_indices=slot_indices,
        )
        self._slots = {slot.index: slot for slot in self.host.slots}
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}  # id(job) -> members not recorded yet
        self._report = report

    def submit(
        self,
        slot: int,
        members: list[tuple[int, int, int | None]],
        fused: bool = False,
        plan_cap_bytes: int | None = None,
        frozen: list[optuna.trial.FrozenTrial] | None = None,
    ) -> None:
        """Run the study's trials (asked by the driver) in slot ``slot``, as one job.

        The job goes the executor's one run path (``host/_attempt.py``), as on one machine, in
        the slot's own thread.

        Args:
            slot: The slot's index.
            members: ``(trial_id, attempt, retry_of)`` of each trial: one, or a fused batch's.
            fused: A fused batch (``fuse=K``): the objective takes the list of trials.
            plan_cap_bytes: With ``memory_plan="home"``: a re-run's plan cap, else ``None``.
            frozen: The members as the driver's storage holds them now: a relayed storage
                answers reads of them from these copies; ``None``: it reads each once.

        Precondition: the driver only submits to a slot whose previous job it has seen end.
        """
        job = self._job(members, fused, plan_cap_bytes, frozen)
        with self._lock:
            self._pending[id(job)] = len(job.members())
            self.host.submit(self._slots[slot], job)

    def run_here(
        self,
        slot: int,
        members: list[tuple[int, int, int | None]],
        fused: bool = False,
        plan_cap_bytes: int | None = None,
        frozen: list[optuna.trial.FrozenTrial] | None = None,
    ) -> None:
        """As :meth:`submit`, but run the job in the calling thread; return when it has ended.

        For a transport whose thread that takes the driver's requests is free to run the trial
        (a worker process's one slot): no hand-off to a slot thread. Every job of ``slot``
        must come from the same thread. The records are reported (``report``) before it
        returns.
        """
        job = self._job(members, fused, plan_cap_bytes, frozen)
        seat = self._slots[slot]
        with self._lock:
            self._pending[id(job)] = len(job.members())
        self.host.run_here(seat, job)

    def _job(
        self,
        members: list[tuple[int, int, int | None]],
        fused: bool,
        plan_cap_bytes: int | None,
        frozen: list[optuna.trial.FrozenTrial] | None,
    ) -> TrialJob:
        """The job of ``members``: their trials built on this host's study."""
        planning = (
            None
            if self._memory_plan.mode is MemoryPlanMode.OFF
            else TrialPlanning(self._memory_plan, cap_bytes=plan_cap_bytes)
        )
        if self._relayed is not None:
            for index, (trial_id, _, _) in enumerate(members):
                self._relayed.adopt(
                    self._relayed.get_trial(trial_id) if frozen is None else frozen[index]
                )
        jobs = [
            TrialJob(optuna.trial.Trial(self._study, trial_id), attempt, retry_of, planning)
            for trial_id, attempt, retry_of in members
        ]
        first = jobs[0]
        if not fused:
            return first
        return TrialJob(first.trial, first.attempt, first.retry_of, planning, batch=tuple(jobs))

    def poll(self, timeout_s: float) -> tuple[list[TrialRecord], HostSnapshot]:
        """Wait up to ``timeout_s`` seconds for trial attempts to end; return how they ended."""
        outcomes: list[TrialOutcome] = []
        with contextlib.suppress(queue.Empty):
            outcomes.append(self.host.settings.outcomes.get(timeout=timeout_s))
            while True:
                outcomes.append(self.host.settings.outcomes.get_nowait())
        records = []
        with self._lock:
            for outcome in outcomes:
                records.append(self._record(outcome))
            snapshot = HostSnapshot(
                has_room=self.host.memory.has_room(),
                stop_requested=_optuna_compat.stop_requested(self._study),
            )
        return records, snapshot

    def idle(self) -> bool:
        """Whether every job submitted has been recorded (no trial runs in any slot)."""
        with self._lock:
            return not self._pending

    def _report_now(self, outcome: TrialOutcome) -> None:
        """Hand ``outcome``'s record to ``report`` (in the slot's thread that ended it)."""
        assert self._report is not None
        with self._lock:
            record = self._record(outcome)
            snapshot = HostSnapshot(
                has_room=self.host.memory.has_room(),
                stop_requested=_optuna_compat.stop_requested(self._study),
            )
        self._report([record], snapshot)

    def interrupt(self, slot: int) -> None:
        """Stop the trial running in ``slot`` (the driver has told it FAIL already)."""
        self._slots[slot].interrupt()

    def shutdown(self, timeout_s: float) -> None:
        """Stop the slot threads, waiting up to ``timeout_s`` seconds."""
        self.host.shutdown(timeout_s=timeout_s)

    def _record(self, outcome: TrialOutcome) -> TrialRecord:
        number = outcome.job.trial.number
        slot_index = -1
        for slot in self.host.slots:
            if slot.job is not None and any(m is outcome.job for m in slot.job.members()):
                slot_index = slot.index
                self._pending[id(slot.job)] -= 1
                if not self._pending[id(slot.job)]:  # every trial of its job recorded
                    del self._pending[id(slot.job)]
                    slot.job = None
        self.host.memory.trial_ended(number)
        finish = (
            None
            if self._relayed is None
            else self._relayed.release(_optuna_compat.trial_id(outcome.job.trial))
        )
        with self._study._told_lock:
            told = self._study._told.pop(number, None)
        if told is not None:  # the objective (or an interrupt) told the study itself
            state, values = told
        elif finish is None:  # never told (cannot happen on the run path): fail it
            state, values = TrialState.FAIL, None
        elif finish[0] is TrialState.COMPLETE:
            state, values = None, finish[1]
        else:  # PRUNED (the driver takes its value from the last report) or FAIL
            state, values = finish[0], None
        planning = outcome.job.planning
        return TrialRecord(
            slot=slot_index,
            number=number,
            kind=outcome.kind,
            state=state,
            values=plain_values(values) if state is None else None,
            error_traceback=format_traceback(outcome.error),
            error=picklable_error(outcome.error),
            neighbours=outcome.neighbours,
            footprint_bytes=None if planning is None else planning.footprint_bytes,
            smallest_peak_bytes=None if planning is None else planning.smallest_peak_bytes,
            fail_message=outcome.fail_message,
        )


class _ReportAtOnce(queue.SimpleQueue[TrialOutcome]):
    """A host's outcome queue that hands each outcome on as it is put (``HostRunner(report=)``)."""

    def __init__(self, sink: Callable[[TrialOutcome], None]) -> None:
        self._sink = sink

    def put(self, item: TrialOutcome, block: bool = True, timeout: float | None = None) -> None:
        self._sink(item)


def plain_values(values: Any) -> float | list[float] | str | None:
    """``values`` as floats: a CUDA tensor or a numpy scalar must not cross to the driver."""
    if values is None:
        return None
    try:
        if isinstance(values, (list, tuple)):
            return [float(v) for v in values]
        return float(values)
    except (TypeError, ValueError):
        return repr(values)


class UnpicklableError(RuntimeError):
    """An error raised on a host (a worker process, a Ray actor) that could not be pickled.

    Its message names the original type (``module.QualName: message``) and carries the
    original traceback as a note, so the driver's report shows what happened where.

    Attributes:
        type_name: The original exception's ``module.QualName``.
    """

    def __init__(self, type_name: str, text: str) -> None:
        self.type_name = type_name
        super().__init__(f"{type_name}: {text}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.type_name, str(self).split(": ", 1)[1]), self.__dict__)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a host's process (a worker, a Ray host), as text.

    The driver sets it as the ``__cause__`` of the exception it logs and raises (pickling drops
    tracebacks), so the user sees the frames of their objective above the driver's, as with
    ``concurrent.futures.ProcessPoolExecutor``.

    Args:
        text: The traceback as ``traceback.format_exception`` writes it.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'


def format_traceback(error: BaseException | None) -> str | None:
    """``error``'s traceback (with its chained causes) as text, for :class:`RemoteTraceback`."""
    if error is None:
        return None
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def with_remote_traceback(error: BaseException | None, text: str | None) -> BaseException | None:
    """``error`` with the host's traceback ``text`` as its cause (``None`` or no text: as is)."""
    if error is not None and text and not isinstance(error.__cause__, RemoteTraceback):
        error.__cause__ = RemoteTraceback(text)
    return error


def picklable_error(error: BaseException | None) -> BaseException | None:
    """``error`` ready to cross to the driver, its type kept where it can be.

    The traceback object cannot cross: the host sends its text beside the error
    (:func:`format_traceback`, :class:`TrialRecord`'s ``error_traceback``) and the driver sets
    it as the cause (:func:`with_remote_traceback`). If ``error`` cannot be pickled (an
    unpicklable attribute, an ``__init__`` its pickled arguments do not fit), the same type is
    tried without its attributes; failing that, an :class:`UnpicklableError` names the type and
    keeps the message.
    """
    if error is None:
        return None
    import cloudpickle

    error.__traceback__ = None
    with contextlib.suppress(Exception):
        cloudpickle.loads(cloudpickle.dumps(error))
        return error
    with contextlib.suppress(Exception):  # the same type, without its unpicklable attributes
        bare = type(error).__new__(type(error), *error.args)
        bare.args = error.args
        bare.__notes__ = list(getattr(error, "__notes__", []))  # type: ignore[attr-defined]
        if type(cloudpickle.loads(cloudpickle.dumps(bare))) is type(error):
            return bare
    name = f"{type(error).__module__}.{type(error).__qualname__}"
    return UnpicklableError(name, str(error))


def tell_record(settings: RunSettings, job: TrialJob, record: TrialRecord) -> TrialOutcome:
    """Tell the driver's study how ``job`` ended on a host; the outcome for the run loop.

    The host may have written the trial's end through the relay already; the driver's tell then
    skips it and reads the trial back. A tell that fails fails the trial (nothing is left
    RUNNING) and makes the outcome FATAL.
    """
    study = settings.study
    kind = record.kind
    error = with_remote_traceback(record.error, record.error_traceback)
    fail_message = record.fail_message
    frozen = None
    # The tell runs the driver's sampler's after_trial, which may call study.stop() (a grid
    # sampler whose grid is done); Optuna allows that only inside the optimize loop, a
    # thread-local flag, and this is a transport's thread (a worker's pipe, Ray's results).
    inside = _optuna_compat.in_optimize_loop(study)
    _optuna_compat.set_in_optimize_loop(study, True)
    try:
        frozen, message = _optuna_compat.tell_as_optimize(
            study, job.trial, record.values, record.state
        )
        fail_message = fail_message or message
    except Exception as tell_error:  # the driver could not tell: fail it, never leave it
        kind, error = OutcomeKind.FATAL, tell_error
        frozen = fail_trial(study, job, f"waterwave-hpo could not tell this trial: {tell_error!r}")
    finally:
        _optuna_compat.set_in_optimize_loop(study, inside)
    return TrialOutcome(job, kind, frozen, error, record.neighbours, fail_message)


def fail_trial(study: optuna.Study, job: TrialJob, reason: str) -> optuna.trial.FrozenTrial | None:
    """Tell ``job``'s trial FAIL with ``reason`` in its fail-reason attribute; never raises.

    The reason is recorded whatever ``record_trial_attrs`` says: the trial's host is gone, and
    the reason (a signal, an exit code, a lost node) is nowhere else.
    """
    with contextlib.suppress(Exception):
        _optuna_compat.set_system_attr(
            study, _optuna_compat.trial_id(job.trial), ATTR_FAIL_REASON, reason[:_REASON_MAX_CHARS]
        )
    with contextlib.suppress(Exception):
        return study.tell(job.trial, state=TrialState.FAIL, skip_if_finished=True)
    return None
