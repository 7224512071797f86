"""The few places where driving an ``optuna.Study`` from outside needs Optuna's internals.

Optuna has no executor hook: ``Study.optimize`` runs trials itself. To drive a study with
``ask``/``tell`` from many threads and still honour ``study.stop()`` (which Optuna only allows
"inside an objective function or a callback") we set the study's per-thread
``in_optimize_loop`` flag and read its stop flag, exactly as ``optuna/study/_optimize.py`` does.
These attributes have been stable from Optuna 3.x through 5.x; everything touching them is here.

To behave as ``Study.optimize`` does, the executor also uses what ``optuna/study/_optimize.py``
uses: ``_tell_with_warning`` (an invalid value is logged, not warned), its log functions, the
progress bar, heartbeat threads and ``fail_stale_trials``; and the storage's system attributes
for its own bookkeeping. The conformance suite (``tests/conformance``) runs Optuna's own tests
through the executor, so a change in any of them shows there.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import copy
import datetime
import logging
import math
import time
from typing import Protocol
import warnings
import weakref

import optuna


def in_optimize_loop(study: optuna.Study) -> bool:
    """Whether an ``optimize`` loop is already running in this thread for ``study``."""
    return bool(getattr(study._thread_local, "in_optimize_loop", False))


def set_in_optimize_loop(study: optuna.Study, value: bool) -> None:
    """Mark this thread as inside (or outside) an optimize loop of ``study``."""
    study._thread_local.in_optimize_loop = value


def stop_requested(study: optuna.Study) -> bool:
    """Whether ``study.stop()`` was called since :func:`reset_stop`."""
    return bool(getattr(study, "_stop_flag", False))


def reset_stop(study: optuna.Study) -> None:
    """Clear the stop flag, as ``Study.optimize`` does when it starts."""
    study._stop_flag = False


def storage_of(study: optuna.Study) -> optuna.storages.BaseStorage:
    """The storage object behind ``study`` (what Optuna keeps in ``study._storage``)."""
    return study._storage


def study_id(study: optuna.Study) -> int:
    """The storage id of ``study``."""
    return int(study._study_id)


def request_stop(study: optuna.Study) -> None:
    """Ask a running optimize loop to start no new trial, as ``Study.stop`` does.

    Unlike ``Study.stop`` it may be called from any thread, not only inside the loop.
    """
    study._stop_flag = True


def study_system_attrs(study: optuna.Study) -> dict[str, object]:
    """The study's own system attributes, read from its storage."""
    return dict(study._storage.get_study_system_attrs(study._study_id))


def set_study_system_attr(study: optuna.Study, key: str, value: object) -> None:
    """Set a system attribute of the study itself (``Study.set_system_attr`` is deprecated)."""
    study._storage.set_study_system_attr(study._study_id, key, value)  # type: ignore[arg-type]


def fail_trial(study: optuna.Study, trial_id: int) -> None:
    """Set the unfinished trial ``trial_id`` to FAIL in the storage without the tell bookkeeping.

    Raises:
        optuna.exceptions.UpdateFinishedTrialError: The trial had already finished.
    """
    study._storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)


def is_finished(study: optuna.Study, trial: optuna.trial.Trial | optuna.trial.FrozenTrial) -> bool:
    """Whether the storage has ``trial`` COMPLETE, PRUNED or FAIL (read from the storage)."""
    return study._storage.get_trial(trial_id(trial)).state.is_finished()


class _SkippedTellFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Skipped telling trial")


_SKIPPED_TELL_FILTER = _SkippedTellFilter()


@contextlib.contextmanager
def quiet_skipped_tells() -> Iterator[None]:
    """Drop Optuna's ``Skipped telling trial N ...`` INFO lines while the block runs.

    An interrupted run tells its running trials FAIL while they still run; each trial's own
    end (a ``report()`` refused, an interrupt) then tells it again, which Optuna's ``study.tell``
    logs once per trial. The run says what it did in one line of its own instead.
    """
    logger = logging.getLogger("optuna.study._tell")
    logger.addFilter(_SKIPPED_TELL_FILTER)
    try:
        yield
    finally:
        logger.removeFilter(_SKIPPED_TELL_FILTER)


