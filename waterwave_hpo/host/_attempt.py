"""One run path for a trial: a single trial is a batch of one.

Every runner of trials goes through :func:`run_attempt`: the executor's slots (one GPU, and a
Ray host actor, which is a :class:`~waterwave_hpo.host._device_host.DeviceHost` in an actor) and
the Tune host of ``tune_hosts()``. It makes the trial's context current, opens its pool
account, makes its stream current, calls the objective once, and on the way out frees a failed
attempt's memory, closes the account and ends the trial's share in the pipeline scheduler.
:func:`run_job` is the Optuna side on top of it: one call of the objective for a job of one
trial or a fused batch (``fuse=K``, HFTA: arXiv:2102.02344), then each trial told its own
outcome (COMPLETE, PRUNED or FAIL) with the executor's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
import contextlib
from dataclasses import dataclass
import gc
import traceback
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

import optuna
from optuna.trial import TrialState
import torch

from waterwave_hpo import _checks
from waterwave_hpo import _optuna_compat
from waterwave_hpo.host._attrs import ATTR_BATCH
from waterwave_hpo.host._attrs import ATTR_DEVICE
from waterwave_hpo.host._attrs import ATTR_FAIL_REASON
from waterwave_hpo.host._attrs import ATTR_PEAK_BYTES
from waterwave_hpo.host._attrs import ATTR_SLOT
from waterwave_hpo.host._backward import backward_in_this_thread
from waterwave_hpo.host._forks import running_trial
from waterwave_hpo.host._oom import is_out_of_memory
from waterwave_hpo.host._oom import never_fits_reason
from waterwave_hpo.host._outcome import OnOOM
from waterwave_hpo.host._outcome import OutcomeKind
from waterwave_hpo.host._outcome import TrialJob
from waterwave_hpo.host._outcome import TrialOutcome
from waterwave_hpo.host._planning import MemoryPlanMode
from waterwave_hpo.host._planning import NoPlanFitsError
from waterwave_hpo.host._planning import find_no_plan_fits
from waterwave_hpo.scheduler import BudgetExceededError
from waterwave_hpo.sim import PLAN_SHRINK
from waterwave_hpo.trial import TrialContext
from waterwave_hpo.trial._internal import CURRENT_CONTEXT

if TYPE_CHECKING:
    from waterwave_hpo.host._device_host import RunSettings
    from waterwave_hpo.host._memory import DeviceMemory

_REASON_MAX_CHARS = 500


class TrialInterrupted(BaseException):
    """Raised inside a trial's thread when the executor stops it (Ctrl+C on the main thread).

    A ``BaseException``, like ``KeyboardInterrupt``, so that ``except Exception`` in an objective
    does not swallow it.
    """


class Seat(Protocol):
    """Where an attempt runs, as :func:`run_attempt` sees it: a slot of a host.

    The seat knows its neighbours and whether it may be interrupted now; the attempt calls
    :meth:`enter` before the objective runs and :meth:`leave` after (also when :meth:`enter`
    raised).
    """

    def enter(self) -> None:
        """The objective starts: from now on the seat may be interrupted (may raise to stop)."""

    def leave(self) -> int:
        """The objective has ended; return how many other trials ran on the device beside it."""


@dataclass
class Attempt:
    """What one call of an objective left behind, before anyone is told."""

    result: Any = None
    pruned: bool = False
    error: BaseException | None = None
    neighbours: int = 0
    """Other trials on the device when it ended (batch-mates included: see :func:`run_job`)."""
    out_of_memory: bool = False
    no_plan_fits: NoPlanFitsError | None = None
    peak_bytes: int | None = None
    """The pool account's peak, bytes; ``None`` without the pool."""
    cannot_fit: str | None = None
    """Out of memory with a known need above the most the trial could ever get: both figures."""


