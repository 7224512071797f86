"""Optuna studies whose ``optimize`` takes ``executor=``.

``optuna.Study.optimize`` runs trials itself (its ``n_jobs`` is a fixed thread pool) and has no
executor hook. :class:`Study` is an ``optuna.Study`` whose ``optimize`` also accepts
``executor=WaterwaveExecutor(...)`` and then hands the work to it; without ``executor`` it is
Optuna's own ``optimize``, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from waterwave_hpo import _checks
from waterwave_hpo.executor import WaterwaveExecutor


class Study(optuna.Study):
    """An ``optuna.Study`` whose :meth:`optimize` also takes ``executor=``.

    Create one with :func:`create_study` or :func:`load_study`, or adopt an existing study with
    :func:`wrap_study`; everything else is ``optuna.Study``.
    """

    def optimize(
        self,
        func: Callable[[optuna.trial.Trial], Any],
        n_trials: int | None = None,
        timeout: float | None = None,
        n_jobs: int = 1,
        catch: Iterable[type[Exception]] | type[Exception] = (),
        callbacks: Iterable[Callable[[optuna.Study, FrozenTrial], None]] | None = None,
        gc_after_trial: bool = False,
        show_progress_bar: bool = False,
        *,
        executor: WaterwaveExecutor | None = None,
    ) -> None:
        """Optimize an objective, as ``optuna.Study.optimize``, optionally with an executor.

        Args:
            func: The objective, as for ``optuna.Study.optimize``.
            n_trials: As for ``optuna.Study.optimize``.
            timeout: As for ``optuna.Study.optimize`` (seconds).
            n_jobs: As for ``optuna.Study.optimize``; must be 1 with an executor.
            catch: As for ``optuna.Study.optimize``.
            callbacks: As for ``optuna.Study.optimize``.
            gc_after_trial: As for ``optuna.Study.optimize``.
            show_progress_bar: As for ``optuna.Study.optimize``.
            executor: A :class:`~waterwave_hpo.WaterwaveExecutor` that runs the trials
                concurrently on its devices, or ``None`` for Optuna's own loop.

        Raises:
            TypeError: If ``executor`` is not a ``WaterwaveExecutor``.
            ValueError: If both ``executor`` and ``n_jobs != 1`` are given (the executor
                decides concurrency: use ``trials_per_device``).
        """
        if executor is None:
            super().optimize(
                func,
                n_trials=n_trials,
                timeout=timeout,
                n_jobs=n_jobs,
                catch=catch,
                callbacks=callbacks,
                gc_after_trial=gc_after_trial,
                show_progress_bar=show_progress_bar,
            )
            return
        if not isinstance(executor, WaterwaveExecutor):
            raise _checks.type_error(
                "executor",
                executor,
                "a waterwave_hpo.WaterwaveExecutor",
                "pass e.g. executor=ww.WaterwaveExecutor(trials_per_device=4)",
            )
        if n_jobs != 1:
            raise ValueError(
                f"n_jobs={n_jobs} cannot be combined with executor=: the executor runs "
                "trials_per_device trials on each device. Drop n_jobs, or set "
                "WaterwaveExecutor(trials_per_device=...)."
            )
        executor.optimize(
            self,
            func,
            n_trials=n_trials,
            timeout=timeout,
            catch=catch,
            callbacks=callbacks,
            gc_after_trial=gc_after_trial,
            show_progress_bar=show_progress_bar,
        )


def wrap_study(study: optuna.Study) -> Study:
    """Return ``study`` as a :class:`Study` (the same object, same storage, sampler and pruner).

    Raises:
        TypeError: If ``study`` is not an ``optuna.Study``.
    """
    if not isinstance(study, optuna.Study):
        raise _checks.type_error(
            "study", study, "an optuna.Study", "create one with optuna.create_study(...)"
        )
    if type(study) is optuna.Study:
        # Study adds a method and no state, so the object can take the subclass as it is.
        study.__class__ = Study
    elif not isinstance(study, Study):
        raise TypeError(
            f"Cannot adopt a study of type {type(study).__name__!r}; pass an optuna.Study, or "
            "call WaterwaveExecutor().optimize(study, ...) with it directly."
        )
    return study  # type: ignore[return-value]


def open_storage(
    storage: str | optuna.storages.BaseStorage | None,
) -> optuna.storages.BaseStorage | None:
    """``storage`` opened as ``optuna.create_study`` would, with errors naming ``storage``.

    A path where a URL is wanted (``"/runs/study.log"``) and a URL SQLAlchemy cannot open
    (unknown dialect, a directory that does not exist, a read-only file) raise an error that
    names the argument, the value and the fix; the storage's own error is its ``__cause__``.

    Raises:
        TypeError: ``storage`` is neither ``None``, a URL string nor an Optuna storage.
        ValueError: ``storage`` is not a database URL, or the database cannot be opened.
    """
    if storage is None or isinstance(storage, optuna.storages.BaseStorage):
        return storage
    if not isinstance(storage, str):
        raise _checks.type_error(
            "storage",
            storage,
            "a database URL, an optuna storage or None",
            "pass e.g. storage='sqlite:///study.db', or an optuna.storages.JournalStorage",
        )
    if "://" not in storage:
        raise _checks.value_error(
            "storage",
            storage,
            "is not a database URL (a string storage is an SQLAlchemy URL such as "
            "'sqlite:///study.db')",
            "for a journal file pass optuna.storages.JournalStorage("
            f"optuna.storages.journal.JournalFileBackend({storage!r})); for SQLite pass "
            f"'sqlite:///{storage}'",
        )
    try:
        return optuna.storages.get_storage(storage)
    except Exception as error:
        if isinstance(error, ImportError):
            raise
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise _checks.value_error(
            "storage",
            storage,
            f"could not be opened ({type(error).__name__}: {first})",
            "check the URL's dialect and that its database (or the directory of an SQLite "
            "file) exists and is writable, e.g. storage='sqlite:///study.db'",
        ) from error


def create_study(
    *,
    storage: str | optuna.storages.BaseStorage | None = None,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    study_name: str | None = None,
    direction: str | optuna.study.StudyDirection | None = None,
    load_if_exists: bool = False,
    directions: Sequence[str | optuna.study.StudyDirection] | None = None,
) -> Study:
    """Create a study, as ``optuna.create_study`` with the same arguments.

    Returns:
        A :class:`Study` whose ``optimize`` also takes ``executor=``.

    Raises:
        TypeError, ValueError: If ``storage`` is not a URL or storage, or cannot be opened
            (see :func:`open_storage`); the storage's own error is the ``__cause__``. Else
            whatever ``optuna.create_study`` raises for the same arguments.
    """
    study = optuna.create_study(
        storage=open_storage(storage),
        sampler=sampler,
        pruner=pruner,
        study_name=study_name,
        direction=direction,  # type: ignore[arg-type]
        load_if_exists=load_if_exists,
        directions=directions,  # type: ignore[arg-type]
    )
    return wrap_study(study)


def load_study(
    *,
    study_name: str | None,
    storage: str | optuna.storages.BaseStorage,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
) -> Study:
    """Load a study, as ``optuna.load_study`` with the same arguments.

    Returns:
        A :class:`Study` whose ``optimize`` also takes ``executor=``.

    Raises:
        KeyError: If no study of that name exists; else whatever ``optuna.load_study`` raises
            for the same arguments.
    """
    opened = open_storage(storage)
    try:
        study = optuna.load_study(
            study_name=study_name,
            storage=opened,  # type: ignore[arg-type]
            sampler=sampler,
            pruner=pruner,
        )
    except KeyError as error:  # Optuna's "No such study ..." / "Record does not exist."
        assert opened is not None
        names = sorted(s.study_name for s in opened.get_all_studies())
        raise KeyError(
            _checks.message(
                "study_name",
                study_name,
                f"no such study in storage {storage!r} (it holds {names or 'no study'})",
                "pass one of those names, or create it with waterwave_hpo.create_study("
                "study_name=..., storage=...)",
            )
        ) from error
    return wrap_study(study)


__all__ = ["Study", "create_study", "load_study", "wrap_study"]
