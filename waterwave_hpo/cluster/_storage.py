"""The study's storage, carried to host actors over Ray itself, for one study and few calls.

Host actors run trials in other processes and on other nodes, so they cannot share the driver's
``optuna.Study`` object, and the driver's storage may live only in its memory. Until issue 18
the driver served the *whole* storage with Optuna's gRPC storage proxy on an unauthenticated,
plain-text port of the node's address: anyone who could reach it could read, rewrite or delete
every study in it. The channel now runs over Ray, and nothing new listens:

* a :class:`StorageRelay` actor (anonymous, on the driver's node, no CPU reserved) takes each
  call a host makes through its :class:`RayStorageClient` (an ``optuna.storages.BaseStorage``);
* a thread of the driver's :class:`StorageServer` takes the calls from the relay, checks each
  against the run's :class:`StudyAccessPolicy` and runs it on the study's own storage (the
  driver remains the only process that touches the storage, as Optuna recommends for many
  workers on one RDB), and hands the result, or the exception, back through the relay.

Why Ray and not gRPC with TLS and a secret (issue 18, option (b)): Ray's RPC already connects
the driver and every host, with Ray's TLS when the cluster enables it (``RAY_USE_TLS``) and
Ray's trust model (whoever can submit work to the cluster can run code on it anyway); a second
channel would need its own certificates, secret distribution and a listener to close on every
exit path, and would still only be as safe as Ray. The relay is anonymous (no name to look it
up by; its handle reaches the hosts only inside their creation arguments), and even a holder of
its handle gets only what :class:`StudyAccessPolicy` allows: the run's study, the calls a host
makes (ask/tell, reports, parameters, trial attributes, Optuna's heartbeat), never another
study, never a study's creation, deletion, renaming or attributes. Cost: measured in
``experiments/results/2026-11-23-storage-channel/`` against the old gRPC channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from collections.abc import Container
from collections.abc import Sequence
import concurrent.futures
from concurrent.futures import ThreadPoolExecutor
import contextlib
from dataclasses import dataclass
import itertools
import logging
import threading
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.study._frozen import FrozenStudy
from optuna.study._study_direction import StudyDirection
from optuna.trial import FrozenTrial
from optuna.trial import TrialState

from waterwave_hpo import _optuna_compat
from waterwave_hpo.cluster._imports import import_ray

_logger = logging.getLogger("waterwave_hpo")
_TAKE_WAIT_S = 0.5  # how long the driver's relay thread waits for calls before checking stop
_BATCH_WAIT_S = 0.05  # how long a batch's quick calls wait for its slow ones


class StoragePermissionError(PermissionError):
    """A host's storage call that the run's :class:`StudyAccessPolicy` refuses.

    Raised in the calling host (the driver logs each kind of refusal once); the storage is
    unchanged.
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
# Calls without a study or trial: the storage's heartbeat settings (heartbeat storages only).
_HEARTBEAT_SETTINGS_CALLS = frozenset(
    {"get_heartbeat_interval", "get_heartbeat_stale_trial_callback", "get_failed_trial_callback"}
)


class StudyAccessPolicy:
    """What hosts may do with the driver's storage: the calls a host makes, on one study only.

    Allowed: reading the study's name, directions, attributes and trials; creating trials in it
    (ask); setting its trials' parameters, states and values (tell), intermediate values
    (report) and attributes; Optuna's heartbeat calls for its trials (when the storage has a
    heartbeat). Refused with :class:`StoragePermissionError`: any other study (by id, by name, or
    through a trial id of another study), ``get_all_studies``, creating, deleting or renaming a
    study, and setting study attributes (set them in the driver before ``optimize``).

    Args:
        storage: The study's storage (the driver's ``study._storage``).
        study_id: The run's study.
        study_name: Its name (``optuna.load_study`` looks the study up by name).
    """

    def __init__(self, storage: BaseStorage, study_id: int, study_name: str) -> None:
        self.storage = storage
        self.study_id = study_id
        self.study_name = study_name
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
                "no creating, deleting or renaming studies, no study attributes)."
            )

    def allowed_result(self, method: str, result: Any) -> None:
        """Learn the trial ids a call created or revealed (so later calls on them pass)."""
        if method in ("create_new_trial", "get_trial_id_from_study_id_trial_number"):
            with self._lock:
                self._trial_ids.add(int(result))

    def _is_own_trial(self, trial_id: object) -> bool:
        if isinstance(trial_id, bool) or not isinstance(trial_id, int):
            return False
        with self._lock:
            if trial_id in self._trial_ids:
                return True
        # A trial the driver asked since the last look: read the study's trial ids again.
        ids = {
            _optuna_compat.trial_id(t)
            for t in self.storage.get_all_trials(self.study_id, deepcopy=False)
        }
        with self._lock:
            self._trial_ids |= ids
            return trial_id in self._trial_ids


