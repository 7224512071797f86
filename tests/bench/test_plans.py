"""compare_plans: co-hosting with and without memory plans on the simulated device."""

from __future__ import annotations

import pytest

from waterwave_hpo.bench import PlanSharing
from waterwave_hpo.bench import compare_plans
from waterwave_hpo.scheduler import TrialProfile
from waterwave_hpo.sim import SimPlan
from waterwave_hpo.sim import SimTrial


def test_plans_turn_out_of_memory_errors_and_waits_into_planned_runs() -> None:
    # Two registered models of 60 bytes on a 100-byte device, the second one plannable to 30.
    trials = [
        SimTrial(TrialProfile.of(60, [0]), (1.0,), (1.0,), plan=SimPlan(30, 1.5)),
        SimTrial(TrialProfile.of(60, [0]), (1.0,), (1.0,), plan=SimPlan(30, 1.5)),
    ]
    rows = {r.sharing: r for r in compare_plans(trials, 100, 2, workload="w", setting="high")}
    assert list(rows) == [s.value for s in PlanSharing]
    stock, stock_plans = rows["stock"], rows["stock+plans"]
    ledger, ledger_plans = rows["ledger"], rows["ledger+plans"]
    assert (stock.ooms, stock.reruns, stock.planned_attempts) == (1, 1, 0)
    assert (stock_plans.ooms, stock_plans.reruns, stock_plans.planned_attempts) == (0, 0, 1)
    assert (ledger.ooms, ledger.evictions, ledger.planned_attempts) == (0, 0, 0)
    assert ledger_plans.planned_attempts == 1
    # Planned beside its neighbour (40 bytes left: 4/3 as slow) beats waiting for it.
    assert ledger_plans.makespan_s == pytest.approx(8 / 3)
    assert ledger.makespan_s == pytest.approx(4.0)
    assert all(r.failed_trials == 0 and r.peak_bytes <= 100 for r in rows.values())
