"""``RayExecutor``: the Waterwave executor on a Ray cluster, one device-host actor per GPU."""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
import contextlib
import logging
import threading
from typing import Any
from typing import cast

import optuna

from waterwave_hpo.cluster._actor import HostActor
from waterwave_hpo.cluster._actor import HostSpec
from waterwave_hpo.cluster._imports import import_ray
from waterwave_hpo.cluster._remote import RemoteHost
from waterwave_hpo.cluster._storage import StorageServer
from waterwave_hpo.executor import WaterwaveExecutor
from waterwave_hpo.executor._executor import Callback
from waterwave_hpo.executor._executor import ObjectiveFunc
from waterwave_hpo.executor._executor import _check_positive_int
from waterwave_hpo.executor._host import DeviceHost
from waterwave_hpo.executor._host import RunSettings
from waterwave_hpo.executor._memory import MemoryPoolMode
from waterwave_hpo.executor._outcome import OnOOM
from waterwave_hpo.scheduler import Policy
from waterwave_hpo.scheduler import PolicyName

_logger = logging.getLogger("waterwave_hpo")
_ACTOR_CONCURRENCY = 4  # poll (blocking) + submit + interrupt + shutdown


class AllHostsLostError(RuntimeError):
    """Raised by :meth:`RayExecutor.optimize` when every device host died during the search.

    The trials that were running on them were told FAIL; no trial is left RUNNING.
    """


class RayExecutor(WaterwaveExecutor):
    """Run an Optuna study's trials on a Ray cluster: one device-host actor per GPU, each
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

    A host actor that dies (killed, crashed, its node lost) has each of its running trials told
    FAIL (``waterwave:fail_reason`` says why) and its parameters re-queued on the remaining hosts
    (up to ``max_host_retries`` times), and the search goes on; if every host is lost,
    :class:`AllHostsLostError` is raised. Nothing is left RUNNING.

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
        max_host_retries: How many times one set of parameters is re-queued after its host was
            lost (>= 0).
        startup_timeout_s: Seconds to wait for all host actors to be placed and open the study
            (> 0).
        on_oom, max_oom_retries, memory_budget_bytes, policy, memory_pool,
            max_trials_per_device: As for :class:`WaterwaveExecutor`, applied on every host.

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
        max_host_retries: int = 2,
        startup_timeout_s: float = 120.0,
        on_oom: OnOOM | str = OnOOM.RETRY,
        max_oom_retries: int = 2,
        memory_budget_bytes: int | None = None,
        policy: str | PolicyName | Policy = PolicyName.WATERWAVE,
        memory_pool: MemoryPoolMode | str = MemoryPoolMode.AUTO,
        max_trials_per_device: int = 16,
    ) -> None:
        import_ray()
        # The driver's devices do not matter: each host resolves its own ("auto") in its actor.
        super().__init__(
            devices="cpu",
            trials_per_device=trials_per_device,
            on_oom=on_oom,
            max_oom_retries=max_oom_retries,
            memory_budget_bytes=memory_budget_bytes,
            policy=policy,
            memory_pool=memory_pool,
            max_trials_per_device=max_trials_per_device,
        )
        self.devices = []
        if n_hosts != "auto":
            if isinstance(n_hosts, str):
                raise TypeError(f"n_hosts={n_hosts!r} must be an int >= 1 or 'auto'.")
            _check_positive_int("n_hosts", n_hosts, 1)
        self.n_hosts = n_hosts
        if isinstance(num_gpus_per_host, bool) or num_gpus_per_host not in (0, 1):
            raise ValueError(
                f"num_gpus_per_host={num_gpus_per_host!r} must be 1 (one host actor per GPU) "
                "or 0 (CPU hosts). A host drives one device; to share a GPU among trials, "
                "raise trials_per_device instead of splitting the GPU."
            )
        if num_gpus_per_host == 0 and n_hosts == "auto":
            raise ValueError(
                "n_hosts='auto' counts the cluster's GPUs, but num_gpus_per_host=0 asks for "
                "CPU hosts. Pass n_hosts=N with num_gpus_per_host=0."
            )
        self.num_gpus_per_host = int(num_gpus_per_host)
        self.num_cpus_per_host = _check_positive_number("num_cpus_per_host", num_cpus_per_host)
        self.host_resources = _check_resources(host_resources)
        self.max_host_retries = _check_positive_int("max_host_retries", max_host_retries, 0)
        self.startup_timeout_s = _check_positive_number("startup_timeout_s", startup_timeout_s)
        self._server: StorageServer | None = None
        self._run_state: _ClusterState | None = None

    def __repr__(self) -> str:
        return (
            f"RayExecutor(n_hosts={self.n_hosts!r}, trials_per_device="
            f"{'auto' if self.auto_trials else self.trials_per_device}, "
            f"num_gpus_per_host={self.num_gpus_per_host}, "
            f"num_cpus_per_host={self.num_cpus_per_host}, on_oom={self.on_oom.value!r})"
        )

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
            RuntimeError: If the host actors cannot be placed within ``startup_timeout_s``
                (e.g. fewer GPUs than ``n_hosts``), or Ray is not initialized and cannot start.
            AllHostsLostError: If every host actor died; their trials were told FAIL.
            TypeError, ValueError, Exception, KeyboardInterrupt: As
                :meth:`WaterwaveExecutor.optimize`.
        """
        ray = import_ray()
        if not isinstance(study, optuna.Study):
            raise TypeError(
                f"study must be an optuna.Study, got {type(study).__name__!r}. Create one with "
                "waterwave_hpo.create_study(...) or optuna.create_study(...)."
            )
        if not ray.is_initialized():
            ray.init()
        n_hosts = self._resolve_n_hosts(ray)
        # One driver thread per trial that may call the storage at once, within reason.
        threads = min(64, max(8, n_hosts * self.trials_per_device))
        self._server = StorageServer(study, max_workers=threads)
        self._run_state = _ClusterState(n_hosts)
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
            self._server.stop()
            self._server = None
        state, self._run_state = self._run_state, None
        if state.all_lost:
            raise AllHostsLostError(
                f"All {n_hosts} device host(s) were lost during the search (last: "
                f"{state.last_error!r}); their running trials were told FAIL. Check the Ray "
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
        if n_hosts * self.num_gpus_per_host > gpus:
            raise RuntimeError(
                f"n_hosts={n_hosts} host actors need {n_hosts * self.num_gpus_per_host} GPU(s), "
                f"but the Ray cluster has {gpus:g}. Pass n_hosts <= {int(gpus)} or "
                "n_hosts='auto', or num_gpus_per_host=0 for CPU hosts."
            )
        return n_hosts

    def _make_hosts(self, settings: RunSettings) -> list[DeviceHost]:
        ray = import_ray()
        assert self._server is not None and self._run_state is not None
        state = self._run_state
        study = settings.study
        spec = HostSpec(
            storage=self._server.channel,
            study_name=study.study_name,
            sampler=study.sampler,
            pruner=study.pruner,
            func=settings.func,
            catch=settings.catch,
            on_oom=settings.on_oom,
            max_oom_retries=settings.max_oom_retries,
            gc_after_trial=settings.gc_after_trial,
            n_slots=self.trials_per_device,
            admit_by_memory=self.auto_trials,
            memory_pool=self.memory_pool,
            memory_budget_bytes=self.memory_budget_bytes,
            policy=self.policy,
        )
        actor_class = ray.remote(HostActor).options(
            num_gpus=self.num_gpus_per_host,
            num_cpus=self.num_cpus_per_host,
            resources=dict(self.host_resources) or None,
            max_restarts=0,
            max_concurrency=_ACTOR_CONCURRENCY,
            scheduling_strategy="SPREAD",
        )
        actors = [actor_class.remote(spec) for _ in range(state.n_hosts)]
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=self.startup_timeout_s)
        except BaseException as error:
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            if isinstance(error, ray.exceptions.GetTimeoutError):
                raise RuntimeError(
                    f"{state.n_hosts} host actor(s) with num_gpus={self.num_gpus_per_host}, "
                    f"num_cpus={self.num_cpus_per_host}, resources={self.host_resources} could "
                    f"not all start within startup_timeout_s={self.startup_timeout_s}. The "
                    f"cluster has {ray.available_resources()} available; lower n_hosts or "
                    "num_cpus_per_host, or raise startup_timeout_s."
                ) from None
            raise
        hosts = [
            RemoteHost(
                actor,
                info,
                self.trials_per_device,
                self.auto_trials,
                settings,
                self.max_host_retries,
                on_lost=state.host_lost,
            )
            for actor, info in zip(actors, infos, strict=True)
        ]
        state.study = study
        _logger.info("Device hosts: %s", ", ".join(info.label for info in infos))
        # RemoteHost is duck-typed to DeviceHost for the executor's loop.
        return cast("list[DeviceHost]", hosts)