def _first(args: Sequence[Any]) -> object:
    return args[0] if args else None


class StorageRelay:
    """The Ray actor between hosts and the driver (async: thousands of calls wait at once).

    Hosts call :meth:`call`; the driver's :class:`StorageServer` answers the calls it took and
    takes the next ones in one :meth:`exchange`. Create it only through
    :class:`StorageServer`.
    """

    def __init__(self) -> None:
        self._calls: list[tuple[int, str, tuple[Any, ...]]] = []
        self._arrived = asyncio.Event()
        self._waiting: dict[int, asyncio.Future[tuple[bool, Any]]] = {}
        self._ids = itertools.count()
        self._closed = False

    async def call(self, method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        """A host's storage call: ``(True, result)`` or ``(False, exception)``."""
        if self._closed:
            return False, ConnectionError("The study's storage channel is closed (the run ended).")
        call_id = next(self._ids)
        future: asyncio.Future[tuple[bool, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        self._calls.append((call_id, method, args))
        self._arrived.set()
        return await future

    async def exchange(
        self, answers: list[tuple[int, bool, Any]], wait_s: float
    ) -> list[tuple[int, str, tuple[Any, ...]]]:
        """The driver's round trip: deliver answers and take the waiting calls.

        The driver's round trip: deliver ``answers`` (``(call id, ok, result or exception)``)
        and take the calls waiting now, waiting up to ``wait_s`` seconds for the first.

        One actor call carries both ways, so a host's call costs the driver one round trip.
        """
        for call_id, ok, payload in answers:
            future = self._waiting.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result((ok, payload))
        if not self._calls:
            # An event, not a queue's get(): a wait_for that times out as a call arrives can
            # lose nothing (the call stays in the list for the next exchange).
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout=wait_s)
        calls, self._calls = self._calls, []
        return calls

    async def answer(self, call_id: int, ok: bool, payload: Any) -> None:
        """The driver's answer to one call that took longer than its batch."""
        future = self._waiting.pop(call_id, None)
        if future is not None and not future.done():
            future.set_result((ok, payload))

    async def close(self) -> None:
        """Refuse new calls and end the waiting ones with ``ConnectionError``."""
        self._closed = True
        error = ConnectionError("The study's storage channel closed (the run ended).")
        for future in self._waiting.values():
            if not future.done():
                future.set_result((False, error))
        self._waiting.clear()


@dataclass(frozen=True)
class StorageChannel:
    """How a host actor reaches the run's study.

    How a host actor reaches the run's study: the relay's handle (pickled into the host's
    creation arguments, never published under a name).

    Attributes:
        relay: The :class:`StorageRelay` actor handle.
        heartbeat: Whether the driver's storage has Optuna's heartbeat enabled (the client then
            is a ``BaseHeartbeat`` too, so Optuna's heartbeat thread runs on the hosts).
    """

    relay: Any
    heartbeat: bool

    def connect(self) -> RayStorageClient:
        """The host's ``BaseStorage`` for the run's study."""
        if self.heartbeat:
            return RayHeartbeatStorageClient(self.relay)
        return RayStorageClient(self.relay)


class StorageServer:
    """The driver's side of the channel: a relay actor and a thread that answers its calls.

    Start it before the hosts, stop it after them (``with`` or :meth:`stop`; idempotent): the
    relay is killed and every call still waiting ends with ``ConnectionError``.

    Args:
        study: The run's study; hosts get its storage, for it alone (:class:`StudyAccessPolicy`).
        max_workers: Driver threads running storage calls at once (>= 1).

    Raises:
        ImportError: If Ray is not installed.
    """

    def __init__(self, study: optuna.Study, max_workers: int = 16) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._storage = _optuna_compat.storage_of(study)
        self.policy = StudyAccessPolicy(
            self._storage, _optuna_compat.study_id(study), study.study_name
        )
        self._relay = (
            ray.remote(StorageRelay)
            .options(
                num_cpus=0,
                max_restarts=0,
                # Beside the driver: a host's call crosses the network at most once.
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=False
                ),
            )
            .remote()
        )
        self.channel = StorageChannel(self._relay, is_heartbeat_enabled(self._storage))
        self._refused: set[str] = set()
        self._refused_lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="ww-storage")
        self._thread = threading.Thread(
            target=self._serve, name="waterwave-storage-relay", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop answering, end waiting calls and kill the relay. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        ray = import_ray()
        with contextlib.suppress(Exception):
            ray.get(self._relay.close.remote(), timeout=timeout_s)
        self._thread.join(timeout=timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(Exception):
            ray.kill(self._relay)

    def __enter__(self) -> StorageServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        ray = import_ray()
        answers: list[tuple[int, bool, Any]] = []
        while not self._stop.is_set():
            try:
                try:
                    pending = self._relay.exchange.remote(answers, _TAKE_WAIT_S)
                except Exception:  # an answer that cannot be pickled: send the others, and why
                    answers = [_picklable_answer(answer) for answer in answers]
                    pending = self._relay.exchange.remote(answers, _TAKE_WAIT_S)
                calls = ray.get(pending)
            except Exception as error:  # the relay died (its node lost): hosts cannot go on
                if not self._stop.is_set():
                    _logger.error("The study's storage relay was lost: %r", error)
                return
            # Calls of different host threads run side by side. The quick ones (most) go back
            # with the next exchange; a slow one (an RDB lock) answers on its own when done,
            # so it holds up the others by _BATCH_WAIT_S at most.
            try:
                running = [self._pool.submit(self._run, *call) for call in calls]
            except RuntimeError:  # the pool was shut down: stop() is under way
                return
            done, late = concurrent.futures.wait(running, timeout=_BATCH_WAIT_S)
            answers = [future.result() for future in running if future in done]
            for future in late:
                future.add_done_callback(self._answer_late)

    def _answer_late(self, future: concurrent.futures.Future[tuple[int, bool, Any]]) -> None:
        with contextlib.suppress(Exception):  # the relay is gone: the run has ended
            self._relay.answer.remote(*_picklable_answer(future.result()))

    def _run(self, call_id: int, method: str, args: tuple[Any, ...]) -> tuple[int, bool, Any]:
        try:
            self.policy.check(method, args)
            result = getattr(self._storage, method)(*args)
            self.policy.allowed_result(method, result)
        except StoragePermissionError as error:
            self._log_refusal(method, error)
            return call_id, False, error
        except Exception as error:  # KeyError, UpdateFinishedTrialError...: the host's to see
            return call_id, False, error
        return call_id, True, result

    def _log_refusal(self, method: str, error: StoragePermissionError) -> None:
        with self._refused_lock:
            if method in self._refused:
                return
            self._refused.add(method)
        _logger.warning(
            "Refused a host's storage call (logged once per method): %s", error, stacklevel=1
        )


def _picklable_answer(answer: tuple[int, bool, Any]) -> tuple[int, bool, Any]:
    from ray import cloudpickle

    try:
        cloudpickle.dumps(answer)  # type: ignore[no-untyped-call]
    except Exception as error:
        return answer[0], False, RuntimeError(f"The storage's answer cannot be sent: {error!r}")
    return answer


class RayStorageClient(BaseStorage):
    """A host's ``BaseStorage``: every call goes to the driver through the run's relay.

    Exceptions the driver's storage raises (``KeyError``, ``UpdateFinishedTrialError``...) are
    raised here unchanged; a call the run's :class:`StudyAccessPolicy` refuses raises
    :class:`StoragePermissionError`; a call after the run ended raises ``ConnectionError``.

    Args:
        relay: The :class:`StorageRelay` actor handle.
    """

    def __init__(self, relay: Any) -> None:
        self._relay = relay

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        ok, payload = ray.get(self._relay.call.remote(method, args))
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


class RayHeartbeatStorageClient(RayStorageClient, BaseHeartbeat):
    """:class:`RayStorageClient` for a driver storage with Optuna's heartbeat.

    :class:`RayStorageClient` for a driver storage with Optuna's heartbeat (an RDB with
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
