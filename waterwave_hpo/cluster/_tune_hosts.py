"""``TuneHosts``: Ray Tune trials whose training functions run co-hosted in one actor per GPU.

Imports Ray Tune; see :func:`waterwave_hpo.tune_hosts` for the user-facing entry point,
:mod:`waterwave_hpo.cluster._hosted` for the host itself and
:mod:`waterwave_hpo.cluster._tune_trial` for what runs in each Tune trial's process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from collections.abc import Hashable
import contextlib
import logging
import threading
from typing import Any
import uuid

from ray.tune import PlacementGroupFactory

from waterwave_hpo import _checks
from waterwave_hpo.cluster._broker import NAMESPACE
from waterwave_hpo.cluster._hosted_events import HostStats
from waterwave_hpo.cluster._imports import import_ray
from waterwave_hpo.cluster._imports import start_ray
from waterwave_hpo.cluster._nodes import NodeView
from waterwave_hpo.cluster._nodes import alive_nodes
from waterwave_hpo.cluster._nodes import describe_error
from waterwave_hpo.cluster._nodes import interleave
from waterwave_hpo.cluster._tune_host_actor import TuneHostActor
from waterwave_hpo.cluster._tune_trial import hosted_trainable
from waterwave_hpo.host import check_fuse_matches
from waterwave_hpo.host import is_batched

_WATCH_S = 1.0
_logger = logging.getLogger("waterwave_hpo")


class TuneHosts:
    """What :func:`waterwave_hpo.tune_hosts` returns.

    What :func:`waterwave_hpo.tune_hosts` returns: one trial-host actor per GPU of the
    cluster (``num_gpus=1`` each), and what a Tune run needs to use them.

    Use it as a context manager around the Tune run: the host actors start on ``__enter__``
    and are stopped on ``__exit__``::

        with ww.tune_hosts(trials_per_gpu=4) as hosts:
            tune.run(
                hosts.wrap(train_fn),
                resources_per_trial=hosts.resources,
                max_concurrent_trials=hosts.max_concurrent_trials,
                num_samples=64,
                reuse_actors=True,  # a trial's process relays the next trial (docs/guide/ray.md)
            )

    Each Tune trial is a small process that reserves ``cpus_per_trial`` CPUs and no GPU; its
    training function runs in the least loaded host, in a thread with its own CUDA stream,
    next to the other trials there (one stream-aware pool and one pipeline scheduler per GPU).
    ``tune.report(metrics, checkpoint=...)`` and ``tune.get_checkpoint()`` inside the function
    work as in any Tune trial: results stream back to the Tune trial, which reports them, so
    Tune's schedulers (ASHA, PBT), searchers, stoppers, result files and checkpoints work
    unchanged (checkpoint directories are copied to the Tune trial as gzipped tars, so keep
    them small). A trial Tune stops is stopped in its host at its next ``tune.report``; one
    whose Tune process dies (or stops: nothing keeps its trial alive) is stopped after
    ``heartbeat_ttl_s``. A failing function fails its
    own Tune trial (:class:`~waterwave_hpo.cluster._tune_trial.HostedTrialError`), never its
    neighbours.

    The hosts follow the cluster: each is placed on its node (one per GPU), a host that does
    not start is a warning naming its node (an error only when none starts), a GPU node that
    joins while the ``with`` block runs gets hosts (all its GPUs with ``n_hosts=None``, else
    while fewer than ``n_hosts`` are alive), and a trial picks the least loaded host that
    answers when it starts, so it never waits on a node that is gone. A trial whose host is
    lost fails with :class:`~waterwave_hpo.cluster._tune_trial.HostedTrialError` saying so; with
    ``tune.FailureConfig(max_failures=...)`` Tune runs it again in another host, from its last
    checkpoint. Hosts that join add room, but ``max_concurrent_trials`` stays what was passed
    to Tune: pass a larger value to let Tune start more trials when nodes join.

    With ``tune_hosts(fuse=K)``, wrap a batched trainable (HFTA, arXiv:2102.02344)::

        @ww.batched
        def train(trials):  # up to K TuneBatchTrial, one per Tune trial
            model = fusion.fuse([build(t.config) for t in trials])
            for step in range(steps):
                losses = ...  # one fused step for all
                for t, loss in zip(trials, losses):
                    t.report({"loss": float(loss)})  # each to its own Tune trial

        with ww.tune_hosts(trials_per_gpu=2, fuse=8) as hosts:
            tune.run(hosts.wrap(train), max_concurrent_trials=hosts.max_concurrent_trials, ...)

    Attributes:
        trials_per_gpu: Trials each host runs at once (the cap with ``auto``).
        auto: Whether hosts admit by measured memory, as ``trials_per_device="auto"``.
        cpus_per_trial: CPUs each Tune trial reserves for the work its function does in a host.
        n_hosts: Host actors that started when entered (one per GPU of the alive nodes, or
            the ``n_hosts`` asked for, less those that failed to start); ``None`` before.
        fuse: Tune trials a batched trainable runs per call (``None``: one).
    """

    def __init__(
        self,
        trials_per_gpu: int,
        auto: bool,
        cpus_per_trial: float,
        host_settings: dict[str, Any],
        n_hosts: int | None,
        fuse: int | None = None,
    ) -> None:
        self.trials_per_gpu = trials_per_gpu
        self.fuse = fuse
        self.auto = auto
        self.cpus_per_trial = cpus_per_trial
        self._host_settings = host_settings
        self._wanted_hosts = n_hosts
        self.n_hosts: int | None = None
        self._prefix = ""
        self._actors: dict[str, Any] = {}  # name -> handle, every host started (alive or not)
        self._placed: dict[str, str] = {}  # name -> the node id it was placed on
        self._lost: set[str] = set()
        self._used: Counter[str] = Counter()  # node id -> hosts started there
        self._initial_nodes: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def resources(self) -> PlacementGroupFactory:
        """The resources of one Tune trial: CPUs only.

        ``tune.PlacementGroupFactory([{"CPU": cpus_per_trial}])``: a Tune trial reserves
        CPUs only; its GPU work happens in a host.
        """
        return PlacementGroupFactory([{"CPU": self.cpus_per_trial}])

    @property
    def max_concurrent_trials(self) -> int:
        """The most trials Tune should run at once.

        ``n_hosts * trials_per_gpu`` (times ``fuse``: each place runs a batch of up to
        ``fuse`` trials): pass it to ``tune.run``/``TuneConfig`` so that Tune starts no more
        trials than the hosts run (more would wait in a host, shown RUNNING).

        Raises:
            RuntimeError: Before ``__enter__``.
        """
        if self.n_hosts is None:
            raise RuntimeError(
                "max_concurrent_trials is known once the hosts started: use "
                "`with ww.tune_hosts(...) as hosts:`."
            )
        return self.n_hosts * self.trials_per_gpu * (self.fuse or 1)

    def __enter__(self) -> TuneHosts:
        ray = import_ray()
        start_ray(ray, "tune_hosts()")
        nodes = alive_nodes(ray)
        self._initial_nodes = {node.node_id for node in nodes}
        places = interleave([[node] * _gpus(node) for node in nodes])
        if self._wanted_hosts is not None:
            if not places:
                raise RuntimeError(
                    f"tune_hosts(n_hosts={self._wanted_hosts}) starts one host actor per GPU, "
                    "but the Ray cluster's alive nodes have no GPU. Start Ray on GPU nodes, or "
                    "declare logical GPUs with ray.init(num_gpus=N) before entering tune_hosts(); "
                    "without GPUs use ww.shared_gpu() or plain Tune resources."
                )
            if self._wanted_hosts > len(places):
                raise RuntimeError(
                    f"tune_hosts(n_hosts={self._wanted_hosts}) needs {self._wanted_hosts} "
                    f"GPU(s), but the Ray cluster's alive nodes have {len(places)}. Pass "
                    f"n_hosts <= {len(places)} or None."
                )
            places = places[: self._wanted_hosts]
        if not places:
            raise RuntimeError(
                "tune_hosts() found no GPU in the Ray cluster (ray.cluster_resources() has no "
                "'GPU'); start Ray on a machine with GPUs, or declare them with "
                "ray.init(num_gpus=N) before entering tune_hosts()."
            )
        self._prefix = f"waterwave-tune-host/{uuid.uuid4().hex[:8]}/"
        self._stop.clear()
        started = [self._start_host(node) for node in places]
        failures = []
        for name, node in zip(started, places, strict=True):
            try:
                ray.get(self._actors[name].load.remote())  # started, or raise here
            except Exception as error:
                self._lost.add(name)
                failures.append(f"{node.label}: {describe_error(error)}")
                _logger.warning(
                    "The trial host on %s did not start: %s", node.label, describe_error(error)
                )
        if len(self._lost) == len(started):
            self._kill_all()
            raise RuntimeError(
                "No waterwave-hpo trial host started: " + "; ".join(failures) + ". Check that "
                "the GPU nodes are alive (ray.nodes())."
            )
        self.n_hosts = len(started) - len(self._lost)
        self._watcher = threading.Thread(
            target=self._watch_loop, name="waterwave-tune-hosts", daemon=True
        )
        self._watcher.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
            self._watcher = None
        self._kill_all()
        self.n_hosts = None

    def _kill_all(self) -> None:
        ray = import_ray()
        with self._lock:
            actors, self._actors = dict(self._actors), {}
            self._placed.clear()
        for name, actor in actors.items():
            if name not in self._lost:
                with contextlib.suppress(Exception):
                    ray.get(actor.shutdown.remote(), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(actor)

    def _start_host(self, node: NodeView) -> str:
        """Start a host on ``node`` (hard affinity, so that it never waits for another)."""
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._lock:
            name = f"{self._prefix}{len(self._actors)}"
            self._actors[name] = (
                ray.remote(TuneHostActor)
                .options(
                    name=name,
                    namespace=NAMESPACE,
                    num_gpus=1,
                    num_cpus=0,
                    max_concurrency=4 * self.trials_per_gpu + 16,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
                )
                .remote(self._host_settings)
            )
            self._placed[name] = node.node_id
            self._used[node.node_id] += 1
        return name

    def _watch_loop(self) -> None:
        """Follow the cluster's GPU nodes as they leave and join.

        Forget hosts whose node left; start hosts on GPU nodes that joined (all their GPUs
        with ``n_hosts=None``, else while fewer than ``n_hosts`` hosts are alive).
        """
        while not self._stop.wait(_WATCH_S):
            with contextlib.suppress(Exception):  # a GCS hiccup: try again on the next turn
                self._watch_once()

    def _watch_once(self) -> None:
        ray = import_ray()
        nodes = alive_nodes(ray)
        alive = {node.node_id for node in nodes}
        with self._lock:
            for name, node_id in self._placed.items():
                if node_id not in alive and name not in self._lost:
                    self._lost.add(name)
                    _logger.warning("The trial host %s was lost with its node %s.", name, node_id)
            n_alive = len(self._actors) - len(self._lost)
        for node in nodes:
            if node.node_id in self._initial_nodes:
                continue
            while _gpus(node) > self._used[node.node_id] and (
                self._wanted_hosts is None or n_alive < self._wanted_hosts
            ):
                _logger.info("Starting a trial host on %s, which joined.", node.label)
                self._start_host(node)
                n_alive += 1

    def stats(self) -> list[HostStats]:
        """Each alive host's trials now (running, waiting, the most that ran at once)."""
        ray = import_ray()
        with self._lock:
            actors = [a for name, a in self._actors.items() if name not in self._lost]
        stats = []
        for actor in actors:
            with contextlib.suppress(ray.exceptions.RayActorError):
                stats.append(ray.get(actor.stats.remote()))
        return stats

    def wrap(
        self,
        trainable: Callable[[Any], Any],
        *,
        batch_key: Callable[[dict[str, Any]], Hashable] | None = None,
    ) -> Callable[[dict[str, Any]], Any]:
        """A function trainable that runs ``trainable(config)`` in a host.

        With ``tune_hosts(fuse=K)``, ``trainable`` is a batched trainable
        (:func:`waterwave_hpo.batched`): each host calls it with a list of up to K
        :class:`~waterwave_hpo.cluster._hosted.TuneBatchTrial` (Tune trials that arrived
        together), each with its ``config``, ``report``, ``get_checkpoint`` and ``stopped``. It
        returns ``None``, or one entry per trial where an exception instance fails that trial
        alone. A function that raises fails every trial of its batch.

        Args:
            trainable: A function trainable taking a config, or with ``fuse`` a batched one.
            batch_key: With ``fuse``: trials whose configs give equal keys may share a batch
                (e.g. ``lambda c: c["width"]`` when the width changes the model's structure);
                ``None``: any trials of this trainable may.

        Raises:
            TypeError: If ``trainable`` is a class (only function trainables are hosted), is
                not batched while ``fuse`` is set, cannot be pickled (it is sent to the hosts
                as ``ray.cloudpickle`` bytes), or ``batch_key`` is not callable.
            ValueError: If ``trainable`` is batched while ``fuse`` is not set.
            RuntimeError: Before ``__enter__`` (no hosts yet).
        """
        if isinstance(trainable, type) or not callable(trainable):
            raise TypeError(
                f"wrap() takes a function trainable, got {trainable!r}; class trainables cannot "
                "be hosted (use shared_gpu() for them)."
            )
        check_fuse_matches(
            trainable,
            self.fuse,
            name="trainable",
            kind="trainable",
            setting="ww.tune_hosts(fuse=K)",
            noun="Tune trials",
        )
        if batch_key is not None and not callable(batch_key):
            raise _checks.type_error(
                "batch_key", batch_key, "callable", "pass a function of the config, or None"
            )
        if self.n_hosts is None:
            raise RuntimeError(
                "wrap() needs started hosts: call it inside `with ww.tune_hosts(...) as hosts:`."
            )
        try:
            payload = import_ray().cloudpickle.dumps(trainable)
        except Exception as error:
            raise TypeError(
                f"trainable={trainable!r} cannot be pickled ({type(error).__name__}: {error}); "
                "its host runs it in another process: capture no locks, files or sockets in "
                "it (pass data with tune.with_parameters or through its config instead)."
            ) from error
        return hosted_trainable(
            getattr(trainable, "__name__", type(trainable).__name__),
            payload,
            self._prefix,
            # this wrap's trials share batches only with each other
            uuid.uuid4().hex[:12] if is_batched(trainable) else None,
            batch_key,
            self._host_settings["heartbeat_ttl_s"],
        )


def _gpus(node: NodeView) -> int:
    return int(node.resources.get("GPU", 0.0))