def run_attempt(
    call: Callable[[], Any],
    *,
    context: TrialContext,
    memory: DeviceMemory,
    seat: Seat,
    numbers: Sequence[int] | None = None,
) -> Attempt:
    """Run ``call()`` once as the attempt described by ``context``; never raises.

    In the calling thread: ``context`` is current (:func:`waterwave_hpo.current`), the pool
    account of ``context.trial_number`` is open on ``context.stream`` and that stream is
    current (PyTorch and CuPy). On the way out, an attempt that ran out of memory has its
    frames' tensors freed first; then the account is closed and every trial of ``numbers``
    (default: the context's trial) ends its share in the device's scheduler.

    Args:
        call: The objective, bound to its arguments.
        context: The attempt's context (device, stream, slot, scheduler, planning).
        memory: The device's pool and scheduler.
        seat: The slot running it (interrupts, neighbours).
        numbers: The trial numbers the attempt runs (a fused batch's); their shares end
            together.

    Returns:
        The :class:`Attempt`: the result, or how it ended.
    """
    attempt = Attempt()
    account: Any = None
    token = CURRENT_CONTEXT.set(context)
    try:
        account = memory.open_account(context.trial_number, context.stream)
        seat.enter()
        with (
            on_trial_stream(context.device, context.stream, memory.pool),
            running_trial(context.trial_number),
        ):
            attempt.result = call()
    except optuna.TrialPruned:
        attempt.pruned = True
    except BaseException as caught:  # classified by the caller; KeyboardInterrupt included
        attempt.error = caught
    finally:
        attempt.neighbours = seat.leave()
        CURRENT_CONTEXT.reset(token)
        error = attempt.error
        attempt.no_plan_fits = find_no_plan_fits(error)
        attempt.out_of_memory = isinstance(error, Exception) and (
            attempt.no_plan_fits is not None or is_out_of_memory(error)
        )
        if attempt.out_of_memory:
            # Trials outside the host (other worker processes) shared the device too: counted
            # now, as the attempt ends (the release below may take a second), and only on OOM,
            # so an attempt that ends otherwise costs no question to the driver.
            outside = getattr(seat, "outside", None)
            if outside is not None:
                attempt.neighbours += outside()
            # Free the failed attempt's tensors (held by the traceback's frames) before its
            # scheduler share is released and before anyone retries.
            release_memory(error, context.device)  # type: ignore[arg-type]
        with contextlib.suppress(Exception):
            attempt.peak_bytes = memory.close_account(context.trial_number, account)
        if attempt.out_of_memory:
            attempt.cannot_fit = cannot_fit(error, attempt.peak_bytes, context, memory)
        for number in numbers if numbers is not None else (context.trial_number,):
            with contextlib.suppress(Exception):
                memory.trial_ended(number)  # a pruned or finished trial frees its share at once
    return attempt


class SlotSeat(Protocol):
    """A local slot (``host/_device_host.py``'s ``_Slot``): a seat with a host and an index."""

    index: int
    host: Any

    def enter(self) -> None:
        """See :meth:`Seat.enter`."""

    def leave(self) -> int:
        """See :meth:`Seat.leave`."""


def run_job(slot: SlotSeat, job: TrialJob, stream: torch.cuda.Stream | None) -> list[TrialOutcome]:
    """Run ``job`` (one trial, or a fused batch) in ``slot``'s thread; tell each trial.

    One trial calls ``func(trial)``; a batch (``fuse=K``) calls ``func(trials)`` once and reads
    one entry per trial (see :func:`waterwave_hpo.batched`). The trials share the slot's device,
    stream, pool account and memory planning; :func:`waterwave_hpo.current` gives the first
    trial's context. Every member job gets exactly one outcome, in order.
    """
    settings: RunSettings = slot.host.settings
    members = job.members()
    trials = [member.trial for member in members]
    fused = bool(job.batch)
    device = slot.host.device
    memory = slot.host.memory
    if job.planning is not None:
        job.planning.device_plans = memory.plans
    context = TrialContext(
        trial=job.trial,
        trial_number=job.trial.number,
        device=device,
        stream=stream,
        slot=slot.index,
        attempt=job.attempt,
        scheduler=slot.host.scheduler,
        retry_of=None if job.retry_of is None else int(job.retry_of),
        planning=job.planning,
        batch=tuple(trials) if fused else (),
    )

    def call() -> Any:
        for trial in trials:
            _set_attr(settings, trial, ATTR_DEVICE, str(device))
            _set_attr(settings, trial, ATTR_SLOT, slot.index)
            if fused:
                _set_attr(settings, trial, ATTR_BATCH, [t.number for t in trials])
        return settings.func(trials if fused else job.trial)

    _optuna_compat.set_in_optimize_loop(settings.study, True)
    attempt = run_attempt(
        call, context=context, memory=memory, seat=slot, numbers=[t.number for t in trials]
    )
    # Batch-mates count as neighbours: they shared the device's memory with each trial.
    attempt.neighbours += len(trials) - 1
    outcomes = _tell_attempt(settings, job, attempt)
    if settings.gc_after_trial:
        gc.collect()
    return outcomes


