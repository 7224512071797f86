"""The few places where driving an ``optuna.Study`` from outside needs Optuna's internals.

Optuna has no executor hook: ``Study.optimize`` runs trials itself. To drive a study with
``ask``/``tell`` from many threads and still honour ``study.stop()`` (which Optuna only allows
"inside an objective function or a callback") we set the study's per-thread
``in_optimize_loop`` flag and read its stop flag, exactly as ``optuna/study/_optimize.py`` does.
These attributes have been stable from Optuna 3.x through 5.x; everything touching them is here.
"""

from __future__ import annotations

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


def set_user_attr(
    study: optuna.Study, trial: optuna.trial.FrozenTrial, key: str, value: object
) -> None:
    """Set a user attribute on any trial of ``study`` that is not finished yet, by its id.

    ``optuna.trial.Trial.set_user_attr`` needs the live ``Trial`` object; a trial left RUNNING
    by a process that died has only its ``FrozenTrial``.
    """
    study._storage.set_trial_user_attr(trial._trial_id, key, value)
