"""The study's storage seen from a process that runs trials: calls relayed to the driver.

What a process may keep: the trials it runs
(:meth:`RelayedStorage.adopt`: read from its own copy, written through to the driver), their
final state when the driver tells them (``defer_finish``), and the study's finished trials
(Optuna never changes a finished trial, so a process fetches only what is new or unfinished).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Container
from collections.abc import Sequence
import copy
import datetime
import threading
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.distributions import check_distribution_compatibility
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.study._frozen import FrozenStudy
from optuna.study._study_direction import StudyDirection
from optuna.trial import FrozenTrial
from optuna.trial import TrialState

from waterwave_hpo import _optuna_compat

# ``transport(method, args) -> (ok, result or exception)``: one storage call carried to the driver.
Transport = Callable[[str, tuple[Any, ...]], tuple[bool, Any]]
# ``post(method, args)``: one storage write sent to the driver without waiting for its answer.
Post = Callable[[str, tuple[Any, ...]], None]


class RelayedStorage(BaseStorage):
    """A ``BaseStorage`` whose calls go to the driver's storage through a relay.

    The process that runs trials (a Ray host actor, a worker process) uses it as the study's
    storage; ``transport`` carries one call to the driver and brings back its answer, which the
    driver produced with :class:`StorageService` (so the run's :class:`StudyAccessPolicy` holds
    whatever the transport is, for every call: nothing is read from another study). Exceptions
    the driver's storage raises (``KeyError``, ``UpdateFinishedTrialError``...) are raised here
    unchanged; a call the policy refuses raises :class:`StoragePermissionError`; a call after the
    run ended raises ``ConnectionError`` (the transport's to raise).

    Every write goes to the driver before it returns (other processes' samplers and pruners see
    it at once, as on a shared RDB), except with ``post``: then the writes to an adopted trial
    (its parameters, user and system attributes, intermediate values) are checked here as far
    as this process can (the trial is still running here; a parameter's distribution is
    compatible with the one this process saw for its name) and handed to ``post``, which sends
    them without waiting; the transport delivers them, in order, before its next call and
    before the trial's record. An error the driver's storage raises for a posted write then
    fails the trial in the driver with that error (as if the objective had raised it there),
    not the objective's call. What is kept here, to save round trips:

    * the trials this process runs (:meth:`adopt`, with the copy the driver sent): reads of
      them are answered from that copy, which this process's own writes keep current, and a
      bookkeeping attribute already there with the same value is not written again. The driver
      may still fail such a trial (Ctrl+C, its host lost): the next write to it raises
      ``UpdateFinishedTrialError`` as the storage does; reads show this process's view, as
      Optuna's own ``Trial`` caches its trial.
    * with ``defer_finish=True``: an adopted trial's final state and values (the executor's
      tell) are kept for :meth:`release` instead of written; the driver tells the trial from
      them (so the user's sampler and callbacks in the driver's process see it).
    * the study's finished trials: ``get_all_trials`` fetches only the trials that are new or
      were unfinished at the last call (Optuna forbids changing a finished trial).
    * the study's directions (fixed when Optuna creates a study), read once.

    Args:
        transport: ``transport(method, args) -> (ok, result or exception)``; ``args`` are
            positional and picklable.
        defer_finish: Keep adopted trials' final states for :meth:`release` (the driver tells).
        post: ``post(method, args)`` sends a write to an adopted trial without waiting, or
            ``None``: every write waits for the driver's answer.
    """

    def __init__(
        self, transport: Transport, defer_finish: bool = False, post: Post | None = None
    ) -> None:
        self._transport = transport
        self._defer_finish = defer_finish
        self._post = post
        self._lock = threading.RLock()
        self._own: dict[int, FrozenTrial] = {}
        self._finished: dict[int, tuple[TrialState, list[float] | None]] = {}
        self._trials: dict[int, list[FrozenTrial]] = {}  # by study id; index = trial number
        # The last distribution this process saw for each parameter name (its own writes and
        # the trials it read): a posted set_trial_param is checked against it here.
        self._distributions: dict[str, BaseDistribution] = {}
        self._directions: dict[int, list[StudyDirection]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # A copy sent to another process starts empty: it runs no trials, it kept nothing.
        return {
            "_transport": self._transport,
            "_defer_finish": self._defer_finish,
            "_post": self._post,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        RelayedStorage.__init__(
            self, state["_transport"], state["_defer_finish"], state.get("_post")
        )

    def _call(self, method: str, *args: Any) -> Any:
        ok, payload = self._transport(method, args)
        if not ok:
            raise payload
        return payload

    # -- the trials this process runs ---------------------------------------------------------

    def adopt(self, trial: FrozenTrial) -> None:
        """Run ``trial`` here: answer reads of it from this copy (the driver's, just sent).

        Args:
            trial: The trial as the driver's storage holds it now (RUNNING, its id set): a
                copy no one else holds (unpickled from the driver's message, or read from this
                storage), which this storage keeps and updates.
        """
        with self._lock:
            self._own[_optuna_compat.trial_id(trial)] = trial
            self._distributions.update(trial.distributions)

    def release(self, trial_id: int) -> tuple[TrialState, list[float] | None] | None:
        """Forget an adopted trial; return the final state and values kept for it, if any.

        Args:
            trial_id: The adopted trial's id.

        Returns:
            ``(state, values)`` of its deferred finish (``defer_finish=True``), else ``None``.
        """
        with self._lock:
            self._own.pop(trial_id, None)
            return self._finished.pop(trial_id, None)

    def _own_copy(self, trial_id: int) -> FrozenTrial | None:
        return self._own.get(trial_id) if isinstance(trial_id, int) else None

    def _write_own(self, trial_id: int, method: str, *args: Any) -> FrozenTrial | None:
        """Relay a write (no lock held: other threads' calls go on); return the adopted copy.

        The caller updates the copy under the lock; ``None``: the trial is not adopted.
        """
        self._call(method, trial_id, *args)
        with self._lock:
            return self._own_copy(trial_id)

    def _posted(
        self, trial_id: int, method: str, *args: Any, check: Callable[[], None] | None = None
    ) -> FrozenTrial | None:
        """Post a write to an adopted trial still running here; return its copy, else ``None``.

        Called with the lock held; the caller updates the copy. ``None``: no ``post``, or the
        trial is not adopted; the caller then relays the write and waits. ``check`` runs
        before the write is posted (the storage's own checks that this process can make).

        Raises:
            UpdateFinishedTrialError: If the trial has finished (as the storage would).
        """
        if self._post is None:
            return None
        own = self._own_copy(trial_id)
        if own is None:
            return None
        if own.state.is_finished():
            raise UpdateFinishedTrialError(
                f"Trial#{own.number} has already finished and can not be updated."
            )
        if check is not None:
            check()
        self._post(method, (trial_id, *args))
        return own

    def _check_distribution(self, name: str, distribution: BaseDistribution) -> None:
        """Raise ``ValueError`` as the storage would: ``name`` was seen with another kind."""
        known = self._distributions.get(name)
        if known is not None:
            check_distribution_compatibility(known, distribution)

    def _saw_distributions(self, trials: Sequence[FrozenTrial]) -> None:
        with self._lock:
            for trial in trials:
                self._distributions.update(trial.distributions)

    # -- studies ------------------------------------------------------------------------------

    def create_new_study(
        self, directions: Sequence[StudyDirection], study_name: str | None = None
    ) -> int:
        return int(self._call("create_new_study", list(directions), study_name))

    def delete_study(self, study_id: int) -> None:
        with self._lock:
            self._directions.pop(study_id, None)
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
        # A study's directions never change (Optuna sets them when it creates the study):
        # read once (``Trial.report`` reads them at every report).
        with self._lock:
            known = self._directions.get(study_id)
        if known is None:
            known = list(self._call("get_study_directions", study_id))
            with self._lock:
                self._directions[study_id] = known
        return list(known)

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
        with self._lock:
            own = self._posted(
                trial_id,
                "set_trial_param",
                param_name,
                param_value_internal,
                distribution,
                check=lambda: self._check_distribution(param_name, distribution),
            )
            if own is not None:
                own.params[param_name] = distribution.to_external_repr(param_value_internal)
                own.distributions[param_name] = distribution
                self._distributions[param_name] = distribution
                return
        own = self._write_own(
            trial_id, "set_trial_param", param_name, param_value_internal, distribution
        )
        with self._lock:
            self._distributions[param_name] = distribution
        if own is not None:
            with self._lock:
                own.params[param_name] = distribution.to_external_repr(param_value_internal)
                own.distributions[param_name] = distribution

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return int(self._call("get_trial_id_from_study_id_trial_number", study_id, trial_number))

    def get_trial_number_from_id(self, trial_id: int) -> int:
        with self._lock:
            own = self._own_copy(trial_id)
            if own is not None:
                return own.number
        return int(self._call("get_trial_number_from_id", trial_id))

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        with self._lock:
            own = self._own_copy(trial_id)
            if own is not None and param_name in own.distributions:
                return float(own.distributions[param_name].to_internal_repr(own.params[param_name]))
        return float(self._call("get_trial_param", trial_id, param_name))

    def set_trial_state_values(
        self, trial_id: int, state: TrialState, values: Sequence[float] | None = None
    ) -> bool:
        with self._lock:
            own = self._own_copy(trial_id)
            if own is not None and own.state.is_finished():
                raise UpdateFinishedTrialError(
                    f"Trial#{own.number} has already finished and can not be updated."
                )
            if own is not None and self._defer_finish and state.is_finished():
                # The driver tells it from release()'s answer; this process sees it finished.
                kept = None if values is None else [float(v) for v in values]
                self._finished[trial_id] = (state, kept)
                own.state = state
                own.values = kept
                own.datetime_complete = datetime.datetime.now()
                return True
        changed = bool(self._call("set_trial_state_values", trial_id, state, values))
        with self._lock:
            own = self._own_copy(trial_id)
            if own is not None and changed:
                own.state = state
                if values is not None:
                    own.values = list(values)
        return changed

    def set_trial_intermediate_value(
        self, trial_id: int, step: int, intermediate_value: float
    ) -> None:
        with self._lock:
            own = self._posted(trial_id, "set_trial_intermediate_value", step, intermediate_value)
            if own is not None:
                own.intermediate_values[step] = intermediate_value
                return
        own = self._write_own(trial_id, "set_trial_intermediate_value", step, intermediate_value)
        if own is not None:
            with self._lock:
                own.intermediate_values[step] = intermediate_value

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        with self._lock:
            own = self._posted(trial_id, "set_trial_user_attr", key, value)
            if own is not None:
                own.user_attrs[key] = value
                return
        own = self._write_own(trial_id, "set_trial_user_attr", key, value)
        if own is not None:
            with self._lock:
                own.user_attrs[key] = value

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        with self._lock:
            own = self._own_copy(trial_id)
            if own is not None and key in own.system_attrs and own.system_attrs[key] == value:
                # Already stored (the driver wrote the host's bookkeeping when it sent the
                # trial): writing the same value again would change nothing.
                if own.state.is_finished():
                    raise UpdateFinishedTrialError(
                        f"Trial#{own.number} has already finished and can not be updated."
                    )
                return
            own = self._posted(trial_id, "set_trial_system_attr", key, value)
            if own is not None:
                own.system_attrs[key] = value
                return
        own = self._write_own(trial_id, "set_trial_system_attr", key, value)
        if own is not None:
            with self._lock:
                own.system_attrs[key] = value

    def get_trial(self, trial_id: int) -> FrozenTrial:
        with self._lock:
            own = self._own_copy(trial_id)
            if own is not None:
                return _copy_trial(own)
        trial: FrozenTrial = self._call("get_trial", trial_id)
        return trial

    def get_all_trials(
        self,
        study_id: int,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
    ) -> list[FrozenTrial]:
        # The finished trials kept from earlier calls, and what the driver sends now: the
        # trials numbered from len(kept) on, and those kept unfinished (they may have changed).
        with self._lock:
            kept = self._trials.setdefault(study_id, [])
            known = len(kept)
            unfinished = tuple(t.number for t in kept if not t.state.is_finished())
        fresh: list[FrozenTrial] = self._call("get_trials_since", study_id, known, unfinished)
        self._saw_distributions(fresh)
        trials: list[FrozenTrial] = []
        with self._lock:
            kept = self._trials.setdefault(study_id, [])
            for trial in fresh:
                if trial.number < len(kept):
                    if not kept[trial.number].state.is_finished():  # never back to unfinished
                        kept[trial.number] = trial
                elif trial.number == len(kept):
                    kept.append(trial)
                else:  # numbers with a gap (not Optuna's): keep nothing
                    kept.clear()
                    break
            else:
                trials = list(kept)
        if not kept and fresh:
            trials = list(self._call("get_trials_since", study_id, 0, ()))
        if states is not None:
            trials = [t for t in trials if t.state in states]
        return copy.deepcopy(trials) if deepcopy else trials

    def get_n_trials(
        self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None
    ) -> int:
        return int(self._call("get_n_trials", study_id, state))

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        trial: FrozenTrial = self._call("get_best_trial", study_id)
        return trial

    def get_trial_params(self, trial_id: int) -> dict[str, Any]:
        with self._lock:
            own = self._own_copy(trial_id)
            if own is not None:
                return copy.deepcopy(own.params)
        return dict(self._call("get_trial_params", trial_id))

    def get_trial_user_attrs(self, trial_id: int) -> dict[str, Any]:
        with self._lock:
            own = self._own_copy(trial_id)
            if own is not None:
                return copy.deepcopy(own.user_attrs)
        return dict(self._call("get_trial_user_attrs", trial_id))

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        with self._lock:
            own = self._own_copy(trial_id)
            if own is not None:
                return copy.deepcopy(own.system_attrs)
        return dict(self._call("get_trial_system_attrs", trial_id))


def _copy_trial(trial: FrozenTrial) -> FrozenTrial:
    """``trial`` with containers of its own (parameters, attributes, values), entries shared.

    What a read of an adopted trial returns: this storage's later writes replace the entries
    of its copy's containers and never change an entry in place, so the returned trial keeps
    what it read (as a deep copy would, at a fraction of its cost: one is made several times
    per trial).
    """
    copied = copy.copy(trial)
    copied.params = dict(trial.params)
    copied.distributions = dict(trial.distributions)
    copied.user_attrs = dict(trial.user_attrs)
    copied.system_attrs = dict(trial.system_attrs)
    copied.intermediate_values = dict(trial.intermediate_values)
    copied.values = None if trial.values is None else list(trial.values)
    return copied


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
