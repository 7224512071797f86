"""The device-host actor: one :class:`~waterwave_hpo.executor._host.DeviceHost` in a Ray actor.

Each actor owns one device (the GPU Ray gave it, ``num_gpus=1``; the CPU where it has none) and
co-hosts trials on it exactly as on one machine: slot threads, one CUDA stream each, the pool and
the pipeline scheduler. It opens the study through the driver's storage channel (over Ray), runs
the trials the driver hands it and reports how each ended; it does not tell the study: the driver
does, so the user's sampler and callbacks see every result in the driver's process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from dataclasses import field
import os
import queue
import threading
from typing import Any

import optuna
from optuna.trial import TrialState

from waterwave_hpo import _optuna_compat
from waterwave_hpo.cluster._storage import StorageChannel
from waterwave_hpo.executor import MemoryPoolMode
from waterwave_hpo.executor import OnOOM
from waterwave_hpo.executor._internal import DeviceHost
from waterwave_hpo.executor._internal import MemoryPlanMode
from waterwave_hpo.executor._internal import OutcomeKind
from waterwave_hpo.executor._internal import PlanSettings
from waterwave_hpo.executor._internal import RunSettings
from waterwave_hpo.executor._internal import TrialJob
from waterwave_hpo.executor._internal import TrialOutcome
from waterwave_hpo.executor._internal import TrialPlanning
from waterwave_hpo.executor._internal import make_device_memory
from waterwave_hpo.executor._internal import resolve_devices

ATTR_HOST = "waterwave:host"
"""The host actor that ran the trial: ``"<node ip>/pid<pid>/<device>"`` (Ray cluster only)."""
ATTR_NODE = "waterwave:node"
"""The Ray node id of the host actor that ran the trial (Ray cluster only)."""


@dataclass(frozen=True)
class HostSpec:
    """Everything a host actor needs to build its device host (sent once, at creation)."""

    storage: StorageChannel
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


@dataclass(frozen=True)
class HostInfo:
    """Where a host actor runs."""

    label: str
    device: str
    node_id: str
    pid: int


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
        neighbours: Trials running beside it on the host when it ended.
        footprint_bytes: With ``memory_plan="home"``: the footprint its registered model ran
            with (the driver plans a re-run from it), else ``None``.
        smallest_peak_bytes: The registered model's smallest planned peak, else ``None``.
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


@dataclass(frozen=True)
class HostSnapshot:
    """A host's state after a poll: admission room and stop requests."""

    has_room: bool
    """Whether the host's measured memory demand leaves room for one more trial."""
    stop_requested: bool
    """Whether an objective on this host called ``study.stop()``."""


class _HostStudy(optuna.Study):
    """The actor's view of the study: ``tell`` is recorded for the driver, not stored."""

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


