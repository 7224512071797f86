"""``shared_gpu()`` and ``with_shared_gpu()``: Ray Tune trials that share GPUs.

Kept apart from :mod:`waterwave_hpo.cluster._tune` so that ``waterwave_hpo.shared_gpu`` is
importable without Ray; Ray Tune is imported on the first call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any

from waterwave_hpo import _checks
from waterwave_hpo.cluster._imports import import_ray

if TYPE_CHECKING:
    from waterwave_hpo.cluster._tune import SharedGPU


def shared_gpu(
    trials_per_gpu: int | str = "auto",
    cpus_per_trial: float = 1.0,
    *,
    memory_budget_bytes: int | None = None,
    memory_per_trial_bytes: int | None = None,
    max_trials_per_gpu: int = 8,
    lease_ttl_s: float = 10.0,
    on_no_gpu: str = "error",
) -> SharedGPU:
    """Resources for Ray Tune trials that share GPUs: several trials per GPU, memory leased.

    Returns a ``tune.PlacementGroupFactory`` (a :class:`SharedGPU`) with one bundle
    ``{"CPU": cpus_per_trial, "GPU": 1 / trials_per_gpu}``, which ``tune.run(...,
    resources_per_trial=...)``, ``tune.with_resources(trainable, ...)`` and ``tune.Tuner`` take,
    so Ray places ``trials_per_gpu`` trials on each GPU::

        resources = ww.shared_gpu(trials_per_gpu=4)
        tuner = tune.Tuner(
            tune.with_resources(resources.wrap(train_fn), resources),
            tune_config=tune.TuneConfig(num_samples=64),
        )
        tuner.fit()

    It also reads as a mapping (``resources["gpu"]``, ``resources.get("cpu")``), for callers
    that take a ``resources_per_trial`` dict, e.g. transformers'
    ``trainer.hyperparameter_search(backend="ray", resources_per_trial=ww.shared_gpu(4))``.
    On a Ray cluster without GPUs, placing the first trial raises ``RuntimeError`` (instead of
    Tune's trials PENDING forever), unless ``on_no_gpu="wait"``.

    Experimental on CUDA: the leases' cap on a CUDA device (``set_per_process_memory_fraction``)
    has never run on a GPU; its first use in a process emits
    :class:`waterwave_hpo.ExperimentalWarning`.

    Ray's fractional GPUs alone are book-keeping (its docs leave memory to the user). Trials
    that hold :meth:`SharedGPU.lease` (``resources.wrap(train_fn)`` does it for them, or use
    :func:`with_shared_gpu`) ask the GPU's broker (a Ray named actor per GPU) for a lease of
    device memory and wait until it fits beside the leases already granted, so co-placed trials'
    peaks do not collide; on CUDA each process's PyTorch memory fraction follows its lease. A
    trainable that takes no lease is only packed, as with plain fractional GPUs.

    Args:
        trials_per_gpu: Trials placed on one GPU (>= 1), or ``"auto"``: up to
            ``max_trials_per_gpu`` are placed, and leases sized by the measured peak memory of
            finished trials (CUDA) decide how many train at once; the first trial on a GPU runs
            alone to be measured.
        cpus_per_trial: CPUs each trial reserves (>= 0).
        memory_budget_bytes: Device memory per GPU the leases share (> 0); ``None``: 90 % of
            the GPU's total memory on CUDA (the rest is for the processes' CUDA contexts), and no
            coordination where the trial sees no CUDA device.
        memory_per_trial_bytes: Each lease's size when the trainable does not give one (> 0);
            ``None``: ``budget / trials_per_gpu``, or measured with ``"auto"``.
        max_trials_per_gpu: The cap for ``trials_per_gpu="auto"`` (>= 1).
        lease_ttl_s: Seconds after which a lease its process stopped renewing expires (> 0).
        on_no_gpu: ``"error"`` (default): placing a trial on a Ray cluster that has no GPU
            raises ``RuntimeError`` naming the fixes; ``"wait"``: Tune's behaviour (the trials
            stay PENDING until GPUs join, e.g. an autoscaling cluster).

    Returns:
        The :class:`SharedGPU` resource request.

    Raises:
        ImportError: If Ray Tune is not installed (``pip install "waterwave-hpo[ray]"``).
        TypeError: If an argument has the wrong type.
        ValueError: If an argument is out of range; the message names it and the fix.
    """
    k, auto = _check_trials_per_gpu(trials_per_gpu, max_trials_per_gpu)
    if k > 10_000:
        raise _checks.value_error(
            "trials_per_gpu",
            k,
            "is more than Ray's GPU resolution (1/10000) allows",
            "pass <= 10000",
        )
    _check_number("cpus_per_trial", cpus_per_trial, allow_zero=True)
    if memory_budget_bytes is not None:
        _check_int("memory_budget_bytes", memory_budget_bytes, 1)
    if memory_per_trial_bytes is not None:
        _check_int("memory_per_trial_bytes", memory_per_trial_bytes, 1)
        if memory_budget_bytes is not None and memory_per_trial_bytes > memory_budget_bytes:
            raise _checks.value_error(
                "memory_per_trial_bytes",
                memory_per_trial_bytes,
                f"is more than memory_budget_bytes={memory_budget_bytes} "
                f"({_checks.format_bytes(memory_budget_bytes)}), so no trial could ever get its "
                "lease",
                "lower memory_per_trial_bytes or raise memory_budget_bytes",
            )
    _check_number("lease_ttl_s", lease_ttl_s, allow_zero=False)
    if on_no_gpu not in ("error", "wait"):
        raise _checks.value_error(
            "on_no_gpu", on_no_gpu, "is not a choice", "pass 'error' (default) or 'wait'"
        )
    import_ray()
    from waterwave_hpo.cluster._tune import SharedGPU

    return SharedGPU(
        trials_per_gpu=k,
        auto=auto,
        cpus_per_trial=float(cpus_per_trial),
        memory_budget_bytes=memory_budget_bytes,
        memory_per_trial_bytes=memory_per_trial_bytes,
        lease_ttl_s=float(lease_ttl_s),
        on_no_gpu=on_no_gpu,
    )


def with_shared_gpu(trainable: Callable[[dict[str, Any]], Any], **shared_gpu_kwargs: Any) -> Any:
    """A trainable whose trials share GPUs and hold memory leases, in one call.

    It is ``tune.with_resources(resources.wrap(trainable), resources)`` with
    ``resources = shared_gpu(**shared_gpu_kwargs)``::

        from waterwave_hpo.integrations.ray_tune import with_shared_gpu

        tune.Tuner(with_shared_gpu(train_fn, trials_per_gpu=4), ...).fit()

    (``waterwave_hpo.integrations.ray_tune.with_shared_gpu`` after ``import waterwave_hpo``
    works too.)

    Raises:
        ImportError, TypeError, ValueError: As :func:`shared_gpu` and :meth:`SharedGPU.wrap`
            raise them.
    """
    from ray import tune

    resources = shared_gpu(**shared_gpu_kwargs)
    return tune.with_resources(resources.wrap(trainable), resources)


def _check_trials_per_gpu(trials_per_gpu: object, max_trials_per_gpu: object) -> tuple[int, bool]:
    """``(k, auto)``: the trials per GPU (the cap ``max_trials_per_gpu`` with ``"auto"``)."""
    auto = trials_per_gpu == "auto"
    if not auto:
        if isinstance(trials_per_gpu, str):
            raise _checks.type_error(
                "trials_per_gpu", trials_per_gpu, "an int >= 1 or 'auto'", "pass e.g. 4"
            )
        _check_int("trials_per_gpu", trials_per_gpu, 1)
    _check_int("max_trials_per_gpu", max_trials_per_gpu, 1)
    return int(max_trials_per_gpu if auto else trials_per_gpu), auto  # type: ignore[call-overload]


def _check_int(name: str, value: object, minimum: int) -> None:
    _checks.check_int(name, value, minimum=minimum)


def _check_number(name: str, value: object, allow_zero: bool) -> None:
    _checks.check_number(name, value, allow_zero=allow_zero)
