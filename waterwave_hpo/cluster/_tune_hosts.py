"""``TuneHosts``: Ray Tune trials whose training functions run co-hosted in one actor per GPU.

Imports Ray Tune; see :func:`waterwave_hpo.tune_hosts` for the user-facing entry point and
:mod:`waterwave_hpo.cluster._hosted` for the host itself.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import functools
import shutil
from typing import Any
import uuid

from ray import tune
from ray.tune import PlacementGroupFactory

from waterwave_hpo.cluster._broker import NAMESPACE
from waterwave_hpo.cluster._hosted import HostedEvent
from waterwave_hpo.cluster._hosted import HostStats
from waterwave_hpo.cluster._hosted import pack_directory
from waterwave_hpo.cluster._hosted import unpack_directory
from waterwave_hpo.cluster._imports import import_ray

_POLL_S = 1.0


class HostedTrialError(RuntimeError):
    """Raised in a Tune trial whose function failed inside its trial host; the message carries
    the function's own traceback. ``out_of_memory`` says whether the device ran out of memory
    (set ``tune.FailureConfig(max_failures=...)`` to run such a trial again)."""

    def __init__(self, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


class _HostActor:
    """The Ray actor: a :class:`~waterwave_hpo.cluster._hosted.TrialHost` on its GPU."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import ray
        import torch

        from waterwave_hpo.cluster._hosted import TrialHost

        gpu_ids = ray.get_gpu_ids()
        device = torch.device("cpu")
        if gpu_ids and torch.cuda.is_available() and torch.cuda.device_count() > 0:
            device = torch.device("cuda", 0)  # Ray made this actor's GPU the only one visible
        self._host = TrialHost(device, **settings)

    def start(self, key: str, fn: Any, config: dict[str, Any], checkpoint: bytes | None) -> None:
        self._host.start(key, fn, config, checkpoint)

    def poll(self, key: str, timeout_s: float) -> list[HostedEvent]:
        return self._host.poll(key, timeout_s)

    def stop(self, key: str) -> None:
        self._host.stop(key)

    def load(self) -> int:
        return self._host.load()

    def stats(self) -> HostStats:
        return self._host.stats()

    def shutdown(self) -> None:
        self._host.shutdown()