def _tell_attempt(settings: RunSettings, job: TrialJob, attempt: Attempt) -> list[TrialOutcome]:
    study = settings.study
    members = job.members()
    n_trials = len(members)
    error = attempt.error
    if isinstance(error, TrialInterrupted):
        # The executor has told the study FAIL already; make sure, without raising. The
        # interrupt may have landed inside a storage call, leaving a database connection in a
        # transaction (SQLite: holding the file's write lock) referenced only by the
        # traceback's frames: free them, and this thread's session, before anyone writes.
        release_interrupted(error)
        with contextlib.suppress(Exception):
            _optuna_compat.release_thread_session(study)
        outcomes = []
        for member in members:
            with contextlib.suppress(Exception):
                if not _optuna_compat.is_finished(study, member.trial):  # no "Skipped" line
                    study.tell(member.trial, state=TrialState.FAIL, skip_if_finished=True)
            outcomes.append(TrialOutcome(member, OutcomeKind.INTERRUPTED, None))
        return outcomes

    if attempt.peak_bytes is not None:
        # A batch's peak, shared evenly: the fused model's memory is the trials' together.
        for member in members:
            with contextlib.suppress(Exception):
                _set_attr(settings, member.trial, ATTR_PEAK_BYTES, attempt.peak_bytes // n_trials)
    if attempt.pruned:
        return [_end_pruned(settings, member) for member in members]
    if error is None and not job.batch:
        error = _told_by_objective(study, job.trial, attempt.result)
    if error is not None:
        kind = classify(
            settings,
            job,
            error,
            attempt.neighbours,
            attempt.out_of_memory,
            cannot_fit=attempt.cannot_fit,
        )
        if attempt.no_plan_fits is not None:
            reason = f"out of device memory: {attempt.no_plan_fits}"
        elif attempt.cannot_fit is not None:
            reason = (
                f"out of device memory, not re-run: {attempt.cannot_fit}; use a smaller batch "
                "size or model, or a larger memory_budget_bytes"
            )
        elif attempt.out_of_memory and job.batch:
            reason = f"out of device memory in a fused batch of {n_trials}: {error}"
        elif attempt.out_of_memory:
            reason = f"out of device memory with {attempt.neighbours} neighbour(s): {error}"
        else:
            reason = _format(error)
        return [
            _end_failed(settings, member, kind, reason, error=error, neighbours=attempt.neighbours)
            for member in members
        ]
    if not job.batch:
        return [_end_value(settings, job, attempt.result, attempt.neighbours)]
    entries = _entries(attempt.result, n_trials)
    if isinstance(entries, str):
        return [_end_failed(settings, member, OutcomeKind.FAILED, entries) for member in members]
    return [
        _end_entry(settings, member, entry, attempt.neighbours)
        for member, entry in zip(members, entries, strict=True)
    ]


def _told_by_objective(
    study: optuna.Study, trial: optuna.trial.Trial, value: Any
) -> BaseException | None:
    """The error for an objective that told its own trial and then returned ``value``, or None.

    ``Study.optimize`` raises then (Optuna cannot tell a finished trial); without this the
    executor's ``tell(skip_if_finished=True)`` would drop the returned value without a word.
    """
    frozen = _optuna_compat.storage_of(study).get_trial(_optuna_compat.trial_id(trial))
    if not frozen.state.is_finished():
        return None
    return optuna.exceptions.UpdateFinishedTrialError(
        f"func returned {value!r} for trial {trial.number}, which was already finished "
        f"({frozen.state.name}, values {frozen.values}): the returned value is not recorded. "
        "An objective run by an executor must not tell its own trial "
        "(trial.study.tell(trial, ...)): return the value, or raise optuna.TrialPruned, and "
        "the executor tells the study."
    )


def classify(
    settings: RunSettings,
    job: TrialJob,
    error: BaseException,
    neighbours: int,
    out_of_memory: bool,
    *,
    cannot_fit: str | None = None,
) -> OutcomeKind:
    """How an attempt that raised ``error`` ended, for the executor (retry, fail, re-raise).

    An out-of-memory attempt is re-run (``OOM_RETRY``) only when a re-run could fit: not when
    no memory plan fits, and not when ``cannot_fit`` (see :func:`cannot_fit`) says its known
    need exceeds the most it could ever get.
    """
    if out_of_memory:
        if find_no_plan_fits(error) is not None or cannot_fit is not None:
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


def cannot_fit(
    error: BaseException | None,
    peak_bytes: int | None,
    context: TrialContext,
    memory: DeviceMemory,
) -> str | None:
    """Why a re-run of an out-of-memory attempt can never fit, with both figures; else ``None``.

    The trial's known need is compared with the most it could ever get, whatever its
    neighbours do (a fused batch is never judged so: its trials re-run unfused, each needing
    less):

    - a request the pipeline scheduler refused as larger than its whole budget
      (:class:`~waterwave_hpo.scheduler.BudgetExceededError`, not an eviction): what the trial
      held plus what it asked for, against the budget (``memory_budget_bytes``, or in a worker
      process the trial's share of it);
    - the smallest peak any memory plan of its registered model reaches, against that budget;
    - the peak its pool account measured before it ran out, against the pool's capacity (the
      device, or in a worker process its lease): it already held all it could get;
    - a bound its neighbours do not change (a worker process's lease), marked on the error
      (:func:`~waterwave_hpo.host._oom.mark_never_fits`).

    Args:
        error: The attempt's error.
        peak_bytes: The attempt's measured peak (its pool account), bytes, or ``None``.
        context: The attempt's context (its memory planning).
        memory: The device's pool, scheduler and budget.

    Returns:
        A sentence naming the need and the most, in bytes, or ``None`` when a re-run with fewer
        neighbours or a smaller plan could fit (or nothing is known).
    """
    if len(context.batch) > 1:
        return None  # a fused batch re-runs unfused, one trial each: a smaller need
    never = never_fits_reason(error)
    if never is not None:
        return never
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, BudgetExceededError) and not cause.evicted:
            need = cause.held_bytes + cause.nbytes
            return (
                f"it needs at least {_checks.format_bytes(need)} (a NodeGroup's "
                f"{_checks.format_bytes(cause.nbytes)} on top of the "
                f"{_checks.format_bytes(cause.held_bytes)} it held) and the most it could ever "
                f"get is the memory budget of {_checks.format_bytes(cause.budget_bytes)}"
            )
        cause = cause.__cause__ or cause.__context__
    budget = memory.budget_bytes
    planning = context.planning
    smallest = None if planning is None else planning.smallest_peak_bytes
    if budget is not None and smallest is not None and smallest > budget:
        return (
            f"its smallest memory plan peaks at {_checks.format_bytes(smallest)} and the most "
            f"it could ever get is the memory budget of {_checks.format_bytes(budget)}"
        )
    capacity = None if memory.pool is None else getattr(memory.pool, "capacity_bytes", None)
    if isinstance(capacity, int) and peak_bytes is not None and peak_bytes >= capacity > 0:
        return (
            f"it held {_checks.format_bytes(peak_bytes)} when it ran out and the most it could "
            f"ever get is the pool's capacity of {_checks.format_bytes(capacity)}"
        )
    return None


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