def set_system_attr(study: optuna.Study, trial_id: int, key: str, value: object) -> None:
    """Set a system attribute of the unfinished trial ``trial_id`` of ``study``.

    ``Trial.set_system_attr`` is deprecated in Optuna; the storage's method is the one Optuna
    itself uses. The executor keeps its bookkeeping there, out of the user's attributes.
    """
    study._storage.set_trial_system_attr(trial_id, key, value)  # type: ignore[arg-type]


def set_system_attrs(study: optuna.Study, trial_id: int, attrs: dict[str, object]) -> None:
    """Set several system attributes of the unfinished trial ``trial_id`` of ``study``.

    On Optuna's RDB storage (SQLite, PostgreSQL, MySQL; Optuna wraps it in ``_CachedStorage``)
    all in one transaction, with the statements Optuna's ``set_trial_system_attr`` runs (one
    commit instead of one per attribute: measured 3.6 ms of driver CPU each on SQLite); on any
    other storage one call per attribute.
    """
    storage = study._storage
    backend = getattr(storage, "_backend", storage)
    if isinstance(backend, optuna.storages.RDBStorage) and hasattr(
        backend, "_set_trial_attr_without_commit"
    ):
        from optuna.storages._rdb import models
        from optuna.storages._rdb.storage import _create_scoped_session

        with _create_scoped_session(backend.scoped_session, True) as session:
            for key, value in attrs.items():
                backend._set_trial_attr_without_commit(
                    session, models.TrialSystemAttributeModel, trial_id, key, value
                )
        return
    for key, value in attrs.items():
        storage.set_trial_system_attr(trial_id, key, value)  # type: ignore[arg-type]


def system_attrs(study: optuna.Study, trial_id: int) -> dict[str, object]:
    """The system attributes of trial ``trial_id`` of ``study``, read from its storage."""
    return dict(study._storage.get_trial_system_attrs(trial_id))


def trial_id(trial: optuna.trial.Trial | optuna.trial.FrozenTrial) -> int:
    """The storage id of a live or frozen trial."""
    return int(trial._trial_id)


def enqueue_with_system_attrs(
    study: optuna.Study, params: dict[str, object], system_attrs: dict[str, object]
) -> None:
    """``study.enqueue_trial(params)`` that also records ``system_attrs`` on the queued trial.

    As ``Study.enqueue_trial`` does, the parameters go in the ``fixed_params`` system attribute
    of a WAITING trial, which ``study.ask()`` pops.
    """
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.WAITING,
            system_attrs={**system_attrs, "fixed_params": params},
        )
    )