class _ClusterState:
    """Which hosts of one ``optimize`` call are lost; stops the loop when all are."""

    def __init__(self, n_hosts: int) -> None:
        self.n_hosts = n_hosts
        self.n_lost = 0
        self.last_error: BaseException | None = None
        self.study: optuna.Study | None = None
        self._lock = threading.Lock()

    @property
    def all_lost(self) -> bool:
        return self.n_lost >= self.n_hosts

    def host_lost(self, host: RemoteHost, error: BaseException) -> None:
        with self._lock:
            self.n_lost += 1
            self.last_error = error
            if self.all_lost and self.study is not None:
                # Nothing can run any more: stop asking (the flag _optuna_compat reads).
                self.study._stop_flag = True


def _check_positive_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a number > 0, not {type(value).__name__}.")
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0.")
    return float(value)


def _check_resources(resources: Mapping[str, float] | None) -> dict[str, float]:
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        raise TypeError(
            f"host_resources={resources!r} must be a mapping of Ray custom resource names to "
            'amounts, e.g. {"accelerator_type:A100": 0.001}.'
        )
    result: dict[str, float] = {}
    for key, amount in resources.items():
        if key in ("CPU", "GPU", "memory"):
            raise ValueError(
                f"host_resources contains {key!r}; set CPUs with num_cpus_per_host and GPUs "
                "with num_gpus_per_host, and keep host_resources for custom resources."
            )
        result[str(key)] = _check_positive_number(f"host_resources[{key!r}]", amount)
    return result
