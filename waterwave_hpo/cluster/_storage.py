"""The study's storage, carried to host actors over Ray itself, for one study and few calls.

Host actors run trials in other processes and on other nodes, so they cannot share the driver's
``optuna.Study`` object, and the driver's storage may live only in its memory. Before this relay
the driver served the *whole* storage with Optuna's gRPC storage proxy on an unauthenticated,
plain-text port of the node's address: anyone who could reach it could read, rewrite or delete
every study in it. The channel now runs over Ray, and nothing new listens:

* a :class:`StorageRelay` actor (anonymous, on the driver's node, no CPU reserved) takes each
  call a host makes through its :class:`RayStorageClient` (an ``optuna.storages.BaseStorage``);
* a thread of the driver's :class:`StorageServer` takes the calls from the relay, checks each
  against the run's :class:`StudyAccessPolicy` and runs it on the study's own storage (the
  driver remains the only process that touches the storage, as Optuna recommends for many
  workers on one RDB), and hands the result, or the exception, back through the relay.

Why Ray and not gRPC with TLS and a secret: Ray's RPC already connects
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
import concurrent.futures
from concurrent.futures import ThreadPoolExecutor
import contextlib
from dataclasses import dataclass
import itertools
import logging
import threading
from typing import Any

import optuna
from optuna.storages._heartbeat import is_heartbeat_enabled

from waterwave_hpo.cluster._imports import import_ray
from waterwave_hpo.relay import RelayedHeartbeatStorage
from waterwave_hpo.relay import RelayedStorage
from waterwave_hpo.relay import StorageService
from waterwave_hpo.relay import sendable

_logger = logging.getLogger("waterwave_hpo")
_TAKE_WAIT_S = 0.5  # how long the driver's relay thread waits for calls before checking stop
_BATCH_WAIT_S = 0.05  # how long a batch's quick calls wait for its slow ones
_GATHER_S = 0.002
"""How long the relay lets calls gather after the first one before the driver takes them: a
round trip of the driver costs it ~0.5 ms of CPU (2-core VM, Ray 2.60), so calls taken together
cost it less each; a host's call waits this much longer."""


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
        self, answers: list[tuple[int, bool, Any]], wait_s: float, gather_s: float = 0.0
    ) -> list[tuple[int, str, tuple[Any, ...]]]:
        """The driver's round trip: deliver answers and take the waiting calls.

        The driver's round trip: deliver ``answers`` (``(call id, ok, result or exception)``)
        and take the calls waiting now, waiting up to ``wait_s`` seconds for the first and,
        when none was waiting, ``gather_s`` seconds more for others to join it.

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
            if self._calls and gather_s > 0:
                await asyncio.sleep(gather_s)  # let the calls of other hosts' threads join
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

    def connect(self, defer_finish: bool = False) -> RayStorageClient:
        """The host's ``BaseStorage`` for the run's study.

        Args:
            defer_finish: Keep adopted trials' final states for the driver to tell
                (:class:`~waterwave_hpo.relay.RelayedStorage`).
        """
        if self.heartbeat:
            return RayHeartbeatStorageClient(self.relay, defer_finish)
        return RayStorageClient(self.relay, defer_finish)


class StorageServer:
    """The driver's side of the channel: a relay actor and a thread that answers its calls.

    Start it before the hosts, stop it after them (``with`` or :meth:`stop`; idempotent): the
    relay is killed and every call still waiting ends with ``ConnectionError``.

    Args:
        study: The run's study; hosts get its storage, for it alone (:class:`StudyAccessPolicy`).
        max_workers: Driver threads running storage calls at once (>= 1).
        gather_s: How long the relay lets calls gather after the first (seconds, >= 0).

    Raises:
        ImportError: If Ray is not installed.
    """

    def __init__(
        self, study: optuna.Study, max_workers: int = 16, gather_s: float = _GATHER_S
    ) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.service = StorageService(study)
        self.policy = self.service.policy
        self._gather_s = gather_s
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
        self.channel = StorageChannel(self._relay, is_heartbeat_enabled(self.service.storage))
        # Optuna's in-memory storage answers each call in microseconds: the relay's thread runs
        # them itself (no hand-over to a worker and back, ~0.2 ms of driver CPU per trial at 4
        # hosts). Any other storage (an RDB waits on locks, a subclass may do anything) runs
        # them on the workers, side by side.
        self._inline = type(self.service.storage) is optuna.storages.InMemoryStorage
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
                    pending = self._relay.exchange.remote(answers, _TAKE_WAIT_S, self._gather_s)
                except Exception:  # an answer that cannot be pickled: send the others, and why
                    answers = [_picklable_answer(answer) for answer in answers]
                    pending = self._relay.exchange.remote(answers, _TAKE_WAIT_S, self._gather_s)
                calls = ray.get(pending)
            except Exception as error:  # the relay died (its node lost): hosts cannot go on
                if not self._stop.is_set():
                    _logger.error("The study's storage relay was lost: %r", error)
                return
            # Calls of different host threads run side by side. The quick ones (most) go back
            # with the next exchange; a slow one (an RDB lock) answers on its own when done,
            # so it holds up the others by _BATCH_WAIT_S at most.
            if self._inline:
                answers = [self._run(*call) for call in calls]
                continue
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
        ok, payload = self.service.run(method, args)
        return call_id, ok, payload


def _picklable_answer(answer: tuple[int, bool, Any]) -> tuple[int, bool, Any]:
    from ray import cloudpickle

    call_id, ok, payload = answer
    return (call_id, *sendable(ok, payload, cloudpickle.dumps))


class RayStorageClient(RelayedStorage):
    """A host's ``BaseStorage``: every call goes to the driver through the run's relay actor.

    Args:
        relay: The :class:`StorageRelay` actor handle.
        defer_finish: Keep adopted trials' final states for the driver to tell.
    """

    def __init__(self, relay: Any, defer_finish: bool = False) -> None:
        super().__init__(_RayTransport(relay), defer_finish)


class RayHeartbeatStorageClient(RayStorageClient, RelayedHeartbeatStorage):
    """:class:`RayStorageClient` for a driver storage with Optuna's heartbeat."""


class _RayTransport:
    """One storage call carried by the relay actor (picklable: it holds only the handle)."""

    def __init__(self, relay: Any) -> None:
        self._relay = relay

    def __call__(self, method: str, args: tuple[Any, ...]) -> tuple[bool, Any]:
        import ray

        answer: tuple[bool, Any] = ray.get(self._relay.call.remote(method, args))
        return answer
