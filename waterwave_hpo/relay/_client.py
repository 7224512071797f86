"""The study's storage seen from a process that runs trials: every call relayed to the driver."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Container
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.study._frozen import FrozenStudy
from optuna.study._study_direction import StudyDirection
from optuna.trial import FrozenTrial
from optuna.trial import TrialState

# ``transport(method, args) -> (ok, result or exception)``: one storage call carried to the driver.
Transport = Callable[[str, tuple[Any, ...]], tuple[bool, Any]]


class RelayedStorage(BaseStorage):
    """A ``BaseStorage`` whose every call goes to the driver's storage through a relay.

    The process that runs trials (a Ray host actor, a worker process) uses it as the study's
    storage; ``transport`` carries one call to the driver and brings back its answer, which the
    driver produced with :class:`StorageService` (so the run's :class:`StudyAccessPolicy` holds
    whatever the transport is). Exceptions the driver's storage raises (``KeyError``,
    ``UpdateFinishedTrialError``...) are raised here unchanged; a call the policy refuses raises
    :class:`StoragePermissionError`; a call after the run ended raises ``ConnectionError`` (the
    transport's to raise).

    Args:
        transport: ``transport(method, args) -> (ok, result or exception)``; ``args`` are
            positional and picklable.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def _call(self, method: str, *args: Any) -> Any:
        ok, payload = self._transport(method, args)
        if not ok:
            raise payload
        return payload

    # -- studies ------------------------------------------------------------------------------

    def create_new_study(
        self, directions: Sequence[StudyDirection], study_name: str | None = None
    ) -> int:
        return int(self._call("create_new_study", list(directions), study_name))

    def delete_study(self, study_id: int) -> None:
        self._call("delete_study", study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call("set_study_user_attr", study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call("set_study_system_attr", study_id, key, value)

    def get_study_id_from_name(self, study_name: str) -> int:
        return int(self._call("get_study_id_from_name", study_name))

    def get_study_name_from_id(self, study_id: int) -> str:
        return str(self._call("get_study_name_from_id", study_id))

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return list(self._call("get_study_directions", study_id))

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return dict(self._call("get_study_user_attrs", study_id))

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return dict(self._call("get_study_system_attrs", study_id))

    def get_all_studies(self) -> list[FrozenStudy]:
        return list(self._call("get_all_studies"))

    # -- trials -------------------------------------------------------------------------------

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return int(self._call("create_new_trial", study_id, template_trial))

    def set_trial_param(
        self,
        trial_id: int,
        param_name: str,
        param_value_internal: float,
        distribution: BaseDistribution,
    ) -> None:
        self._call("set_trial_param", trial_id, param_name, param_value_internal, distribution)

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return int(self._call("get_trial_id_from_study_id_trial_number", study_id, trial_number))

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return int(self._call("get_trial_number_from_id", trial_id))

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        return float(self._call("get_trial_param", trial_id, param_name))

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        return bool(self._call("set_trial_state_values", trial_id, state, values))

    def set_trial_intermediate_value(
        self, trial_id: int, step: int, intermediate_value: float
    ) -> None:
        self._call("set_trial_intermediate_value", trial_id, step, intermediate_value)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call("set_trial_user_attr", trial_id, key, value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call("set_trial_system_attr", trial_id, key, value)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        trial: FrozenTrial = self._call("get_trial", trial_id)
        return trial

    def get_all_trials(
        self,
        study_id: int,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
    ) -> list[FrozenTrial]:
        # Every answer is a fresh copy (it crossed a process boundary): no deepcopy needed.
        states_arg = None if states is None else tuple(s for s in TrialState if s in states)
        return list(self._call("get_all_trials", study_id, False, states_arg))

    def get_n_trials(
        self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None
    ) -> int:
        return int(self._call("get_n_trials", study_id, state))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        trial: FrozenTrial = self._call("get_best_trial", study_id)
        return trial

    def get_trial_params(self, trial_id: int) -> dict[str, Any]:
        return dict(self._call("get_trial_params", trial_id))

    def get_trial_user_attrs(self, trial_id: int) -> dict[str, Any]:
        return dict(self._call("get_trial_user_attrs", trial_id))

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        return dict(self._call("get_trial_system_attrs", trial_id))


class RelayedHeartbeatStorage(RelayedStorage, BaseHeartbeat):
    """:class:`RelayedStorage` for a driver storage with Optuna's heartbeat.

    :class:`RelayedStorage` for a driver storage with Optuna's heartbeat (an RDB with
    ``heartbeat_interval``): the hosts' trials record heartbeats, and stale trials fail, as
    with the storage itself.
    """

    def record_heartbeat(self, trial_id: int) -> None:
        self._call("record_heartbeat", trial_id)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        return list(self._call("_get_stale_trial_ids", study_id))

    def get_heartbeat_interval(self) -> int | None:
        interval: int | None = self._call("get_heartbeat_interval")
        return interval

    def get_heartbeat_stale_trial_callback(
        self,
    ) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        callback: Callable[[optuna.Study, FrozenTrial], None] | None = self._call(
            "get_heartbeat_stale_trial_callback"
        )
        return callback

    def get_failed_trial_callback(self) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        return self.get_heartbeat_stale_trial_callback()
