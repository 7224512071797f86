"""What a process that runs trials may do with the driver's storage: one study, a host's calls.

Hosts on Ray (``cluster/``) and worker processes of one machine (``executor/``, process
isolation) reach the driver's storage through a relay; whatever carries the call, the driver
checks it against the run's :class:`StudyAccessPolicy` before it touches the storage.
"""

from __future__ import annotations

from collections.abc import Sequence
import threading
from typing import Any

from optuna.storages import BaseStorage
from optuna.storages._heartbeat import is_heartbeat_enabled


class StoragePermissionError(PermissionError):
    """A host's storage call that the run's :class:`StudyAccessPolicy` refuses.

    Raised in the calling host or worker process (the driver logs each kind of refusal once);
    the storage is unchanged.
    """


# Calls whose first argument is a study id that must be the run's study.
_STUDY_CALLS = frozenset(
    {
        "get_study_name_from_id",
        "get_study_directions",
        "get_study_user_attrs",
        "get_study_system_attrs",
        "create_new_trial",
        "get_all_trials",
        "get_trials_since",  # the relay's get_all_trials: new and unfinished trials only
        "get_n_trials",
        "get_best_trial",
        "get_trial_id_from_study_id_trial_number",
        "_get_stale_trial_ids",  # Optuna's fail_stale_trials (heartbeat)
    }
)
# Calls whose first argument is a trial id that must belong to the run's study.
_TRIAL_CALLS = frozenset(
    {
        "get_trial",
        "get_trial_number_from_id",
        "get_trial_param",
        "get_trial_params",
        "get_trial_user_attrs",
        "get_trial_system_attrs",
        "set_trial_param",
        "set_trial_state_values",
        "set_trial_intermediate_value",
        "set_trial_user_attr",
        "set_trial_system_attr",
        "record_heartbeat",  # Optuna's heartbeat thread
    }
)
# Calls whose first argument is a study id that must be the run's study, allowed only where the
# hosts own the study as the objective and the sampler do under ``Study.optimize``.
_STUDY_ATTR_CALLS = frozenset({"set_study_user_attr", "set_study_system_attr"})
# Calls without a study or trial: the storage's heartbeat settings (heartbeat storages only).
_HEARTBEAT_SETTINGS_CALLS = frozenset(
    {"get_heartbeat_interval", "get_heartbeat_stale_trial_callback", "get_failed_trial_callback"}
)


class StudyAccessPolicy:
    """What hosts may do with the driver's storage: the calls a host makes, on one study only.

    Allowed: reading the study's name, directions, attributes and trials; creating trials in it
    (ask); setting its trials' parameters, states and values (tell), intermediate values
    (report) and attributes; Optuna's heartbeat calls for its trials (when the storage has a
    heartbeat); with ``study_attrs=True``, setting the study's user and system attributes.
    Refused with :class:`StoragePermissionError`: any other study (by id, by name, or through a
    trial id of another study), ``get_all_studies``, creating, deleting or renaming a study, and,
    unless ``study_attrs=True``, setting study attributes (set them in the driver before
    ``optimize``).

    Args:
        storage: The study's storage (the driver's ``study._storage``).
        study_id: The run's study.
        study_name: Its name (``optuna.load_study`` looks the study up by name).
        study_attrs: Allow ``set_study_user_attr`` and ``set_study_system_attr`` on the run's
            study: what an objective (``trial.study.set_user_attr``) and a sampler (NSGA-II's
            generations, QMC's sample id) do to their study under ``Study.optimize``. Process
            isolation allows them (the workers run the user's own objective and sampler on the
            user's own study).
    """

    def __init__(
        self, storage: BaseStorage, study_id: int, study_name: str, study_attrs: bool = False
    ) -> None:
        self.storage = storage
        self.study_id = study_id
        self.study_name = study_name
        self.study_attrs = study_attrs
        self._heartbeat = is_heartbeat_enabled(storage)
        self._trial_ids: set[int] = set()
        self._lock = threading.Lock()

    def check(self, method: str, args: Sequence[Any]) -> None:
        """Refuse a call that this policy does not allow; return if it is allowed.

        Args:
            method: The ``BaseStorage`` method's name.
            args: Its positional arguments (the client passes every argument positionally).

        Raises:
            StoragePermissionError: The call is not allowed; the message says which rule.
        """
        if method == "get_study_id_from_name":
            if not args or args[0] != self.study_name:
                raise StoragePermissionError(
                    f"get_study_id_from_name({_first(args)!r}): hosts of this run may open only "
                    f"the study {self.study_name!r}."
                )
        elif method in _STUDY_CALLS:
            if not args or args[0] != self.study_id:
                raise StoragePermissionError(
                    f"{method}(study_id={_first(args)!r}): hosts of this run may use only the "
                    f"study {self.study_name!r} (study_id={self.study_id})."
                )
            if method.startswith("_get_stale") and not self._heartbeat:
                raise StoragePermissionError(f"{method}: this run's storage has no heartbeat.")
        elif method in _STUDY_ATTR_CALLS and self.study_attrs:
            if not args or args[0] != self.study_id:
                raise StoragePermissionError(
                    f"{method}(study_id={_first(args)!r}): hosts of this run may set the "
                    f"attributes of the study {self.study_name!r} (study_id={self.study_id}) "
                    "only."
                )
        elif method in _TRIAL_CALLS:
            if method == "record_heartbeat" and not self._heartbeat:
                raise StoragePermissionError(f"{method}: this run's storage has no heartbeat.")
            if not args or not self._is_own_trial(args[0]):
                raise StoragePermissionError(
                    f"{method}(trial_id={_first(args)!r}): that trial is not in the study "
                    f"{self.study_name!r}, the only study hosts of this run may use."
                )
        elif method in _HEARTBEAT_SETTINGS_CALLS:
            if not self._heartbeat:
                raise StoragePermissionError(f"{method}: this run's storage has no heartbeat.")
        else:
            raise StoragePermissionError(
                f"{method}: hosts of this run may not call it; they may ask, tell, report and "
                f"set trial attributes in the study {self.study_name!r} only (no other study, "
                "no creating, deleting or renaming studies"
                + (")." if self.study_attrs else ", no study attributes).")
            )

    def allowed_result(self, method: str, result: Any) -> None:
        """Learn the trial ids a call created or revealed (so later calls on them pass)."""
        if method in ("create_new_trial", "get_trial_id_from_study_id_trial_number"):
            with self._lock:
                self._trial_ids.add(int(result))

    def allow_trial(self, trial_id: int) -> None:
        """Allow calls on ``trial_id``: the driver vouches that it is a trial of the study.

        The driver calls it for each trial it hands to a host, so the host's first call on it
        needs no lookup in the storage (on an RDB, a query per trial).
        """
        with self._lock:
            self._trial_ids.add(int(trial_id))

    def _is_own_trial(self, trial_id: object) -> bool:
        if isinstance(trial_id, bool) or not isinstance(trial_id, int):
            return False
        with self._lock:
            if trial_id in self._trial_ids:
                return True
        # A trial the driver asked since the last look: two indexed reads, not a scan of the
        # study's trials (an RDB answers them from its indexes).
        try:
            number = self.storage.get_trial_number_from_id(trial_id)
            own = (
                self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
                == trial_id
            )
        except KeyError:  # no such trial, or no trial of that number in the study
            return False
        if own:
            with self._lock:
                self._trial_ids.add(trial_id)
        return own


def _first(args: Sequence[Any]) -> object:
    return args[0] if args else None
