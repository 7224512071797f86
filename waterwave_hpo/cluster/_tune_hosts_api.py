"""``tune_hosts()``: the entry point of in-process co-hosting for Ray Tune.

Kept apart from :mod:`waterwave_hpo.cluster._tune_hosts` so that ``waterwave_hpo.tune_hosts``
is importable without Ray; Ray Tune is imported on the first call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from waterwave_hpo import _checks
from waterwave_hpo.cluster._imports import import_ray
from waterwave_hpo.cluster._shared_gpu import _check_int
from waterwave_hpo.cluster._shared_gpu import _check_number
from waterwave_hpo.cluster._shared_gpu import _check_trials_per_gpu
from waterwave_hpo.host import MemoryPoolMode
from waterwave_hpo.host import plan_settings
from waterwave_hpo.scheduler import PolicyName

if TYPE_CHECKING:
    from waterwave_hpo.cluster._tune_hosts import TuneHosts


def tune_hosts(
    trials_per_gpu: int | str = 4,
    cpus_per_trial: float = 1.0,
    *,
    max_trials_per_gpu: int = 8,
    policy: str = "waterwave",
    memory_budget_bytes: int | None = None,
    memory_pool: str = "auto",
    heartbeat_ttl_s: float = 30.0,
    n_hosts: int | None = None,
    memory_plan: str = "off",
    memory_planner: str = "pso",
    fuse: int | None = None,
    fuse_wait_s: float = 2.0,
) -> TuneHosts:
    """Ray Tune trials whose training functions run co-hosted, in one process per GPU.

    The full Waterwave for Tune (IEEE TC 2023, Secs. 3-4): the trials on a GPU are threads of
    one host actor, each on its own CUDA stream, drawing from one stream-aware pool, with their
    NodeGroups ordered by one pipeline scheduler; Tune keeps scheduling, searching, stopping and
    checkpointing the trials. See :class:`~waterwave_hpo.cluster._tune_hosts.TuneHosts` for how
    to use it with ``tune.run``/``Tuner``, and :func:`waterwave_hpo.shared_gpu` for the other
    way (trials stay in their own processes and lease memory from a per-GPU broker).

    Args:
        trials_per_gpu: Trials each host runs at once (>= 1), or ``"auto"``: up to
            ``max_trials_per_gpu``, admitted while measured memory leaves room (as
            ``WaterwaveExecutor(trials_per_device="auto")``).
        cpus_per_trial: CPUs each Tune trial reserves (>= 0); the work runs in the host.
        max_trials_per_gpu: The cap for ``"auto"`` (>= 1).
        policy: The pipeline scheduler's policy, ``"waterwave"`` or ``"fifo"``.
        memory_budget_bytes: Each GPU's scheduler budget in bytes (> 0); ``None``: the pool's
            capacity on CUDA, no scheduler on the CPU.
        memory_pool: ``"auto"``, ``"on"`` or ``"off"`` (the stream-aware pool on CUDA).
        heartbeat_ttl_s: Seconds after which a hosted trial whose Tune process is gone (or
            stopped: it sends a heartbeat every quarter of this, also while Tune's driver is
            slow to take its results) is stopped in its host (> 0).
        n_hosts: Host actors to start (>= 1); ``None``: one per GPU in the cluster.
        memory_plan: ``"off"`` or ``"home"``, as for :class:`~waterwave_hpo.WaterwaveExecutor`:
            with ``"home"``, a model a trial registers with
            :func:`waterwave_hpo.fit_trial_memory` gets a HOME plan when it does not fit
            beside its neighbours on the host.
        memory_planner: The planner for ``memory_plan="home"`` (``"pso"``, ``"capuchin"``,
            ``"exhaustive"``).
        fuse: ``None``: each hosted call runs one Tune trial. ``K >= 1``: wrap a batched
            trainable (:func:`waterwave_hpo.batched`, taking a list of
            :class:`~waterwave_hpo.cluster._hosted.TuneBatchTrial`): a host gathers up to K
            Tune trials of one fusion group that arrive together and runs them as one call,
            e.g. one fused model (HFTA, arXiv:2102.02344); a batch takes one of the
            ``trials_per_gpu`` places, so Tune may run ``n_hosts * trials_per_gpu * K``
            trials at once (``max_concurrent_trials``).
        fuse_wait_s: Seconds the first trial of a group waits in its host for batch-mates
            (>= 0) before it runs in a smaller batch.

    Returns:
        A :class:`TuneHosts`; enter it (``with``) to start the hosts.

    Raises:
        ImportError: If Ray Tune is not installed (``pip install "waterwave-hpo[ray]"``).
        TypeError, ValueError: For a bad argument; the message names it and the fix.
    """
    k, auto = _check_trials_per_gpu(trials_per_gpu, max_trials_per_gpu)
    _check_number("cpus_per_trial", cpus_per_trial, allow_zero=True)
    _check_number("heartbeat_ttl_s", heartbeat_ttl_s, allow_zero=False)
    if policy not in {p.value for p in PolicyName}:
        allowed = sorted(p.value for p in PolicyName)
        raise _checks.value_error("policy", policy, f"is not one of {allowed}", "pass 'waterwave'")
    if memory_pool not in {m.value for m in MemoryPoolMode}:
        raise _checks.value_error(
            "memory_pool", memory_pool, "is not one of 'auto', 'on', 'off'", "pass 'auto'"
        )
    if memory_budget_bytes is not None:
        _check_int("memory_budget_bytes", memory_budget_bytes, 1)
    if n_hosts is not None:
        _check_int("n_hosts", n_hosts, 1)
    fuse = _checks.check_optional_int(
        "fuse",
        fuse,
        minimum=1,
        fix="pass the number of Tune trials a batched trainable runs at once, e.g. fuse=8, "
        "or None for one trial per call",
    )
    _check_number("fuse_wait_s", fuse_wait_s, allow_zero=True)
    plan_settings(memory_plan, memory_planner)  # checked here, made again in each host
    import_ray()
    from waterwave_hpo.cluster._tune_hosts import TuneHosts

    return TuneHosts(
        trials_per_gpu=k,
        auto=auto,
        cpus_per_trial=float(cpus_per_trial),
        fuse=fuse,
        host_settings={
            "trials_per_device": k,
            "auto": auto,
            "policy": policy,
            "memory_budget_bytes": memory_budget_bytes,
            "memory_pool": memory_pool,
            "heartbeat_ttl_s": float(heartbeat_ttl_s),
            "memory_plan": memory_plan,
            "memory_planner": memory_planner,
            "fuse": fuse,
            "fuse_wait_s": float(fuse_wait_s),
        },
        n_hosts=n_hosts,
    )
