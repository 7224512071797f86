"""Both built-in policies pass the conformance suite shipped in waterwave_hpo.scheduler.testing."""

from __future__ import annotations

import pytest

from waterwave_hpo.scheduler import FifoPolicy
from waterwave_hpo.scheduler import Policy
from waterwave_hpo.scheduler import WaterwavePolicy
from waterwave_hpo.scheduler.testing import check_budget_and_liveness
from waterwave_hpo.scheduler.testing import check_contrived_deadlock
from waterwave_hpo.scheduler.testing import check_trial_finished_wakes_waiters

POLICIES: list[type[Policy]] = [FifoPolicy, WaterwavePolicy]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_budget_never_exceeded_and_nothing_hangs(policy: type[Policy]) -> None:
    check_budget_and_liveness(policy, seeds=10)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_contrived_deadlock_is_resolved(policy: type[Policy]) -> None:
    check_contrived_deadlock(policy)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_trial_finished_wakes_waiters(policy: type[Policy]) -> None:
    check_trial_finished_wakes_waiters(policy)
