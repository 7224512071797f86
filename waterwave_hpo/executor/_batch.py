"""Batched objectives: a slot runs up to ``fuse`` trials at once, as one call, and ends each alone.

Horizontal fusion (HFTA: Wang et al., "Horizontally Fused Training Array", MLSys 2021,
arXiv:2102.02344) trains K models of one structure as one model whose operators are batched.
The executor's side of it is here: :func:`batched` marks an objective that takes a list of
trials, ``WaterwaveExecutor(fuse=K)`` hands each slot up to K trials, and :func:`run_batch` runs
the objective once and tells the study every trial's own outcome (its value, PRUNED or FAIL),
so that one trial's failure, pruning or NaN touches no other trial of its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import contextlib
import functools
import gc
import traceback
from typing import TYPE_CHECKING
from typing import Any
from typing import Generic
from typing import TypeVar

import optuna
from optuna.trial import TrialState

from waterwave_hpo import _checks
from waterwave_hpo import _optuna_compat
from waterwave_hpo.executor._attrs import ATTR_BATCH
from waterwave_hpo.executor._attrs import ATTR_DEVICE
from waterwave_hpo.executor._attrs import ATTR_FAIL_REASON
from waterwave_hpo.executor._attrs import ATTR_PEAK_BYTES
from waterwave_hpo.executor._attrs import ATTR_SLOT
from waterwave_hpo.executor._oom import is_out_of_memory
from waterwave_hpo.executor._outcome import OutcomeKind
from waterwave_hpo.executor._outcome import TrialJob
from waterwave_hpo.executor._outcome import TrialOutcome
from waterwave_hpo.trial import TrialContext
from waterwave_hpo.trial._internal import CURRENT_CONTEXT as _CURRENT

if TYPE_CHECKING:
    import torch

    from waterwave_hpo.executor._host import RunSettings
    from waterwave_hpo.executor._host import _Slot

_REASON_MAX_CHARS = 500

R = TypeVar("R")


class BatchedObjective(Generic[R]):
    """An objective that runs a list of trials at once; made by :func:`batched`.

    Calling it calls the wrapped function with the same list of trials.
    """

    def __init__(self, func: Callable[[list[optuna.trial.Trial]], Sequence[R]]) -> None:
        self.func = func
        functools.update_wrapper(self, func)

    def __call__(self, trials: list[optuna.trial.Trial]) -> Sequence[R]:
        """Run the wrapped objective on ``trials``; returns its entries, one per trial."""
        return self.func(trials)

    def __repr__(self) -> str:
        return f"batched({getattr(self.func, '__qualname__', self.func)!r})"


def batched(
    func: Callable[[list[optuna.trial.Trial]], Sequence[R]],
) -> BatchedObjective[R]:
    """Mark ``func`` as a batched objective: it runs a list of trials at once.

    Run it with ``WaterwaveExecutor(fuse=K)``: each slot asks the study for up to K trials
    and calls ``func(trials)`` once, so the objective can train their models as one fused
    model (``waterwave_hpo.fusion.fuse``; HFTA, arXiv:2102.02344). Each trial keeps its own
    ``trial.report``/``trial.should_prune`` and its own outcome. ``func`` returns one entry
    per trial, in the order of ``trials``:

    - a float (a sequence of floats for a multi-objective study): the trial is told COMPLETE
      with it; NaN, or the wrong number of values, fails that trial alone (Optuna's rule for
      one trial's value);
    - an ``optuna.TrialPruned`` instance: the trial is told PRUNED;
    - any other exception instance: the trial is told FAIL with it as the reason (whatever
      ``catch`` says: the objective caught it for that trial); its batch-mates go on.

    If ``func`` itself raises, the whole batch shares the outcome: ``optuna.TrialPruned``
    prunes every trial; an exception in ``catch`` fails every trial and the study goes on;
    running out of device memory fails every trial and, with ``on_oom="retry"``, re-queues
    each trial's parameters to run unfused (a batch of one); any other exception fails every
    trial and propagates from ``optimize`` (Optuna's semantics). A result that is not a
    sequence of ``len(trials)`` entries fails every trial, with a reason naming both lengths.

    Not supported yet by :class:`waterwave_hpo.RayExecutor` or Ray Tune (they raise).

    >>> import optuna
    >>> import waterwave_hpo as ww
    >>> optuna.logging.set_verbosity(optuna.logging.WARNING)
    >>> @ww.batched
    ... def objective(trials):
    ...     return [t.suggest_float("x", -1, 1) ** 2 for t in trials]
    >>> study = optuna.create_study()
    >>> ww.WaterwaveExecutor("cpu", trials_per_device=1, fuse=4).optimize(
    ...     study, objective, n_trials=6
    ... )
    >>> len(study.trials), {t.state.name for t in study.trials}
    (6, {'COMPLETE'})

    Args:
        func: A function taking ``trials: list[optuna.trial.Trial]`` (1 to K of them) and
            returning a sequence of ``len(trials)`` entries as above.

    Returns:
        The marked objective; calling it calls ``func``.

    Raises:
        TypeError: If ``func`` is not callable.
    """
    if not callable(func):
        raise _checks.type_error(
            "func", func, "callable", "pass a function taking a list of optuna trials"
        )
    if isinstance(func, BatchedObjective):
        return func
    return BatchedObjective(func)


def is_batched(func: object) -> bool:
    """Whether ``func`` was marked by :func:`batched`."""
    return isinstance(func, BatchedObjective)


def run_batch(slot: _Slot, job: TrialJob, stream: torch.cuda.Stream | None) -> list[TrialOutcome]:
    """Run the batched objective on ``job.batch``'s trials in ``slot``; tell each trial.

    Called in the slot's thread, as ``_run_trial`` for one trial. Every member job gets
    exactly one outcome, in order. The trials share the slot's device, stream and pool
    account; :func:`waterwave_hpo.current` gives the first trial's context.
    """
    outcomes = _run_batch(slot, job, stream)
    if slot.host.settings.gc_after_trial:
        gc.collect()
    return outcomes


def _run_batch(slot: _Slot, job: TrialJob, stream: torch.cuda.Stream | None) -> list[TrialOutcome]:
    # Here, not at the top: _host's slot loop imports this module.
    from waterwave_hpo.executor._host import TrialInterrupted
    from waterwave_hpo.executor._host import _classify
    from waterwave_hpo.executor._host import _release_interrupted
    from waterwave_hpo.executor._host import _release_memory
    from waterwave_hpo.executor._host import on_trial_stream

    settings = slot.host.settings
    study = settings.study
    members = job.batch
    trials = [member.trial for member in members]
    device = slot.host.device
    first = trials[0]
    context = TrialContext(
        trial=first,
        trial_number=first.number,
        device=device,
        stream=stream,
        slot=slot.index,
        attempt=job.attempt,
        scheduler=slot.host.scheduler,
        retry_of=job.retry_of,
    )
    _optuna_compat.set_in_optimize_loop(study, True)
    token = _CURRENT.set(context)
    memory = slot.host.memory
    account: Any = None
    peak_bytes: int | None = None
    result: Any = None
    pruned = False
    error: BaseException | None = None
    slot.busy = True
    try:
        for trial in trials:
            _set_attr(settings, trial, ATTR_DEVICE, str(device))
            _set_attr(settings, trial, ATTR_SLOT, slot.index)
            _set_attr(settings, trial, ATTR_BATCH, [t.number for t in trials])
        account = memory.open_account(first.number, stream)
        with on_trial_stream(device, stream, memory.pool):
            result = settings.func(trials)
    except optuna.TrialPruned:
        pruned = True
    except BaseException as caught:  # classified below; KeyboardInterrupt included
        error = caught
    finally:
        # Batch-mates count as neighbours: they shared the device's memory with each trial.
        neighbours = slot.neighbours() + len(trials) - 1
        slot.busy = False
        _CURRENT.reset(token)
        out_of_memory = isinstance(error, Exception) and is_out_of_memory(error)
        if out_of_memory:
            _release_memory(error, device)  # type: ignore[arg-type]
        with contextlib.suppress(Exception):
            peak_bytes = memory.close_account(first.number, account)
        for trial in trials:
            with contextlib.suppress(Exception):
                memory.trial_ended(trial.number)

    if isinstance(error, TrialInterrupted):
        _release_interrupted(error)
        with contextlib.suppress(Exception):
            _optuna_compat.release_thread_session(study)
        outcomes = []
        for member in members:
            with contextlib.suppress(Exception):
                study.tell(member.trial, state=TrialState.FAIL, skip_if_finished=True)
            outcomes.append(TrialOutcome(member, OutcomeKind.INTERRUPTED, None))
        return outcomes

    if peak_bytes is not None:
        # The batch's peak, shared evenly: the fused model's memory is the trials' together.
        for trial in trials:
            with contextlib.suppress(Exception):
                _set_attr(settings, trial, ATTR_PEAK_BYTES, peak_bytes // len(trials))
    if pruned:
        return [_end_pruned(settings, member) for member in members]
    if error is not None:
        kind = _classify(settings, job, error, neighbours, out_of_memory)
        if out_of_memory:
            reason = f"out of device memory in a fused batch of {len(trials)}: {error}"
        else:
            reason = _format(error)
        return [
            _end_failed(settings, member, kind, reason, error=error, neighbours=neighbours)
            for member in members
        ]
    entries = _entries(result, len(trials))
    if isinstance(entries, str):
        return [
            _end_failed(settings, member, OutcomeKind.FAILED, entries, fail_value=result)
            for member in members
        ]
    return [
        _end_entry(settings, member, entry) for member, entry in zip(members, entries, strict=True)
    ]


def _entries(result: object, n_trials: int) -> Sequence[object] | str:
    """``result`` as one entry per trial, or the reason it is not."""
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


def _end_entry(settings: RunSettings, member: TrialJob, entry: object) -> TrialOutcome:
    if isinstance(entry, optuna.TrialPruned):
        return _end_pruned(settings, member, entry)
    if isinstance(entry, BaseException):
        return _end_failed(settings, member, OutcomeKind.FAILED, _format(entry), error=entry)
    frozen, fail_message = _optuna_compat.tell_as_optimize(settings.study, member.trial, entry)
    if fail_message is not None:
        with contextlib.suppress(Exception):
            _set_attr(settings, member.trial, ATTR_FAIL_REASON, fail_message[:_REASON_MAX_CHARS])
    return TrialOutcome(member, OutcomeKind.COMPLETE, frozen, None, 0, fail_message, entry)


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
    fail_value: object = None,
) -> TrialOutcome:
    with contextlib.suppress(Exception):
        # A reason already there was written by the executor on Ctrl+C, which tells the batch
        # FAIL while it still runs: a batch-mate's report() then raises UpdateFinishedTrialError
        # here, and that must not replace "interrupted" as the trial's reason.
        study, trial_id = settings.study, _optuna_compat.trial_id(member.trial)
        if ATTR_FAIL_REASON not in _optuna_compat.system_attrs(study, trial_id):
            _set_attr(settings, member.trial, ATTR_FAIL_REASON, reason[:_REASON_MAX_CHARS])
    frozen, _ = _optuna_compat.tell_as_optimize(settings.study, member.trial, state=TrialState.FAIL)
    fail_message = reason if error is None else None
    return TrialOutcome(member, kind, frozen, error, neighbours, fail_message, fail_value)


def _format(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _set_attr(settings: RunSettings, trial: optuna.trial.Trial, key: str, value: object) -> None:
    if settings.record_trial_attrs:
        _optuna_compat.set_system_attr(settings.study, _optuna_compat.trial_id(trial), key, value)
