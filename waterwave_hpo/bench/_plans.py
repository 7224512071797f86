"""Co-hosting with and without memory plans, on the simulated device, beside the measurement.

The measured ``waterwave-plans`` run says what plans do on this machine; this comparison says
what they do to makespan, out-of-memory errors and re-runs on a device with the setting's
capacity, from the same trials (their profiles in bytes, their solo step times from the
temporal run), under four ways of co-hosting ``k`` trials:

* ``stock``: no ledger (PyTorch's allocator): an allocation that does not fit is an
  out-of-memory error; the trial re-runs with fewer neighbours;
* ``stock+plans``: the same, but each trial's model is registered and planned when it does not
  fit beside its neighbours, and a re-run is planned for half its failed footprint;
* ``ledger``: the executor's scheduler, models registered without plans: a trial waits until
  its plain peak fits;
* ``ledger+plans``: the executor with ``memory_plan="home"``.

The device overlaps ``k`` trials' work (``compute_parallelism=k``: small trials that each
leave the device underused, the setting Waterwave and ``trials_per_device="auto"`` assume), so
the makespans show what waiting, failing and planning cost when co-hosting is worth it.
"""

from __future__ import annotations

from dataclasses import dataclass
import enum

from waterwave_hpo.sim import Sharing
from waterwave_hpo.sim import SimDevice
from waterwave_hpo.sim import SimTrial
from waterwave_hpo.sim import simulate


class PlanSharing(enum.Enum):
    """The four ways of co-hosting the comparison simulates (see the module docstring)."""

    STOCK = "stock"
    STOCK_PLANS = "stock+plans"
    LEDGER = "ledger"
    LEDGER_PLANS = "ledger+plans"

    def sharing(self, k: int) -> Sharing:
        """The simulator's :class:`Sharing` for ``k`` trials at once."""
        policy = None if self in (PlanSharing.STOCK, PlanSharing.STOCK_PLANS) else "waterwave"
        plans = self in (PlanSharing.STOCK_PLANS, PlanSharing.LEDGER_PLANS)
        return Sharing(k, policy=policy, retry_on_oom=True, memory_plans=plans)


@dataclass(frozen=True)
class PlanComparison:
    """One way of co-hosting one workload and setting, simulated (units in the names).

    Attributes:
        workload: ``resnet``, ``gpt`` or ``digits``.
        setting: ``light`` or ``high``.
        sharing: The :class:`PlanSharing` value.
        k: Trials at once.
        capacity_bytes: The simulated device's memory.
        makespan_s: Simulated seconds until the last trial ended.
        ooms: Attempts that ran out of memory.
        evictions: Attempts the scheduler evicted.
        reruns: Attempts that re-ran a trial after an out-of-memory error or an eviction.
        planned_attempts: Attempts that ran with a memory plan.
        failed_trials: Trials that never completed.
        peak_bytes: The most bytes in use at once.
    """

    workload: str
    setting: str
    sharing: str
    k: int
    capacity_bytes: int
    makespan_s: float
    ooms: int
    evictions: int
    reruns: int
    planned_attempts: int
    failed_trials: int
    peak_bytes: int


def compare_plans(
    planned_trials: list[SimTrial],
    capacity_bytes: int,
    k: int,
    *,
    workload: str,
    setting: str,
) -> list[PlanComparison]:
    """Simulate ``planned_trials`` under every :class:`PlanSharing`, ``k`` at a time.

    Args:
        planned_trials: The trials as registered models (each holds its plain peak, with a
            :class:`~waterwave_hpo.sim.SimPlan`): ``_validate.planned_sim_trials``.
        capacity_bytes: The device's memory, bytes.
        k: Trials at once (>= 1).
        workload: For the rows.
        setting: For the rows.

    Returns:
        One row per way of co-hosting, in :class:`PlanSharing` order.
    """
    device = SimDevice(capacity_bytes, compute_parallelism=float(k))
    rows = []
    for way in PlanSharing:
        result = simulate(planned_trials, device, way.sharing(k))
        rows.append(
            PlanComparison(
                workload=workload,
                setting=setting,
                sharing=way.value,
                k=k,
                capacity_bytes=capacity_bytes,
                makespan_s=result.makespan_s,
                ooms=result.ooms,
                evictions=result.evictions,
                reruns=sum(a.attempt > 0 for a in result.attempts),
                planned_attempts=result.n_planned,
                failed_trials=result.n_failed,
                peak_bytes=result.peak_bytes,
            )
        )
    return rows
