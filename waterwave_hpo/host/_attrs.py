"""Trial system attributes the executor writes, so a study records where and how a trial ran.

They are the executor's bookkeeping, kept out of the user's ``trial.user_attrs`` (so
``trials_dataframe()`` columns and ``enqueue_trial(user_attrs=...)`` round trips are Optuna's):
they are written as system attributes through the study's storage and read back with
:func:`trial_attr` (``frozen_trial.system_attrs``) by trials.csv, the timeline and retries.
"""

from __future__ import annotations

from typing import Any

from optuna.trial import FrozenTrial

from waterwave_hpo.planning import MemoryPlan

ATTR_DEVICE = "waterwave:device"
"""The device the trial ran on, e.g. ``"cuda:0"`` or ``"cpu"``."""
ATTR_SLOT = "waterwave:slot"
"""The slot (0 .. trials_per_device - 1) of the device host that ran it."""
ATTR_ATTEMPT = "waterwave:attempt"
"""``k`` for the ``k``-th re-run of a parameter set after an out-of-memory error."""
ATTR_RETRY_OF = "waterwave:retry_of"
"""The number of the trial whose parameters this re-run repeats."""
ATTR_FAIL_REASON = "waterwave:fail_reason"
"""Why a FAIL trial failed: the exception, or out of memory with how many neighbours."""
ATTR_PEAK_BYTES = "waterwave:peak_bytes"
"""The trial's peak allocated device memory in bytes, measured by its pool account (CUDA); for
a trial of a fused batch, the batch's peak divided by the number of its trials."""
ATTR_BATCH = "waterwave:batch"
"""The numbers of the trials run together in one call of a batched objective (``fuse=K``)."""
ATTR_MEMORY_PLAN = "waterwave:memory_plan"
"""The memory plan the trial's model ran with (``memory_plan="home"``): the fields of a
:class:`~waterwave_hpo.planning.MemoryPlan`; read it with :func:`trial_memory_plan`. Recorded
whenever a plan is installed, like the re-run attributes."""
ATTR_PLAN_CAP = "waterwave:plan_cap_bytes"
"""On a re-run after an out-of-memory error with ``memory_plan="home"``: the bytes its plan
may use at most (a fraction of the failed attempt's footprint)."""


def trial_memory_plan(trial: FrozenTrial) -> MemoryPlan | None:
    """The memory plan ``trial``'s model ran with, or ``None`` if it ran without one.

    Read from the system attribute :data:`ATTR_MEMORY_PLAN`, which
    ``WaterwaveExecutor(memory_plan="home")`` writes when :func:`waterwave_hpo.fit_trial_memory`
    installs a plan.

    Args:
        trial: A trial of a study the executor ran (``study.trials[i]``).
    """
    fields = trial.system_attrs.get(ATTR_MEMORY_PLAN)
    if not isinstance(fields, dict):
        return None
    return MemoryPlan(**fields)


def trial_attr(trial: FrozenTrial, key: str, default: Any = None) -> Any:
    """The executor's attribute ``key`` (one of the ``ATTR_*`` names) of ``trial``, or ``default``.

    Args:
        trial: A trial of a study the executor ran (``study.trials[i]``).
        key: ``ATTR_DEVICE``, ``ATTR_SLOT``, ``ATTR_ATTEMPT``, ``ATTR_RETRY_OF``,
            ``ATTR_FAIL_REASON``, ``ATTR_PEAK_BYTES``, ``ATTR_BATCH``, ``ATTR_MEMORY_PLAN``,
            ``ATTR_PLAN_CAP`` or ``waterwave_hpo.cluster.ATTR_HOST``.
        default: Returned when the trial does not have it (not run by the executor, or, for
            ``ATTR_RETRY_OF``, not a re-run).

    Studies written by waterwave-hpo 0.1 kept these in ``user_attrs``; they are read from there
    when the system attribute is missing, so such studies still resume and report.
    """
    if key in trial.system_attrs:
        return trial.system_attrs[key]
    return trial.user_attrs.get(key, default)
