"""A study's storage that refuses writes: refused up front where visible, else named.

The executor records every trial through the study's storage (``ask``, system attributes,
``tell``). When the storage refuses a write (a read-only SQLite URL, a database file made
immutable, a journal file without write permission, a full disk), Optuna and SQLAlchemy raise
errors that name neither the storage nor what is left behind (``StorageInternalError: ...
invalid data in the commit, e.g. exceeding max length``). A trial whose end cannot be written
stays RUNNING. This module says which storage refused, which trials are left RUNNING and how
to end them, keeping the storage's own error as ``__cause__``.
"""

from __future__ import annotations

from collections.abc import Sequence
import os
from urllib.parse import parse_qs
from urllib.parse import urlsplit

import optuna

from waterwave_hpo import _checks
from waterwave_hpo import _optuna_compat


class StorageWriteError(RuntimeError):
    """The study's storage refused to record a trial (its creation, an attribute or its end).

    Raised by ``optimize`` once the trials running at that moment have finished; no new trial
    is asked for after the refusal. The message names the storage, the trials left RUNNING
    (their end could not be written) and how to end them; the storage's own error is the
    ``__cause__``.

    Attributes:
        left_running: Numbers of this run's trials the storage still holds as RUNNING.
    """

    def __init__(self, message: str, left_running: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.left_running = list(left_running)


def describe_storage(study: optuna.Study) -> str:
    """The study's storage as a user named it: an RDB URL, a journal file path, or a type."""
    storage: object = _optuna_compat.storage_of(study)
    backend = getattr(storage, "_backend", storage)  # _CachedStorage wraps RDBStorage
    url = getattr(backend, "url", None)
    if isinstance(url, str):
        return repr(url)
    journal = getattr(backend, "_backend", None)  # JournalStorage -> JournalFileBackend
    path = getattr(journal, "_file_path", None)
    if isinstance(path, str):
        return f"journal file {path!r}"
    return type(backend).__name__


def check_storage_writable(study: optuna.Study) -> None:
    """Refuse, before any trial, a storage whose URL opens the database read-only.

    Raises:
        ValueError: The study's RDB URL has ``mode=ro`` (SQLite) or ``immutable=1``.
    """
    storage: object = _optuna_compat.storage_of(study)
    backend = getattr(storage, "_backend", storage)
    url = getattr(backend, "url", None)
    if not isinstance(backend, optuna.storages.RDBStorage) or not isinstance(url, str):
        return
    query = parse_qs(urlsplit(url).query)
    if "ro" in query.get("mode", []) or "1" in query.get("immutable", []):
        raise _checks.value_error(
            "study",
            study.study_name,
            f"has a read-only storage ({url!r}): no trial could be recorded",
            "open the study with a writable URL (drop mode=ro / immutable=1), e.g. "
            "optuna.load_study(study_name=..., storage='sqlite:///path/to/study.db')",
        )


def is_storage_error(error: BaseException) -> bool:
    """Whether ``error`` is a storage's refusal to read or write (not a user's objective error).

    Optuna's ``StorageInternalError`` (an RDB commit failed), SQLAlchemy's errors (a query
    failed, the database is locked or read-only) and ``OSError`` (a journal file that cannot be
    written, a full disk).
    """
    if isinstance(error, (optuna.exceptions.StorageInternalError, OSError)):
        return True
    return type(error).__module__.startswith("sqlalchemy")


def refused_write_error(
    study: optuna.Study,
    error: BaseException,
    left_running: Sequence[int],
    *,
    what: str,
) -> StorageWriteError:
    """The error ``optimize`` raises after the study's storage refused a write.

    Args:
        study: The study.
        error: The storage's own error (becomes ``__cause__`` when raised ``from`` it).
        left_running: Numbers of this run's trials still RUNNING in the storage.
        what: What the storage refused, e.g. ``"record a trial's end"``.

    Returns:
        The error, for the caller to raise from ``error``.
    """
    cause = f"{type(error).__name__}: {_root_message(error)}"
    if left_running:
        numbers = ", ".join(str(n) for n in left_running)
        left = (
            f"Trial(s) {numbers} are left RUNNING (their end could not be written). End them "
            "once the storage is writable: study.tell(number, state=optuna.trial.TrialState."
            "FAIL) for each, or, with RDBStorage(heartbeat_interval=...), "
            "optuna.storages.fail_stale_trials(study)."
        )
    else:
        left = "No trial of this run is left RUNNING."
    return StorageWriteError(
        f"study {study.study_name!r}: its storage {describe_storage(study)} refused to {what} "
        f"({cause}); no new trial was asked for after that. {left} Fix: make the storage "
        "writable (file permissions, `chattr -i`, free disk space, a URL without mode=ro), "
        "then run optimize again.",
        left_running,
    )


def running_trials(study: optuna.Study, numbers: set[int]) -> list[int]:
    """Those of ``numbers`` (trials whose end was not recorded) the storage holds as RUNNING.

    All of ``numbers`` when the storage refuses reads too.
    """
    try:
        trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    except Exception:  # the storage may refuse reads too; then we cannot say more
        return sorted(numbers)
    return sorted(t.number for t in trials if t.number in numbers)


def _root_message(error: BaseException) -> str:
    # Optuna's StorageInternalError hides SQLite's reason ("attempt to write a readonly
    # database", "disk I/O error") in its cause.
    cause = error.__cause__ or error.__context__
    text = str(cause if cause is not None else error).splitlines()
    first = text[0] if text else type(error).__name__
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.strerror or error} ({os.fspath(error.filename)})"
    return first