def tell_as_optimize(
    study: optuna.Study,
    trial: optuna.trial.Trial,
    values: object = None,
    state: optuna.trial.TrialState | None = None,
) -> tuple[optuna.trial.FrozenTrial, str | None]:
    """Tell ``trial`` as ``Study.optimize`` does; return the told trial and why it failed.

    ``Study.tell`` warns (``UserWarning``) about an invalid return value; ``Study.optimize``
    instead logs it as the trial's failure. This calls the function both share with
    ``suppress_warning=True`` (and ``skip_if_finished=True``: the objective, or the executor on
    Ctrl+C, may have told the trial already). The second item is the message of an invalid
    return value, else ``None``.

    Optuna checks ``skip_if_finished`` before it writes: a tell from another thread (the
    executor failing the trial on Ctrl+C) that lands between the two makes the write raise
    ``UpdateFinishedTrialError``. That trial has ended as if it had ended a moment earlier: it
    is skipped the same way, and its stored end is returned.
    """
    from optuna.study._tell import _tell_with_warning

    try:
        _, _, warning_message = _tell_with_warning(
            study=study,
            trial=trial,
            value_or_values=values,  # type: ignore[arg-type]
            state=state,
            skip_if_finished=True,
            suppress_warning=True,
        )
    except TypeError as error:
        if state is not None:
            raise
        # A value float() takes but Optuna's check does not (the string "0": Optuna's own
        # optimize then fails with "Should not reach"): the trial's failure, as any invalid value.
        warning_message = (
            f"The objective returned {values!r} ({type(values).__name__}), which Optuna cannot "
            f"check ({error}); return a float."
        )
        study.tell(trial, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    except optuna.exceptions.UpdateFinishedTrialError:
        if not is_finished(study, trial):
            raise
        warning_message = None  # told meanwhile: skipped, as skip_if_finished would have
    return study._storage.get_trial(trial_id(trial)), warning_message


def log_finished_trial(
    study: optuna.Study,
    frozen: optuna.trial.FrozenTrial,
    error: BaseException | None,
    fail_message: str | None,
) -> None:
    """Log a finished trial on Optuna's loggers, with Optuna's words, as ``Study.optimize`` does.

    ``"Trial N finished with value: ... Best is trial M with value: ..."`` (INFO), ``"Trial N
    pruned. ..."`` (INFO), ``"Trial N failed with parameters: ... because of the following
    error: ..."`` (WARNING); they follow ``optuna.logging.set_verbosity``. A failed trial gets
    that one line with its reason: not Optuna's second one, ``"Trial N failed with value
    None."``, which reads as if the objective had returned ``None`` when it raised.
    """
    from optuna.study import _optimize

    state = frozen.state
    if state is optuna.trial.TrialState.COMPLETE and frozen.values is not None:
        study._log_completed_trial(frozen.values, frozen.number, frozen.params)
    elif state is optuna.trial.TrialState.PRUNED:
        _optimize._logger.info(f"Trial {frozen.number} pruned. {error if error else ''}")
    elif state is optuna.trial.TrialState.FAIL and (error is not None or fail_message is not None):
        _optimize._logger.warning(
            f"Trial {frozen.number} failed with parameters: {frozen.params} because of the "
            f"following error: {repr(error) if error is not None else fail_message}.",
            exc_info=error,
        )


class Heartbeat(Protocol):
    """A running trial's heartbeat: Optuna's ``HeartbeatThread`` or its null object."""

    def start(self) -> None:
        """Start recording heartbeats (nothing for the null object)."""

    def join(self) -> None:
        """Stop recording heartbeats and wait for the thread to end."""


def heartbeat(study: optuna.Study, trial_id: int) -> Heartbeat:
    """Optuna's heartbeat for trial ``trial_id`` (a null object when the storage has none).

    With ``RDBStorage(heartbeat_interval=...)``, ``Study.optimize`` records a heartbeat for each
    running trial every ``heartbeat_interval`` seconds from a thread of its own
    (``optuna/storages/_heartbeat.py``); the executor does the same for each co-hosted trial.
    """
    from optuna.storages._heartbeat import get_heartbeat_thread

    return get_heartbeat_thread(trial_id, study._storage)


def record_heartbeat(study: optuna.Study, trial_id: int) -> None:
    """Record one heartbeat of trial ``trial_id`` now (nothing when the storage has none).

    Optuna's heartbeat thread writes its first beat only once the thread runs; the executor
    calls this right after ``ask()`` so that a process dying later leaves a trial Optuna's
    ``fail_stale_trials`` sees (it skips a RUNNING trial with no heartbeat at all).
    """
    from optuna.storages._heartbeat import is_heartbeat_enabled

    storage = study._storage
    if is_heartbeat_enabled(storage):
        storage.record_heartbeat(trial_id)  # type: ignore[attr-defined]


_NO_HEARTBEAT_SWEPT: weakref.WeakKeyDictionary[optuna.Study, float] = weakref.WeakKeyDictionary()


def fail_stale_trials(study: optuna.Study, *, force: bool = False) -> None:
    """Fail the trials whose heartbeat is stale, as ``optimize`` does before each ``ask()``.

    Fail the trials whose heartbeat is older than the grace period, as ``optimize`` does
    before each ``ask()``, and run the storage's ``failed_trial_callback`` for each. Also fail
    the RUNNING trials of an RDB storage that have no heartbeat at all and started more than the
    grace period ago: their process died between ``ask()`` and its first heartbeat, and Optuna's
    sweep skips them forever (``RDBStorage._get_stale_trial_ids``). That second query runs at
    most once per heartbeat interval per study (it is on the ask path; such a trial only becomes
    failable a grace period after its start anyway), or at once with ``force``.
    """
    from optuna.storages._heartbeat import is_heartbeat_enabled

    storage = study._storage
    if not is_heartbeat_enabled(storage):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    interval_s = getattr(getattr(storage, "_backend", storage), "heartbeat_interval", None) or 0
    now = time.monotonic()
    if not force and now - _NO_HEARTBEAT_SWEPT.get(study, -math.inf) < interval_s:
        return
    _NO_HEARTBEAT_SWEPT[study] = now
    failed: list[int] = []
    for stale_id in _running_without_heartbeat(study):
        try:
            if storage.set_trial_state_values(stale_id, optuna.trial.TrialState.FAIL):
                failed.append(stale_id)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another process failed (or its owner finished) it meanwhile
    callback = storage.get_heartbeat_stale_trial_callback()  # type: ignore[attr-defined]
    if callback is not None:
        for stale_id in failed:
            callback(study, copy.deepcopy(storage.get_trial(stale_id)))


def _running_without_heartbeat(study: optuna.Study) -> list[int]:
    """Ids of RUNNING trials with no heartbeat row that started over a grace period ago.

    Only an ``RDBStorage`` (possibly behind Optuna's cache) keeps heartbeat rows. The start is
    the trial's ``datetime_start`` (naive local time, as Optuna gives it in every version),
    compared with this process's clock.
    """
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session

    storage: object = study._storage
    backend = getattr(storage, "_backend", storage)  # _CachedStorage wraps RDBStorage
    if not isinstance(backend, optuna.storages.RDBStorage) or backend.heartbeat_interval is None:
        return []
    grace_s = backend.grace_period or 2 * backend.heartbeat_interval  # as Optuna's default
    with _create_scoped_session(backend.scoped_session) as session:
        rows = (
            session.query(models.TrialModel.trial_id)
            .outerjoin(
                models.TrialHeartbeatModel,
                models.TrialHeartbeatModel.trial_id == models.TrialModel.trial_id,
            )
            .filter(models.TrialModel.study_id == study._study_id)
            .filter(models.TrialModel.state == optuna.trial.TrialState.RUNNING)
            .filter(models.TrialHeartbeatModel.trial_heartbeat_id.is_(None))
            .all()
        )
    started_before = datetime.datetime.now() - datetime.timedelta(seconds=grace_s)
    stale: list[int] = []
    for (row_id,) in rows:
        start = backend.get_trial(int(row_id)).datetime_start
        if start is not None and start < started_before:
            stale.append(int(row_id))
    return stale


def in_memory_sqlite_url(study: optuna.Study) -> str | None:
    """The URL of ``study``'s storage if it is an in-memory SQLite database, else ``None``.

    ``sqlite:///:memory:`` is a database per connection: a trial told from another thread
    (another connection) is not seen, so trials would stay RUNNING.
    """
    storage: object = study._storage
    backend = getattr(storage, "_backend", storage)  # _CachedStorage wraps RDBStorage
    url = getattr(backend, "url", None)
    if not isinstance(backend, optuna.storages.RDBStorage) or not isinstance(url, str):
        return None
    if url.startswith("sqlite") and (
        url.rstrip("/").endswith(":memory:") or url in ("sqlite://", "sqlite:///")
    ):
        return url
    if "mode=memory" in url:
        return url
    return None


class ProgressBar(Protocol):
    """Optuna's progress bar of ``Study.optimize``."""

    def update(self, elapsed_seconds: float, study: optuna.Study) -> None:
        """Count one finished trial (or show the elapsed time of a timeout) and the best."""

    def close(self) -> None:
        """Close the bar."""


def progress_bar(show: bool, n_trials: int | None, timeout_s: float | None) -> ProgressBar:
    """The progress bar ``Study.optimize`` shows.

    The progress bar ``Study.optimize`` shows (``optuna/progress_bar.py``): finished trials of
    ``n_trials``; with only a timeout, elapsed of ``timeout_s`` seconds; with neither, Optuna's
    warning and no bar. It also routes Optuna's log lines through tqdm while it shows.
    """
    from optuna.progress_bar import _ProgressBar

    return _ProgressBar(show, n_trials, timeout_s)


def release_thread_session(study: optuna.Study) -> None:
    """Close this thread's storage session, as ``Study.optimize`` does when a worker ends.

    After an asynchronous exception (Ctrl+C delivered into a trial's thread) inside a storage
    call, an RDB session may be left in a transaction that holds SQLite's lock.
    """
    study._storage.remove_session()
