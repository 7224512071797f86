"""``RayExecutor``: the Waterwave executor on a Ray cluster, one device-host actor per GPU."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
import functools
import logging
from typing import Any

import optuna
import torch

from waterwave_hpo import _checks
from waterwave_hpo.cluster._actor import HostActor
from waterwave_hpo.cluster._actor import HostInfo
from waterwave_hpo.cluster._actor import HostSpec
from waterwave_hpo.cluster._fleet import HostFleet
from waterwave_hpo.cluster._handle import RayHostHandle
from waterwave_hpo.cluster._imports import import_ray
from waterwave_hpo.cluster._imports import start_ray
from waterwave_hpo.cluster._isolated import IsolatedHostActor
from waterwave_hpo.cluster._isolated import IsolatedSpec
from waterwave_hpo.cluster._isolated import describe_loss
from waterwave_hpo.cluster._storage import StorageServer
from waterwave_hpo.executor import Isolation
from waterwave_hpo.executor import MemoryPoolMode
from waterwave_hpo.executor import OnOOM
from waterwave_hpo.executor import WaterwaveExecutor
from waterwave_hpo.executor._internal import Callback
from waterwave_hpo.executor._internal import HostHandle
from waterwave_hpo.executor._internal import ObjectiveFunc
from waterwave_hpo.executor._internal import check_isolation
from waterwave_hpo.host import RunSettings
from waterwave_hpo.scheduler import Policy
from waterwave_hpo.scheduler import PolicyName

_logger = logging.getLogger("waterwave_hpo")
_ACTOR_CONCURRENCY = 4  # poll (blocking) + submit + interrupt + shutdown


class AllHostsLostError(RuntimeError):
    """Raised by :meth:`RayExecutor.optimize` when every device host died during the search.

    The trials that were running on them were told FAIL; no trial is left RUNNING.
    """


class RayExecutor(WaterwaveExecutor):
    """Run an Optuna study's trials on a Ray cluster, one device-host actor per GPU.

    Run an Optuna study's trials on a Ray cluster: one device-host actor per GPU, each
    co-hosting ``trials_per_device`` trials exactly as :class:`WaterwaveExecutor` does on one
    machine (slot threads, one CUDA stream each, the stream-aware pool, the NodeGroup pipeline
    scheduler; Waterwave, IEEE TC 2023).

    The driver (the process calling :meth:`optimize`) asks the study for trials, hands each to
    the host with the most room (the fewest running trials among hosts with a free slot and,
    with ``trials_per_device="auto"``, measured memory to spare), and tells the study how it
    ended, so the study's sampler, callbacks and ``study.stop()`` behave as with
    ``study.optimize``. Host actors reach the study through Ray itself (an anonymous relay
    actor and a driver thread, :mod:`waterwave_hpo.cluster._storage`) around the study's own
    storage: an in-memory study, a journal file or an RDB URL all work unchanged, only the
    driver touches the storage itself, nothing new listens on the network, and hosts may use
    only this study, with only the calls a host makes (no other study, no deletion).

    The hosts are elastic (:mod:`waterwave_hpo.cluster._fleet`). The study starts with the hosts
    that come up: one that fails to start (its node lost, no room within ``startup_timeout_s``)
    is a warning naming its node, and an error only when none starts. While the study runs, a
    GPU node that joins the cluster gets hosts (while fewer than ``n_hosts``, or
    ``max_devices``, are alive), used from the next trial on; with ``max_devices``, Ray's
    autoscaler is asked for more GPUs while every host is full. A host actor that dies (killed,
    crashed, its node lost) has each of its running trials told FAIL
    (``waterwave:fail_reason`` says why) and its parameters re-queued on the remaining hosts (up
    to ``max_host_retries`` times), and the search goes on; if every host is lost and none can
    replace them, :class:`AllHostsLostError` is raised. Nothing is left RUNNING.
    :attr:`cluster_stats` counts what happened.

    With ``isolation="process"`` each trial runs in a process of its own: every GPU gets
    ``trials_per_device`` single-slot host actors (Ray's fractional GPUs, ``num_gpus=1/K``),
    each holding for its lifetime a memory lease of ``budget / K`` bytes from the GPU's broker
    (the one :func:`~waterwave_hpo.shared_gpu` uses): its memory budget and, on CUDA, the
    bound of each of its trials (the pool account's quota, else PyTorch's per-process memory
    fraction), so the K processes' peaks do not collide. Trials no longer share one pool (no
    memory flows between them) nor any process-wide state (random generators, framework
    singletons, ``os.environ``).
    A trial that crashes its process (segmentation fault, ``abort()``, ``os._exit``, the OOM
    killer) kills its actor only: it is told FAIL with the reason (the signal and where, from
    the process's :mod:`faulthandler` report), it is not re-run, its slot gets a new actor, and
    the study goes on (:mod:`waterwave_hpo.cluster._isolated`).

    Args:
        n_hosts: How many host actors to start (>= 1), or ``"auto"``: one per GPU in the cluster
            (``ray.cluster_resources()["GPU"]``, logical GPUs included).
        trials_per_device: Trials co-hosted on each host (>= 1) or ``"auto"``, as for
            :class:`WaterwaveExecutor`.
        num_gpus_per_host: GPUs each host actor reserves: ``1`` (one actor per GPU) or ``0``
            (CPU hosts, for clusters without GPUs).
        num_cpus_per_host: CPUs each host actor reserves (> 0); its trials' threads share them.
        host_resources: Extra Ray custom resources each host actor reserves, e.g.
            ``{"accelerator_type:A100": 0.001}`` to pick a GPU type.
        max_devices: The most host actors alive at once (>= ``n_hosts``), and, while every
            host is full, how many Ray's autoscaler is asked to make room for
            (``ray.autoscaler.sdk.request_resources`` with one bundle per host: its
            ``num_gpus_per_host``, ``num_cpus_per_host`` and ``host_resources``; withdrawn when
            :meth:`optimize` returns). ``None``: no autoscaler request; ``n_hosts`` caps the
            hosts when it is an int, else every GPU of the cluster gets one, nodes that join
            included.
        max_host_retries: How many times one set of parameters is re-queued after its host was
            lost (>= 0).
        startup_timeout_s: Seconds a host actor may take to be placed and open the study
            (> 0); the study starts once every first host is up or failed, or this long.
        isolation: ``"threads"`` (default): one host actor per GPU, its trials co-hosted as
            threads (one pool, memory flowing between trials); ``"process"``: one
            single-slot host actor per trial slot, ``trials_per_device`` (an int) per GPU,
            each with a memory lease; ``num_cpus_per_host`` is then shared by a GPU's K
            actors and ``memory_budget_bytes`` is the GPU's budget their leases share.
        on_oom: As for :class:`WaterwaveExecutor`, applied on every host, as are
            ``max_oom_retries``, ``memory_budget_bytes``, ``policy``, ``memory_pool``,
            ``max_trials_per_device``, ``memory_plan``, ``memory_planner`` and ``fuse``: a
            fused batch (``fuse=K``) runs in one slot of one host, and each attempt's memory
            plan is made on its host.

    Attributes:
        devices: Always empty: the driver runs no trial; each host actor resolves its own
            device where Ray placed it (see :attr:`cluster_stats` and the trials'
            ``waterwave:host``).

    Raises:
        ImportError: If Ray is not installed (the message says how to install it).
        ValueError: For an argument out of range; the message names the argument, the value
            and the fix.
        TypeError: For an argument of the wrong type.

    Example::

        import ray, waterwave_hpo as ww

        ray.init(address="auto")
        study = ww.create_study(direction="maximize")
        study.optimize(objective, n_trials=256, executor=ww.RayExecutor(trials_per_device=4))
    """

    def __init__(
        self,
        n_hosts: int | str = "auto",
        trials_per_device: int | str = 4,
        *,
        num_gpus_per_host: int = 1,
        num_cpus_per_host: float = 1.0,
        host_resources: Mapping[str, float] | None = None,
        max_devices: int | None = None,
        max_host_retries: int = 2,
        startup_timeout_s: float = 120.0,
        on_oom: OnOOM | str = OnOOM.RETRY,
        max_oom_retries: int = 2,
        memory_budget_bytes: int | None = None,
        policy: str | PolicyName | Policy = PolicyName.WATERWAVE,
        memory_pool: MemoryPoolMode | str = MemoryPoolMode.AUTO,
        max_trials_per_device: int = 16,
        memory_plan: str = "off",
        memory_planner: str = "pso",
        fuse: int | None = None,
        isolation: Isolation | str = Isolation.THREADS,
    ) -> None:
        import_ray()
        self.isolation = check_isolation(isolation, trials_per_device)
        # Not WaterwaveExecutor.__init__: the driver resolves no device; each host actor
        # resolves its own ("auto") where Ray placed it.
        self._init_trial_settings(
            trials_per_device,
            on_oom=on_oom,
            max_oom_retries=max_oom_retries,
            memory_budget_bytes=memory_budget_bytes,
            policy=policy,
            memory_pool=memory_pool,
            max_trials_per_device=max_trials_per_device,
            memory_plan=memory_plan,
            memory_planner=memory_planner,
            fuse=fuse,
            # Hosts always record where a trial ran (waterwave:host, :node, :device, :slot,
            # :fail_reason) as system attributes: on a cluster that is how a lost node is traced.
            record_trial_attrs=True,
        )
        self.devices: list[torch.device] = []  # the driver runs no trial (see cluster_stats)
        if n_hosts != "auto":
            if isinstance(n_hosts, str):
                raise _checks.type_error(
                    "n_hosts", n_hosts, "an int >= 1 or 'auto'", "pass e.g. n_hosts=2"
                )
            _checks.check_int("n_hosts", n_hosts, minimum=1)
        self.n_hosts = n_hosts
        if isinstance(num_gpus_per_host, bool) or num_gpus_per_host not in (0, 1):
            raise _checks.value_error(
                "num_gpus_per_host",
                num_gpus_per_host,
                "must be 1 (one host actor per GPU) or 0 (CPU hosts)",
                "a host drives one device; to share a GPU among trials, raise "
                "trials_per_device instead of splitting the GPU",
            )
        if num_gpus_per_host == 0 and n_hosts == "auto":
            raise ValueError(
                "n_hosts='auto' counts the cluster's GPUs, but num_gpus_per_host=0 asks for "
                "CPU hosts. Pass n_hosts=N with num_gpus_per_host=0."
            )
        self.num_gpus_per_host = int(num_gpus_per_host)
        self.num_cpus_per_host = _check_positive_number("num_cpus_per_host", num_cpus_per_host)
        self.host_resources = _check_resources(host_resources)
        if max_devices is not None:
            _checks.check_int("max_devices", max_devices, minimum=1)
            if isinstance(n_hosts, int) and max_devices < n_hosts:
                raise ValueError(
                    f"max_devices={max_devices} is below n_hosts={n_hosts}: it caps the hosts "
                    f"alive at once. Pass max_devices >= {n_hosts}, or None."
                )
        self.max_devices = max_devices
        self.max_host_retries = _checks.check_int("max_host_retries", max_host_retries, minimum=0)
        self.startup_timeout_s = _check_positive_number("startup_timeout_s", startup_timeout_s)
        self._server: StorageServer | None = None
        self._fleet: HostFleet | None = None
        self._cluster_stats: ClusterStats | None = None

    def __repr__(self) -> str:
        return (
            f"RayExecutor(n_hosts={self.n_hosts!r}, trials_per_device="
            f"{'auto' if self.auto_trials else self.trials_per_device}, "
            f"num_gpus_per_host={self.num_gpus_per_host}, "
            f"num_cpus_per_host={self.num_cpus_per_host}, max_devices={self.max_devices}, "
            f"on_oom={self.on_oom.value!r}, memory_plan={self.memory_plan.mode.value!r}, "
            f"fuse={self.fuse}, isolation={self.isolation.value!r})"
        )

    @property
    def cluster_stats(self) -> ClusterStats | None:
        """What happened to the hosts in the most recent optimize call.

        What happened to the hosts in the most recent :meth:`optimize` call (``None``
        before the first); see :class:`ClusterStats`.
        """
        return self._cluster_stats

    def optimize(
        self,
        study: optuna.Study,
        func: ObjectiveFunc,
        n_trials: int | None = None,
        timeout: float | None = None,
        catch: Iterable[type[Exception]] | type[Exception] = (),
        callbacks: Iterable[Callback] | None = None,
        gc_after_trial: bool = False,
        show_progress_bar: bool = False,
    ) -> None:
        """Optimize ``func`` on ``study`` with trials co-hosted on the cluster's devices.

        The arguments mean what they mean for :meth:`WaterwaveExecutor.optimize`. ``func``,
        ``catch`` and the study's sampler and pruner are pickled to every host actor (Ray's
        cloudpickle), so they must be picklable; the objective runs in the actors, where
        :func:`waterwave_hpo.current` gives the trial's device and stream.

        Raises:
            RuntimeError: If no host actor starts within ``startup_timeout_s`` (e.g. fewer
                GPUs than ``n_hosts``, or every node lost), or Ray is not initialized and
                cannot start.
            AllHostsLostError: If every host actor died and none could replace them; their
                trials were told FAIL.
            TypeError, ValueError, Exception, KeyboardInterrupt: As
                :meth:`WaterwaveExecutor.optimize`.
        """
        ray = import_ray()
        # WaterwaveExecutor's own checks, before Ray starts (a local Ray takes seconds to start
        # and outlives the call) or the driver serves the storage.
        n_trials, _, _ = self._check_run(study, func, n_trials, timeout, catch, callbacks)
        start_ray(ray, "RayExecutor.optimize")
        n_hosts = self._resolve_n_hosts(ray)
        # One driver thread per trial that may call the storage at once, within reason.
        threads = min(64, max(8, max(n_hosts, self.max_devices or 0) * self.trials_per_device))
        self._server = StorageServer(study, max_workers=threads)
        try:
            super().optimize(
                study,
                func,
                n_trials=n_trials,
                timeout=timeout,
                catch=catch,
                callbacks=callbacks,
                gc_after_trial=gc_after_trial,
                show_progress_bar=show_progress_bar,
            )
        finally:
            fleet, self._fleet = self._fleet, None
            if fleet is not None:
                fleet.stop()
                self._cluster_stats = ClusterStats(
                    hosts_started=len(fleet.hosts),
                    hosts_lost=fleet.n_lost,
                    nodes_lost=len(fleet.nodes_lost),
                    nodes_joined=len(fleet.nodes_joined),
                    autoscaler_requests=fleet.n_autoscaler_requests,
                )
            self._server.stop()
            self._server = None
        if fleet is not None and fleet.all_lost:
            raise AllHostsLostError(
                f"All {len(fleet.hosts)} device host(s) were lost during the search (last: "
                f"{fleet.last_error!r}); their running trials were told FAIL. Check the Ray "
                "logs of the host actors, and that the cluster still has the resources they "
                "need."
            )

    def _resolve_n_hosts(self, ray: Any) -> int:
        gpus = float(ray.cluster_resources().get("GPU", 0.0))
        if self.n_hosts == "auto":
            n_hosts = int(gpus // self.num_gpus_per_host)
            if n_hosts < 1:
                raise RuntimeError(
                    "RayExecutor(n_hosts='auto') starts one host actor per GPU, but the Ray "
                    f"cluster has {gpus:g} GPU(s). Start Ray on GPU nodes, declare logical "
                    "GPUs (ray.init(num_gpus=N)), or pass n_hosts=N with num_gpus_per_host=0 "
                    "for CPU hosts."
                )
            return n_hosts
        n_hosts = int(self.n_hosts)
        if n_hosts * self.num_gpus_per_host > gpus and int(gpus) < 1:
            raise RuntimeError(
                f"n_hosts={n_hosts} host actors with num_gpus_per_host=1 need {n_hosts} GPU(s), "
                "but the Ray cluster has none. Pass num_gpus_per_host=0 for CPU hosts, or start "
                "Ray on GPU nodes (or declare logical GPUs: ray.init(num_gpus=N))."
            )
        if n_hosts * self.num_gpus_per_host > gpus:
            raise RuntimeError(
                f"n_hosts={n_hosts} host actors need {n_hosts * self.num_gpus_per_host} GPU(s), "
                f"but the Ray cluster has {gpus:g}. Pass n_hosts <= {int(gpus)} or "
                "n_hosts='auto', or num_gpus_per_host=0 for CPU hosts."
            )
        return n_hosts

    def _hosts_up(self) -> bool:
        return False  # host actors start per optimize call: their start-up counts

    def _make_hosts(self, settings: RunSettings) -> Sequence[HostHandle[Any]]:
        ray = import_ray()
        assert self._server is not None
        study = settings.study
        spec = HostSpec.of_run(
            settings,
            self._server.channel,
            n_slots=self.trials_per_device,
            admit_by_memory=self.auto_trials,
            memory_pool=self.memory_pool,
            memory_budget_bytes=self.memory_budget_bytes,
            policy=self.policy,
            memory_plan=self.memory_plan,
        )
        isolated = self.isolation is Isolation.PROCESS
        per_gpu = self.trials_per_device if isolated else 1
        actor_options = {
            "num_gpus": _share(self.num_gpus_per_host, per_gpu),
            "num_cpus": _share(self.num_cpus_per_host, per_gpu),
            "resources": (
                {key: _share(amount, per_gpu) for key, amount in self.host_resources.items()}
                or None
            ),
            "max_restarts": 0,
            "max_concurrency": _ACTOR_CONCURRENCY,
        }
        actor_spec: Any = spec
        if isolated:
            actor_spec = IsolatedSpec(
                host=spec,
                trials_per_gpu=per_gpu,
                budget_bytes=self.memory_budget_bytes,
                lease_timeout_s=self.startup_timeout_s,
            )

        def make_host(
            actor: Any, info: HostInfo, on_lost: Callable[[RayHostHandle, BaseException], None]
        ) -> RayHostHandle:
            return RayHostHandle(
                actor,
                info,
                1 if isolated else self.trials_per_device,
                self.auto_trials,
                settings,
                self.max_host_retries,
                on_lost=on_lost,
                describe_loss=functools.partial(describe_loss, ray) if isolated else None,
                access=self._server.policy if self._server is not None else None,
            )

        self._fleet = HostFleet(
            ray=ray,
            actor_class=ray.remote(IsolatedHostActor if isolated else HostActor),
            actor_options=actor_options,
            spec=actor_spec,
            make_host=make_host,
            study=study,
            n_hosts=None if self.n_hosts == "auto" else int(self.n_hosts),
            num_gpus_per_host=self.num_gpus_per_host,
            host_resources=self.host_resources,
            num_cpus_per_host=self.num_cpus_per_host,
            max_devices=self.max_devices,
            startup_timeout_s=self.startup_timeout_s,
            hosts_per_gpu=per_gpu,
            replace_lost=isolated,
        )
        # The loop reads this list on every turn; the fleet appends hosts that join.
        return self._fleet.start()


@dataclass(frozen=True)
class ClusterStats:
    """What happened to the host actors of one :meth:`RayExecutor.optimize` call.

    Attributes:
        hosts_started: Host actors that came up (at start, late, or on nodes that joined).
        hosts_lost: Host actors that died during the search (their trials told FAIL and, up
            to ``max_host_retries`` times, re-queued).
        nodes_lost: Nodes that left the cluster during the search.
        nodes_joined: Nodes that joined the cluster during the search.
        autoscaler_requests: Times Ray's autoscaler was asked for more devices
            (``max_devices``).
    """

    hosts_started: int
    hosts_lost: int
    nodes_lost: int
    nodes_joined: int
    autoscaler_requests: int


def _share(amount: float, k: int) -> float:
    """``amount / k``, rounded down to Ray's resolution (1/10000) so that k shares fit."""
    return amount if k == 1 else int(amount * 10_000 / k) / 10_000


def _check_positive_number(name: str, value: object) -> float:
    return _checks.check_number(name, value)


def _check_resources(resources: Mapping[str, float] | None) -> dict[str, float]:
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        raise _checks.type_error(
            "host_resources",
            resources,
            "a mapping of Ray custom resource names to amounts",
            'pass e.g. {"accelerator_type:A100": 0.001}',
        )
    result: dict[str, float] = {}
    for key, amount in resources.items():
        if key in ("CPU", "GPU", "memory"):
            raise _checks.value_error(
                f"host_resources[{key!r}]",
                amount,
                f"{key!r} is not a custom resource",
                "set CPUs with num_cpus_per_host and GPUs with num_gpus_per_host, and keep "
                "host_resources for custom resources",
            )
        result[str(key)] = _check_positive_number(f"host_resources[{key!r}]", amount)
    return result