class HostActor:
    """One device host in a Ray actor (create it with ``ray.remote(HostActor).options(...)``).

    Methods are called by the driver's :class:`~waterwave_hpo.cluster._remote.RemoteHost`; the
    actor is threaded (``max_concurrency > 1``) so that :meth:`submit` runs while :meth:`poll`
    waits for outcomes.

    Args:
        spec: The study, the objective and the executor's settings.

    Raises:
        StoragePermissionError: If the study is not the one the driver's channel serves.
    """

    def __init__(self, spec: HostSpec) -> None:
        import ray

        # The driver tells each trial from this host's record (defer_finish): the user's
        # sampler and callbacks see it in the driver's process, and a trial's end costs no
        # storage round trip here.
        storage = spec.storage.connect(defer_finish=True)
        self._storage = storage
        study = optuna.load_study(
            study_name=spec.study_name, storage=storage, sampler=spec.sampler, pruner=spec.pruner
        )
        # Every actor got the same pickled sampler; without a new seed they would all draw the
        # same parameters (Optuna reseeds for n_jobs > 1 the same way).
        study.sampler.reseed_rng()
        study.__class__ = _HostStudy
        assert isinstance(study, _HostStudy)
        study._told = {}
        study._told_lock = threading.Lock()
        self._study = study
        device = resolve_devices("auto")[0]
        settings = RunSettings(
            study=study,
            func=spec.func,
            catch=spec.catch,
            on_oom=spec.on_oom,
            max_oom_retries=spec.max_oom_retries,
            gc_after_trial=spec.gc_after_trial,
            outcomes=queue.SimpleQueue(),
            memory_plan=spec.memory_plan,
        )
        self._memory_plan = spec.memory_plan
        memory = make_device_memory(
            device,
            spec.memory_pool,
            spec.memory_budget_bytes,
            spec.policy,
            max_trials=spec.n_slots,
            plans=spec.memory_plan.mode is not MemoryPlanMode.OFF,
        )
        self._host = DeviceHost(
            device, spec.n_slots, settings, memory=memory, admit_by_memory=spec.admit_by_memory
        )
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}  # id(job) -> members not recorded yet
        node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._info = HostInfo(
            label=f"{node_ip}/pid{os.getpid()}/{device}",
            device=str(device),
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
        )

    def info(self) -> HostInfo:
        """Where this host runs (also: the actor is up and its study is open)."""
        return self._info

    def submit(
        self,
        slot: int,
        members: list[tuple[int, int, int | None]],
        fused: bool = False,
        plan_cap_bytes: int | None = None,
        frozen: list[optuna.trial.FrozenTrial] | None = None,
    ) -> None:
        """Run the study's trials (asked by the driver) in slot ``slot``, as one job.

        The job goes the executor's one run path (``executor/_run.py``), as on one machine.

        Args:
            slot: The slot's index.
            members: ``(trial_id, attempt, retry_of)`` of each trial: one, or a fused batch's.
            fused: A fused batch (``fuse=K``): the objective takes the list of trials.
            plan_cap_bytes: With ``memory_plan="home"``: a re-run's plan cap, else ``None``.
            frozen: The members as the driver's storage holds them, with this host's
                bookkeeping attributes (``ATTR_HOST``, ``ATTR_NODE``...) written by the driver;
                ``None``: this host writes them and reads the trials.

        Precondition: the driver only submits to a slot whose previous job it has seen end.
        """
        planning = (
            None
            if self._memory_plan.mode is MemoryPlanMode.OFF
            else TrialPlanning(self._memory_plan, cap_bytes=plan_cap_bytes)
        )
        jobs = []
        for index, (trial_id, attempt, retry_of) in enumerate(members):
            if frozen is None:
                _optuna_compat.set_system_attr(self._study, trial_id, ATTR_HOST, self._info.label)
                _optuna_compat.set_system_attr(self._study, trial_id, ATTR_NODE, self._info.node_id)
                self._storage.adopt(self._storage.get_trial(trial_id))
            else:
                self._storage.adopt(frozen[index])
            trial = optuna.trial.Trial(self._study, trial_id)
            jobs.append(TrialJob(trial, attempt, retry_of, planning))
        first = jobs[0]
        job = (
            TrialJob(first.trial, first.attempt, first.retry_of, planning, batch=tuple(jobs))
            if fused
            else first
        )
        with self._lock:
            self._pending[id(job)] = len(jobs)
            self._host.submit(self._host.slots[slot], job)

    def poll(self, timeout_s: float) -> tuple[list[TrialRecord], HostSnapshot]:
        """Wait up to ``timeout_s`` seconds for trial attempts to end; return how they ended."""
        outcomes: list[TrialOutcome] = []
        with contextlib.suppress(queue.Empty):
            outcomes.append(self._host.settings.outcomes.get(timeout=timeout_s))
            while True:
                outcomes.append(self._host.settings.outcomes.get_nowait())
        records = []
        with self._lock:
            for outcome in outcomes:
                records.append(self._record(outcome))
            snapshot = HostSnapshot(
                has_room=self._host.memory.has_room(),
                stop_requested=_optuna_compat.stop_requested(self._study),
            )
        return records, snapshot

    def interrupt(self, slot: int) -> None:
        """Stop the trial running in ``slot`` (the driver has told it FAIL already)."""
        self._host.slots[slot].interrupt()

    def shutdown(self, timeout_s: float) -> None:
        """Stop the slot threads, waiting up to ``timeout_s`` seconds."""
        self._host.shutdown(timeout_s=timeout_s)

    def _record(self, outcome: TrialOutcome) -> TrialRecord:
        number = outcome.job.trial.number
        slot_index = -1
        for slot in self._host.slots:
            if slot.job is not None and any(m is outcome.job for m in slot.job.members()):
                slot_index = slot.index
                self._pending[id(slot.job)] -= 1
                if not self._pending[id(slot.job)]:  # every trial of its job recorded
                    del self._pending[id(slot.job)]
                    slot.job = None
        self._host.memory.trial_ended(number)
        finish = self._storage.release(_optuna_compat.trial_id(outcome.job.trial))
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
            values=_plain_values(values) if state is None else None,
            error=_picklable(outcome.error),
            neighbours=outcome.neighbours,
            footprint_bytes=None if planning is None else planning.footprint_bytes,
            smallest_peak_bytes=None if planning is None else planning.smallest_peak_bytes,
        )


def _plain_values(values: Any) -> float | list[float] | str | None:
    # A CUDA tensor or a numpy scalar must not cross to a driver without CUDA: send floats.
    if values is None:
        return None
    try:
        if isinstance(values, (list, tuple)):
            return [float(v) for v in values]
        return float(values)
    except (TypeError, ValueError):
        return repr(values)


def _picklable(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    from ray import cloudpickle

    try:
        cloudpickle.loads(cloudpickle.dumps(error))  # type: ignore[no-untyped-call]
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    error.__traceback__ = None
    return error
