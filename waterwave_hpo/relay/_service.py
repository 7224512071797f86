"""The driver's side of a relay: each call checked against the run's policy, then run."""

from __future__ import annotations

import logging
import pickle
import threading
from typing import Any

import optuna

from waterwave_hpo import _optuna_compat
from waterwave_hpo.relay._policy import StoragePermissionError
from waterwave_hpo.relay._policy import StudyAccessPolicy

_logger = logging.getLogger("waterwave_hpo")


class StorageService:
    """Runs relayed storage calls on the study's own storage, for the run's study only.

    The driver stays the only process that touches the storage (as Optuna recommends for many
    workers on one RDB); whatever carries the calls (a Ray actor, a pipe to a worker process)
    hands them to :meth:`run`. Thread-safe: calls of several hosts run side by side, as the
    storage allows.

    Args:
        study: The run's study; callers get its storage, for it alone.
        study_attrs: Callers may set the study's user and system attributes
            (:class:`StudyAccessPolicy`'s ``study_attrs``).
    """

    def __init__(self, study: optuna.Study, study_attrs: bool = False) -> None:
        self.storage = _optuna_compat.storage_of(study)
        self.policy = StudyAccessPolicy(
            self.storage, _optuna_compat.study_id(study), study.study_name, study_attrs
        )
        self._refused: set[str] = set()
        self._refused_lock = threading.Lock()

    def run(self, method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        """One call: ``(True, result)``, or ``(False, exception)`` for the caller to raise.

        A call the policy refuses answers :class:`StoragePermissionError` (logged once per
        method); an exception of the storage itself (``KeyError``, ``UpdateFinishedTrialError``)
        is the caller's to see. Never raises.
        """
        try:
            self.policy.check(method, args)
            if method == "get_trials_since":
                result = self._trials_since(*args)
            else:
                result = getattr(self.storage, method)(*args)
            self.policy.allowed_result(method, result)
        except StoragePermissionError as error:
            self._log_refusal(method, error)
            return False, error
        except Exception as error:
            return False, error
        return True, result

    def _trials_since(
        self, study_id: int, known: int, unfinished: tuple[int, ...]
    ) -> list[optuna.trial.FrozenTrial]:
        """The study's trials numbered ``known`` or more, and those numbered in ``unfinished``.

        What a :class:`~waterwave_hpo.relay.RelayedStorage` that kept the finished trials
        below ``known`` needs to answer ``get_all_trials`` (Optuna never changes a finished
        trial), so a process does not receive the whole study at every sample.
        """
        trials = self.storage.get_all_trials(study_id, deepcopy=False)
        if len(trials) >= known and (known == 0 or trials[known - 1].number == known - 1):
            # Ordered by number, as Optuna's storages return them: slice, do not scan.
            fresh = trials[known:]
            wanted = [trials[n] for n in unfinished if n < known and trials[n].number == n]
            if len(wanted) == len(unfinished):
                return wanted + fresh
        wanted_set = set(unfinished)
        return [t for t in trials if t.number >= known or t.number in wanted_set]

    def _log_refusal(self, method: str, error: StoragePermissionError) -> None:
        with self._refused_lock:
            if method in self._refused:
                return
            self._refused.add(method)
        _logger.warning(
            "Refused a host's storage call (logged once per method): %s", error, stacklevel=1
        )


def sendable(ok: bool, payload: Any, dumps: Any = pickle.dumps) -> tuple[bool, Any]:
    """``(ok, payload)``, or a ``RuntimeError`` answer when ``payload`` cannot be pickled.

    Args:
        ok: Whether the call succeeded.
        payload: Its result or exception.
        dumps: The pickler the transport uses (``pickle.dumps``, Ray's ``cloudpickle.dumps``).
    """
    try:
        dumps(payload)
    except Exception as error:
        return False, RuntimeError(f"The storage's answer cannot be sent: {error!r}")
    return ok, payload