def _entries(result: object, n_trials: int) -> Sequence[object] | str:
    """A batched objective's ``result`` as one entry per trial, or the reason it is not."""
    if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
        return (
            f"the batched objective returned {type(result).__name__} {result!r:.80}, not a "
            f"sequence of {n_trials} entries (one per trial, in the order of the trials)"
        )
    if len(result) != n_trials:
        return (
            f"the batched objective returned {len(result)} entries for a batch of {n_trials} "
            "trials; return one entry per trial, in the order of the trials"
        )
    return result


def _end_value(
    settings: RunSettings, member: TrialJob, value: object, neighbours: int
) -> TrialOutcome:
    # As Study.optimize tells: an invalid return value is logged as the trial's failure, not
    # warned; skip_if_finished: the executor may have told FAIL already (Ctrl+C) or the
    # objective may have told the study itself.
    frozen, fail_message = _optuna_compat.tell_as_optimize(settings.study, member.trial, value)
    if fail_message is not None:
        with contextlib.suppress(Exception):
            _set_attr(settings, member.trial, ATTR_FAIL_REASON, fail_message[:_REASON_MAX_CHARS])
    return TrialOutcome(member, OutcomeKind.COMPLETE, frozen, None, neighbours, fail_message)


def _end_entry(
    settings: RunSettings, member: TrialJob, entry: object, neighbours: int
) -> TrialOutcome:
    if isinstance(entry, optuna.TrialPruned):
        return _end_pruned(settings, member, entry)
    if isinstance(entry, BaseException):
        return _end_failed(settings, member, OutcomeKind.FAILED, _format(entry), error=entry)
    return _end_value(settings, member, entry, neighbours)


