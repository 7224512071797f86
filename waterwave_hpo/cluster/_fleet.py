"""The host actors of one ``RayExecutor.optimize`` call, elastic.

The host actors of one ``RayExecutor.optimize`` call, elastic: started where the cluster has
room, watched, replaced on nodes that join, grown through Ray's autoscaler.

A :class:`HostFleet` places one host actor per GPU (``num_gpus_per_host=1``) on the alive nodes
with a hard node affinity, so that it always knows which node a host was meant for. The study
starts with the hosts that come up: a host that fails to start (its node lost, no room within
``startup_timeout_s``) is a warning naming the node, an error only when none starts. A watcher
thread then looks at the cluster every :data:`_WATCH_S` seconds: it adopts hosts that came up
late, starts hosts on GPUs that joined (a node added by hand or by Ray's autoscaler) while fewer
than the cap run, and, with ``max_devices``, asks the autoscaler for more GPUs
(``ray.autoscaler.sdk.request_resources``) while every host is full. Hosts lost mid-study are
handled by their :class:`~waterwave_hpo.cluster._handle.RayHostHandle` poller (trials told FAIL with
the reason, their parameters re-queued); the fleet only counts them, and stops the study when no
host is left and none is starting.

Each GPU of a node hosts at most ``hosts_per_gpu`` host actors per ``optimize`` call (one, or
``trials_per_device`` single-slot hosts with ``isolation="process"``). With threads, a host that
died on an alive node (an objective that killed its process, say) is not started there again,
where it would most likely die the same way, taking its neighbours with it; with
``replace_lost`` (process isolation: a host runs one trial, which failed alone) the slot gets a
new host on the same node.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Mapping
import contextlib
from dataclasses import dataclass
import logging
import threading
import time
from typing import Any

import optuna

from waterwave_hpo import _optuna_compat
from waterwave_hpo.cluster._actor import HostInfo
from waterwave_hpo.cluster._handle import RayHostHandle
from waterwave_hpo.cluster._nodes import NodeView
from waterwave_hpo.cluster._nodes import alive_nodes
from waterwave_hpo.cluster._nodes import describe_error
from waterwave_hpo.cluster._nodes import interleave

_logger = logging.getLogger("waterwave_hpo")
_WATCH_S = 0.5

MakeHost = Callable[[Any, HostInfo, Callable[[RayHostHandle, BaseException], None]], RayHostHandle]
"""Builds the driver's :class:`RayHostHandle` for a started actor: ``(actor, info, on_lost)``."""


@dataclass
class _Pending:
    actor: Any
    where: str  # "node 60df83ad (10.0.0.2)", or "a CPU host placed by Ray"
    node_id: str | None
    since_s: float