class TuneHosts:
    """What :func:`waterwave_hpo.tune_hosts` returns: one trial-host actor per GPU of the
    cluster (``num_gpus=1`` each), and what a Tune run needs to use them.

    Use it as a context manager around the Tune run: the host actors start on ``__enter__``
    and are stopped on ``__exit__``::

        with ww.tune_hosts(trials_per_gpu=4) as hosts:
            tune.run(
                hosts.wrap(train_fn),
                resources_per_trial=hosts.resources,
                max_concurrent_trials=hosts.max_concurrent_trials,
                num_samples=64,
            )

    Each Tune trial is a small process that reserves ``cpus_per_trial`` CPUs and no GPU; its
    training function runs in the least loaded host, in a thread with its own CUDA stream,
    next to the other trials there (one stream-aware pool and one pipeline scheduler per GPU).
    ``tune.report(metrics, checkpoint=...)`` and ``tune.get_checkpoint()`` inside the function
    work as in any Tune trial: results stream back to the Tune trial, which reports them, so
    Tune's schedulers (ASHA, PBT), searchers, stoppers, result files and checkpoints work
    unchanged (checkpoint directories are copied to the Tune trial as gzipped tars, so keep
    them small). A trial Tune stops is stopped in its host at its next ``tune.report``; one
    whose Tune process dies is stopped after ``heartbeat_ttl_s``. A failing function fails its
    own Tune trial (:class:`HostedTrialError`), never its neighbours.

    Attributes:
        trials_per_gpu: Trials each host runs at once (the cap with ``auto``).
        auto: Whether hosts admit by measured memory, as ``trials_per_device="auto"``.
        cpus_per_trial: CPUs each Tune trial reserves for the work its function does in a host.
        n_hosts: Host actors (GPUs in the cluster when entered; ``None`` before).
    """

    def __init__(
        self,
        trials_per_gpu: int,
        auto: bool,
        cpus_per_trial: float,
        host_settings: dict[str, Any],
        n_hosts: int | None,
    ) -> None:
        self.trials_per_gpu = trials_per_gpu
        self.auto = auto
        self.cpus_per_trial = cpus_per_trial
        self._host_settings = host_settings
        self._wanted_hosts = n_hosts
        self.n_hosts: int | None = None
        self._names: list[str] = []
        self._actors: list[Any] = []

    @property
    def resources(self) -> PlacementGroupFactory:
        """``tune.PlacementGroupFactory([{"CPU": cpus_per_trial}])``: a Tune trial reserves
        CPUs only; its GPU work happens in a host."""
        return PlacementGroupFactory([{"CPU": self.cpus_per_trial}])

    @property
    def max_concurrent_trials(self) -> int:
        """``n_hosts * trials_per_gpu``: pass it to ``tune.run``/``TuneConfig`` so that Tune
        starts no more trials than the hosts run (more would wait in a host, shown RUNNING).

        Raises:
            RuntimeError: Before ``__enter__``.
        """
        if self.n_hosts is None:
            raise RuntimeError(
                "max_concurrent_trials is known once the hosts started: use "
                "`with ww.tune_hosts(...) as hosts:`."
            )
        return self.n_hosts * self.trials_per_gpu

    def __enter__(self) -> TuneHosts:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init()
        n = self._wanted_hosts
        if n is None:
            n = int(ray.cluster_resources().get("GPU", 0))
        if n < 1:
            raise RuntimeError(
                "tune_hosts() found no GPU in the Ray cluster (ray.cluster_resources() has no "
                "'GPU'); start Ray on a machine with GPUs, or declare them with "
                "ray.init(num_gpus=N), or pass n_hosts=N."
            )
        run = uuid.uuid4().hex[:8]
        actor_class = ray.remote(_HostActor)
        self._names = [f"waterwave-tune-host/{run}/{i}" for i in range(n)]
        self._actors = [
            actor_class.options(
                name=name,
                namespace=NAMESPACE,
                num_gpus=1,
                num_cpus=0,
                max_concurrency=4 * self.trials_per_gpu + 16,
            ).remote(self._host_settings)
            for name in self._names
        ]
        ray.get([actor.load.remote() for actor in self._actors])  # started, or raise here
        self.n_hosts = n
        return self

    def __exit__(self, *exc_info: object) -> None:
        ray = import_ray()
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.get(actor.shutdown.remote(), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors = []
        self.n_hosts = None

    def stats(self) -> list[HostStats]:
        """Each host's trials now (running, waiting, the most that ran at once)."""
        ray = import_ray()
        return list(ray.get([actor.stats.remote() for actor in self._actors]))

    def wrap(self, trainable: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        """A function trainable that runs ``trainable(config)`` in a host.

        Raises:
            TypeError: If ``trainable`` is a class (only function trainables are hosted).
            RuntimeError: Before ``__enter__`` (no hosts yet).
        """
        if isinstance(trainable, type) or not callable(trainable):
            raise TypeError(
                f"wrap() takes a function trainable, got {trainable!r}; class trainables cannot "
                "be hosted (use shared_gpu() for them)."
            )
        if not self._names:
            raise RuntimeError(
                "wrap() needs started hosts: call it inside `with ww.tune_hosts(...) as hosts:`."
            )
        names = list(self._names)

        @functools.wraps(trainable)
        def hosted(config: dict[str, Any]) -> None:
            _run_in_host(names, trainable, config)

        return hosted


def _run_in_host(
    names: list[str], fn: Callable[[dict[str, Any]], Any], config: dict[str, Any]
) -> None:
    """The Tune trial's side: start ``fn`` in the least loaded host and replay its events."""
    import ray

    hosts = [ray.get_actor(name, namespace=NAMESPACE) for name in names]
    loads = ray.get([host.load.remote() for host in hosts])
    host = hosts[min(range(len(hosts)), key=lambda i: loads[i])]
    # Unique per run of the function: Tune may reuse a trial's process, or run a trial again.
    key = f"{tune.get_context().get_trial_id()}/{uuid.uuid4().hex[:12]}"
    checkpoint = tune.get_checkpoint()
    packed = None
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            packed = pack_directory(directory)
    ray.get(host.start.remote(key, fn, config, packed))
    finished = False
    try:
        while not finished:
            for event in ray.get(host.poll.remote(key, _POLL_S)):
                if event.kind == "result":
                    _report(event)
                    continue
                finished = True
                if event.kind == "error":
                    raise HostedTrialError(
                        f"The trial's function failed in its waterwave-hpo host:\n{event.error}",
                        out_of_memory=event.out_of_memory,
                    )
    finally:
        if not finished:  # Tune stopped this trial (report raised SystemExit) or it failed here
            with contextlib.suppress(Exception):
                host.stop.remote(key)


def _report(event: HostedEvent) -> None:
    assert event.metrics is not None
    if event.checkpoint is None:
        tune.report(event.metrics)
        return
    directory = unpack_directory(event.checkpoint)
    try:
        tune.report(event.metrics, checkpoint=tune.Checkpoint.from_directory(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