def _end_pruned(
    settings: RunSettings, member: TrialJob, entry: optuna.TrialPruned | None = None
) -> TrialOutcome:
    frozen, _ = _optuna_compat.tell_as_optimize(
        settings.study, member.trial, state=TrialState.PRUNED
    )
    return TrialOutcome(member, OutcomeKind.PRUNED, frozen, entry)


def _end_failed(
    settings: RunSettings,
    member: TrialJob,
    kind: OutcomeKind,
    reason: str,
    *,
    error: BaseException | None = None,
    neighbours: int = 0,
) -> TrialOutcome:
    _record_first_reason(settings, member.trial, reason)
    frozen, _ = _optuna_compat.tell_as_optimize(settings.study, member.trial, state=TrialState.FAIL)
    fail_message = reason if error is None else None
    return TrialOutcome(member, kind, frozen, error, neighbours, fail_message)


def fail_without_running(
    settings: RunSettings, job: TrialJob, error: BaseException
) -> TrialOutcome:
    """Tell FAIL for a trial the executor itself could not run or tell; never raises."""
    reason = f"waterwave-hpo could not run or tell this trial: {error!r}"
    frozen = None
    _record_first_reason(settings, job.trial, reason)
    with contextlib.suppress(Exception):
        frozen, _ = _optuna_compat.tell_as_optimize(
            settings.study, job.trial, state=TrialState.FAIL
        )
    return TrialOutcome(job, OutcomeKind.FATAL, frozen, error)


def release_interrupted(error: BaseException) -> None:
    """Free an interrupted attempt's frames (they may hold an open database transaction).

    The young generations only: what the interrupt cut short was made just now, and a full
    collection per slot costs seconds on a loaded machine with torch imported (the driver
    runs one full collection once every slot has stopped).
    """
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)
    error.__traceback__ = None
    gc.collect(1)


def release_memory(error: BaseException, device: torch.device) -> None:
    """Free the tensors a failed attempt's traceback holds, before anyone retries."""
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
    # CuPy's current stream too, so a trial's CuPy work is ordered with its PyTorch work; and
    # the trial's backward in this thread, not on autograd's shared device thread.
    with (
        torch.cuda.device(device),
        torch.cuda.stream(stream),
        cupy_on_stream(stream.cuda_stream, index, pool),
        backward_in_this_thread(),
    ):
        if pool is None:
            yield
            return
        from waterwave_hpo.memory import translate_oom

        # A pluggable allocator's exhaustion reaches Python as a plain RuntimeError; make it the
        # torch.cuda.OutOfMemoryError that OOM isolation and users' own handlers expect.
        with translate_oom():
            yield


def _format(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _record_first_reason(settings: RunSettings, trial: optuna.trial.Trial, reason: str) -> None:
    """Record ``reason`` as ``trial``'s fail reason unless one is there; never raises.

    A reason already there was written by the executor on Ctrl+C, which tells the trials FAIL
    while they still run: a batch-mate's report() then raises UpdateFinishedTrialError in the
    trial's thread, and what follows from it must not replace "interrupted" as the reason.
    """
    with contextlib.suppress(Exception):
        study, trial_id = settings.study, _optuna_compat.trial_id(trial)
        if ATTR_FAIL_REASON not in _optuna_compat.system_attrs(study, trial_id):
            _set_attr(settings, trial, ATTR_FAIL_REASON, reason[:_REASON_MAX_CHARS])


def _set_attr(settings: RunSettings, trial: optuna.trial.Trial, key: str, value: object) -> None:
    # The executor's bookkeeping is a system attribute, and only on request: the user's
    # attributes stay the user's, and trials_dataframe() shows Optuna's columns.
    if settings.record_trial_attrs:
        _optuna_compat.set_system_attr(settings.study, _optuna_compat.trial_id(trial), key, value)