class HostFleet:
    """The host actors of one ``optimize`` call; :attr:`hosts` is the executor loop's list.

    Args:
        ray: The ``ray`` module.
        actor_class: ``ray.remote(HostActor)``.
        actor_options: Its options (``num_gpus``, ``num_cpus``, ``resources``, ...); the
            fleet adds the scheduling strategy.
        spec: The :class:`~waterwave_hpo.cluster._actor.HostSpec` every actor is created with.
        make_host: Builds the :class:`RayHostHandle` of a started actor.
        study: The driver's study (stopped when no host is left).
        n_hosts: Hosts to start with; ``None``: one per GPU in the cluster ("auto").
        num_gpus_per_host: ``1`` (one host per GPU, placed per node) or ``0`` (CPU hosts,
            spread by Ray; not grown on joining nodes, which offer no GPU to count).
        host_resources: Custom resources each host reserves; a node offers GPUs to the fleet
            only if it has them.
        num_cpus_per_host: CPUs each host reserves (for the autoscaler's bundles).
        max_devices: The most hosts alive at once, and the target asked of the autoscaler;
            ``None``: ``n_hosts`` when it is an int, else no cap and no autoscaler request.
        startup_timeout_s: Seconds a host actor may take to come up (> 0).
        hosts_per_gpu: Host actors per GPU (>= 1; the actors' ``num_gpus`` is its share), or,
            with CPU hosts, per ``n_hosts``; ``n_hosts`` and ``max_devices`` count devices.
        replace_lost: Start a new host in place of one that died while its node is alive.
    """

    def __init__(
        self,
        *,
        ray: Any,
        actor_class: Any,
        actor_options: Mapping[str, Any],
        spec: Any,
        make_host: MakeHost,
        study: optuna.Study,
        n_hosts: int | None,
        num_gpus_per_host: int,
        host_resources: Mapping[str, float],
        num_cpus_per_host: float,
        max_devices: int | None,
        startup_timeout_s: float,
        hosts_per_gpu: int = 1,
        replace_lost: bool = False,
    ) -> None:
        self._ray = ray
        self._actor_class = actor_class
        self._actor_options = dict(actor_options)
        self._spec = spec
        self._make_host = make_host
        self._study = study
        self._n_hosts = n_hosts
        self._num_gpus_per_host = num_gpus_per_host
        self._host_resources = dict(host_resources)
        self._num_cpus_per_host = num_cpus_per_host
        self._max_devices = max_devices
        self._hosts_per_gpu = hosts_per_gpu
        self._replace_lost = replace_lost
        devices = max_devices if max_devices is not None else n_hosts
        self._cap = None if devices is None else devices * hosts_per_gpu
        self._startup_timeout_s = startup_timeout_s
        self.hosts: list[RayHostHandle] = []
        """Every host that came up, in order; only grows (the executor's loop reads it)."""
        self.n_lost = 0
        self.last_error: BaseException | None = None
        self.nodes_lost: set[str] = set()
        self.nodes_joined: set[str] = set()
        self.n_autoscaler_requests = 0
        self._initial_nodes: set[str] = set()
        self._seen_alive: set[str] = set()
        self._pending: dict[Any, _Pending] = {}  # the actor's info() ref -> what it is
        self._used: Counter[str] = Counter()  # node id -> host actors started there
        self._requested = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- start and stop -------------------------------------------------------------------

    def start(self) -> list[RayHostHandle]:
        """Start the first hosts and return as soon as one is up.

        Start the first hosts; return :attr:`hosts` as soon as one has come up (the study
        starts on it), or every one failed. The others keep coming up in the background and
        join when ready, each within ``startup_timeout_s`` of its start (a host that cannot
        be placed, e.g. more hosts than the cluster has CPUs for, never delays the study);
        then start watching.

        Raises:
            RuntimeError: If no host came up; the message says why, per node.
        """
        nodes = alive_nodes(self._ray)
        self._initial_nodes = {node.node_id for node in nodes}
        self._seen_alive = set(self._initial_nodes)
        with self._lock:
            if self._num_gpus_per_host == 0:
                for _ in range((self._n_hosts or 0) * self._hosts_per_gpu):
                    self._start_actor(None, "a CPU host placed by Ray")
            else:
                places = interleave([[node] * self._gpu_capacity(node) for node in nodes])
                if self._cap is not None:
                    places = places[: self._cap]
                for node in places:
                    self._start_actor(node.node_id, node.label)
        deadline = time.monotonic() + self._startup_timeout_s
        failures: list[str] = []
        while self._pending and not self.hosts and time.monotonic() < deadline:
            failures += self._adopt(
                timeout_s=min(0.5, max(0.0, deadline - time.monotonic())), first=True
            )
        failures += self._adopt(timeout_s=0.0)
        if not self.hosts:
            waited = [
                f"{entry.where}: not up within startup_timeout_s={self._startup_timeout_s:g}"
                for entry in self._pending.values()
            ]
            self.stop()
            raise RuntimeError(
                "No device host started. "
                + "; ".join(failures + waited or ["no node offers what a host reserves"])
                + f". The host actors reserve num_gpus={self._num_gpus_per_host}, "
                f"num_cpus={self._num_cpus_per_host}, resources={self._host_resources}; the "
                f"cluster has {self._ray.available_resources()} available. Lower n_hosts or "
                "num_cpus_per_host, or raise startup_timeout_s."
            )
        if self._pending:
            _logger.info(
                "The study starts on %d device host(s); %d more are starting (%s) and join "
                "when up, each within startup_timeout_s=%g.",
                len(self.hosts),
                len(self._pending),
                ", ".join(entry.where for entry in self._pending.values()),
                self._startup_timeout_s,
            )
        _logger.info("Device hosts: %s", ", ".join(host.info.label for host in self.hosts))
        self._watcher = threading.Thread(
            target=self._watch_loop, name="waterwave-ray-fleet", daemon=True
        )
        self._watcher.start()
        return self.hosts

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop watching and shut down every host (idempotent).

        Stop watching, withdraw the autoscaler request, kill hosts still starting and shut
        down every host (idempotent).
        """
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=timeout_s)
        with self._lock:
            self._name_failed_pending()
            pending, self._pending = list(self._pending.values()), {}
            if self._requested:
                self._request_devices(0)
        for entry in pending:
            with contextlib.suppress(Exception):
                self._ray.kill(entry.actor)
        for host in list(self.hosts):
            host.shutdown(timeout_s=timeout_s)

    # -- the loss of a host (its poller thread) ---------------------------------------------

    def host_lost(self, host: RayHostHandle, error: BaseException) -> None:
        """Count ``host`` lost, replace it, or stop the study.

        Count ``host`` lost; replace it on a GPU never used yet if there is one; stop the
        study when no host is left and none is starting.
        """
        with self._lock:
            self.n_lost += 1
            self.last_error = error
            node_alive = host.info.node_id in self._alive_node_ids()
            if not node_alive:
                self.nodes_lost.add(host.info.node_id)
                self._seen_alive.discard(host.info.node_id)
            if self._replace_lost and node_alive and not self._stop.is_set():
                self._replace(host)
            if not self._stop.is_set():
                try:
                    self._grow(alive_nodes(self._ray))
                except Exception as grow_error:  # the watcher tries again on its next turn
                    _logger.debug("Could not replace host %s: %r", host.device, grow_error)
            if self.all_lost:
                # Nothing can run any more: stop asking (the flag _optuna_compat reads).
                _optuna_compat.request_stop(self._study)

    def _replace(self, host: RayHostHandle) -> None:
        """Start a host in place of ``host`` (lost on an alive node), within the cap."""
        if self._num_gpus_per_host:
            # Its GPU share is free again: _grow (called next) starts the new host there.
            self._used[host.info.node_id] -= 1
        elif self._cap is None or self.n_alive + len(self._pending) < self._cap:
            _logger.info("Starting a CPU host in place of %s.", host.device)
            self._start_actor(None, "a CPU host placed by Ray")

    @property
    def all_lost(self) -> bool:
        """Whether no host is alive and none is starting."""
        with self._lock:
            return not self._pending and all(host.lost for host in self.hosts)

    @property
    def n_alive(self) -> int:
        """Hosts up and not lost."""
        return sum(1 for host in self.hosts if not host.lost)

    # -- the watcher thread -----------------------------------------------------------------

    def _watch_loop(self) -> None:
        while not self._stop.wait(_WATCH_S):
            try:
                self._watch_once()
            except Exception as error:  # a GCS hiccup: try again on the next turn
                _logger.debug("Watching the Ray cluster failed: %r", error)

    def _watch_once(self) -> None:
        with self._lock:
            self._adopt(timeout_s=0.0)
            now = time.monotonic()
            for ref, entry in list(self._pending.items()):
                if now - entry.since_s > self._startup_timeout_s:
                    del self._pending[ref]
                    with contextlib.suppress(Exception):
                        self._ray.kill(entry.actor)
                    _logger.warning(
                        "The device host on %s did not come up within startup_timeout_s=%g; "
                        "given up.",
                        entry.where,
                        self._startup_timeout_s,
                    )
            nodes = alive_nodes(self._ray)
            alive = {node.node_id for node in nodes}
            for node_id in self._seen_alive - alive:
                if node_id not in self.nodes_lost:
                    self.nodes_lost.add(node_id)
                    _logger.warning("Node %s left the Ray cluster.", node_id[:8])
            self._seen_alive = alive
            for node in nodes:
                if node.node_id not in self._initial_nodes and node.node_id not in (
                    self.nodes_joined
                ):
                    self.nodes_joined.add(node.node_id)
                    _logger.info("%s joined the Ray cluster.", node.label.capitalize())
            self._grow(nodes)
            self._ask_autoscaler()
            if self.all_lost:
                _optuna_compat.request_stop(self._study)

    def _grow(self, nodes: list[NodeView]) -> None:
        """Start hosts on GPUs not used yet while fewer than the cap are alive or starting."""
        if self._num_gpus_per_host == 0:
            return
        for node in nodes:
            while self._gpu_capacity(node) > self._used[node.node_id] and (
                self._cap is None or self.n_alive + len(self._pending) < self._cap
            ):
                _logger.info("Starting a device host on %s.", node.label)
                self._start_actor(node.node_id, node.label)

    def _ask_autoscaler(self) -> None:
        """Ask Ray's autoscaler for room while every host is full.

        With ``max_devices``: while every alive host is full and fewer than ``max_devices``
        are alive or starting, ask Ray's autoscaler to make room for ``max_devices`` hosts.
        """
        if self._max_devices is None or self._requested:
            return
        if self.n_alive + len(self._pending) >= self._max_devices * self._hosts_per_gpu:
            return
        if any(host.idle_slot() is not None for host in self.hosts if not host.lost):
            return
        self._request_devices(self._max_devices)

    def _request_devices(self, n_devices: int) -> None:
        from ray.autoscaler import sdk

        bundle: dict[str, float] = {"CPU": self._num_cpus_per_host, **self._host_resources}
        if self._num_gpus_per_host:
            bundle["GPU"] = float(self._num_gpus_per_host)
        try:
            sdk.request_resources(bundles=[dict(bundle) for _ in range(n_devices)])
        except Exception as error:  # a cluster without an autoscaler may refuse: say so once
            _logger.warning("Could not ask Ray's autoscaler for %d device(s): %r", n_devices, error)
            return
        self._requested = n_devices > 0
        if n_devices:
            self.n_autoscaler_requests += 1
            _logger.info(
                "Every device host is full: asked Ray's autoscaler for room for %d host(s) of %s.",
                n_devices,
                bundle,
            )

    # -- helpers (under the lock) -----------------------------------------------------------

    def _gpu_capacity(self, node: NodeView) -> int:
        if any(
            node.resources.get(key, 0.0) < amount for key, amount in self._host_resources.items()
        ):
            return 0
        gpus = int(node.resources.get("GPU", 0.0) // max(1, self._num_gpus_per_host))
        return gpus * self._hosts_per_gpu

    def _alive_node_ids(self) -> set[str]:
        try:
            return {node.node_id for node in alive_nodes(self._ray)}
        except Exception:
            return set()

    def _start_actor(self, node_id: str | None, where: str) -> None:
        if node_id is None:
            strategy: Any = "SPREAD"
        else:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            self._used[node_id] += 1
        options = self._actor_options
        actor = self._actor_class.options(**options, scheduling_strategy=strategy).remote(
            self._spec
        )
        self._pending[actor.info.remote()] = _Pending(actor, where, node_id, time.monotonic())

    def _name_failed_pending(self) -> None:
        """Warn about hosts still starting whose start has failed (the study may end first)."""
        if not self._pending:
            return
        with contextlib.suppress(Exception):
            refs = list(self._pending)
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                try:
                    self._ray.get(ref)
                except Exception as error:
                    _logger.warning(
                        "The device host on %s did not start: %s",
                        self._pending[ref].where,
                        describe_error(error),
                    )

    def _adopt(self, timeout_s: float, first: bool = False) -> list[str]:
        """Make hosts of the actors that came up; drop (and name) those that failed.

        ``first``: return as soon as one actor answered (up or failed), not after
        ``timeout_s`` for all.
        """
        if not self._pending:
            return []
        ready, _ = self._ray.wait(
            list(self._pending),
            num_returns=1 if first else len(self._pending),
            timeout=timeout_s,
        )
        failures = []
        for ref in ready:
            entry = self._pending.pop(ref)
            try:
                info = self._ray.get(ref)
            except Exception as error:
                with contextlib.suppress(Exception):
                    self._ray.kill(entry.actor)
                failures.append(f"{entry.where}: {describe_error(error)}")
                _logger.warning(
                    "The device host on %s did not start: %s", entry.where, describe_error(error)
                )
                continue
            self.hosts.append(self._make_host(entry.actor, info, self.host_lost))
        return failures
